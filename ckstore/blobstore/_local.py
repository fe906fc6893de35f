"""Objects as files in a local folder (or a shared file system mounted on every node)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO

from ..errors import BlobStoreError
from ._base import BlobExistsError, BlobInfo, BlobNotFoundError, BlobStore, check_key

__all__ = ["LocalBlobStore"]


class LocalBlobStore(BlobStore):
    """Objects as files under a local folder; writes go through a temp file, fsync and rename."""

    is_local = True
    #: a finished pack's fsync and rename overlap with filling the next one
    write_concurrency = 2

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = os.path.abspath(os.fspath(root))
        super().__init__(self.root)
        self.fsync = fsync
        self._tmp = os.path.join(self.root, "tmp")
        os.makedirs(self._tmp, exist_ok=True)

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.root, *key.split("/"))

    @contextmanager
    def _writer(self, key: str) -> Iterator[IO[bytes]]:
        path = self._path(key)
        tmp = os.path.join(self._tmp, f"{uuid.uuid4().hex}.part")
        f = open(tmp, "wb", buffering=0)
        try:
            yield f
            if self.fsync:
                os.fdatasync(f.fileno())
            f.close()
            parent = os.path.dirname(path)
            if not os.path.isdir(parent):
                os.makedirs(parent, exist_ok=True)
                if self.fsync:
                    _fsync_dir(os.path.dirname(parent))
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(parent)
        except BaseException:
            f.close()
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def _put_exclusive(self, key: str, data: memoryview) -> None:
        path = self._path(key)
        tmp = os.path.join(self._tmp, f"{uuid.uuid4().hex}.part")
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(data)
                if self.fsync:
                    os.fdatasync(f.fileno())
            parent = os.path.dirname(path)
            os.makedirs(parent, exist_ok=True)
            try:
                os.link(tmp, path)  # atomic, and fails when the name is taken
            except FileExistsError as e:
                raise BlobExistsError(f"object {key!r} already exists in {self.url}") from e
            if self.fsync:
                _fsync_dir(parent)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _read(self, key: str, start: int, end: int | None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                if start:
                    f.seek(start)
                if end is None:
                    return f.read()
                data = f.read(end - start)
        except FileNotFoundError as e:
            raise BlobNotFoundError(f"no object {key!r} in {self.url}") from e
        except OSError as e:
            raise BlobStoreError(f"reading {key!r} in {self.url} failed: {e}") from e
        if len(data) != end - start:
            raise BlobStoreError(
                f"object {key!r} in {self.url} is shorter than expected: wanted bytes "
                f"[{start}, {end}), got {len(data)}"
            )
        return data

    def _delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass

    def _list(self, prefix: str) -> Iterator[BlobInfo]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not os.path.isdir(base):
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if rel.startswith("tmp/") and not prefix.startswith("tmp"):
                    continue
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                yield BlobInfo(rel, st.st_size, st.st_mtime)

    def _exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def stale_temp_files(self, older_than: float) -> list[str]:
        out = []
        for name in os.listdir(self._tmp):
            p = os.path.join(self._tmp, name)
            try:
                if os.stat(p).st_mtime < older_than:
                    out.append(p)
            except FileNotFoundError:
                pass
        return out

    def discard_temp_files(self, handles: Sequence[str]) -> int:
        n = 0
        for p in handles:
            try:
                os.unlink(p)
                n += 1
            except FileNotFoundError:
                pass
        return n


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

