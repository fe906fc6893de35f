"""S3 failure modes, through a fault-injecting proxy in front of a real S3-compatible server.

What docs/backends.md ("Timeouts and retries", "Object stores") promises: throttling, 5xx answers
and reset connections are retried with exponential backoff, up to ``attempts`` tries; missing
objects, missing buckets and refused credentials are not retried and give a clear error; a
frozen server fails a commit within the configured timeouts; a failed multipart upload is
aborted; gc aborts the unfinished uploads older than its grace and no younger one. Every count
here is taken at the proxy (tests/faultproxy.py), every upload listed at the server itself.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import torch
from conformance import assert_consistent
from faultproxy import RESET, FaultProxy
from helpers import assert_same, random_tensor
from services import S3_KEY, S3_REGION, S3_SECRET, S3Server

import ckstore
from ckstore.blobstore import BlobNotFoundError, FsspecBlobStore
from ckstore.errors import BlobStoreError

pytestmark = pytest.mark.s3

CHUNK = 64 * 1024
#: seconds a frozen-server test waits before it calls the operation hung (and fails)
HANG_GUARD = 30.0
MiB = 1024 * 1024


def _state(seed: int, n: int = 6 * CHUNK) -> dict[int, dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    return {0: {"model_states": {"w": random_tensor(torch.uint8, (n,), g), "step": seed}}}


def _open(server: S3Server, proxy: FaultProxy, tmp_path: Path, bucket: str | None = None,
          **options: Any) -> ckstore.Store:  # fmt: skip
    bucket = bucket or server.make_bucket()
    opts = {**server.storage_options(), "endpoint_url": proxy.endpoint, **options}
    return ckstore.open(
        f"s3://{bucket}/store", catalog=f"sqlite:///{tmp_path / 'catalog.db'}", storage_options=opts,
        run="exp", chunk_size=CHUNK, pack_size=2 * CHUNK, workers=2,
    )  # fmt: skip


def _gaps(reqs: list[Any]) -> list[float]:
    return [b.at - a.at for a, b in zip(reqs, reqs[1:])]


# -- retried ------------------------------------------------------------------------------------
def test_throttling_and_server_errors_are_retried_and_the_commit_succeeds(
    s3_server: S3Server, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    store = _open(s3_server, fault_proxy, tmp_path)
    fault_proxy.fail(503, op="PutObject", key="packs/", code="SlowDown")
    fault_proxy.fail(500, op="PutObject", key="packs/", code="InternalError")
    fault_proxy.fail(429, op="PutObject", key="packs/", code="TooManyRequests")
    fault_proxy.fail(RESET, op="PutObject", key="packs/")
    state = _state(1)
    ck = store.commit(1, state)
    puts = fault_proxy.seen("PutObject", "packs/")
    failed = [r for r in puts if r.status != 200]
    assert sorted(r.status for r in failed) == [RESET, 429, 500, 503]
    for r in failed:  # each failed put was tried again, and went through
        assert any(o.key == r.key and o.status == 200 and o.at > r.at for o in puts), r
    packs = {i.key for i in store.blobs.list("packs/")}
    assert len(packs) >= 3 and {r.key.removeprefix("store/") for r in puts if r.status == 200} == packs
    assert [c.step for c in store.checkpoints()] == [ck.step]

    fault_proxy.fail(503, op="GetObject", times=2, code="SlowDown")
    assert_same(store.checkout(1), state)
    assert fault_proxy.count("GetObject", status=503) == 2
    assert_consistent(store)


def test_retries_back_off_exponentially_up_to_attempts(
    s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    opts = {**s3_server.storage_options(), "endpoint_url": fault_proxy.endpoint}
    blobs = FsspecBlobStore(f"s3://{s3_bucket}/b", **opts)  # the documented default: 4 attempts
    fault_proxy.fail(503, op="PutObject", key="slow", times=3, code="SlowDown")
    blobs.put("slow", b"payload")
    tries = fault_proxy.seen("PutObject", "slow")
    assert [r.status for r in tries] == [503, 503, 503, 200]
    # waits of 0.2 s, 0.4 s, 0.8 s, each jittered down to half at most: lower bounds only,
    # which no load on the machine can break
    gaps = _gaps(tries)
    assert all(g >= 0.1 * 2**i for i, g in enumerate(gaps)), gaps
    assert blobs.read("slow") == b"payload"

    fault_proxy.fail(500, op="PutObject", key="down", times=10, code="InternalError")
    with pytest.raises(BlobStoreError, match=r"writing 'down'.* failed 4 times, the last with .*injected by the test proxy.*reachable"):
        blobs.put("down", b"x")
    assert fault_proxy.count("PutObject", "down") == 4
    assert not s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="b/down").get("Contents")


def test_unreachable_endpoint_is_tried_attempts_times(s3_server: S3Server) -> None:
    """A server that takes each connection and drops it: ``attempts`` tries, then a clear error
    (connections counted at a real listening socket, not time measured)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    methods: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                methods.append(conn.recv(65536).split(b" ", 1)[0].decode())  # the request line's verb

    threading.Thread(target=serve, daemon=True).start()
    opts = {**s3_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{listener.getsockname()[1]}"}
    try:
        with pytest.raises(BlobStoreError, match=r"failed 1 times"):
            FsspecBlobStore("s3://bucket/x", attempts=1, **opts).read("k")
        one_try = len(methods)
        assert one_try >= 1
        methods.clear()
        with pytest.raises(BlobStoreError, match=r"failed 3 times.*reachable") as info:
            FsspecBlobStore("s3://bucket/x", attempts=3, **opts).read("k")
    finally:
        listener.close()
    assert "s3://bucket/x" in str(info.value) and "'k'" in str(info.value)
    assert len(methods) == 3 * one_try, methods  # three tries, each as many requests as one


# -- not retried --------------------------------------------------------------------------------
def test_missing_objects_buckets_and_bad_credentials_are_not_retried(
    s3_server: S3Server, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    opts = {**s3_server.storage_options(), "endpoint_url": fault_proxy.endpoint}
    blobs = FsspecBlobStore(f"s3://{s3_bucket}/b", **opts)

    with pytest.raises(BlobNotFoundError, match=r"no object 'packs/00/none' in s3://"):
        blobs.read("packs/00/none")
    assert [r.status for r in fault_proxy.seen(key="packs/00/none")] == [404]

    nobucket = FsspecBlobStore("s3://no-such-bucket-ckstore/x", **opts)
    with pytest.raises(BlobStoreError, match="does not exist.*create the bucket first"):
        nobucket.put("k", b"1")
    assert [(r.op, r.status) for r in fault_proxy.requests if r.bucket == "no-such-bucket-ckstore"] == [
        ("PutObject", 404)
    ]

    blobs.put("secret", b"1")
    before = len(fault_proxy.requests)
    fault_proxy.fail(403, key="b/secret", times=10, code="InvalidAccessKeyId")
    with pytest.raises(BlobStoreError, match=r"reading 'secret'.*PermissionError.*check the credentials") as info:
        blobs.read("secret")
    assert "failed 4 times" not in str(info.value)
    assert [r.status for r in fault_proxy.requests[before:]] == [403]
    fault_proxy.clear()


def test_refused_credentials_fail_a_commit_at_once_and_leave_nothing(
    s3_server: S3Server, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    store = _open(s3_server, fault_proxy, tmp_path)
    store.commit(1, _state(1))
    fault_proxy.fail(403, op="PutObject", times=100, code="AccessDenied")
    with pytest.raises(BlobStoreError, match="check the credentials"):
        store.commit(2, _state(2))
    refused = fault_proxy.seen("PutObject")
    # one request per pack the commit had in flight (up to write_concurrency), none retried
    assert 1 <= sum(r.status == 403 for r in refused) <= store.blobs.write_concurrency  # type: ignore[attr-defined]
    assert len({r.key for r in refused if r.status == 403}) == sum(r.status == 403 for r in refused)
    fault_proxy.clear()
    assert [c.step for c in store.checkpoints()] == [1] and store.catalog.pending() == []
    assert_same(store.checkout(1), _state(1))


# -- a frozen server ------------------------------------------------------------------------------
def test_s3_server_frozen_during_a_commit(private_s3_server: S3Server, tmp_path: Path) -> None:
    """SIGSTOP the server mid-commit: the commit fails with a clear error once its (small,
    configured) timeouts and attempts are spent, nothing of it is visible, and after SIGCONT
    committing again succeeds."""
    bucket = private_s3_server.make_bucket()
    store = ckstore.open(
        f"s3://{bucket}/store", catalog=f"sqlite:///{tmp_path / 'catalog.db'}",
        storage_options={**private_s3_server.storage_options(connect_timeout=1, read_timeout=1), "attempts": 2},
        run="exp", chunk_size=CHUNK, pack_size=2 * CHUNK, workers=2,
    )  # fmt: skip
    store.commit(1, _state(1))
    frozen = []

    def freeze_once(_done: int, _total: int) -> None:
        if not frozen:
            private_s3_server.freeze()  # the socket stays open: only a timeout ends a request
            frozen.append(True)

    outcome: list[BaseException | None] = []

    def commit() -> None:
        try:
            store.commit(2, _state(2, 16 * CHUNK), progress=freeze_once)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    worker = threading.Thread(target=commit, daemon=True)
    worker.start()
    # 2 attempts x (1 s connect + 1 s read) + backoff: the bound below only keeps a hanging commit
    # from hanging the suite; the test asserts what the commit raised, not how long it took
    worker.join(HANG_GUARD)
    hung = worker.is_alive()
    private_s3_server.thaw()
    worker.join(60)
    assert frozen
    assert not hung, (
        f"the commit was still running {HANG_GUARD:.0f} s after the server froze, though its timeouts "
        f"are 1 s and its attempts 2 (it ended with {outcome!r} once the server was thawed)"
    )
    (error,) = outcome
    assert isinstance(error, BlobStoreError), error
    assert re.search(r"failed 2 times, the last with .*(Timeout|timed out)", str(error)), str(error)
    assert [c.step for c in store.checkpoints()] == [1] and store.catalog.pending() == []
    ck = store.commit(2, _state(2, 16 * CHUNK))
    assert ck.step == 2
    assert_same(store.checkout(2), _state(2, 16 * CHUNK))
    assert_same(store.checkout(1), _state(1))


def test_s3_server_frozen_while_a_large_part_uploads(private_s3_server: S3Server) -> None:
    """SIGSTOP the server between two parts: the next part, larger than the sockets' buffers, can
    never be sent whole, so only ckstore's own bound on a body that stops moving ends it (the
    read timeout starts once a body is sent). The write fails with a clear error, nothing is
    visible, and once the server is back the upload is aborted and the object written."""
    bucket = private_s3_server.make_bucket()
    blobs = FsspecBlobStore(
        f"s3://{bucket}/b", attempts=2, buffer_limit=MiB, default_block_size=64 * MiB,
        **private_s3_server.storage_options(connect_timeout=1, read_timeout=1),
    )  # fmt: skip
    payload = bytes(range(256)) * (4 * 65 * MiB // 1024)  # 65 MiB: a 64 MiB part and the rest
    outcome: list[BaseException | None] = []

    def write() -> None:
        try:
            with blobs.writer("packs/00/big") as w:
                w.write(payload[: 2 * MiB])  # past buffer_limit: the multipart upload starts
                private_s3_server.freeze()
                w.write(payload[2 * MiB :])  # the first part goes to a frozen server
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    worker = threading.Thread(target=write, daemon=True)
    worker.start()
    worker.join(HANG_GUARD)
    hung = worker.is_alive()
    private_s3_server.thaw()
    worker.join(60)
    assert not hung, f"the write was still running {HANG_GUARD:.0f} s after the server froze ({outcome!r})"
    (error,) = outcome
    assert isinstance(error, BlobStoreError), error
    assert re.search(r"uploading 'packs/00/big' \(part 1\).* failed 2 times, the last with .*(Timeout|timed out)", str(error)), str(error)
    assert not blobs.exists("packs/00/big")
    stale = blobs.stale_temp_files(time.time() + 60)  # the abort could not reach the frozen server
    assert len(stale) <= 1 and blobs.discard_temp_files(stale) == len(stale)
    assert private_s3_server.uploads(bucket) == {}
    blobs.put("packs/00/big", payload)
    assert blobs.read("packs/00/big") == payload


# -- multipart uploads ----------------------------------------------------------------------------
def _multipart_store(server: S3Server, proxy: FaultProxy, tmp_path: Path, bucket: str) -> ckstore.Store:
    """Packs of 12 MiB that stream as multipart uploads of 5 MiB parts past 1 MiB buffered."""
    bucket_store = ckstore.open(
        f"s3://{bucket}/store", catalog=f"sqlite:///{tmp_path / 'catalog.db'}",
        storage_options={
            **server.storage_options(), "endpoint_url": proxy.endpoint,
            "buffer_limit": MiB, "default_block_size": 5 * MiB,
        },
        run="exp", chunk_size=MiB, pack_size=12 * MiB, workers=2,
    )  # fmt: skip
    return bucket_store


def test_multipart_commit_uploads_in_parts(s3_server: S3Server, fault_proxy: FaultProxy, tmp_path: Path) -> None:
    bucket = s3_server.make_bucket()
    store = _multipart_store(s3_server, fault_proxy, tmp_path, bucket)
    state = _state(3, 11 * MiB)
    store.commit(1, state)
    (created,) = fault_proxy.seen("CreateMultipartUpload")
    assert fault_proxy.count("UploadPart", created.key, status=200) == 3  # 5 + 5 + the rest
    assert fault_proxy.count("CompleteMultipartUpload", created.key, status=200) == 1
    assert s3_server.uploads(bucket) == {}
    assert_same(store.checkout(1), state)


def test_a_part_upload_throttled_once_is_retried(s3_server: S3Server, fault_proxy: FaultProxy, tmp_path: Path) -> None:
    bucket = s3_server.make_bucket()
    store = _multipart_store(s3_server, fault_proxy, tmp_path, bucket)
    fault_proxy.fail(503, op="UploadPart", code="SlowDown")
    state = _state(4, 11 * MiB)
    store.commit(1, state)
    assert fault_proxy.count("UploadPart", status=503) == 1
    assert_same(store.checkout(1), state)
    assert s3_server.uploads(bucket) == {}


def test_a_commit_failing_mid_upload_aborts_its_multipart_upload(
    s3_server: S3Server, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    bucket = s3_server.make_bucket()
    store = _multipart_store(s3_server, fault_proxy, tmp_path, bucket)
    store.commit(1, _state(1))
    # the first part goes up, every try of the second fails
    fault_proxy.fail(500, op="UploadPart", query="partNumber=2", times=1000, code="InternalError")
    with pytest.raises(BlobStoreError, match=r"uploading 'packs/.*injected by the test proxy"):
        store.commit(2, _state(2, 11 * MiB))
    fault_proxy.clear()
    (created,) = fault_proxy.seen("CreateMultipartUpload")
    assert fault_proxy.count("UploadPart", created.key, status=200) == 1  # the upload was under way
    assert fault_proxy.count("UploadPart", created.key, status=500) >= 1
    assert fault_proxy.count("AbortMultipartUpload", created.key, status=204) == 1
    assert fault_proxy.count("CompleteMultipartUpload") == 0
    assert s3_server.uploads(bucket) == {}  # nothing left billing at the server
    assert [c.step for c in store.checkpoints()] == [1] and store.catalog.pending() == []
    assert_same(store.checkout(1), _state(1))


def test_gc_aborts_uploads_older_than_its_grace_and_no_younger_one(
    s3_server: S3Server, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Uploads of killed commits: the one started two hours ago goes, the one started now stays
    (the proxy reports each upload's real start time; moto reports a fixed date)."""
    import boto3

    bucket = s3_server.make_bucket()
    store = _open(s3_server, fault_proxy, tmp_path, bucket)
    store.commit(1, _state(1))
    client = boto3.client("s3", endpoint_url=fault_proxy.endpoint, region_name=S3_REGION,
                          aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET)  # fmt: skip
    old_key, young_key = "store/packs/ab/" + "ab" * 16, "store/packs/cd/" + "cd" * 16
    old = client.create_multipart_upload(Bucket=bucket, Key=old_key)["UploadId"]
    young = client.create_multipart_upload(Bucket=bucket, Key=young_key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=old_key, UploadId=old, PartNumber=1, Body=b"x" * 1024)
    fault_proxy.set_started(old, time.time() - 7200)
    assert s3_server.uploads(bucket) == {old: old_key, young: young_key}

    dry = store.gc(grace=3600, dry_run=True)
    assert dry.temp_files_deleted == 1 and set(s3_server.uploads(bucket)) == {old, young}
    report = store.gc(grace=3600)
    assert report.temp_files_deleted == 1
    assert s3_server.uploads(bucket) == {young: young_key}
    assert fault_proxy.count("AbortMultipartUpload", old_key) == 1
    assert fault_proxy.count("AbortMultipartUpload", young_key) == 0
    assert store.gc(grace=0).temp_files_deleted == 1  # past any grace, the young one goes too
    assert s3_server.uploads(bucket) == {}
    assert_same(store.checkout(1), _state(1))


def test_gc_aborts_no_upload_outside_the_stores_own_keys(s3_server: S3Server, tmp_path: Path) -> None:
    """A store at a bucket's root shares the bucket with whatever else writes there: gc aborts
    only its own packs' uploads, never another program's (nor one under the store's prefix but
    outside the keys ckstore writes). moto reports every upload as started long ago."""
    bucket = s3_server.make_bucket()
    store = ckstore.open(f"s3://{bucket}", catalog=f"sqlite:///{tmp_path / 'catalog.db'}",
                         storage_options=s3_server.storage_options(), run="exp", chunk_size=CHUNK)  # fmt: skip
    store.commit(1, _state(1))
    client = s3_server.client()
    ours = "packs/ab/" + "ab" * 16
    uploads = {k: client.create_multipart_upload(Bucket=bucket, Key=k)["UploadId"]
               for k in (ours, "other-app/big.bin", "packsXY/a", "ckstore.json")}  # fmt: skip
    report = store.gc(grace=0)
    assert report.temp_files_deleted == 1
    assert s3_server.uploads(bucket) == {uploads[k]: k for k in ("other-app/big.bin", "packsXY/a", "ckstore.json")}
    with pytest.raises(ckstore.errors.BlobStoreError, match="refusing to abort"):
        store.blobs.discard_temp_files([f"{bucket}/other-app/big.bin\n{uploads['other-app/big.bin']}"])
    assert len(s3_server.uploads(bucket)) == 3
    assert_same(store.checkout(1), _state(1))
    store.close()


class _PagingProxy(FaultProxy):
    """The fault proxy, answering ``ListMultipartUploads`` as S3 does for a bucket holding more
    uploads than one answer takes: at most :attr:`page` uploads (fewer when ``max-uploads`` asks),
    in key order, from the ``key-marker`` / ``upload-id-marker`` asked for, with ``IsTruncated``
    and the next markers. moto honours ``prefix`` but answers every upload at once, so with S3's
    page of 1000 a test would need thousands of uploads to see a second page."""

    page = 3

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self._asked = threading.local()  # the query of the request this handler thread forwards

    def _enter_holds(self, req: Any) -> Any:
        self._asked.query = req.query
        return super()._enter_holds(req)

    def _rewrite(self, op: str, body: bytes, sent_at: float) -> bytes:
        body = super()._rewrite(op, body, sent_at)
        if op != "ListMultipartUploads":
            return body
        asked = parse_qs(self._asked.query, keep_blank_values=True)
        key_marker, id_marker = (asked.get(n, [""])[0] for n in ("key-marker", "upload-id-marker"))
        size = min(self.page, int(asked.get("max-uploads", [self.page])[0]))

        def ident(upload: bytes) -> tuple[str, str]:
            return tuple(re.search(rb"<%s>([^<]*)</%s>" % (n, n), upload).group(1).decode()  # type: ignore[union-attr,return-value]
                         for n in (b"Key", b"UploadId"))  # fmt: skip

        uploads = sorted(re.findall(rb"<Upload>.*?</Upload>", body, flags=re.S), key=ident)
        after = [u for u in uploads if (ident(u) > (key_marker, id_marker) if id_marker else ident(u)[0] > key_marker)]
        shown, more = after[:size], len(after) > size
        body = re.sub(rb"<Upload>.*?</Upload>", b"", body, flags=re.S)
        tail = b"".join(shown)
        if more:
            key, upload_id = ident(shown[-1])
            tail += f"<NextKeyMarker>{key}</NextKeyMarker><NextUploadIdMarker>{upload_id}</NextUploadIdMarker>".encode()
        body = re.sub(rb"<IsTruncated>[^<]*</IsTruncated>", b"<IsTruncated>%s</IsTruncated>" % (b"true" if more else b"false"), body)
        return body.replace(b"</ListMultipartUploadsResult>", tail + b"</ListMultipartUploadsResult>")


def test_gc_lists_only_its_prefix_and_every_page_of_unfinished_uploads(s3_server: S3Server, tmp_path: Path) -> None:
    """A busy shared bucket holds more unfinished uploads than S3 answers at once: gc asks for
    its own prefix only and follows the pages, so it aborts each of its stale uploads however many
    others the bucket holds (listing the whole bucket's first page, it aborted none of them)."""
    bucket = s3_server.make_bucket()
    client = s3_server.client()
    others = {client.create_multipart_upload(Bucket=bucket, Key=f"a-other-app/{i}.bin")["UploadId"]: f"a-other-app/{i}.bin"
              for i in range(4)}  # fmt: skip
    keys = [f"store/packs/{i:02x}/" + f"{i:02x}" * 16 for i in range(6)] + ["store/packs/02/" + "02" * 16]
    ours = {client.create_multipart_upload(Bucket=bucket, Key=k)["UploadId"]: k for k in keys}
    assert len(ours) == 7  # two uploads of one key: the next page starts within that key
    with _PagingProxy(s3_server.endpoint) as proxy:
        store = _open(s3_server, proxy, tmp_path, bucket)
        store.commit(1, _state(1))
        listed = len(proxy.seen("ListMultipartUploads"))
        report = store.gc(grace=3600)  # moto reports every upload as started in 2010
        asks = proxy.seen("ListMultipartUploads")[listed:]
        assert report.temp_files_deleted == 7
        assert s3_server.uploads(bucket) == others
        assert len(asks) == 3 and all("prefix=store%2F" in r.query.split("&") for r in asks)
        assert_same(store.checkout(1), _state(1))
        store.close()
