"""The blob store: immutable bytes under opaque keys, on any fsspec file system.

The blob store knows nothing of tensors, chunks or the catalog. Keys are ``/``-separated
ASCII paths relative to the store's root (``packs/3f/3fa9…``).

Contract for every implementation
---------------------------------
* :meth:`BlobStore.writer` makes an object visible atomically when its ``with`` block ends
  without error: a reader sees the whole object or nothing, never a prefix. On a local disk the
  bytes are durable (fsynced, directory entry included) before the block ends. When the block
  raises, nothing is left visible.
* Writing a key that already exists with the same bytes is harmless; ckstore never writes
  different bytes under one key.
* :meth:`BlobStore.read` returns exactly the bytes asked for or raises
  :class:`BlobNotFoundError` / :class:`~ckstore.errors.BlobStoreError`.
* :meth:`BlobStore.delete` ignores keys that are already gone.
* Every method may be called from many threads at once.

Only garbage collection deletes. Subclasses implement the underscored methods; the public
methods count requests and bytes in :attr:`BlobStore.stats` so tests and benchmarks can see
exactly what a checkout read.
"""

from __future__ import annotations

import io
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from .errors import BlobStoreError, CkstoreError

__all__ = [
    "BlobNotFoundError",
    "BlobInfo",
    "BlobStats",
    "BlobStore",
    "LocalBlobStore",
    "FsspecBlobStore",
    "open_blobstore",
    "is_local_url",
]

T = TypeVar("T")


class BlobNotFoundError(BlobStoreError, FileNotFoundError):
    """No object under that key."""


@dataclass(frozen=True, slots=True)
class BlobInfo:
    key: str
    size: int
    mtime: float | None  # seconds since the epoch, when the backend reports it


