"""Objects as files in a local folder (or a shared file system mounted on every node).

Writes go through a temp file under ``tmp/``, which the writer holds an exclusive ``flock`` on
from the moment it exists until it is renamed into place or removed. The stale-temp sweep
(:meth:`LocalBlobStore.stale_temp_files`, :meth:`LocalBlobStore.discard_temp_files`) skips every
file it cannot lock, and removes a file only while holding its lock, so however long a live
writer stalls, gc never deletes its temp file; a killed writer's lock dies with it. On a file
system without working locks (some FUSE mounts) the grace period is the only protection.

Pack files a delete releases are *recycled*: kept in ``tmp/`` and written over by later packs
(:mod:`._recycle`, which says how two writers never share one and a reader never gets another
pack's bytes).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, cast

from .._threads import TaskGroup
from ..errors import BlobStoreError
from ._base import (
    OWNED_PREFIXES,
    BlobExistsError,
    BlobInfo,
    BlobNotFoundError,
    BlobStore,
    NotOwnedError,
    check_key,
)
from ._fileops import fsync_dir, lock, same_file, unlink, with_lock
from ._recycle import (
    DEFAULT_RECYCLE_BYTES,
    RECYCLED_PREFIX,
    Recycler,
    check_unreleased,
    is_recycled,
)

__all__ = ["LocalBlobStore"]

#: Files a delete unlinks at once (see :meth:`LocalBlobStore._delete`)
_UNLINK_THREADS = 4


class _Flusher:
    """A temp file whose bytes go to the disk while the writer goes on writing.

    On Linux, every :data:`_START_EVERY` bytes written have their writeback started at once
    (``sync_file_range`` with ``SYNC_FILE_RANGE_WRITE``, which queues the pages for the disk and
    does not wait), so the final ``fdatasync`` in :meth:`finish` waits for little more than the
    last megabyte (measured on a 4 MiB commit: 2.6 ms of final ``fdatasync`` became 0.8 ms, the
    commit 1.6 ms faster; large commits unchanged). Where that call is missing, a background
    thread runs ``fdatasync`` every :data:`_FLUSH_EVERY` bytes (one at a time) instead.
    Durability comes from :meth:`finish`'s ``fdatasync`` either way.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._since = 0  # bytes written since writeback was last started
        self.started = 0  # bytes from the start of the file whose writeback was started
        self._start = _sync_file_range()
        self._thread: threading.Thread | None = None
        self._clean = False  # nothing written since the last fdatasync (durable_now)

    def write(self, data: bytes | memoryview) -> int | None:
        n = self._f.write(data)
        self._clean = False
        self._since += memoryview(data).nbytes if n is None else n
        if self._start is not None:
            if self._since >= _START_EVERY:
                if self._start(self._f.fileno(), self.started, self._since, _SYNC_FILE_RANGE_WRITE) == 0:
                    self.started += self._since
                else:  # refused here (a file system without it): fdatasync in the background instead
                    self._start = None
                self._since = 0
        elif self._since >= _FLUSH_EVERY and (self._thread is None or not self._thread.is_alive()):
            self._since = 0
            self._thread = threading.Thread(target=_quiet_fdatasync, args=(self._f.fileno(),), daemon=True)
            self._thread.start()
        return n

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def durable_now(self) -> None:
        """``fdatasync`` now, before the file is complete (a checkpoint's record, made durable
        while its packs are); :meth:`finish` then skips its own if nothing was written since."""
        self.join()
        os.fdatasync(self._f.fileno())
        self._clean = True

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` (a recycled file longer than what was written over it);
        :meth:`finish` then makes the new length durable too."""
        self._f.truncate(size)
        self._clean = False

    def finish(self) -> None:
        """Make every byte written durable (errors raise here, not in the background)."""
        self.join()
        if not self._clean:
            os.fdatasync(self._f.fileno())


#: how many bytes a local writer lets pile up before it starts their writeback (Linux)
_START_EVERY = 1 << 20
#: elsewhere, how many bytes pile up before a background ``fdatasync``
_FLUSH_EVERY = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_UNLOADED: Any = object()
#: the names of the fan-out folders (see :meth:`LocalBlobStore._make_folder`)
_FAN_OUT = tuple(f"{i:02x}" for i in range(256))
_sync_file_range_fn: Any = _UNLOADED


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), loaded on first use; None elsewhere. ctypes calls
    release the GIL while they run."""
    global _sync_file_range_fn
    if _sync_file_range_fn is _UNLOADED:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):  # no such symbol in this libc
                fn = None
        _sync_file_range_fn = fn
    return cast("Callable[[int, int, int, int], int] | None", _sync_file_range_fn)


#: how a file system without hard links refuses ``link`` (FAT and exFAT: EPERM; SMB and FUSE
#: mounts: EOPNOTSUPP or ENOSYS; a ``tmp/`` on another file system than the object: EXDEV)
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV)
_AT_FDCWD = -100  # <fcntl.h>
_RENAME_NOREPLACE = 1  # <linux/fs.h>
_renameat2_fn: Any = _UNLOADED


def _renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    """libc's ``renameat2`` (Linux, glibc 2.28), loaded on first use; None elsewhere."""
    global _renameat2_fn
    if _renameat2_fn is _UNLOADED:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):  # no such symbol in this libc
                fn = None
        _renameat2_fn = fn
    return cast("Callable[[int, bytes, int, bytes, int], int] | None", _renameat2_fn)


def _quiet_fdatasync(fd: int) -> None:
    try:
        os.fdatasync(fd)
    except OSError:  # the writer's own fdatasync at the end reports the failure
        pass


class LocalBlobStore(BlobStore):
    """Objects as files under a local folder; writes go through a temp file, fsync and rename."""

    is_local = True
    #: a finished pack's fsync and rename overlap with filling the next one
    write_concurrency = 2
    reads_into = True

    def __init__(
        self, root: str | os.PathLike[str], *, fsync: bool = True, recycle_bytes: int = DEFAULT_RECYCLE_BYTES
    ) -> None:
        self.root = os.path.abspath(os.fspath(root))
        super().__init__(self.root)
        self.fsync = fsync
        #: the most bytes of released pack files kept in ``tmp/`` for later packs (0: unlink them)
        self.recycle_bytes = recycle_bytes
        self._tmp = os.path.join(self.root, "tmp")  # made by the first write: reading makes nothing
        self._recycler = Recycler(self._tmp, self.stats)

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.root, *key.split("/"))

    def _open_temp(self) -> tuple[str, IO[bytes]]:
        """A new temp file, open and locked. The sweep may lock and remove a file in the instant
        between its creation and the writer's lock; the writer then sees another file (or none)
        under the name and starts over with a new one."""
        while True:
            tmp = os.path.join(self._tmp, f"{uuid.uuid4().hex}.part")
            try:
                f = open(tmp, "xb", buffering=0)  # noqa: SIM115 - closed by the caller
            except FileNotFoundError:  # this folder's first write (a link in its place: makedirs raises)
                os.makedirs(self._tmp, exist_ok=True)
                continue
            try:
                if not lock(f.fileno(), wait=True):
                    self._recycler.locks = False
                    return tmp, f
                self._recycler.locks = True
                if same_file(tmp, f.fileno()):
                    return tmp, f
            except BaseException:
                f.close()
                raise
            f.close()

    @contextmanager
    def _writer(self, key: str, size_hint: int | None = None) -> Iterator[IO[bytes]]:
        path = self._path(key)
        claimed = self._recycler.claim(size_hint) if key.startswith(RECYCLED_PREFIX) else None
        tmp, f = claimed if claimed is not None else self._open_temp()
        flusher = _Flusher(f) if self.fsync else None
        try:
            try:
                yield flusher if flusher is not None else f  # type: ignore[misc]
                if claimed is not None:  # the recycled file may be longer than what was written
                    (flusher or f).truncate(f.tell())
                if flusher is not None:
                    flusher.finish()
                parent = os.path.dirname(path)
                self._make_folder(parent)
                os.replace(tmp, path)  # still locked: the sweep never sees a half-renamed file
                if self.fsync:
                    fsync_dir(parent)
            except BaseException as e:
                unlink(tmp)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._recycler.release_all()  # the space they hold goes to the retry
                raise
        finally:
            if flusher is not None:
                flusher.join()
            f.close()

    def _make_folder(self, folder: str) -> None:
        """Make ``folder`` (and any missing above it) where it is missing, each durably (the
        folder it lies in fsynced). A folder named by two hex digits, the fan-out of packs and
        records (``packs/3f/``), is made with its 255 siblings: a young store's commits would
        otherwise make, and fsync, one or two new folders each for their first few hundred
        (~0.3 ms apiece on this project's test machine)."""
        if os.path.isdir(folder):
            return
        above, name = os.path.split(folder)
        self._make_folder(above)
        for n in _FAN_OUT if name in _FAN_OUT else (name,):
            try:
                os.mkdir(os.path.join(above, n))
            except FileExistsError:  # another writer made it meanwhile, or a sibling was there
                pass
        if self.fsync:
            fsync_dir(above)

    def _put_exclusive(self, key: str, data: memoryview) -> None:
        path = self._path(key)
        tmp, f = self._open_temp()
        try:
            view = data.cast("B")
            while view:  # an unbuffered write may take only part (a file size limit)
                n = f.write(view)
                if not n:
                    raise OSError(errno.EIO, f"writing {key} took no bytes")
                view = view[n:]
            if self.fsync:
                os.fdatasync(f.fileno())
            parent = os.path.dirname(path)
            self._make_folder(parent)
            try:
                try:
                    self._link(tmp, path)  # atomic, and fails when the name is taken
                except OSError as e:
                    if isinstance(e, FileExistsError) or e.errno not in _NO_LINKS:
                        raise
                    try:  # a file system without hard links: a rename as atomic and as exclusive
                        self._rename_noreplace(tmp, path)
                    except OSError as e2:
                        if isinstance(e2, FileExistsError):
                            raise
                        raise BlobStoreError(
                            f"cannot create {key!r} in {self.url}: its file system has no hard links "
                            f"({e.strerror}) and no exclusive rename (renameat2 RENAME_NOREPLACE: "
                            f"{e2.strerror}), which creating an object only if it is absent needs. Put "
                            "the store on a file system that has either (ext4, xfs, btrfs, NFS, …)"
                        ) from e
            except FileExistsError as e:
                raise BlobExistsError(f"object {key!r} already exists in {self.url}") from e
            if self.fsync:
                fsync_dir(parent)
        finally:
            unlink(tmp)
            f.close()

    def _link(self, src: str, dst: str) -> None:
        """``os.link`` of an exclusive put (a seam for tests: a file system without hard links)."""
        os.link(src, dst)

    def _rename_noreplace(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` only if ``dst`` is free, atomically (``renameat2`` with
        ``RENAME_NOREPLACE``: Linux 3.15, glibc 2.28; ext4, xfs, btrfs, tmpfs, exFAT, FAT and SMB
        mounts have it, a FUSE mount where its daemon does); :class:`FileExistsError` when taken,
        another :class:`OSError` where it is missing (a seam for tests too)."""
        fn = _renameat2()
        if fn is None:
            raise OSError(errno.ENOSYS, "renameat2 is not available here")
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) != 0:
            import ctypes

            n = ctypes.get_errno()
            raise OSError(n, os.strerror(n), dst)

    def _read(self, key: str, start: int, end: int | None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                if start:
                    f.seek(start)
                data = f.read() if end is None else f.read(end - start)
                check_unreleased(path, f.fileno(), key, self.url)
        except BlobStoreError:
            raise
        except FileNotFoundError as e:
            raise BlobNotFoundError(f"no object {key!r} in {self.url}") from e
        except OSError as e:
            raise BlobStoreError(f"reading {key!r} in {self.url} failed: {e}") from e
        if end is not None and len(data) != end - start:
            raise BlobStoreError(
                f"object {key!r} in {self.url} is shorter than expected: wanted bytes "
                f"[{start}, {end}), got {len(data)}"
            )
        return data

    def _read_into(self, key: str, start: int, out: memoryview) -> None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise BlobNotFoundError(f"no object {key!r} in {self.url}") from e
        except OSError as e:
            raise BlobStoreError(f"reading {key!r} in {self.url} failed: {e}") from e
        try:
            done = 0
            while done < out.nbytes:
                n = self._pread(fd, out[done:], start + done)
                if n == 0:
                    raise BlobStoreError(
                        f"object {key!r} in {self.url} is shorter than expected: wanted bytes "
                        f"[{start}, {start + out.nbytes}), got {done}"
                    )
                done += n
            check_unreleased(path, fd, key, self.url)
        except BlobStoreError:
            raise
        except OSError as e:
            raise BlobStoreError(f"reading {key!r} in {self.url} failed: {e}") from e
        finally:
            os.close(fd)

    def _pread(self, fd: int, out: memoryview, offset: int) -> int:
        """One ``preadv`` of a read (a seam for tests that must act between a reader's open and
        its read)."""
        return os.preadv(fd, [out], offset)

    def check_delete(self, keys: Sequence[str]) -> None:
        """Also refuses a key whose folder resolves outside the store's namespaces (a link put in
        the store) and a key naming a folder (``packs/3f``, ``packs/.``: a catalog row is
        untrusted), each folder checked once (gc deletes hundreds of packs from the same few)."""
        super().check_delete(keys)
        owned = [os.path.realpath(os.path.join(self.root, p.rstrip("/"))) for p in OWNED_PREFIXES]
        checked: set[str] = set()
        for key in keys:
            path = self._path(key)
            folder = os.path.dirname(path)
            if folder not in checked:
                # a namespace folder replaced by a link must not lead a delete out of the store
                where = os.path.realpath(folder)
                if not any(where == o or where.startswith(o + os.sep) for o in owned):
                    raise NotOwnedError(
                        f"refusing to delete {key!r} from {self.url}: its folder resolves to {where}, "
                        "outside the store's own namespaces (a link was put in the store)"
                    )
                checked.add(folder)
            try:
                is_folder = stat.S_ISDIR(os.lstat(path).st_mode)
            except (FileNotFoundError, NotADirectoryError):  # gone already: nothing to delete
                continue
            if is_folder:
                raise NotOwnedError(
                    f"refusing to delete {key!r} from {self.url}: it names a folder, not an object; "
                    "whatever named this key (a catalog row) is damaged or was tampered with. "
                    "Check the store with `ckstore fsck`"
                )

    def _delete(self, keys: Sequence[str]) -> None:
        """Keys were checked before (:meth:`check_delete`). Pack files are recycled while the
        bound allows (:meth:`._recycle.Recycler.release`), and the rest unlinked on up to
        :data:`_UNLINK_THREADS` threads (ext4 frees a file's extents in the ``unlink`` call: about
        a millisecond for a 3 MiB pack on this project's test machine, 0.7 ms each with four at a
        time)."""
        paths = [self._path(key) for key in keys]
        if self.recycle_bytes > 0 and self._locks_work():
            packs = [p for k, p in zip(keys, paths) if k.startswith(RECYCLED_PREFIX)]
            kept = self._recycler.release(packs, self.recycle_bytes)
            paths = [p for p in paths if p not in kept]
        if len(paths) < _UNLINK_THREADS:  # a few: not worth a thread hand-off
            for path in paths:
                unlink(path)
            return
        with TaskGroup("unlink", _UNLINK_THREADS) as pool:
            for fut in [pool.submit(unlink, p) for p in paths]:
                fut.result()

    def _locks_work(self) -> bool:
        """Whether ``flock`` works in ``tmp/``, tried on a temp file the first time it is asked
        before any write (writers claim recycled files under their lock)."""
        if self._recycler.locks is None:
            tmp, f = self._open_temp()
            f.close()
            unlink(tmp)
        return bool(self._recycler.locks)

    def recycled(self) -> tuple[int, int]:
        return self._recycler.totals()

    def _list(self, prefix: str) -> Iterator[BlobInfo]:
        rel = prefix.strip("/")
        base = self._path(rel) if rel else self.root
        # folders to list, each with its key prefix; links to folders are not followed
        todo = [(base, rel + "/" if rel else "")]
        while todo:
            folder, under = todo.pop()
            try:
                entries = os.scandir(folder)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with entries:
                for e in entries:
                    key = under + e.name
                    try:
                        if e.is_dir():
                            if not e.is_symlink() and (key != "tmp" or prefix.startswith("tmp")):
                                todo.append((e.path, key + "/"))
                            continue
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    yield BlobInfo(key, st.st_size, st.st_mtime)

    def _exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def stale_temp_files(self, older_than: float) -> list[str]:
        """Temp files older than ``older_than`` that no live writer holds, and the recycled
        files beyond the bound that no writer is claiming (:meth:`._recycle.Recycler.surplus`)."""
        out: list[str] = []
        if not self._recycler.owns_tmp():  # a link put in the store: nothing there is ours to remove
            return out
        for name in os.listdir(self._tmp):
            if is_recycled(name):
                continue
            p = os.path.join(self._tmp, name)
            try:
                if os.stat(p).st_mtime < older_than and with_lock(p, lambda: None):
                    out.append(p)
            except FileNotFoundError:
                pass
        return out + self._recycler.surplus(self.recycle_bytes)

    def discard_temp_files(self, handles: Sequence[str]) -> int:
        """Remove the temp files in ``handles`` that lie in this store's ``tmp/`` folder and that
        no live writer holds (each checked again, under its lock)."""
        n = 0
        if not self._recycler.owns_tmp():
            return n
        for p in handles:
            if os.path.dirname(os.path.abspath(p)) != self._tmp:
                raise NotOwnedError(f"refusing to remove {p!r}: not a temp file of {self.url}")
            if with_lock(p, lambda p=p: os.unlink(p)):  # type: ignore[misc]
                n += 1
        return n

