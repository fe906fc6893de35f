"""The blob store conformance suite on every backend, and what only object stores do."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conformance.blobstore import BlobStoreConformance
from services import AzuriteEmulator, GcsEmulator, S3Server

from ckstore.blobstore import (
    S3_CONFIG_DEFAULTS,
    BlobExistsError,
    BlobNotFoundError,
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

    def test_before_publish_sees_the_whole_object_in_its_temp_file(self, blobs: LocalBlobStore) -> None:
        """A checkpoint's record is written, and made durable, while its packs are: the whole
        record lies in its temp file when ``before_publish`` runs, and is renamed into place
        after (``fdatasync`` is not visible from here; the writer skips its second one)."""
        data = os.urandom(100_000)
        held: list[bytes] = []

        def publish() -> None:
            parts = list((Path(blobs.root) / "tmp").glob("*.part"))
            held.extend(p.read_bytes() for p in parts)
            assert not blobs.exists("records/checkpoints/ab/r")

        blobs.put("records/checkpoints/ab/r", data, before_publish=publish)
        assert held == [data] and blobs.read("records/checkpoints/ab/r") == data
        assert list((Path(blobs.root) / "tmp").glob("*.part")) == []


    def test_a_write_cut_short_leaves_nothing_visible(self, blobs: LocalBlobStore) -> None:
        """An unbuffered file's ``write`` may take only part of the bytes (here a file size
        limit cuts it, in a process of its own): the write fails and no truncated object, nor
        a temp file, is left; before, the rest was dropped and a short pack appeared. The failure
        is ckstore's error naming the store and the limit (before: a raw ``OSError`` EFBIG)."""
        code = (
            "import resource, signal, sys\n"
            "from ckstore.blobstore import LocalBlobStore\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))\n"
            "blobs = LocalBlobStore(sys.argv[1], fsync=sys.argv[2] == '1')\n"
            "for key, exclusive in (('packs/ab/cut', False), ('cut.json', True)):\n"
            "    try:\n"
            "        blobs.put(key, b'1' * 5000, exclusive=exclusive)\n"
            "    except OSError as e:\n"
            "        clear = 'file size limit' in str(e) and 'ulimit -f' in str(e) and sys.argv[1] in str(e)\n"
            "        print(key, 'failed', type(e).__name__, clear)\n"
            "    else:\n"
            "        print(key, 'written')\n"
        )
        for fsync in ("1", "0"):
            out = subprocess.run(
                [sys.executable, "-c", code, blobs.root, fsync], capture_output=True, text=True, check=True
            ).stdout
            assert out.split("\n")[:2] == ["packs/ab/cut failed BlobStoreError True", "cut.json failed BlobStoreError True"], out
            assert not blobs.exists("packs/ab/cut") and not blobs.exists("cut.json")
            assert list((Path(blobs.root) / "tmp").glob("*.part")) == []


    def test_an_exclusive_put_without_hard_links_renames_only_onto_a_free_name(self, blobs: LocalBlobStore) -> None:
        """On a file system without hard links (FAT, exFAT, some SMB and FUSE mounts refuse
        ``link`` with EPERM or EOPNOTSUPP) an exclusive put renames its temp file with
        ``RENAME_NOREPLACE``: the first put creates the object whole, the second finds it taken
        and changes nothing, and no temp file stays (before, the raw EPERM failed every put)."""
        refused: list[str] = []

        def no_links(src: str, dst: str) -> None:
            refused.append(dst)
            raise PermissionError(errno.EPERM, "Operation not permitted", dst)

        blobs._link = no_links  # type: ignore[method-assign]
        blobs.put("ckstore.json", b"first", exclusive=True)
        with pytest.raises(BlobExistsError):
            blobs.put("ckstore.json", b"second", exclusive=True)
        assert len(refused) == 2 and blobs.read("ckstore.json") == b"first"
        assert list((Path(blobs.root) / "tmp").glob("*.part")) == []

    def test_an_exclusive_put_without_hard_links_nor_exclusive_rename_is_a_clear_error(
        self, blobs: LocalBlobStore
    ) -> None:
        def refuse(errno_: int) -> Any:
            def call(src: str, dst: str) -> None:
                raise OSError(errno_, os.strerror(errno_), dst)

            return call

        blobs._link = refuse(errno.EOPNOTSUPP)  # type: ignore[method-assign]
        blobs._rename_noreplace = refuse(errno.EINVAL)  # type: ignore[method-assign]
        with pytest.raises(BlobStoreError, match=r"has no hard links .* no exclusive rename") as e:
            blobs.put("ckstore.json", b"first", exclusive=True)
        assert blobs.root in str(e.value) and not blobs.exists("ckstore.json")
        assert list((Path(blobs.root) / "tmp").glob("*.part")) == []