class BlobStats:
    """Counters of the requests a blob store served (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.reads = 0
            self.bytes_read = 0
            self.writes = 0
            self.bytes_written = 0
            self.deletes = 0
            self.lists = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "reads": self.reads,
                "bytes_read": self.bytes_read,
                "writes": self.writes,
                "bytes_written": self.bytes_written,
                "deletes": self.deletes,
                "lists": self.lists,
            }


class _CountingWriter:
    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.written = 0

    def write(self, data: bytes | memoryview) -> int:
        n = self._f.write(data)
        m = memoryview(data).nbytes
        self.written += m
        return n if n is not None else m


class BlobStore(ABC):
    """Immutable objects under opaque keys. See the module docstring for the contract."""

    #: True when objects live on a local (or locally mounted) file system.
    is_local: bool = False

    def __init__(self, url: str) -> None:
        self.url = url
        self.stats = BlobStats()

    # -- public, counted -------------------------------------------------------------
    @contextmanager
    def writer(self, key: str) -> Iterator[_CountingWriter]:
        """A file-like object to write ``key``; the object appears when the block ends."""
        with self._writer(key) as f:
            w = _CountingWriter(f)
            yield w
        self.stats.add(writes=1, bytes_written=w.written)

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self.writer(key) as w:
            w.write(data)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (to the end when ``end`` is None)."""
        data = self._read(key, start, end)
        self.stats.add(reads=1, bytes_read=len(data))
        return data

    def delete(self, keys: Iterable[str]) -> int:
        """Delete ``keys``; returns how many were asked for. Missing keys are ignored."""
        keys = list(keys)
        if keys:
            self._delete(keys)
            self.stats.add(deletes=len(keys))
        return len(keys)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Every object whose key starts with ``prefix`` (a folder-like prefix ending in ``/``)."""
        self.stats.add(lists=1)
        return self._list(prefix)

    def exists(self, key: str) -> bool:
        return self._exists(key)

    # -- for implementers ------------------------------------------------------------
    @abstractmethod
    def _writer(self, key: str) -> Any:  # a context manager yielding a binary file
        ...

    @abstractmethod
    def _read(self, key: str, start: int, end: int | None) -> bytes: ...

    @abstractmethod
    def _delete(self, keys: Sequence[str]) -> None: ...

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[BlobInfo]: ...

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _check_key(key: str) -> None:
    if not key or key.startswith("/") or ".." in key.split("/") or "\\" in key:
        raise BlobStoreError(f"invalid blob key {key!r}")


class LocalBlobStore(BlobStore):
    """Objects as files under a local folder; writes go through a temp file, fsync and rename."""

    is_local = True

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = os.path.abspath(os.fspath(root))
        super().__init__(self.root)
        self.fsync = fsync
        self._tmp = os.path.join(self.root, "tmp")
        os.makedirs(self._tmp, exist_ok=True)

    def _path(self, key: str) -> str:
        _check_key(key)
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
        """Temp files of writes that never finished (a killed process), older than a time."""
        out = []
        for name in os.listdir(self._tmp):
            p = os.path.join(self._tmp, name)
            try:
                if os.stat(p).st_mtime < older_than:
                    out.append(p)
            except FileNotFoundError:
                pass
        return out


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_TRANSIENT = (ConnectionError, TimeoutError)


def _retry(what: str, fn: Callable[[], T], attempts: int = 5, base_delay: float = 0.2) -> T:
    """Call ``fn``, retrying transient failures with exponential backoff."""
    for i in range(attempts):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except CkstoreError:
            raise
        except Exception as e:  # noqa: BLE001 - fsspec backends raise many kinds
            transient = isinstance(e, _TRANSIENT) or _looks_transient(e)
            if not transient or i == attempts - 1:
                raise BlobStoreError(f"{what} failed: {type(e).__name__}: {e}") from e
            time.sleep(base_delay * (2**i))
    raise AssertionError("unreachable")


def _looks_transient(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return any(
        word in text
        for word in ("timeout", "timed out", "connection", "throttl", "slowdown", "503", "500", "reset")
    )


class FsspecBlobStore(BlobStore):
    """Objects on any fsspec file system (``s3://``, ``gs://``, ``memory://``, …).

    Object stores have no rename: an object is written with a single put, or a multipart
    upload that becomes visible only when completed. Transient failures are retried with
    exponential backoff. Credentials come from the environment and fsspec's own
    configuration; they are never stored by ckstore.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        import fsspec

        super().__init__(url.rstrip("/"))
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self._buffered = self.fs.protocol in ("memory",) or "memory" in tuple(self.fs.protocol)

    def _path(self, key: str) -> str:
        _check_key(key)
        return f"{self.root}/{key}" if self.root else key

    @contextmanager
    def _writer(self, key: str) -> Iterator[IO[bytes]]:
        path = self._path(key)
        if self._buffered:
            buf = io.BytesIO()
            yield buf
            _retry(f"writing {key!r} to {self.url}", lambda: self.fs.pipe_file(path, buf.getvalue()))
            return
        try:
            f = self.fs.open(path, "wb", autocommit=False)
        except Exception as e:  # noqa: BLE001
            raise BlobStoreError(f"opening {key!r} in {self.url} for writing failed: {e}") from e
        try:
            yield f
            f.close()
            _retry(f"completing {key!r} in {self.url}", f.commit)
        except BaseException:
            try:
                f.discard()
            except Exception:  # noqa: BLE001 - best effort clean-up of a failed upload
                pass
            raise

    def _read(self, key: str, start: int, end: int | None) -> bytes:
        path = self._path(key)

        def go() -> bytes:
            try:
                return bytes(self.fs.cat_file(path, start=start, end=end))
            except FileNotFoundError as e:
                raise BlobNotFoundError(f"no object {key!r} in {self.url}") from e

        data = _retry(f"reading {key!r} from {self.url}", go)
        if end is not None and len(data) != end - start:
            raise BlobStoreError(
                f"object {key!r} in {self.url} is shorter than expected: wanted bytes "
                f"[{start}, {end}), got {len(data)}"
            )
        return data

    def _delete(self, keys: Sequence[str]) -> None:
        paths = [self._path(k) for k in keys]
        for i in range(0, len(paths), 1000):
            batch = paths[i : i + 1000]

            def go(batch: list[str] = batch) -> None:
                try:
                    self.fs.rm(batch)
                except FileNotFoundError:
                    for p in batch:
                        try:
                            self.fs.rm_file(p)
                        except FileNotFoundError:
                            pass

            _retry(f"deleting {len(batch)} objects from {self.url}", go)

    def _list(self, prefix: str) -> Iterator[BlobInfo]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        try:
            found = self.fs.find(base, detail=True, withdirs=False)
        except FileNotFoundError:
            return
        strip = len(self.root) + 1 if self.root else 0
        for path, info in sorted(found.items()):
            if info.get("type") == "directory":
                continue
            mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
            ts: float | None
            if hasattr(mtime, "timestamp"):
                ts = mtime.timestamp()
            elif isinstance(mtime, (int, float)):
                ts = float(mtime)
            else:
                ts = None
            yield BlobInfo(path[strip:], int(info.get("size") or 0), ts)

    def _exists(self, key: str) -> bool:
        return bool(_retry(f"checking {key!r} in {self.url}", lambda: self.fs.exists(self._path(key))))


def is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def open_blobstore(url: str, **storage_options: Any) -> BlobStore:
    """The blob store for a local path or fsspec URL."""
    if is_local_url(url):
        path = url[len("file://") :] if url.startswith("file://") else url
        return LocalBlobStore(path)
    return FsspecBlobStore(url, **storage_options)
