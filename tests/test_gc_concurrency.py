"""gc against real processes: commits and gc running at once, and both killed with SIGKILL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_same
from services import S3Server

import ckstore
from ckstore.retention import BestN, LatestN

ROOT = Path(__file__).resolve().parent.parent

# the states every process derives from a step number
STATES = """
import torch
SHARED = torch.arange(300_000, dtype=torch.float32)
def state(step):
    g = torch.Generator().manual_seed(step)
    return {"model_states": {"shared": SHARED, "w": torch.randn(160, 256, generator=g)},
            "optim_states": {"m": torch.randn(64, 256, generator=g), "step": step}}
def val_loss(step):
    return abs(step - 7) / 10 + 0.1
"""
_ns: dict[str, Any] = {}
exec(STATES, _ns)  # noqa: S102 - the very source the child processes run
state, val_loss = _ns["state"], _ns["val_loss"]


# a child stops at a chosen point by announcing it and waiting for a line the test never sends
STOP_HERE = """
def stop_here(what):
    print("stopped", what, flush=True)
    sys.stdin.readline()
"""


def spawn(body: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = STATES + "\nimport ckstore, os, sys, json\n" + STOP_HERE + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_line(p: subprocess.Popen[str], want: str) -> str:
    """The child's next line of output, which must start with ``want``."""
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if not line.startswith(want):
        p.kill()
        raise AssertionError(f"child said {line!r}, not {want!r}: {p.stderr.read() if p.stderr else ''}")
    return line


def wait_ready(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        wait_line(p, "ready")


def pack_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "packs").rglob("*") if p.is_file())


def check_every_checkpoint(s: ckstore.Store) -> list[int]:
    steps = []
    for ck in s.checkpoints():
        assert_same(s.load(ck)[0], state(ck.step))
        steps.append(ck.step)
    return steps


def assert_clean(s: ckstore.Store) -> None:
    rep = s.fsck(deep=True)
    assert rep.ok, [d.describe() for d in rep.damage]
    assert not rep.orphans and not rep.temp_files and not rep.pending
    assert rep.trash == 0 and rep.unreferenced_chunks == 0


def _commits_against_gc(path: Path, catalog: str | None) -> None:
    n = 20
    s = ckstore.open(path, catalog=catalog, chunk_size=64 * 1024, pack_size=1024 * 1024)
    stop = path.parent / "stop"
    beat = path.parent / "gc-runs"
    # the committer never gets more than one commit ahead of the collector's gc runs, so the
    # space bound below holds however the two processes are scheduled; they still overlap
    committer = spawn(
        f"""
        import time
        from pathlib import Path
        s = ckstore.open({str(path)!r}, run="train")
        beat = Path({str(beat)!r})
        print("ready", flush=True)
        seen = -1
        for step in range({n}):
            deadline = time.monotonic() + 240  # only a guard against a dead collector
            while True:  # wait for the collector's next gc run (a file it writes)
                runs = int(beat.read_text() or -1) if beat.exists() else -1
                if runs > seen:
                    break
                if time.monotonic() > deadline:
                    sys.exit("the collector stopped running gc")
                time.sleep(0.01)
            seen = runs
            s.commit(step, {{0: state(step)}}, {{"val_loss": val_loss(step)}})
            print("committed", step, flush=True)
        """
    )
    collector = spawn(
        f"""
        from ckstore.retention import LatestN, BestN
        from pathlib import Path
        s = ckstore.open({str(path)!r})
        policy = LatestN(2) | BestN(1, "val_loss")
        print("ready", flush=True)
        runs, peak, dropped, trace = 0, 0, 0, []
        while not os.path.exists({str(stop)!r}):
            dropped += len(s.gc(policy, grace=60).dropped)
            runs += 1
            tmp = Path({str(beat)!r} + ".tmp")
            tmp.write_text(str(runs))
            tmp.replace({str(beat)!r})
            size = sum(p.stat().st_size for p in Path({str(path)!r}, "packs").rglob("*") if p.is_file())
            peak = max(peak, size)
            trace.append((size, len(s.checkpoints())))
        print(json.dumps({{"runs": runs, "peak": peak, "dropped": dropped, "trace": trace}}), flush=True)
        """
    )
    try:
        wait_ready(committer, collector)
        wait_line(committer, "committed 0")  # from here on the store lists a checkpoint
        reads = 0
        rng = random.Random(0)
        while committer.poll() is None:  # read while both write
            ckpts = s.checkpoints()
            assert ckpts  # gc never drops a run's latest checkpoint
            ck = rng.choice(ckpts)
            try:
                out = s.load(ck)
            except (ckstore.CheckpointNotFoundError, ckstore.ChunkNotFoundError):
                # only a checkpoint gc dropped meanwhile may fail to load, and never with wrong bytes
                assert ck.id not in {c.id for c in s.checkpoints()}
                continue
            assert_same(out[0], state(ck.step))
            reads += 1
        assert committer.returncode == 0, committer.stderr.read() if committer.stderr else ""
        stop.touch()
        out, err = collector.communicate(timeout=120)
        assert collector.returncode == 0, err
        stats = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in (committer, collector):
            if p.poll() is None:
                p.kill()
                p.wait()

    assert stats["runs"] >= 3 and stats["dropped"] > 0 and reads > 0
    final = s.gc(LatestN(2) | BestN(1, "val_loss"), grace=60)
    assert check_every_checkpoint(s) == [7, n - 2, n - 1]
    assert_clean(s)
    # space stays bounded while training: after every gc the packs hold about as many checkpoints
    # as the catalog lists (+ one in flight, + the dead part of the first pack, which the shared
    # tensor's chunks keep), however many were committed
    one = s.du().checkpoints[-1].stored_bytes  # one whole checkpoint, shared tensor included
    for size, listed in stats["trace"]:
        assert size <= (listed + 3) * one, (size, listed, one, final)
    assert stats["peak"] < n * one / 2
    # (the kept three, plus the dead part of the first pack, which the live shared chunks hold)
    assert pack_bytes(path) <= 5 * one
    s.close()


