"""Objects as files in a local folder (or a shared file system mounted on every node).

Writes go through a temp file under ``tmp/``, which the writer holds an exclusive ``flock`` on
from the moment it exists until it is renamed into place or removed. The stale-temp sweep
(:meth:`LocalBlobStore.stale_temp_files`, :meth:`LocalBlobStore.discard_temp_files`) skips every
file it cannot lock, and removes a file only while holding its lock, so however long a live
writer stalls, gc never deletes its temp file; a killed writer's lock dies with it. On a file
system without working locks (some FUSE mounts) the grace period is the only protection.

Pack files a delete releases are *recycled*: up to :attr:`LocalBlobStore.recycle_bytes` of them
(and :data:`RECYCLE_FILES` files) are renamed into ``tmp/`` as ``<random>.free`` instead of
unlinked, and a later pack is written over one of them (the best fit for the size its writer
expects; claimed by taking its ``flock`` and
renaming it to a ``.part`` temp file, so two writers never share a file; truncated to the new
length). Overwriting blocks a file already holds costs the disk less than allocating fresh ones,
and renaming a file costs less than unlinking it, whose extents ext4 frees in the call: measured
on this project's test machine, a 4 MiB pack's write and ``fdatasync`` 15.3 ms fresh against 11.8
ms recycled, and an unlink 3.8 ms against 0.2 ms for the rename (``benchmarks/timeline_commit.py``).
Recycled files never hold so much that the file system has less than the bound left free, so a
nearly full disk gets its space back from gc. A file with another hard link (a ``cp -al`` backup of the store) is never
recycled. A read that
overlaps the release of its object checks afterwards that the key still names the file it read,
so it returns the old bytes or raises :class:`BlobNotFoundError`, never a later pack's bytes.
The stale-temp sweep removes recycled files beyond the bound (all of them with a bound of 0, as
``ckstore gc`` opens the store), and a write that finds the disk full removes them all. Where
``tmp/`` is a link rather than a folder of the store's own, nothing is recycled, claimed or swept
there.
"""

from __future__ import annotations

import errno
import fcntl
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

__all__ = ["DEFAULT_RECYCLE_BYTES", "RECYCLE_FILES", "LocalBlobStore"]

