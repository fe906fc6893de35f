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
  :class:`BlobNotFoundError` / :class:`~ckstore.errors.BlobStoreError`.
* :meth:`BlobStore.delete` ignores keys that are already gone.
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

import copy
import io
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from ._retry import retry
from .errors import BlobStoreError, StoreConfigError

__all__ = [
    "BlobNotFoundError",
    "BlobExistsError",
    "BlobInfo",
    "BlobStats",
    "BlobStore",
    "LocalBlobStore",
    "FsspecBlobStore",
    "S3_CONFIG_DEFAULTS",
    "open_blobstore",
    "is_local_url",
]

T = TypeVar("T")


class BlobNotFoundError(BlobStoreError, FileNotFoundError):
    """No object under that key."""


class BlobExistsError(BlobStoreError, FileExistsError):
    """An exclusive put found its key already taken."""


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
    #: How many objects a commit may have uploading at once (each fully written by one thread).
    write_concurrency: int = 1

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

    def put(self, key: str, data: bytes | memoryview, *, exclusive: bool = False) -> None:
        """Write a whole object; with ``exclusive`` only if ``key`` is free (else
        :class:`BlobExistsError`)."""
        if not exclusive:
            with self.writer(key) as w:
                w.write(data)
            return
        view = memoryview(data)
        self._put_exclusive(key, view)
        self.stats.add(writes=1, bytes_written=view.nbytes)

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


def _check_key(key: str) -> None:
    if not key or key.startswith("/") or ".." in key.split("/") or "\\" in key:
        raise BlobStoreError(f"invalid blob key {key!r}")


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