class TestMemory(BlobStoreConformance):
    @pytest.fixture
    def blobs(self) -> Iterator[BlobStore]:
        store = FsspecBlobStore(f"memory://ckstore-test-{uuid.uuid4().hex}")
        yield store
        if store.fs.exists(store.root):
            store.fs.rm(store.root, recursive=True)


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


def _killed_upload_leaves_nothing_visible(blobs: BlobStore) -> None:
    """A commit killed while streaming a large pack never finishes nor cancels its upload: GCS's
    resumable session and Azure's staged blocks stay on the server, invisible to every listing
    (so to fsck and gc), until the service drops them after a week."""
    writing = blobs.writer("packs/ab/killed")
    w = writing.__enter__()
    w.write(os.urandom(3 * 1024 * 1024))
    upload = w._f._f  # past buffer_limit: the fsspec file that streams the parts
    assert upload is not None and upload.offset >= 1024 * 1024  # parts reached the server
    assert list(blobs.list()) == [] and not blobs.exists("packs/ab/killed")
    assert list(blobs.stale_temp_files(time.time() + 60)) == []
    with pytest.raises(BlobNotFoundError):
        blobs.read("packs/ab/killed")
    writing.__exit__(RuntimeError, RuntimeError("killed"), None)  # this process lives on: cancel


@pytest.mark.gcs
class TestGcs(BlobStoreConformance):
    """Google Cloud Storage (its emulator): small objects go up in one upload each."""

    @pytest.fixture
    def blobs(self, gcs_emulator: GcsEmulator, gcs_bucket: str) -> BlobStore:
        return FsspecBlobStore(f"gs://{gcs_bucket}/store", **gcs_emulator.storage_options())

    @pytest.mark.skip(
        reason="gcsfs against gcp-storage-emulator sometimes returns another object's bytes under "
        "concurrent requests (3 of 15 rounds of 8 threads with gcsfs alone, no ckstore code); "
        "see docs/backends.md"
    )
    def test_many_threads(self, blobs: BlobStore) -> None:
        """Not run on the emulator (the reason above); every other test here runs."""


class StreamedUploads:
    """The conformance tests of objects past a small buffer limit, which stream in parts (GCS
    resumable uploads, Azure staged blocks) and become visible only when completed."""

    large_size = 3 * 1024 * 1024 + 17
    test_large_object = BlobStoreConformance.test_large_object
    test_failed_large_writer_leaves_nothing = BlobStoreConformance.test_failed_large_writer_leaves_nothing
    test_writer_streams_parts = BlobStoreConformance.test_writer_streams_parts

    def test_killed_upload_leaves_nothing_visible(self, blobs: BlobStore) -> None:
        _killed_upload_leaves_nothing_visible(blobs)


@pytest.mark.gcs
class TestGcsResumable(StreamedUploads):
    """Past a small buffer limit, objects stream as resumable uploads, finalized on completion."""

    @pytest.fixture
    def blobs(self, gcs_emulator: GcsEmulator, gcs_bucket: str) -> BlobStore:
        return FsspecBlobStore(
            f"gs://{gcs_bucket}/store",
            buffer_limit=1024 * 1024,
            block_size=512 * 1024,  # gcsfs sends resumable chunks of multiples of 256 KiB
            **gcs_emulator.storage_options(),
        )


