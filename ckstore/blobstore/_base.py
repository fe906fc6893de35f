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
* :meth:`BlobStore.put` with ``exclusive=True`` creates the object only if the key is free and
  raises :class:`BlobExistsError` otherwise (a link on a local disk, a conditional put
  ``If-None-Match: *`` on S3). Stores use it for their config object, so two processes creating
  one store at once agree on its settings.
* :meth:`BlobStore.read` returns exactly the bytes asked for or raises
  :class:`BlobNotFoundError` / :class:`~ckstore.errors.BlobStoreError`. A read that overlaps the
  delete of its object returns the object's bytes or raises :class:`BlobNotFoundError`, never
  other bytes (a local folder recycles released pack files for later packs, and checks).
* :meth:`BlobStore.delete` ignores keys that are already gone, and refuses (with
  :class:`NotOwnedError`, before deleting any key of the call) every key outside the namespaces
  ckstore owns, :data:`OWNED_PREFIXES`: a catalog row naming ``ckstore.json`` or a foreign object
  never deletes it. Leftover temp files are removed only through
  :meth:`BlobStore.discard_temp_files`, and only ones a live writer does not hold.
* Every method may be called from many threads at once.
* A backend that talks to a server never waits forever: requests time out, transient failures
  (connection refused or reset, timeouts, throttling, 5xx answers) are retried a bounded number
  of times with exponential backoff, and then surface as :class:`~ckstore.errors.BlobStoreError`
  naming the object and the store.

