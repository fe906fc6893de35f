"""Collective commit and checkout in real multi-process torch.distributed jobs (gloo, CPU).

Each job is a set of subprocesses running tests/_dist_job.py; a job that does not finish within
its timeout is killed and fails the test, so a hang can never pass.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist_job import DT_NAMES, SAVED, check_step1, dt_splits, global_tensors
from conformance import assert_consistent
from faultproxy import FaultProxy
from helpers import assert_clean, bits, expected_piece
from services import S3Server

import ckstore
from ckstore import WorldLayout
from ckstore.commit.collective import failure_message
from ckstore.commit.protocol import assign_writers, packs_needed
from ckstore.errors import OUTCOME_UNKNOWN

pytestmark = pytest.mark.distributed

JOB = Path(__file__).with_name("_dist_job.py")
ROOT = Path(__file__).parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    scenario: str, world: int, store: Path | str, tmp: Path, timeout: float = 90, *,
    env: dict[str, str] | None = None, dies: int | None = None, job: Path = JOB,
) -> list[dict[str, Any]]:
    """Run one job of ``world`` ranks of script ``job`` (each with its ``RANK`` and ``env`` in its
    environment); returns each rank's report (None for a rank that died). Rank ``dies`` must die of
    SIGKILL at the crash point ``env["CKSTORE_CRASH_AT"]`` names, after printing that point."""
    out = tmp / f"out-{scenario}-{world}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    port = _free_port()
    args = [str(store), str(port)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(job), scenario, *args, str(r), str(world), str(out)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"job {scenario!r} of {world} ranks hung for {timeout}s")
    reports = []
    for r, p in enumerate(procs):
        f = out / f"rank{r}.json"
        reports.append(json.loads(f.read_text()) if f.exists() else None)
        if r == dies:
            point = env["CKSTORE_CRASH_AT"].partition(":")[0]
            assert p.returncode == -signal.SIGKILL, f"rank {r} of job {scenario!r} was not killed:\n{logs[r][-4000:]}"
            assert logs[r].rstrip().endswith(f"ckstore crash point: {point}"), logs[r][-4000:]
        elif scenario != "kill" or r != 2:
            assert p.returncode == 0, f"rank {r} of job {scenario!r} failed:\n{logs[r][-4000:]}"
    return reports


@pytest.fixture
def dstore(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    ckstore.open(path, run="exp", chunk_size=64 * 1024, pack_size=1024 * 1024).close()
    return path


def test_commit_on_4_ranks_and_reshard_to_other_jobs(dstore: Path, tmp_path: Path) -> None:
    reports = run_job("main", 4, dstore, tmp_path)
    assert all(r["ok"] for r in reports)
    assert "target rank 2" in reports[2]["tp4_error"] and "fallback='modulo'" in reports[2]["tp4_error"]
    run_job("tp2", 2, dstore, tmp_path)

    g = global_tensors()
    with ckstore.open(dstore, run="exp") as store:
        ck = store.resolve(1)
        assert ck.world_layout == SAVED and ck.ranks == (0, 1, 2, 3)
        # replicated tensors were written once: the bytes stored are about one copy of every
        # global tensor (random bits do not compress), not one per data-parallel rank
        once = sum(g[n].nbytes for n in ("qkv", "proj", "emb", "flat"))
        assert once <= ck.stored_bytes_added <= once * 1.02 + 64 * 1024
        full = store.checkout(1, world_layout=WorldLayout.single())
        assert list(full) == [0]
        check_step1(full[0], g, WorldLayout.single(), 0)
        assert full[0]["optim_states"]["rng"].tolist() == [0, 1000]
        dt = store.checkout(2, world_layout=WorldLayout.single())[0]["model_states"]
        for name in DT_NAMES:
            assert bits(dt[name]) == bits(g[name]), name
        assert store.resolve(2).world_layout == SAVED
        # one process may also check out any ranks of another layout
        some = store.checkout(2, world_layout=WorldLayout({"dp": 2, "tp": 4}), ranks=[5])
        lay = WorldLayout({"dp": 2, "tp": 4})
        for name in DT_NAMES:
            want = expected_piece(g[name], dt_splits(name), lay, lay.coords(5))
            assert bits(some[5]["model_states"][name]) == bits(want), name


def test_a_replicated_tensor_is_written_once_and_each_rank_reads_only_its_chunks(dstore: Path, tmp_path: Path) -> None:
    """Counted in the blob store itself: the objects a 4-rank data-parallel commit leaves hold
    every chunk frame once (the replicated tensor's frames are exactly those one rank alone
    writes), and the ranks' write counters add up to exactly those objects. A collective checkout
    reads on each rank exactly the frames of the replicated tensor and of its own shard."""
    from _dist_job import replica_states

    from ckstore.blobstore import LocalBlobStore
    from ckstore.format.pack import PACK_HEADER, PACK_PREFIX, read_index
    from ckstore.format.record import RECORDS_PREFIX

    def objects() -> dict[str, int]:
        # the store's own objects; the SQLite catalog shares the folder, and its -wal/-shm files
        # outlive the job when the ranks close their connections at the same moment
        return {i.key: i.size for p in (PACK_PREFIX, RECORDS_PREFIX) for i in blobs.list(p)}

    blobs = LocalBlobStore(dstore, fsync=False)
    before = objects()
    reports = run_job("replicated", 4, dstore, tmp_path)
    new = {k: n for k, n in objects().items() if k not in before}
    packs = {k: n for k, n in new.items() if k.startswith(PACK_PREFIX)}
    frames = {k: read_index(blobs.read(k)) for k in packs}
    lengths = [(d, length) for index in frames.values() for d, _, length, _ in index]
    frame = dict(lengths)
    assert len(frame) == len(lengths), "a chunk frame was written twice"
    # pack objects hold their frames and nothing more: header, 32 index bytes a chunk, footer
    assert sum(packs.values()) == sum(frame.values()) + len(packs) * (len(PACK_HEADER) + 8) + 32 * len(lengths)
    # every byte the ranks wrote is in these objects (packs and the checkpoint's record)
    assert sum(r["written"]["writes"] for r in reports) == len(new)
    assert sum(r["written"]["bytes_written"] for r in reports) == sum(new.values())
    assert sum(1 for r in reports if r["written"]["bytes_written"]) >= 2  # the replica's writes were shared

    with ckstore.open(dstore, run="exp") as store:
        ck = store.resolve(1)
        chunks = {r: {t.path: t.chunks for t in store.manifests(ck, ranks=[r])[(r, "m")].tensors} for r in range(4)}
    w = chunks[0]["w"]
    assert len(w) == 16 and all(chunks[r]["w"] == w for r in range(4))
    shards = [d for r in range(4) for d in chunks[r]["s"]]
    assert set(frame) == set(w) | set(shards) and len(shards) == 8  # each stored once, nothing else
    # one rank alone writes the same frames of the replicated tensor: as many bytes, not more
    with ckstore.open(tmp_path / "one", run="exp", chunk_size=64 * 1024, pack_size=1024 * 1024) as one:
        one.commit(1, {0: {"m": {"w": replica_states(0)["m"]["w"]}}})
        alone = {d: length for k in (i.key for i in one.blobs.list(PACK_PREFIX)) for d, _, length, _ in read_index(one.blobs.read(k))}
    assert alone == {d: frame[d] for d in w}

    total = sum(frame.values())
    for r, report in enumerate(reports):
        need = set(w) | set(chunks[r]["s"])
        assert report["read"]["writes"] == 0
        assert report["read"]["bytes_read"] == sum(frame[d] for d in need) < total, (r, report["read"])
        assert report["read"]["reads"] <= len(need)


@pytest.mark.postgres
@pytest.mark.s3
def test_a_collective_commit_on_s3_and_postgres(
    s3_server: S3Server, fault_proxy: FaultProxy, pg_catalog_url: str, tmp_path: Path
) -> None:
    """A 2-rank gloo commit into a store whose blobs are on an S3 server and whose catalog is
    PostgreSQL. Counted at the server (the ranks reach it through tests/faultproxy.py): the PUTs it
    received are exactly the objects the commit left, one each, and those hold every chunk frame
    once, the replicated tensor's included, though both ranks wrote. Each rank checks out its own
    part bit-exact in the saved layout, reading only its chunks; one process consolidates both
    ranks bit-exact; gc + fsck find the store clean."""
    from _dist_job import replica_states

    from ckstore.format.pack import PACK_PREFIX, read_index

    bucket = s3_server.make_bucket()
    location = f"s3://{bucket}/store"
    opts = s3_server.storage_options()
    ckstore.open(location, catalog=pg_catalog_url, storage_options=opts, chunk_size=64 * 1024, pack_size=1 << 20).close()
    client = s3_server.client()

    def objects() -> dict[str, int]:
        listed = client.list_objects_v2(Bucket=bucket, Prefix="store/")
        assert not listed["IsTruncated"]
        return {o["Key"]: o["Size"] for o in listed.get("Contents", [])}

    before = objects()
    requests = len(fault_proxy.requests)
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": fault_proxy.endpoint}  # the job finds the store alone
    reports = run_job("replicated", 2, location, tmp_path, env=env)
    assert all(r["ok"] for r in reports)
    new = {k: n for k, n in objects().items() if k not in before}
    writes = [r for r in fault_proxy.requests[requests:] if r.method in ("PUT", "POST")]
    assert {(r.op, r.status) for r in writes} == {("PutObject", 200)}, writes  # single PUTs, all answered
    assert sorted(r.key for r in writes) == sorted(new)  # each new object PUT once, nothing else
    assert sum(r["written"]["writes"] for r in reports) == len(new)
    assert sum(r["written"]["bytes_written"] for r in reports) == sum(new.values())
    assert all(r["written"]["bytes_written"] for r in reports)  # both ranks wrote their share
    packs = [k for k in new if k.startswith(f"store/{PACK_PREFIX}")]
    lengths = [
        (d, length)
        for k in packs
        for d, _, length, _ in read_index(client.get_object(Bucket=bucket, Key=k)["Body"].read())
    ]
    frame = dict(lengths)
    assert len(frame) == len(lengths), "a chunk frame was written twice"

    with ckstore.open(location, storage_options=opts, run="exp") as store:
        ck = store.resolve(1)
        assert ck.world_layout == WorldLayout({"dp": 2}) and ck.ranks == (0, 1)
        chunks = {r: {t.path: t.chunks for t in store.manifests(ck, ranks=[r])[(r, "m")].tensors} for r in range(2)}
        w = chunks[0]["w"]
        assert len(w) == 16 and chunks[1]["w"] == w
        shards = chunks[0]["s"] + chunks[1]["s"]
        assert set(frame) == set(w) | set(shards) and len(shards) == 8  # each stored once, nothing else
        for r, report in enumerate(reports):  # the collective checkout read each rank's chunks only
            need = set(w) | set(chunks[r]["s"])
            assert report["read"]["writes"] == 0
            assert report["read"]["bytes_read"] == sum(frame[d] for d in need) < sum(frame.values()), report
        parts = [replica_states(r, 2)["m"] for r in range(2)]
        full = store.checkout(1, world_layout=WorldLayout.single())
        assert list(full) == [0]
        assert bits(full[0]["m"]["w"]) == bits(parts[0]["w"])
        assert bits(full[0]["m"]["s"]) == bits(torch.cat([p["s"].tensor for p in parts]))
        assert store.catalog.pending() == []
        assert_consistent(store)
        assert_clean(store)
        assert bits(store.checkout(1, world_layout=WorldLayout.single())[0]["m"]["w"]) == bits(parts[0]["w"])


@pytest.mark.postgres
def test_a_collective_commit_whose_final_commit_answer_is_lost(pg_catalog_url: str, tmp_path: Path) -> None:
    """Rank 0's connection to a PostgreSQL catalog drops at the COMMIT that makes step 1 visible,
    after the server committed it (tests/pgproxy.py, in rank 0's process). Every rank fails saying
    the step may or may not have been committed, none that nothing was; retrying fails on every
    rank naming the step as committed already; the checkpoint is whole, bit-exact, and gc + fsck
    find the store clean."""
    from _dist_job import replica_states

    path = tmp_path / "store"
    ckstore.open(path, catalog=pg_catalog_url, chunk_size=64 * 1024, pack_size=1 << 20).close()
    reports = run_job("lost_commit", 2, path, tmp_path)
    assert reports[0]["cut"] is True  # the server answered the COMMIT; the proxy withheld the answer
    for r in reports:
        assert r["ok"] and "failed on rank 0: CatalogError: step 1 of run 'exp' may or may not have been committed" in r["lost"], r
        assert "nothing was committed" not in r["lost"], r["lost"]
        assert "failed on rank 0: AlreadyExistsError: run 'exp' already has a checkpoint at step 1" in r["retry"], r
    with ckstore.open(path, run="exp") as store:
        assert [c.step for c in store.checkpoints()] == [1] and store.catalog.pending() == []
        got = store.checkout(1, world_layout=WorldLayout({"dp": 2}), ranks=[0, 1])
        for r in range(2):
            want = replica_states(r, 2)["m"]
            assert bits(got[r]["m"]["w"]) == bits(want["w"]) and bits(got[r]["m"]["s"]) == bits(want["s"].tensor)
        assert_consistent(store)
        assert_clean(store)


def test_a_failing_rank_fails_every_rank_and_commits_nothing(dstore: Path, tmp_path: Path) -> None:
    reports = run_job("fail", 4, dstore, tmp_path)
    for r in reports:
        assert r["ok"] and r["final"] == 3
        assert "failed on rank 1: UnsupportedValueError: rank 1, extra, key 'obj'" in r["early"], r["early"]
        assert "failed on rank 2: OSError: injected write failure on rank 2;" in r["mid"], r["mid"]
        assert "run 'exp', step 3" in r["mid"] and "nothing was committed" in r["mid"]
        assert "failed on rank 0: AlreadyExistsError" in r["exists"], r["exists"]
        assert "ranks disagree" in r["disagree"] and "rank 3 commits run 'exp', step 6" in r["disagree"]
        assert "rank 0's piece of shape [5] at [0] and rank 1's piece of shape [3] at [4] overlap" in r["overlap"]
        assert "failed on ranks 0, 1, 2, 3: UnsupportedValueError" in r["partial"], r["partial"]
        assert "placement Partial" in r["partial"] and "redistribute" in r["partial"]
        assert "mesh without dim names" in r["unnamed"], r["unnamed"]
    with ckstore.open(dstore, run="exp") as store:
        assert [c.step for c in store.checkpoints()] == [3, 4]
        assert store.catalog.pending() == []
        g = global_tensors()
        full = store.checkout(3, world_layout=WorldLayout.single())[0]
        check_step1(full, g, WorldLayout.single(), 0)


def test_a_killed_rank_fails_the_others_without_hanging(dstore: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    reports = run_job("kill", 4, dstore, tmp_path)
    assert reports[2] is None  # it died before reporting
    for r in (0, 1, 3):
        assert reports[r]["ok"] and "nothing was committed" in reports[r]["killed"], reports[r]
    assert time.monotonic() - t0 < 60
    with ckstore.open(dstore, run="exp") as store:
        assert store.checkpoints() == []
        assert store.catalog.pending() == []  # rank 0 aborted its pending checkpoint


def test_a_lost_lease_stops_the_collective_commit(tmp_path: Path) -> None:
    """Rank 0 checks its lease on every chunk it writes, as a single-process commit does: once its
    pending checkpoint is taken over it stops writing, and every rank fails."""
    path = tmp_path / "store"
    ckstore.open(path, run="exp", chunk_size=64 * 1024, pack_size=1024 * 1024, lease_seconds=1).close()
    reports = run_job("lease", 2, path, tmp_path)
    for r in reports:
        assert r["ok"] and "failed on rank 0: CommitAbandonedError" in r["lost"], r
        assert "nothing was committed" in r["lost"]
    assert reports[0]["calls"] == 1 < reports[0]["chunks"]  # it stopped at the next chunk
    assert reports[1]["calls"] == reports[1]["chunks"]  # the other rank wrote its own, then learnt
    with ckstore.open(path, run="exp") as store:
        assert store.checkpoints() == [] and store.catalog.pending() == []


# -- the pure parts of the collective commit ----------------------------------------------------


def _d(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_assign_writers_writes_each_chunk_once_and_balances_replicas() -> None:
    n = 64
    replicated = [(_d(i), 100) for i in range(n)]
    holdings = [replicated + [(_d(1000 + r), 100)] for r in range(4)]  # DDP: all replicated
    missing = {d for h in holdings for d, _ in h} - {_d(3)}  # chunk 3 already stored
    plan = assign_writers(holdings, missing, run_bytes=800)
    written = [d for p in plan for d in p]
    assert sorted(written) == sorted(missing)  # every missing chunk exactly once
    for r, p in enumerate(plan):
        assert _d(1000 + r) in p  # a chunk only this rank holds is this rank's
        held = {d for d, _ in holdings[r]}
        assert set(p) <= held
    loads = [len(p) for p in plan]
    assert max(loads) - min(loads) <= 8, loads  # runs of 8 chunks spread over the 4 ranks
    # runs keep consecutive chunks with one writer
    owners = [next(r for r, p in enumerate(plan) if _d(i) in p) for i in range(n) if i != 3]
    assert sum(a != b for a, b in itertools.pairwise(owners)) <= n // 8 + 1


def test_assign_writers_only_picks_holders() -> None:
    holdings = [[(_d(1), 10), (_d(2), 10)], [(_d(2), 10), (_d(3), 10)], []]
    plan = assign_writers(holdings, {_d(1), _d(2), _d(3)}, run_bytes=10)
    assert plan[0][0] == _d(1) and plan[1][-1] == _d(3) and plan[2] == []
    assert sum(p.count(_d(2)) for p in plan) == 1


def test_failure_message_names_every_failing_rank_once() -> None:
    what = "commit of run 'exp', step 3"
    assert failure_message(what, {2: "OSError: disk full"}) == (
        "commit of run 'exp', step 3 failed on rank 2: OSError: disk full; nothing was committed"
    )
    msg = failure_message(what, {3: "E: a", 0: "E: b", 1: "E: a"})
    assert msg == "commit of run 'exp', step 3 failed on ranks 0, 1, 3 (rank 0: E: b; ranks 1, 3: E: a); nothing was committed"
    # rank 0 lost the catalog's answer to its COMMIT: the step may be committed, and no rank denies it
    lost = f"CatalogError: step 3 of run 'exp' {OUTCOME_UNKNOWN}: catalog … failed while committing it"
    assert failure_message(what, {0: lost}) == f"commit of run 'exp', step 3 failed on rank 0: {lost}"


def test_pack_slots_bound_what_a_pack_writer_uses(tmp_path: Path) -> None:
    from ckstore.blobstore import LocalBlobStore
    from ckstore.format.codec import encode
    from ckstore.format.pack import PackWriter

    blobs = LocalBlobStore(tmp_path, fsync=False)
    for count, size, pack in [(1, 4096, 4096), (37, 4096, 4096 * 5), (64, 65536, 1 << 20), (10, 100, 1000)]:
        used: list[str] = []

        def on_open(used: list[str] = used) -> tuple[str, None]:
            used.append(f"p/{len(used)}")
            return used[-1], None

        w = PackWriter(blobs, pack, on_open, lambda *a: None)
        raw = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy()
        for i in range(count):
            w.add(_d(i), encode(memoryview(raw), 16), size)
        w.close()
        assert len(used) <= packs_needed(size * count, count, pack), (count, size, pack)


def test_single_process_commit_of_many_ranks_records_the_same_sharding(store: ckstore.Store) -> None:
    from _dist_job import rank_states

    g = global_tensors()
    ck = store.commit(1, {r: rank_states(r, g) for r in range(4)}, world_layout=SAVED)
    shard = {t.path: t.shard for t in store.manifests(ck, ranks=[3])[(3, "model_states")].tensors}
    assert shard["qkv"].global_shape == (96, 640) and shard["qkv"].offsets == (48, 0)
    assert shard["proj"].splits == ((1, "tp"),) and shard["emb"] is None
    full = store.checkout(1, world_layout=WorldLayout.single())
    check_step1(full[0], g, WorldLayout.single(), 0)