def test_gc_loop_beside_a_commit_loop_keeps_every_listed_checkpoint(tmp_path: Path) -> None:
    _commits_against_gc(tmp_path / "store", None)


@pytest.mark.postgres
def test_gc_loop_beside_a_commit_loop_on_postgres(tmp_path: Path, pg_catalog_url: str) -> None:
    _commits_against_gc(tmp_path / "store", pg_catalog_url)


# where the collector stops, to be killed: after listing the packs (before its catalog
# transaction), after the transaction but before the first object is deleted, after a batch of
# objects is deleted but before the rest
GC_POINTS = ("after-list", "before-delete", "after-delete")


@pytest.mark.parametrize("seed", [0, 1, 2])  # one per gc point; the seed picks the commit's
def test_sigkill_commit_and_gc_at_chosen_points(tmp_path: Path, seed: int) -> None:
    """Both processes stop at a point the seed picks (a commit mid-write, a gc mid-sweep), the
    test checks each is in flight there, then SIGKILLs them in the seed's order."""
    rng = random.Random(seed)
    commit_at = (5 + rng.randrange(3), 1 + rng.randrange(3))  # (step, progress call)
    gc_at = GC_POINTS[seed % len(GC_POINTS)]
    path = tmp_path / "store"
    s = ckstore.open(path, run="r", chunk_size=64 * 1024, pack_size=256 * 1024)
    for step in range(5):  # gc's first run drops three, and deletes the packs of two
        s.commit(step, {0: state(step)})
    committer = spawn(
        f"""
        s = ckstore.open({str(path)!r}, run="r")
        print("ready", flush=True)
        step = 5
        while True:
            calls = [0]
            def progress(done, total, step=step):
                calls[0] += 1
                if (step, calls[0]) == {commit_at!r}:
                    stop_here(f"commit {{step}} call {{calls[0]}}")
            s.commit(step, {{0: state(step)}}, progress=progress)
            step += 1
        """
    )
    collector = spawn(
        f"""
        from ckstore.retention import LatestN
        s = ckstore.open({str(path)!r})
        point = {gc_at!r}
        blobs = s.blobs
        list_, delete = blobs.list, blobs.delete
        def listing(prefix=""):
            found = list(list_(prefix))
            if point == "after-list":
                stop_here(point)
            return iter(found)
        def deleting(keys):
            keys = list(keys)
            if keys and point == "before-delete":
                stop_here(point)
            n = delete(keys)
            if keys and point == "after-delete":
                stop_here(point)
            return n
        blobs.list, blobs.delete = listing, deleting
        print("ready", flush=True)
        while True:
            s.gc(LatestN(2), grace=60)
        """
    )
    procs = [committer, collector]
    try:
        wait_ready(*procs)
        wait_line(committer, f"stopped commit {commit_at[0]} call {commit_at[1]}")
        wait_line(collector, f"stopped {gc_at}")
        # the commit is in flight: its claim is recorded, and it is not visible
        assert [(run, step) for _, run, step, _, _ in s.catalog.pending()] == [("r", commit_at[0])]
        assert commit_at[0] not in [c.step for c in s.checkpoints()]
        rng.shuffle(procs)
        for p in procs:
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    rep = s.fsck(deep=True)  # whatever the kills interrupted, no kept checkpoint is damaged
    assert rep.ok, [d.describe() for d in rep.damage]
    steps = check_every_checkpoint(s)
    assert steps[-1] == commit_at[0] - 1 and len(steps) >= 2
    report = s.gc(LatestN(2), grace=0)  # the next gc finishes the cleaning
    assert [(r.step, "is gone" in r.why) for r in report.reaped] == [(commit_at[0], True)]
    assert check_every_checkpoint(s) == steps[-2:]
    assert_clean(s)
    s.commit(commit_at[0], {0: state(commit_at[0])})  # the killed step commits again
    assert_same(s.checkout("latest")[0], state(commit_at[0]))


