"""The blob store conformance suite on every backend, and what only object stores do."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conformance.blobstore import BlobStoreConformance
from services import S3Server

from ckstore.blobstore import (
    S3_CONFIG_DEFAULTS,
    BlobStore,
    FsspecBlobStore,
    LocalBlobStore,
    open_blobstore,
)
from ckstore.errors import BlobStoreError, StoreConfigError


class TestLocal(BlobStoreConformance):
    @pytest.fixture
    def blobs(self, tmp_path: Path) -> BlobStore:
        return LocalBlobStore(tmp_path / "blobs")

    def test_failed_write_leaves_no_temp_file(self, blobs: LocalBlobStore) -> None:
        with pytest.raises(RuntimeError):
            with blobs.writer("x") as w:
                w.write(b"1")
                raise RuntimeError
        assert blobs.stale_temp_files(time.time() + 60) == []


class TestMemory(BlobStoreConformance):
    @pytest.fixture
    def blobs(self) -> Iterator[BlobStore]:
        store = FsspecBlobStore(f"memory://ckstore-test-{uuid.uuid4().hex}")
        yield store
        store.delete(i.key for i in store.list())


@pytest.mark.s3
class TestS3(BlobStoreConformance):
    """Small objects go up in one PUT each."""

    @pytest.fixture
    def blobs(self, s3_server: S3Server, s3_bucket: str) -> BlobStore:
        return FsspecBlobStore(f"s3://{s3_bucket}/store", **s3_server.storage_options())


@pytest.mark.s3
class TestS3Multipart:
    """Past a small buffer limit, objects stream as multipart uploads of 5 MiB parts."""

    large_size = 11 * 1024 * 1024 + 5
    test_large_object = BlobStoreConformance.test_large_object
    test_failed_large_writer_leaves_nothing = BlobStoreConformance.test_failed_large_writer_leaves_nothing
    test_writer_streams_parts = BlobStoreConformance.test_writer_streams_parts

    @pytest.fixture
    def blobs(self, s3_server: S3Server, s3_bucket: str) -> BlobStore:
        return FsspecBlobStore(
            f"s3://{s3_bucket}/store",
            buffer_limit=1024 * 1024,
            default_block_size=5 * 1024 * 1024,
            **s3_server.storage_options(),
        )

    def test_large_writes_are_multipart_uploads_the_server_sees(
        self, blobs: FsspecBlobStore, s3_server: S3Server, s3_bucket: str
    ) -> None:
        """Past the buffer limit a writer opens an upload at the server, completed by a clean
        end and aborted by a failure: listed at the server itself, not taken on trust."""
        data = os.urandom(self.large_size)
        with blobs.writer("big") as w:
            w.write(data[: 6 * 1024 * 1024])
            assert list(s3_server.uploads(s3_bucket).values()) == ["store/big"]
            w.write(data[6 * 1024 * 1024 :])
        assert s3_server.uploads(s3_bucket) == {}
        assert blobs.read("big") == data

        with pytest.raises(RuntimeError, match="boom"):
            with blobs.writer("failed") as w:
                w.write(data)
                assert list(s3_server.uploads(s3_bucket).values()) == ["store/failed"]
                raise RuntimeError("boom")
        assert s3_server.uploads(s3_bucket) == {}  # aborted, not left to bill
        assert not blobs.exists("failed")

    def test_small_writes_are_single_puts(self, blobs: FsspecBlobStore, s3_server: S3Server, s3_bucket: str) -> None:
        with blobs.writer("small") as w:
            w.write(b"x" * 1000)
            assert s3_server.uploads(s3_bucket) == {}
        assert blobs.read("small") == b"x" * 1000


@pytest.mark.s3
def test_s3_requests_have_bounded_timeouts_and_one_retry_loop(s3_server: S3Server, s3_bucket: str) -> None:
    blobs = FsspecBlobStore(f"s3://{s3_bucket}", **s3_server.storage_options(read_timeout=7))
    config = blobs.fs.config_kwargs
    assert config["read_timeout"] == 7  # the caller's setting wins
    # the rest as docs/backends.md documents them: connect timeout 5 s, read timeout 30 s,
    # 32 pooled connections, no retries inside botocore or s3fs, 4 attempts of ckstore's own
    assert config["connect_timeout"] == 5
    assert config["max_pool_connections"] == 32
    assert config["retries"] == {"total_max_attempts": 1}
    assert blobs.fs.retries == 1
    assert blobs.attempts == 4 and blobs.write_concurrency == 3
    assert blobs.buffer_limit == 128 * 1024 * 1024
    assert S3_CONFIG_DEFAULTS == {
        "connect_timeout": 5, "read_timeout": 30, "retries": {"total_max_attempts": 1}, "max_pool_connections": 32,
    }  # fmt: skip


@pytest.mark.s3
def test_s3_missing_bucket_is_a_clear_error(s3_server: S3Server) -> None:
    blobs = FsspecBlobStore("s3://no-such-bucket-ckstore/x", **s3_server.storage_options())
    with pytest.raises(BlobStoreError, match="create the bucket first"):
        blobs.put("k", b"1")
    with pytest.raises(BlobStoreError, match="create the bucket first"):
        blobs.put("k", b"1", exclusive=True)


@pytest.mark.s3
def test_s3_credentials_stay_out_of_errors(s3_server: S3Server) -> None:
    opts = {**s3_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{_closed_port()}"}
    blobs = FsspecBlobStore("s3://bucket/x", attempts=1, **opts)
    with pytest.raises(BlobStoreError) as info:
        blobs.put("k", b"1")
    assert opts["secret"] not in str(info.value) and opts["secret"] not in repr(blobs)


def test_local_path_takes_no_storage_options(tmp_path: Path) -> None:
    with pytest.raises(StoreConfigError, match="storage options"):
        open_blobstore(str(tmp_path), endpoint_url="http://x")


def test_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(StoreConfigError, match="cannot open nosuchproto://"):
        open_blobstore("nosuchproto://bucket/x")


def _closed_port() -> int:
    from services import free_port

    return free_port()  # bound and released: nothing listens there