#: botocore settings every S3 store starts from; ``storage_options={"config_kwargs": {...}}``
#: overrides any of them. botocore does not retry on its own: ckstore's retry loop does (see
#: :mod:`ckstore._retry`), so a dead endpoint fails after a known number of bounded attempts.
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 30,
    "retries": {"total_max_attempts": 1},
    "max_pool_connections": 32,
}


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _with_defaults(protocol: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(storage_options)
    if protocol == "memory":
        return opts
    # another process may have written or deleted objects: never answer from a stale listing
    opts.setdefault("use_listings_cache", False)
    if protocol in ("s3", "s3a"):
        # a deep copy: botocore edits the retries dict it is given
        opts["config_kwargs"] = copy.deepcopy({**S3_CONFIG_DEFAULTS, **(opts.get("config_kwargs") or {})})
        # a private client, whose own retry count ckstore sets (see FsspecBlobStore.__init__)
        opts.setdefault("skip_instance_cache", True)
    return opts


class _ObjectWriter:
    """One new object: bytes are buffered and put in one request; past ``limit`` bytes they
    stream into an upload (S3 multipart) that becomes visible only when completed."""

    def __init__(self, store: FsspecBlobStore, key: str, path: str, limit: int | None) -> None:
        self._store, self._key, self._path, self._limit = store, key, path, limit
        self._buf: io.BytesIO | None = io.BytesIO()
        self._f: Any = None

    def write(self, data: bytes | memoryview) -> int:
        if self._buf is None:
            return self._stream(data)
        n = self._buf.write(data)
        if self._limit is not None and self._buf.tell() > self._limit:
            buf, self._buf = self._buf, None
            try:
                self._f = self._store.fs.open(self._path, "wb", autocommit=False)
            except Exception as e:  # noqa: BLE001
                raise self._store._error(f"opening an upload of {self._key!r}", e) from e
            self._stream(buf.getbuffer())
        return n

    def _stream(self, data: bytes | memoryview) -> int:
        try:
            return int(self._f.write(data))
        except Exception as e:  # noqa: BLE001 - a part upload failed after the backend's retries
            raise self._store._error(f"uploading {self._key!r}", e) from e

    def finish(self) -> None:
        store = self._store
        if self._buf is not None:
            data = self._buf.getvalue()
            store._call(f"writing {self._key!r}", lambda: store.fs.pipe_file(self._path, data), self._key)
            return
        try:
            self._f.close()  # uploads the last part; the object is not visible yet
        except Exception as e:  # noqa: BLE001
            raise store._error(f"uploading {self._key!r}", e) from e
        store._call(f"completing the upload of {self._key!r}", self._f.commit, self._key)

    def discard(self) -> None:
        if self._f is not None:
            try:
                self._f.discard()
            except Exception:  # noqa: BLE001 - best effort; an unfinished upload is never visible
                pass
            self._f.closed = True  # discarded: closing it later must not upload the rest


class FsspecBlobStore(BlobStore):
    """Objects on any fsspec file system (``s3://``, ``gs://``, ``memory://``, …).

    Object stores have no rename: an object is written with a single put, or (past
    ``buffer_limit`` bytes) a multipart upload that becomes visible only when completed; an
    exclusive put is a conditional write. Every request is retried ``attempts`` times at most
    on transient failures, with exponential backoff. S3 requests time out (see
    :data:`S3_CONFIG_DEFAULTS`). A commit uploads up to ``write_concurrency`` packs at once
    (each buffered in memory up to ``buffer_limit`` bytes). ``attempts``, ``buffer_limit`` and
    ``write_concurrency`` may be given among a store's ``storage_options``; the others go to
    fsspec. Credentials and endpoints come from the environment
    (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, …), fsspec's configuration or
    ``storage_options``; ckstore never stores them.
    """

    def __init__(
        self,
        url: str,
        *,
        attempts: int = 4,
        buffer_limit: int = 128 * 1024 * 1024,
        write_concurrency: int = 3,
        **storage_options: Any,
    ) -> None:
        import fsspec

        super().__init__(url.rstrip("/"))
        protocol = url.split("://", 1)[0]
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **_with_defaults(protocol, storage_options))
        except ImportError as e:
            raise StoreConfigError(f"cannot open {url}: {e} (pip install 'ckstore[{protocol}]')") from e
        except (ValueError, TypeError) as e:
            raise StoreConfigError(f"cannot open {url}: {e}") from e
        if protocol in ("s3", "s3a"):
            self.fs.retries = 1  # s3fs's own loop; ckstore's retry loop takes over
        self.attempts = attempts
        self.root = root.rstrip("/")
        memory = "memory" in _protocols(self.fs)
        self.buffer_limit: int | None = None if memory else buffer_limit
        self.write_concurrency = 1 if memory else max(1, write_concurrency)

    def _path(self, key: str) -> str:
        _check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _error(self, what: str, e: BaseException) -> BlobStoreError:
        return BlobStoreError(f"{what} in {self.url} failed: {type(e).__name__}: {e}")

    def _call(self, what: str, fn: Callable[[], T], key: str | None = None) -> T:
        """``fn`` under the retry loop; a missing object or bucket becomes a clear error."""
        try:
            return retry(f"{what} in {self.url}", fn, attempts=self.attempts)
        except FileNotFoundError as e:
            if key is None:
                raise
            raise BlobNotFoundError(f"no object {key!r} in {self.url}") from e

    @contextmanager
    def _writer(self, key: str) -> Iterator[_ObjectWriter]:
        w = _ObjectWriter(self, key, self._path(key), self.buffer_limit)
        try:
            yield w
            w.finish()
        except BlobNotFoundError as e:
            w.discard()
            raise BlobStoreError(
                f"cannot write {key!r}: {self.url} does not exist (create the bucket first)"
            ) from e
        except BaseException:
            w.discard()
            raise

    def _put_exclusive(self, key: str, data: memoryview) -> None:
        path, body = self._path(key), bytes(data)
        try:
            self._call(f"creating {key!r}", lambda: self.fs.pipe_file(path, body, mode="create"), key)
        except FileExistsError as e:
            raise BlobExistsError(f"object {key!r} already exists in {self.url}") from e
        except BlobNotFoundError as e:
            raise BlobStoreError(
                f"cannot write {key!r}: {self.url} does not exist (create the bucket first)"
            ) from e

    def _read(self, key: str, start: int, end: int | None) -> bytes:
        path = self._path(key)
        whole = start == 0 and end is None  # a plain GET: a range of an empty object is unsatisfiable
        what = f"reading {key!r}" if whole else f"reading bytes [{start}, {end}) of {key!r}"
        first = None if whole else start
        data = self._call(what, lambda: bytes(self.fs.cat_file(path, start=first, end=end)), key)
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

            self._call(f"deleting {len(batch)} objects", go)

    def _list(self, prefix: str) -> Iterator[BlobInfo]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        try:
            found = self._call(f"listing {prefix or '/'}", lambda: self.fs.find(base, detail=True, withdirs=False))
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
        path = self._path(key)
        return bool(self._call(f"checking {key!r}", lambda: self.fs.exists(path)))

    def stale_temp_files(self, older_than: float) -> list[str]:
        """Unfinished multipart uploads under this store's prefix (S3 only): what a commit killed
        while uploading a large pack leaves behind, billed until aborted."""
        lister = getattr(self.fs, "list_multipart_uploads", None)
        if lister is None or not self.root:
            return []
        bucket, _, prefix = self.root.partition("/")
        uploads = self._call("listing unfinished uploads", lambda: lister(bucket))
        out = []
        for u in uploads or ():
            key, started = str(u.get("Key", "")), u.get("Initiated")
            when = started.timestamp() if hasattr(started, "timestamp") else None
            if key.startswith(f"{prefix}/" if prefix else "") and when is not None and when < older_than:
                out.append(f"{bucket}/{key}\n{u['UploadId']}")
        return out

    def temp_file_key(self, handle: str) -> str | None:
        path = handle.partition("\n")[0]
        prefix = f"{self.root}/"
        return path[len(prefix) :] if path.startswith(prefix) else None

    def discard_temp_files(self, handles: Sequence[str]) -> int:
        n = 0
        for h in handles:
            path, _, upload_id = h.partition("\n")
            bucket, _, key = path.partition("/")
            try:
                self._call(
                    f"aborting the upload of {key!r}",
                    lambda b=bucket, k=key, u=upload_id: self.fs.abort_mpu(b, k, u),  # type: ignore[misc]
                )
                n += 1
            except BlobStoreError:
                pass  # already completed or aborted
        return n


def is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def open_blobstore(url: str, **storage_options: Any) -> BlobStore:
    """The blob store for a local path or fsspec URL.

    A local path (or ``file://`` URL) is a :class:`LocalBlobStore`, which suits shared file
    systems mounted on every node too; any other URL is a :class:`FsspecBlobStore` with
    ``storage_options``.
    """
    if is_local_url(url):
        if storage_options:
            raise StoreConfigError(f"storage options apply to object stores, not to the local folder {url}")
        path = url[len("file://") :] if url.startswith("file://") else url
        return LocalBlobStore(path)
    return FsspecBlobStore(url, **storage_options)