# -- gc with no grace beside commits, one of them stalled mid-write -----------------------------
def _race_with_a_stalled_commit(location: str, catalog: str | None, options: dict[str, Any] | None,
                                tmp: Path) -> None:  # fmt: skip
    """gc runs back to back with grace 0 and a 1 s lease, unthrottled, beside a committer running
    flat out, while a third process's commit stalls mid-write (in its progress callback, until a
    file appears). That commit claimed the chunks of step 0 before it stalled; the test releases
    it only once gc has dropped step 0 (and swept everything else it could) meanwhile. The stalled
    commit then completes, bit-exact, and the store is clean."""
    n = 6
    opened = f"ckstore.open({location!r}, catalog={catalog!r}, storage_options={options!r}"
    s = eval(opened + ', run="train", chunk_size=64 * 1024, pack_size=256 * 1024, lease_seconds=1.0)')  # noqa: S307
    assert s.config.lease_seconds == 1.0
    s.commit(0, {0: state(0)}, {"val_loss": val_loss(0)})
    release, stop = tmp / "release", tmp / "stop"
    # step 0's tensors (already stored: claimed, not written) plus a tensor of its own to write
    side = "{**state(0), 'extra': {'x': torch.randn(300_000, generator=torch.Generator().manual_seed(99))}}"
    stalled = spawn(
        f"""
        import time
        s = {opened}, run="side")
        print("ready", flush=True)
        def progress(done, total, first=[True]):
            if first[0]:
                first[0] = False
                print("stalled", flush=True)
                while not os.path.exists({str(release)!r}):  # the event: a file the test creates
                    time.sleep(0.01)
        ck = s.commit(0, {{0: {side}}}, progress=progress)
        print("committed", ck.step, flush=True)
        """
    )
    committer = spawn(
        f"""
        s = {opened}, run="train")
        print("ready", flush=True)
        for step in range(1, {n}):
            s.commit(step, {{0: state(step)}}, {{"val_loss": val_loss(step)}})
            print("committed", step, flush=True)
        """
    )
    collector = spawn(
        f"""
        from ckstore.retention import LatestN
        s = {opened})
        print("ready", flush=True)
        while not os.path.exists({str(stop)!r}):
            r = s.gc(LatestN(2), run="train", grace=0)
            print("gc", json.dumps([r.dropped, len(r.reaped), r.packs_deleted, r.orphans_deleted]), flush=True)
        """
    )
    procs = [stalled, committer, collector]
    try:
        wait_ready(*procs)
        wait_line(stalled, "stalled")  # mid-write, its claim recorded
        assert ("side", 0) in [(run, step) for _, run, step, _, _ in s.catalog.pending()]
        # the collector drops step 0 (whose chunks only the stalled commit still needs) and keeps
        # going; the committer commits beside it, unthrottled
        dropped: list[str] = []
        packs_deleted = 0
        while "train@0" not in dropped or packs_deleted == 0:
            runs = json.loads(wait_line(collector, "gc").split(" ", 1)[1])
            assert runs[1] == 0, "gc reaped the stalled commit, which is alive"
            dropped += runs[0]
            packs_deleted += runs[2]
        more = [json.loads(wait_line(collector, "gc").split(" ", 1)[1]) for _ in range(2)]  # two more full runs
        assert all(r[1] == 0 for r in more)
        release.touch()
        assert wait_line(stalled, "committed") == "committed 0"
        assert stalled.wait(120) == 0, stalled.stderr.read() if stalled.stderr else ""
        assert committer.wait(240) == 0, committer.stderr.read() if committer.stderr else ""
        stop.touch()
        assert collector.wait(120) == 0, collector.stderr.read() if collector.stderr else ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    import torch

    want = {**state(0), "extra": {"x": torch.randn(300_000, generator=torch.Generator().manual_seed(99))}}
    assert_same(s.checkout("side@0")[0], want)
    s.gc(grace=0)
    assert sorted(c.ref for c in s.checkpoints()) == ["side@0", f"train@{n - 2}", f"train@{n - 1}"]
    assert_same(s.checkout("side@0")[0], want)
    for step in (n - 2, n - 1):
        assert_same(s.checkout(f"train@{step}")[0], state(step))
    assert_clean(s)
    s.close()


@pytest.mark.slow
def test_gc_without_grace_beside_commits_and_a_stalled_one(tmp_path: Path) -> None:
    _race_with_a_stalled_commit(str(tmp_path / "store"), None, None, tmp_path)


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.s3
def test_gc_without_grace_beside_commits_and_a_stalled_one_on_s3_and_postgres(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str, pg_catalog_url: str
) -> None:
    _race_with_a_stalled_commit(f"s3://{s3_bucket}/store", pg_catalog_url, s3_server.storage_options(), tmp_path)
