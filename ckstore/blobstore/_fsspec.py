"""Objects on any fsspec file system: S3, GCS, memory, …"""

from __future__ import annotations

import asyncio
import copy
import io
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from ..errors import BlobStoreError, StoreConfigError
from ._base import (
    OWNED_PREFIXES,
    BlobExistsError,
    BlobInfo,
    BlobNotFoundError,
    BlobStore,
    NotOwnedError,
    check_key,
)
from ._retry import retry

__all__ = ["FsspecBlobStore", "S3_CONFIG_DEFAULTS"]

T = TypeVar("T")


#: botocore settings every S3 store starts from; ``storage_options={"config_kwargs": {...}}``
#: overrides any of them. botocore does not retry on its own: ckstore's retry loop does (see
#: :mod:`ckstore.blobstore._retry`), so a dead endpoint fails after a known number of bounded attempts.
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


def _missing_as_file_not_found(fn: Callable[[], T]) -> T:
    """``fn()``; adlfs lets azure-core's ``ResourceNotFoundError`` (a missing container) through
    where the other backends raise ``FileNotFoundError``."""
    try:
        return fn()
    except Exception as e:
        if type(e).__name__ == "ResourceNotFoundError":
            raise FileNotFoundError(str(e).splitlines()[0]) from e
        raise


#: S3's smallest part (but the last): a multipart upload streams in parts of at least this size
_S3_MIN_PART = 5 * 1024 * 1024


def _without_expect_continue(session: Any) -> None:
    """Stop botocore from asking for ``Expect: 100-continue`` on PUTs with a body.

    aiohttp sends such a body only once the server answered ``100 Continue``, and starts its read
    timeout only once the body is sent: a server that stops answering (frozen, overloaded, a
    half-open connection) would hold the request forever, whatever ``read_timeout`` says.
    Without the header, the body goes out at once and the read timeout bounds the wait.
    """
    from botocore.handlers import add_expect_header

    session.unregister("before-call.s3", add_expect_header)


class WriteTimeoutError(Exception):
    """The server took no byte of a request's body for connect_timeout + read_timeout (retried;
    not a ``TimeoutError``, which fsspec would turn into a bare ``FSTimeoutError``)."""