Only garbage collection deletes. Subclasses implement the underscored methods; the public
methods count requests and bytes in :attr:`BlobStore.stats` so tests and benchmarks can see
exactly what a checkout read.
"""

from __future__ import annotations

import errno
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from ..errors import BlobStoreError

__all__ = [
    "BlobNotFoundError",
    "BlobExistsError",
    "NotOwnedError",
    "BlobInfo",
    "BlobStats",
    "BlobStore",
    "OWNED_PREFIXES",
    "check_key",
    "check_deletable",
]

#: The key namespaces ckstore writes objects to and may delete from: packs, and the records a
#: lost catalog is rebuilt from (``docs/format.md``). The store's config (``ckstore.json``), a
#: local catalog and anything else are never deleted.
OWNED_PREFIXES = ("packs/", "records/")


class BlobNotFoundError(BlobStoreError, FileNotFoundError):
    """No object under that key."""


class BlobExistsError(BlobStoreError, FileExistsError):
    """An exclusive put found its key already taken."""


class NotOwnedError(BlobStoreError, PermissionError):
    """A delete named a key outside the namespaces ckstore owns (:data:`OWNED_PREFIXES`)."""


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
            self.recycled = 0  # deleted pack files kept for later packs (a local folder)
            self.reused = 0  # objects written over such a file

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
                "recycled": self.recycled,
                "reused": self.reused,
            }


class _CountingWriter:
    def __init__(self, f: IO[bytes], key: str = "", url: str = "") -> None:
        self._f = f
        self.written = 0
        self._where = (key, url)

    def write(self, data: bytes | memoryview) -> int:
        """Write all of ``data``: an unbuffered file's ``write`` may take only part of it (a
        file size limit, a disk filling up), and the rest must not be lost silently."""
        m = memoryview(data).nbytes
        done = 0
        try:
            while True:
                n = self._f.write(data if not done else memoryview(data).cast("B")[done:])
                if n == 0 and m:
                    raise OSError(errno.EIO, f"writing {self._where[0]} took no bytes")
                done = m if n is None else done + n
                if done >= m:
                    break
        except OSError as e:
            err = _no_space(e, *self._where)
            if err is e:
                raise
            raise err from e
        self.written += m
        return m

    def durable_now(self) -> None:
        """Make what was written so far durable now, where the store can before the object
        appears (a local file's ``fdatasync``; an object store's upload happens when the
        writer's block ends, and this does nothing there). The object still appears only then."""
        durable_now = getattr(self._f, "durable_now", None)
        if durable_now is not None:
            durable_now()


class BlobStore(ABC):
    """Immutable objects under opaque keys. See the module docstring for the contract."""

    #: True when objects live on a local (or locally mounted) file system.
    is_local: bool = False
    #: How many objects a commit may have uploading at once (each fully written by one thread).
    write_concurrency: int = 1
    #: True when :meth:`read_into` reads straight into the caller's buffer (no bytes in between)
    reads_into: bool = False
    #: The most bytes of released pack objects a delete keeps for later writes to reuse (a local
    #: folder's recycled files); 0 where the backend does not recycle
    recycle_bytes: int = 0

    def __init__(self, url: str) -> None:
        self.url = url
        self.stats = BlobStats()

    # -- public, counted -------------------------------------------------------------
    @contextmanager
    def writer(self, key: str, size_hint: int | None = None) -> Iterator[_CountingWriter]:
        """A file-like object to write ``key``; the object appears when the block ends.
        ``size_hint``: about how many bytes will be written, where the caller knows (a local
        folder picks the recycled file that fits best)."""
        try:
            with self._writer(key, size_hint) as f:
                w = _CountingWriter(f, key, self.url)
                yield w
        except OSError as e:
            err = _no_space(e, key, self.url)
            if err is e:
                raise
            raise err from e
        self.stats.add(writes=1, bytes_written=w.written)

    def put(
        self,
        key: str,
        data: bytes | memoryview,
        *,
        exclusive: bool = False,
        before_publish: Callable[[], object] | None = None,
    ) -> None:
        """Write a whole object; with ``exclusive`` only if ``key`` is free (else
        :class:`BlobExistsError`). ``before_publish`` (not with ``exclusive``) runs once the
        bytes are written, and durable where the store can make them so before the object
        appears (:meth:`_CountingWriter.durable_now`), and before the object appears: what the
        object names can be made durable meanwhile (a checkpoint's record waits there for its
        packs). A failure in it leaves no object."""
        if not exclusive:
            with self.writer(key, memoryview(data).nbytes) as w:
                w.write(data)
                if before_publish is not None:
                    w.durable_now()
                    before_publish()
            return
        if before_publish is not None:
            raise ValueError("put(): before_publish is not supported with exclusive=True")
        view = memoryview(data)
        try:
            self._put_exclusive(key, view)
        except OSError as e:
            err = _no_space(e, key, self.url)
            if err is e:
                raise
            raise err from e
        self.stats.add(writes=1, bytes_written=view.nbytes)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (to the end when ``end`` is None)."""
        data = self._read(key, start, end)
        self.stats.add(reads=1, bytes_read=len(data))
        return data

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        """Bytes ``[start, start + len(out))`` of ``key``, into ``out`` (straight from the object
        where :attr:`reads_into` says so; otherwise read, then copied)."""
        self._read_into(key, start, out)
        self.stats.add(reads=1, bytes_read=out.nbytes)

    def _read_into(self, key: str, start: int, out: memoryview) -> None:
        out[:] = self._read(key, start, start + out.nbytes)

    def delete(self, keys: Iterable[str]) -> int:
        """Delete ``keys``; returns how many were asked for. Missing keys are ignored. A key
        outside :data:`OWNED_PREFIXES` raises :class:`NotOwnedError` and nothing is deleted."""
        keys = list(keys)
        self.check_delete(keys)
        if keys:
            self._delete(keys)
            self.stats.add(deletes=len(keys))
        return len(keys)

    def check_delete(self, keys: Sequence[str]) -> None:
        """Raise :class:`NotOwnedError` if :meth:`delete` would refuse ``keys``; deletes nothing
        (a dry run of gc asks, to report what a real one refuses)."""
        for key in keys:
            check_deletable(key, self.url)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Every object whose key starts with ``prefix`` (a folder-like prefix ending in ``/``)."""
        self.stats.add(lists=1)
        return self._list(prefix)

    def exists(self, key: str) -> bool:
        return self._exists(key)

    def recycled(self) -> tuple[int, int]:
        """How many released pack files the store keeps for later packs to be written over, and
        their bytes (a local folder's ``tmp/*.free``); ``(0, 0)`` where the backend keeps none."""
        return 0, 0

    # -- for implementers ------------------------------------------------------------
    @abstractmethod
    def _writer(self, key: str, size_hint: int | None = None) -> Any:  # a context manager yielding a binary file
        ...

    @abstractmethod
    def _read(self, key: str, start: int, end: int | None) -> bytes: ...

    @abstractmethod
    def _delete(self, keys: Sequence[str]) -> None: ...

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[BlobInfo]: ...

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _put_exclusive(self, key: str, data: memoryview) -> None: ...

    def stale_temp_files(self, older_than: float) -> Sequence[str]:
        """Leftovers of writes that never finished (a killed process), started before
        ``older_than`` (seconds since the epoch): temp files of a local folder, unfinished
        multipart uploads of an object store. The handles are for :meth:`discard_temp_files`."""
        return []

    def discard_temp_files(self, handles: Sequence[str]) -> int:
        """Remove leftovers :meth:`stale_temp_files` found; returns how many were removed."""
        return 0

    def temp_file_key(self, handle: str) -> str | None:
        """The key a leftover was being written to, where the backend knows it (else None)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _no_space(e: OSError, key: str, url: str) -> OSError:
    """A full disk or quota, or a file size limit, as a :class:`BlobStoreError` that says what to
    do; other errors as they are."""
    if isinstance(e, BlobStoreError):
        return e
    if e.errno == errno.EFBIG:
        return BlobStoreError(
            f"writing {key} in {url} stopped at a file size limit ({e.strerror}): the process's "
            "(`ulimit -f`, RLIMIT_FSIZE) or the file system's largest file; nothing of what was being "
            "written became visible. Raise the limit, or open the store with a smaller pack_size, and retry"
        )
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return e
    return BlobStoreError(
        f"no space left to write {key} in {url} ({e.strerror}); nothing of what was being written "
        "became visible. Free space (`ckstore gc` removes what a failed commit wrote) and retry"
    )


def check_key(key: str) -> None:
    if not key or key.startswith("/") or ".." in key.split("/") or "\\" in key:
        raise BlobStoreError(f"invalid blob key {key!r}")


def check_deletable(key: str, where: str = "the store") -> None:
    """Refuse to delete ``key`` unless it lies in a namespace ckstore owns (a key that is no
    valid key at all, as ``packs/../ckstore.json``, is refused the same way, and so is one with an
    empty or ``.`` part, as ``packs/3f/`` or ``packs/.``, which ckstore never writes and which
    names a folder on a local disk)."""
    try:
        check_key(key)
        if any(part in ("", ".") for part in key.split("/")):
            raise BlobStoreError(f"invalid blob key {key!r}")
    except BlobStoreError as e:
        raise NotOwnedError(f"refusing to delete {key!r} from {where}: {e}; check the store with `ckstore fsck`") from e
    if not any(key.startswith(p) and len(key) > len(p) for p in OWNED_PREFIXES):
        raise NotOwnedError(
            f"refusing to delete {key!r} from {where}: ckstore deletes only its own objects "
            f"(under {', '.join(OWNED_PREFIXES)}); whatever named this key (a catalog row) is damaged "
            "or was tampered with. Check the store with `ckstore fsck`"
        )