#: Files a delete unlinks at once (see :meth:`LocalBlobStore._delete`)
_UNLINK_THREADS = 4
#: The bytes of released pack files a local store keeps for later packs to be written over,
#: unless :func:`ckstore.open` says otherwise (``recycle_bytes``); four default-sized packs
DEFAULT_RECYCLE_BYTES = 256 << 20
#: At most this many recycled files are kept, whatever their size
RECYCLE_FILES = 64
#: The suffix of a recycled file in ``tmp/`` (a temp file being written ends in ``.part``)
_FREE = ".free"
#: Keys whose files are recycled, and whose writers take a recycled file
_RECYCLED_PREFIX = "packs/"


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
        self._since += memoryview(data).nbytes
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
        self._tmp = os.path.join(self.root, "tmp")
        #: whether ``flock`` works here (None: not tried yet); without it nothing is recycled
        self._locks: bool | None = None
        os.makedirs(self._tmp, exist_ok=True)

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.root, *key.split("/"))

    def _open_temp(self) -> tuple[str, IO[bytes]]:
        """A new temp file, open and locked. The sweep may lock and remove a file in the instant
        between its creation and the writer's lock; the writer then sees another file (or none)
        under the name and starts over with a new one."""
        while True:
            tmp = os.path.join(self._tmp, f"{uuid.uuid4().hex}.part")
            f = open(tmp, "xb", buffering=0)  # noqa: SIM115 - closed by the caller
            try:
                if not _lock(f.fileno(), wait=True):
                    self._locks = False
                    return tmp, f
                self._locks = True
                if _same_file(tmp, f.fileno()):
                    return tmp, f
            except BaseException:
                f.close()
                raise
            f.close()

    def _tmp_is_ours(self) -> bool:
        """Whether ``tmp/`` is a folder of the store's own, not a link that would lead recycling
        and the stale-temp sweep to files outside the store (then neither touches it)."""
        try:
            return stat.S_ISDIR(os.lstat(self._tmp).st_mode)
        except FileNotFoundError:
            return False

    def _claim_recycled(self, size_hint: int | None) -> tuple[str, IO[bytes]] | None:
        """A recycled file, locked and renamed to a new ``.part`` temp file, open for writing
        from its start; None when there is none to take. The best fit for ``size_hint`` goes
        first: the smallest file at least that long, else the longest (no hint: the longest),
        so a pack is neither truncated much nor grown much. A file another writer (or the
        sweep) holds is skipped; one that gained a hard link since it was released loses this
        name (the other keeps its bytes)."""
        if self._locks is False or not self._tmp_is_ours():
            return None
        want = size_hint if size_hint is not None else 1 << 62
        fits = sorted(self._recycled_files(), key=lambda t: (t[1] < want, t[1] if t[1] >= want else -t[1]))
        for path, _, _ in fits:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError:  # taken meanwhile (gone), or not a plain file of ours
                continue
            try:
                try:
                    if not _lock(fd, wait=False):
                        self._locks = False
                        os.close(fd)
                        return None
                except BlockingIOError:  # another writer is claiming it
                    os.close(fd)
                    continue
                st = os.fstat(fd)
                if not _same_file(path, fd) or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    if _same_file(path, fd):
                        _unlink(path)
                    os.close(fd)
                    continue
                tmp = os.path.join(self._tmp, f"{uuid.uuid4().hex}.part")
                try:
                    os.rename(path, tmp)  # under the lock: no other claimer got past _same_file
                except FileNotFoundError:  # the name went meanwhile (a cached lookup, a user)
                    os.close(fd)
                    continue
                # a fresh time: the sweep's grace (all that protects it where locks are per host)
                # runs from the claim, not from the released pack's write
                os.utime(fd)
                self.stats.add(reused=1)
                return tmp, open(fd, "r+b", buffering=0)  # noqa: SIM115 - closed by the caller
            except BaseException:
                try:
                    os.close(fd)
                except OSError:
                    pass
                raise
        return None

    @contextmanager
    def _writer(self, key: str, size_hint: int | None = None) -> Iterator[IO[bytes]]:
        path = self._path(key)
        claimed = self._claim_recycled(size_hint) if key.startswith(_RECYCLED_PREFIX) else None
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
                    _fsync_dir(parent)
            except BaseException as e:
                _unlink(tmp)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._release_recycled()  # the space they hold goes to the retry
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
            _fsync_dir(above)

    def _put_exclusive(self, key: str, data: memoryview) -> None:
        path = self._path(key)
        tmp, f = self._open_temp()
        try:
            f.write(data)
            if self.fsync:
                os.fdatasync(f.fileno())
            parent = os.path.dirname(path)
            self._make_folder(parent)
            try:
                os.link(tmp, path)  # atomic, and fails when the name is taken
            except FileExistsError as e:
                raise BlobExistsError(f"object {key!r} already exists in {self.url}") from e
            if self.fsync:
                _fsync_dir(parent)
        finally:
            _unlink(tmp)
            f.close()

    def _read(self, key: str, start: int, end: int | None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                if start:
                    f.seek(start)
                data = f.read() if end is None else f.read(end - start)
                _check_unreleased(path, f.fileno(), key, self.url)
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
            _check_unreleased(path, fd, key, self.url)
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

    def _delete(self, keys: Sequence[str]) -> None:
        """Every key's folder is checked before any file goes, each folder once (gc deletes
        hundreds of packs from the same few folders). Pack files are then recycled while the
        bound allows (:meth:`_recycle`), and the rest unlinked on up to :data:`_UNLINK_THREADS`
        threads (ext4 frees a file's extents in the ``unlink`` call: about a millisecond for a
        3 MiB pack on this project's test machine, 0.7 ms each with four at a time)."""
        owned = [os.path.realpath(os.path.join(self.root, p.rstrip("/"))) for p in OWNED_PREFIXES]
        checked: set[str] = set()
        paths = []
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
            paths.append(path)
        if self.recycle_bytes > 0 and self._tmp_is_ours() and self._locks_work():
            kept = self._recycle([p for k, p in zip(keys, paths) if k.startswith(_RECYCLED_PREFIX)])
            paths = [p for p in paths if p not in kept]
        if len(paths) < _UNLINK_THREADS:  # a few: not worth a thread hand-off
            for path in paths:
                _unlink(path)
            return
        with TaskGroup("unlink", _UNLINK_THREADS) as pool:
            for fut in [pool.submit(_unlink, p) for p in paths]:
                fut.result()

    def _release_recycled(self) -> int:
        """Delete every recycled file no writer is claiming (a write found the disk full);
        returns how many."""
        n = 0
        for path, _, _ in self._recycled_files():
            if _with_lock(path, lambda path=path: os.unlink(path)):  # type: ignore[misc]
                n += 1
        return n

    def _locks_work(self) -> bool:
        """Whether ``flock`` works in ``tmp/``, tried on a temp file the first time it is asked
        before any write (writers claim recycled files under their lock)."""
        if self._locks is None:
            tmp, f = self._open_temp()
            f.close()
            _unlink(tmp)
        return bool(self._locks)

    def _recycle(self, paths: Sequence[str]) -> set[str]:
        """Rename files of ``paths`` into ``tmp/`` as recycled files while the recycled files stay
        within :attr:`recycle_bytes` and :data:`RECYCLE_FILES` (two processes deleting at once may
        overshoot a little; the sweep trims). Returns the paths handled (renamed, or already
        gone); the caller unlinks the others: files with another hard link, files on another
        file system than ``tmp/``, files over the bound."""
        files, size = self.recycled()
        limit = self._recycle_limit()
        done: set[str] = set()
        for path in paths:
            if files >= RECYCLE_FILES:
                break
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                done.add(path)
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or not 0 < st.st_size <= limit - size:
                continue
            try:
                os.rename(path, os.path.join(self._tmp, f"{uuid.uuid4().hex}{_FREE}"))
            except FileNotFoundError:  # another gc deleted it meanwhile
                done.add(path)
                continue
            except OSError:  # another file system (a folder linked elsewhere): unlinked instead
                continue
            done.add(path)
            files += 1
            size += st.st_size
            self.stats.add(recycled=1)
        return done

    def _recycle_limit(self) -> int:
        """The most bytes recycled files may hold now: :attr:`recycle_bytes`, and no more than
        leaves the file system as much again free, so that a nearly full disk gets its space back
        from gc (under twice the bound free: less; under the bound: none)."""
        try:
            st = os.statvfs(self._tmp)
        except OSError:
            return 0
        return max(0, min(self.recycle_bytes, st.f_bavail * st.f_frsize - self.recycle_bytes))

    def recycled(self) -> tuple[int, int]:
        """How many recycled files ``tmp/`` holds, and their bytes."""
        spares = self._recycled_files()
        return len(spares), sum(size for _, size, _ in spares)

    def _recycled_files(self) -> list[tuple[str, int, float]]:
        """``(path, size, mtime)`` of every recycled file, newest first."""
        out: list[tuple[str, int, float]] = []
        if not self._tmp_is_ours():
            return out
        try:
            names = [n for n in os.listdir(self._tmp) if n.endswith(_FREE)]
        except FileNotFoundError:
            return []
        for name in names:
            path = os.path.join(self._tmp, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):  # nothing else there is ours
                out.append((path, st.st_size, st.st_mtime))
        out.sort(key=lambda t: t[2], reverse=True)
        return out

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
        files beyond the bound (:meth:`_recycle_limit`, :data:`RECYCLE_FILES`; the oldest go
        first) that no writer is claiming."""
        out: list[str] = []
        if not self._tmp_is_ours():  # a link put in the store: nothing there is ours to remove
            return out
        for name in os.listdir(self._tmp):
            if name.endswith(_FREE):
                continue
            p = os.path.join(self._tmp, name)
            try:
                if os.stat(p).st_mtime < older_than and _with_lock(p, lambda: None):
                    out.append(p)
            except FileNotFoundError:
                pass
        files, size, limit = 0, 0, self._recycle_limit()
        for p, n, _ in self._recycled_files():
            if files < RECYCLE_FILES and 0 < n <= limit - size:
                files, size = files + 1, size + n
            elif _with_lock(p, lambda: None):
                out.append(p)
        return out

    def discard_temp_files(self, handles: Sequence[str]) -> int:
        """Remove the temp files in ``handles`` that lie in this store's ``tmp/`` folder and that
        no live writer holds (each checked again, under its lock)."""
        n = 0
        if not self._tmp_is_ours():
            return n
        for p in handles:
            if os.path.dirname(os.path.abspath(p)) != self._tmp:
                raise NotOwnedError(f"refusing to remove {p!r}: not a temp file of {self.url}")
            if _with_lock(p, lambda p=p: os.unlink(p)):  # type: ignore[misc]
                n += 1
        return n


def _lock(fd: int, *, wait: bool) -> bool:
    """Take an exclusive ``flock`` on ``fd``: True when held, False on a file system without
    locks; raises :class:`BlockingIOError` when another holds it and ``wait`` is False."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF):
            return False
        raise
    return True


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _with_lock(path: str, action: Callable[[], None]) -> bool:
    """Run ``action`` holding ``path``'s lock, if no live writer holds it and ``path`` still names
    the file locked; returns whether it ran."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except PermissionError:  # another user's file: a read-only descriptor locks it too (flock)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
    except OSError:  # gone, a link (ELOOP) or a folder (EISDIR): not a temp file to remove
        return False
    try:
        try:
            _lock(fd, wait=False)
        except BlockingIOError:
            return False  # a live writer holds it
        if not _same_file(path, fd):
            return False
        try:
            action()
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def _check_unreleased(path: str, fd: int, key: str, url: str) -> None:
    """After reading ``fd``, opened as ``path``: raise :class:`BlobNotFoundError` unless ``path``
    still names that file. A released pack file is renamed away before anything overwrites it,
    and keys are never reused, so when the name still holds, the bytes read were the object's."""
    if not _same_file(path, fd):
        raise BlobNotFoundError(f"object {key!r} in {url} was deleted while it was being read")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