class _Body(io.BytesIO):
    """A request body that notes when the HTTP client last took bytes from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.last_read = time.monotonic()

    def read(self, size: int | None = -1) -> bytes:
        self.last_read = time.monotonic()
        return super().read(size)


async def _send(fs: Any, method: str, body: _Body, stall: float, kwargs: dict[str, Any]) -> Any:
    """``fs._call_s3(method, Body=body, **kwargs)``, given up once the body has not moved for
    ``stall`` seconds.

    A server that stops reading (frozen, or its connection half-open) fills the socket's
    buffers and then holds the sender forever: aiohttp's read timeout starts only once the whole
    body is sent. Once the body is out, the read timeout bounds the wait for the answer.
    """
    task = asyncio.ensure_future(fs._call_s3(method, Body=body, **kwargs))
    try:
        while True:
            idle = time.monotonic() - body.last_read
            if idle >= stall:
                raise WriteTimeoutError(
                    f"the server took no byte of the request body for {stall:g} s "
                    "(connect_timeout + read_timeout)"
                )
            done, _ = await asyncio.wait({task}, timeout=stall - idle)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()  # aiohttp closes the connection
            try:
                await task
            except BaseException:  # noqa: BLE001 - the request given up, whatever it raised
                pass


class _MultipartUpload:
    """One S3 multipart upload, driven request by request, each under ckstore's retry loop:
    at most ``part_size`` bytes are held at a time, parts go up in order as they fill, and the
    object becomes visible only when :meth:`complete` succeeds."""

    def __init__(self, store: FsspecBlobStore, key: str, path: str, part_size: int) -> None:
        self._store, self._key, self._part_size = store, key, part_size
        bucket, obj, _ = store.fs.split_path(path)
        self._where = {"Bucket": bucket, "Key": obj}
        self._buf = bytearray()
        self._parts: list[dict[str, Any]] = []
        self._size = 0
        self._upload_id: str | None = None
        created = store._s3(f"opening an upload of {key!r}", "create_multipart_upload", key, **self._where)
        self._upload_id = str(created["UploadId"])

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            room = self._part_size - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) == self._part_size:
                part, self._buf = bytes(self._buf), bytearray()
                self._upload(part)

    def _upload(self, body: bytes) -> None:
        number, store = len(self._parts) + 1, self._store
        try:
            answer = store._s3_send(
                f"uploading {self._key!r} (part {number})", "upload_part", None, body,
                **self._where, UploadId=self._upload_id, PartNumber=number,
            )  # fmt: skip
        except FileNotFoundError as e:
            raise store._error(f"uploading {self._key!r} (part {number})", e) from e
        self._parts.append({"PartNumber": number, "ETag": answer["ETag"]})
        self._size += len(body)

    def complete(self) -> None:
        if self._buf or not self._parts:
            part, self._buf = bytes(self._buf), bytearray()
            self._upload(part)  # the last part, which may be short
        store, tries = self._store, 0

        def go() -> Any:
            nonlocal tries
            tries += 1
            try:
                return store.fs.call_s3(
                    "complete_multipart_upload", **self._where, UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )  # fmt: skip
            except FileNotFoundError:
                # the upload is gone: if an earlier try completed it (its answer was lost), the
                # object is there, whole
                if tries > 1 and self._completed_before():
                    return None
                raise

        store._call(f"completing the upload of {self._key!r}", go, self._key)

    def _completed_before(self) -> bool:
        try:
            head = self._store.fs.call_s3("head_object", **self._where)
        except Exception:  # noqa: BLE001 - not there, or unknown: the upload did not complete
            return False
        return int(head.get("ContentLength", -1)) == self._size

    def abort(self) -> None:
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        try:
            self._store._s3(
                f"aborting the upload of {self._key!r}", "abort_multipart_upload", None,
                **self._where, UploadId=upload_id,
            )  # fmt: skip
        except (BlobStoreError, FileNotFoundError):
            pass  # best effort: an unfinished upload is never visible, and gc aborts it later


class _ObjectWriter:
    """One new object: bytes are buffered and put in one request; past ``limit`` bytes they
    stream into an upload (S3 multipart) that becomes visible only when completed."""

    def __init__(self, store: FsspecBlobStore, key: str, path: str, limit: int | None) -> None:
        self._store, self._key, self._path, self._limit = store, key, path, limit
        self._buf: io.BytesIO | None = io.BytesIO()
        self._f: Any = None  # an fsspec file (GCS, Azure, …)
        self._mpu: _MultipartUpload | None = None  # S3

    def write(self, data: bytes | memoryview) -> int:
        if self._buf is None:
            self._stream(data)
            return len(data)
        n = self._buf.write(data)
        if self._limit is not None and self._buf.tell() > self._limit:
            buf, self._buf = self._buf, None
            store = self._store
            if store.is_s3:
                self._mpu = _MultipartUpload(store, self._key, self._path, store.part_size)
            else:
                try:
                    self._f = store.fs.open(self._path, "wb", autocommit=False)
                except Exception as e:  # noqa: BLE001
                    raise store._error(f"opening an upload of {self._key!r}", e) from e
            self._stream(buf.getbuffer())
        return n

    def _stream(self, data: bytes | memoryview) -> None:
        if self._mpu is not None:
            self._mpu.write(data)  # each part under the retry loop
            return
        try:
            self._f.write(data)
        except Exception as e:  # noqa: BLE001 - a part upload failed after the backend's retries
            raise self._store._error(f"uploading {self._key!r}", e) from e

    def finish(self) -> None:
        store = self._store
        if self._buf is not None:
            data = self._buf.getvalue()
            if store.is_s3:
                bucket, obj, _ = store.fs.split_path(self._path)
                store._s3_send(f"writing {self._key!r}", "put_object", self._key, data, Bucket=bucket, Key=obj)
            else:
                store._call(f"writing {self._key!r}", lambda: store.fs.pipe_file(self._path, data), self._key)
            return
        if self._mpu is not None:
            self._mpu.complete()
            self._mpu = None
            return
        try:
            self._f.close()  # uploads the last part; the object is not visible yet
        except Exception as e:  # noqa: BLE001
            raise store._error(f"uploading {self._key!r}", e) from e
        store._call(f"completing the upload of {self._key!r}", self._f.commit, self._key)

    def discard(self) -> None:
        if self._mpu is not None:
            self._mpu.abort()
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
        for name, value, least in (("attempts", attempts, 1), ("buffer_limit", buffer_limit, 0),
                                   ("write_concurrency", write_concurrency, 1)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise StoreConfigError(f"storage option {name} must be an int >= {least}, got {value!r} ({url})")
        protocol = url.split("://", 1)[0]
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **_with_defaults(protocol, storage_options))
        except ImportError as e:
            raise StoreConfigError(f"cannot open {url}: {e} (pip install 'ckstore[{protocol}]')") from e
        except (ValueError, TypeError) as e:
            raise StoreConfigError(f"cannot open {url}: {e}") from e
        self.is_s3 = protocol in ("s3", "s3a")
        if self.is_s3:
            self.fs.retries = 1  # s3fs's own loop; ckstore's retry loop takes over
            if self.fs.session is None:
                # a session of this store's own, which s3fs keeps for every client it creates
                from aiobotocore.session import AioSession

                self.fs.session = AioSession(**self.fs.kwargs)
                self.fs._session_is_owned = False  # never replaced by one with the default handlers
            _without_expect_continue(self.fs.session)  # a session given in storage_options too
            config = getattr(self.fs, "config_kwargs", None) or {}
            self._stall = float(config.get("connect_timeout") or 5) + float(config.get("read_timeout") or 30)
        else:
            self._stall = 0.0  # unused: only S3 requests are sent by ckstore itself
        #: the size of a multipart upload's parts (S3): ``default_block_size``, 5 MiB at least
        self.part_size = max(_S3_MIN_PART, int(getattr(self.fs, "default_block_size", 0) or 0))
        self.attempts = attempts
        self.root = root.rstrip("/")
        memory = "memory" in _protocols(self.fs)
        self.buffer_limit: int | None = None if memory else buffer_limit
        self.write_concurrency = 1 if memory else max(1, write_concurrency)

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _error(self, what: str, e: BaseException) -> BlobStoreError:
        return BlobStoreError(f"{what} in {self.url} failed: {type(e).__name__}: {e}")

    def _call(self, what: str, fn: Callable[[], T], key: str | None = None) -> T:
        """``fn`` under the retry loop; a missing object or bucket becomes a clear error."""
        try:
            plain = lambda: _missing_as_file_not_found(fn)  # noqa: E731
            return retry(f"{what} in {self.url}", plain, attempts=self.attempts)
        except FileNotFoundError as e:
            if key is None:
                raise
            raise BlobNotFoundError(f"no object {key!r} in {self.url}") from e

    def _s3(self, what: str, method: str, key: str | None, **kwargs: Any) -> Any:
        """One S3 request (an s3fs client call, s3fs's own retries off) under the retry loop."""
        return self._call(what, lambda: self.fs.call_s3(method, **kwargs), key)

    def _s3_send(self, what: str, method: str, key: str | None, body: bytes, **kwargs: Any) -> Any:
        """An S3 request with a body (a put, a part) under the retry loop; each try is given up
        once the server has taken no byte of the body for connect_timeout + read_timeout."""
        from fsspec.asyn import sync

        fs = self.fs
        return self._call(what, lambda: sync(fs.loop, _send, fs, method, _Body(body), self._stall, kwargs), key)

    @contextmanager
    def _writer(self, key: str, size_hint: int | None = None) -> Iterator[_ObjectWriter]:
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
            # gcsfs: mtime; s3fs: LastModified; adlfs: last_modified (whole seconds)
            mtime = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
            mtime = mtime or info.get("created")
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
        if not self.root or not hasattr(self.fs, "list_multipart_uploads"):
            return []
        bucket = self.root.partition("/")[0]
        out = []
        for u in self._unfinished_uploads(bucket):
            handle, started = f"{bucket}/{u.get('Key', '')}\n{u.get('UploadId', '')}", u.get("Initiated")
            when = started.timestamp() if hasattr(started, "timestamp") else None
            if self.temp_file_key(handle) is not None and when is not None and when < older_than:
                out.append(handle)
        return out

    def _unfinished_uploads(self, bucket: str) -> list[Any]:
        """Every unfinished upload under this store's prefix: asked for with ``Prefix`` and
        followed page by page (S3 answers at most 1000 uploads a request, and a busy shared
        bucket holds more), where the file system sends S3 requests itself (s3fs's ``call_s3``);
        else the file system's own listing of the whole bucket."""
        if not hasattr(self.fs, "call_s3"):
            lister = self.fs.list_multipart_uploads
            return list(self._call("listing unfinished uploads", lambda: lister(bucket)) or ())
        under = self.root.partition("/")[2]
        ask: dict[str, Any] = {"Bucket": bucket, **({"Prefix": f"{under}/"} if under else {})}
        out: list[Any] = []
        while True:
            page = self._s3("listing unfinished uploads", "list_multipart_uploads", None, **ask)
            out += page.get("Uploads") or []
            # a truncated page names where the next one starts; a page that moves on no further
            # (no marker, or the one just asked with) ends the listing
            key, upload = page.get("NextKeyMarker") or "", page.get("NextUploadIdMarker") or ""
            if not page.get("IsTruncated") or not key or (key, upload) == (ask.get("KeyMarker"), ask.get("UploadIdMarker")):
                return out
            ask.update(KeyMarker=key, UploadIdMarker=upload)

    def temp_file_key(self, handle: str) -> str | None:
        """The key of an upload under this store's prefix and in a namespace ckstore writes
        (:data:`OWNED_PREFIXES`); None for any other upload in the bucket, which is not ours."""
        path = handle.partition("\n")[0]
        prefix = f"{self.root}/"
        key = path[len(prefix) :] if path.startswith(prefix) else ""
        return key if any(key.startswith(p) and len(key) > len(p) for p in OWNED_PREFIXES) else None

    def discard_temp_files(self, handles: Sequence[str]) -> int:
        """Abort the unfinished uploads in ``handles`` (never a visible object), each one under
        this store's prefix."""
        n = 0
        for h in handles:
            path, _, upload_id = h.partition("\n")
            if self.temp_file_key(h) is None:
                raise NotOwnedError(f"refusing to abort the upload of {path!r}: not under {self.url}")
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


