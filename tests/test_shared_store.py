"""The shared setup: many processes on one PostgreSQL catalog and one S3 bucket; an S3 server
that dies under a checkout; the command line finding an S3 store through the environment."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import catalog_tools
import pytest
import torch
from click.testing import CliRunner
from conformance import StoreSpec, assert_consistent, sample_states
from conformance.store import CHUNK, mp_context
from helpers import assert_same
from services import S3_KEY, S3_REGION, S3_SECRET, S3Server

import ckstore
from ckstore.cli import main

ROOT = Path(__file__).resolve().parent.parent
WRITERS = 8

# -- many writers at once -----------------------------------------------------------------------
_barrier: Any = None


def _init_writer(barrier: Any) -> None:
    global _barrier
    _barrier = barrier


def _write_step(spec: StoreSpec, step: int) -> tuple[int, int]:
    store = spec.open()  # every writer may be the one that creates the store
    _barrier.wait(60)
    ck = store.commit(step, sample_states(step), {"loss": 1 / (step + 1)}, tags=["newest"])
    assert_same(store.checkout(step), sample_states(step))
    store.close()
    return ck.step, ck.stored_bytes_added


@pytest.mark.postgres
@pytest.mark.s3
def test_processes_commit_to_one_catalog_and_one_bucket(s3_server: S3Server, s3_bucket: str, pg_catalog_url: str) -> None:
    spec = StoreSpec(f"s3://{s3_bucket}/team", pg_catalog_url, s3_server.storage_options())
    ctx = mp_context()
    barrier = ctx.Barrier(WRITERS)
    with ProcessPoolExecutor(WRITERS, mp_context=ctx, initializer=_init_writer, initargs=(barrier,)) as pool:
        done = list(pool.map(_write_step, [spec] * WRITERS, range(WRITERS)))
    assert sorted(step for step, _ in done) == list(range(WRITERS))
    with spec.open() as store:
        assert [c.step for c in store.checkpoints("exp")] == list(range(WRITERS))
        for step in range(WRITERS):
            assert_same(store.checkout(step), sample_states(step))
        assert store.resolve("min:loss").step == WRITERS - 1
        assert sum("newest" in c.tags for c in store.checkpoints()) == 1
        # the tensor every writer shares is stored once; every chunk is paid for by one commit
        assert sum(added for _, added in done) == store.catalog.stored_bytes()
        assert_consistent(store)
        configs = [i for i in store.blobs.list() if i.key == "ckstore.json"]
        assert len(configs) == 1


# -- an S3 server that goes away ----------------------------------------------------------------
def _s3_store(server: S3Server, tmp_path: Path, **config: Any) -> ckstore.Store:
    bucket = server.make_bucket()
    return ckstore.open(
        f"s3://{bucket}/store",
        catalog=f"sqlite:///{tmp_path / 'catalog.db'}",
        storage_options=server.storage_options(**config),
        run="exp",
        chunk_size=CHUNK,
        pack_size=CHUNK,  # a pack per chunk or so: a checkout makes many requests
        workers=2,
    )


@pytest.mark.s3
def test_s3_server_killed_during_a_checkout(private_s3_server: S3Server, tmp_path: Path) -> None:
    store = _s3_store(private_s3_server, tmp_path)
    store.commit(1, sample_states(1))
    ckpt = store.resolve(1)

    def kill_once(_done: int, _total: int) -> None:
        private_s3_server.kill()

    t0 = time.monotonic()
    with pytest.raises(ckstore.BlobStoreError) as info:
        store.load(ckpt, progress=kill_once)
    assert time.monotonic() - t0 < 30
    msg = str(info.value)
    assert "run 'exp', step 1" in msg and "is the store's server reachable?" in msg, msg
    assert not private_s3_server.alive()


@pytest.mark.s3
def test_s3_server_frozen_during_a_checkout(private_s3_server: S3Server, tmp_path: Path) -> None:
    store = _s3_store(private_s3_server, tmp_path, connect_timeout=1, read_timeout=1)
    store.commit(1, sample_states(1))
    ckpt = store.resolve(1)

    def freeze_once(_done: int, _total: int) -> None:
        private_s3_server.freeze()  # the socket stays open: only a timeout ends a request

    t0 = time.monotonic()
    with pytest.raises(ckstore.BlobStoreError, match=r"run 'exp', step 1.*(Timeout|timed out)"):
        store.load(ckpt, progress=freeze_once)
    assert time.monotonic() - t0 < 30
    private_s3_server.thaw()
    assert_same(store.checkout(1), sample_states(1))  # the server is back: so is the store


@pytest.mark.s3
def test_s3_server_killed_during_a_commit(private_s3_server: S3Server, tmp_path: Path) -> None:
    store = _s3_store(private_s3_server, tmp_path)
    store.commit(1, sample_states(1))
    with pytest.raises(ckstore.BlobStoreError, match="reachable"):
        store.commit(2, sample_states(2), progress=lambda _d, _t: private_s3_server.kill())
    assert [c.step for c in store.checkpoints()] == [1]
    assert store.catalog.pending() == []


@pytest.mark.s3
def test_s3_commit_uploads_packs_in_parallel(s3_server: S3Server, tmp_path: Path) -> None:
    store = _s3_store(s3_server, tmp_path)
    live, most = [0], [0]

    async def slow_put(**_kw: Any) -> None:  # every upload takes 0.2 s of "network"
        live[0] += 1
        most[0] = max(most[0], live[0])
        await asyncio.sleep(0.2)
        live[0] -= 1

    store.blobs.fs.connect()  # type: ignore[attr-defined]
    store.blobs.fs.s3.meta.events.register("before-send.s3.PutObject", slow_put)  # type: ignore[attr-defined]
    state = {0: {"model_states": {"w": torch.randn(16 * CHUNK // 4, generator=torch.Generator().manual_seed(0))}}}
    t0 = time.monotonic()
    store.commit(1, state)
    elapsed = time.monotonic() - t0
    packs = len(list(store.blobs.list("packs/")))
    assert packs >= 6
    assert most[0] == store.blobs.write_concurrency == 3
    # the packs well under one upload after another, then the checkpoint's record: one more
    # upload, which waits until every pack is durable
    assert elapsed < packs * 0.2 / 2 + 0.2
    assert_same(store.checkout(1), state)
    assert_consistent(store)


@pytest.mark.s3
def test_gc_aborts_unfinished_uploads_of_killed_commits(s3_server: S3Server, tmp_path: Path) -> None:
    """A commit killed while uploading a large pack leaves a multipart upload; gc aborts it."""
    import boto3

    store = _s3_store(s3_server, tmp_path)
    store.commit(1, {0: {"m": {"w": torch.ones(4)}}})
    bucket = store.blobs.root.split("/")[0]  # type: ignore[attr-defined]
    client = boto3.client(
        "s3", endpoint_url=s3_server.endpoint, region_name=S3_REGION, aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
    )  # fmt: skip
    ours = client.create_multipart_upload(Bucket=bucket, Key="store/packs/ab/" + "ab" * 16)["UploadId"]
    client.upload_part(Bucket=bucket, Key="store/packs/ab/" + "ab" * 16, UploadId=ours, PartNumber=1, Body=b"x" * 1024)
    other = client.create_multipart_upload(Bucket=bucket, Key="elsewhere/big.bin")["UploadId"]
    # a commit in flight (this process, alive) uploading its pack: never aborted
    from ckstore.catalog import Owner

    owner = Owner.me()
    ckpt = store.catalog.begin_checkpoint(
        "exp", 2, kind="checkpoint", replace=False, owner=owner, world_layout=ckstore.WorldLayout.flat(1),
        lease_seconds=60,
    )  # fmt: skip
    live_key = "packs/cd/" + "cd" * 16
    store.catalog.register_pack(ckpt, owner, live_key)
    live = client.create_multipart_upload(Bucket=bucket, Key="store/" + live_key)["UploadId"]

    def uploads() -> set[str]:
        return {u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}

    assert uploads() == {ours, other, live}
    # (moto reports every upload as started in 2010, so the grace cannot be shown here)
    report = store.gc(grace=0)
    assert report.temp_files_deleted == 1
    assert uploads() == {other, live}  # only this store's prefix, never a live commit's pack
    assert torch.equal(store.checkout(1)[0]["m"]["w"], torch.ones(4))


# -- the command line, with the endpoint and credentials in the environment ---------------------
def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckstore", *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.mark.postgres
@pytest.mark.s3
def test_cli_init_then_log_an_s3_store(
    s3_server: S3Server,
    s3_bucket: str,
    pg_catalog_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    location = f"s3://{s3_bucket}/team"
    catalog = pg_catalog_url.replace("postgres@", "postgres:${CKSTORE_TEST_PGPASSWORD}@")
    password = "pg-password-from-the-environment"
    env = {**os.environ, **s3_server.env(), "CKSTORE_TEST_PGPASSWORD": password, "PYTHONPATH": str(ROOT)}
    env.pop("CKSTORE_STORE", None)

    made = _cli(["init", location, "--catalog", catalog, "--chunk-size", str(CHUNK)], env)
    assert made.returncode == 0, made.stderr
    assert f"created store {location}" in made.stdout

    for name, value in {**s3_server.env(), "CKSTORE_TEST_PGPASSWORD": password}.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.DEBUG)
    with ckstore.open(location, run="exp") as store:  # the location alone is enough
        store.commit(7, sample_states(7), {"loss": 0.25})
        dumped = catalog_tools.dump(store.catalog)
    secrets = (password, S3_SECRET)
    assert not any(s in dumped for s in secrets)
    assert not any(s in r.getMessage() for r in caplog.records for s in secrets)

    log = _cli(["--store", location, "log", "exp", "--json"], env)
    assert log.returncode == 0, log.stderr
    assert [(c["step"], c["metrics"]) for c in json.loads(log.stdout)] == [(7, {"loss": 0.25})]

    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="eu-west-1")
    recorded = client.get_object(Bucket=s3_bucket, Key="team/ckstore.json")["Body"].read().decode()
    assert json.loads(recorded)["catalog"] == catalog  # the reference, not the password
    assert not any(s in recorded for s in secrets)

    again = CliRunner().invoke(main, ["init", location, "--catalog", catalog])
    assert again.exit_code == 2 and "already exists" in again.output
    missing = CliRunner().invoke(main, ["--store", f"s3://{s3_bucket}/nothing", "log"])
    assert missing.exit_code == 2 and "no ckstore store" in missing.output