@pytest.mark.azure
class TestAzure(BlobStoreConformance):
    """Azure Blob Storage (Azurite): small objects go up in one upload each."""

    @pytest.fixture
    def blobs(self, azurite: AzuriteEmulator, az_container: str) -> BlobStore:
        return FsspecBlobStore(f"az://{az_container}/store", **azurite.storage_options())


@pytest.mark.azure
class TestAzureBlocks(StreamedUploads):
    """Past a small buffer limit, objects stream as staged blocks, committed on completion."""

    @pytest.fixture
    def blobs(self, azurite: AzuriteEmulator, az_container: str) -> BlobStore:
        return FsspecBlobStore(
            f"az://{az_container}/store",
            buffer_limit=1024 * 1024,
            blocksize=512 * 1024,
            **azurite.storage_options(),
        )


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


@pytest.mark.gcs
def test_gcs_missing_bucket_is_a_clear_error(gcs_emulator: GcsEmulator) -> None:
    blobs = FsspecBlobStore("gs://no-such-bucket-ckstore/x", **gcs_emulator.storage_options())
    for exclusive in (False, True):
        with pytest.raises(BlobStoreError, match="create the bucket first"):
            blobs.put("k", b"1", exclusive=exclusive)
    assert list(blobs.list()) == []


@pytest.mark.azure
def test_azure_missing_container_is_a_clear_error(azurite: AzuriteEmulator) -> None:
    blobs = FsspecBlobStore("az://no-such-container-ckstore/x", **azurite.storage_options())
    for exclusive in (False, True):
        with pytest.raises(BlobStoreError, match="create the bucket first"):
            blobs.put("k", b"1", exclusive=exclusive)
    with pytest.raises(BlobNotFoundError):
        blobs.read("k")
    assert list(blobs.list()) == []


@pytest.mark.parametrize(
    "backend", [pytest.param("gs", marks=pytest.mark.gcs), pytest.param("az", marks=pytest.mark.azure)]
)
def test_listings_report_modification_times(backend: str, request: pytest.FixtureRequest) -> None:
    """gc removes an orphan only once it is older than the grace: it needs the listing's times."""
    if backend == "gs":
        emulator, bucket = request.getfixturevalue("gcs_emulator"), request.getfixturevalue("gcs_bucket")
    else:
        emulator, bucket = request.getfixturevalue("azurite"), request.getfixturevalue("az_container")
    blobs = FsspecBlobStore(f"{backend}://{bucket}/store", **emulator.storage_options())
    before = time.time()
    blobs.put("packs/aa/1", b"x")
    (info,) = blobs.list()
    assert info.mtime is not None and before - 2 < info.mtime < time.time() + 2  # Azure: whole seconds


def test_local_path_takes_no_storage_options(tmp_path: Path) -> None:
    with pytest.raises(StoreConfigError, match="storage options"):
        open_blobstore(str(tmp_path), endpoint_url="http://x")


def test_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(StoreConfigError, match="cannot open nosuchproto://"):
        open_blobstore("nosuchproto://bucket/x")


@pytest.mark.parametrize(
    "option", [{"attempts": 0}, {"attempts": "4"}, {"write_concurrency": 0}, {"buffer_limit": -1}]
)
def test_bad_retry_and_upload_options_are_config_errors(option: dict) -> None:
    """``attempts=0`` made every request fail with ``AssertionError: unreachable``, a string a
    ``TypeError``: now opening the store names the option."""
    (name,) = option
    with pytest.raises(StoreConfigError, match=f"storage option {name} must be an int"):
        open_blobstore(f"memory://ckstore-test-{uuid.uuid4().hex}", **option)


def _closed_port() -> int:
    from services import free_port

    return free_port()  # bound and released: nothing listens there
