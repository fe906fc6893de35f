"""A commit SIGKILLed at every kill point of its write order damages nothing.

Each case runs a real child process with ``CKSTORE_CRASH_AT=<point>`` (``ckstore/_crash.py``):
it commits a step and kills itself with SIGKILL when it reaches the point, after printing
``ckstore crash point: <point>``. The test proves the kill landed there (the exit signal, the
line, and a pending checkpoint row from the point the commit opens one), then checks that the
earlier checkpoints read back bit-exact, that nothing new is visible, that the next commit of the
same step takes over and reads back bit-exact, and that ``gc(grace=0)`` then leaves a store that
``fsck(deep=True)`` finds clean: no damage, no orphans, no temp files, no pending commits.

Collective commits run as 2-rank gloo jobs (``tests/_dist_job.py``, scenario ``crash``), killing
rank 0 or rank 1 in a chosen phase.

    python tests/test_kill_points.py STORE      (the child: commits STEP_NEW; killed on the way)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_clean, assert_same

import ckstore
from ckstore._crash import POINTS

ROOT = Path(__file__).parent.parent
CHUNK, PACK = 4096, 16 * 1024  # tiny chunks and packs: every pack point is reached in one commit
STEP_NEW = 3


def states(step: int) -> dict[int, dict[str, Any]]:
    """What step ``step`` commits: a tensor every step shares (a chunk claimed, not written
    again), one tensor per step and a few small values; the same in every process."""
    gen = torch.Generator().manual_seed(step)
    return {
        0: {
            "model_states": {
                "frozen": torch.arange(3000, dtype=torch.float32),  # 3 chunks, stored by step 1
                "w": torch.randn(5000, generator=gen),  # 5 chunks: two packs and a bit
                "b": torch.randn(7, generator=gen).to(torch.bfloat16),
                "step": step,
            }
        }
    }


def _marker(point: str) -> str:
    return f"ckstore crash point: {point}"


@pytest.fixture(scope="module")
def base_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding steps 1 and 2, built once; each case works on its own copy."""
    path = tmp_path_factory.mktemp("kill-base") / "store"
    with ckstore.open(path, run="exp", chunk_size=CHUNK, pack_size=PACK) as store:
        for step in (1, 2):
            store.commit(step, states(step))
    return path


def _run_child(store: Path, point: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CKSTORE_CRASH_AT": point, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}  # fmt: skip
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, __file__, str(store)], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


#: the points a single-process commit passes before it opens its pending checkpoint (with its claim)
BEFORE_PENDING = ("stage", "declare", "hash")


@pytest.mark.parametrize("point", POINTS)
def test_a_commit_killed_at_each_point_damages_nothing(base_store: Path, tmp_path: Path, point: str) -> None:
    path = tmp_path / "store"
    shutil.copytree(base_store, path)
    done = _run_child(path, point)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr[-3000:])
    assert done.stderr.rstrip().endswith(_marker(point)), done.stderr[-3000:]
    if point == "pack.mid":  # half a pack is on disk, in a temp file the dead writer held
        parts = list((path / "tmp").glob("*.part"))
        assert len(parts) == 1 and parts[0].stat().st_size > CHUNK // 2, parts
    if point == "pack.durable":  # the whole pack is in place, no chunk row names it yet
        assert len(_files(path / "packs")) > len(_files(base_store / "packs"))
        # and the record of the step is not: it appears only once every pack is durable
        assert len(_files(path / "records" / "checkpoints")) == len(_files(base_store / "records" / "checkpoints"))

    with ckstore.open(path, run="exp") as store:
        pending = store.catalog.pending()
        assert [p.step for p in pending] == ([] if point in BEFORE_PENDING else [STEP_NEW]), pending
        assert [c.step for c in store.checkpoints()] == [1, 2]  # nothing new visible
        for step in (1, 2):
            assert_same(store.checkout(step), states(step))
        # the next commit of the step takes the dead one's pending checkpoint over
        ck = store.commit(STEP_NEW, states(STEP_NEW))
        assert ck.step == STEP_NEW and store.catalog.pending() == []
        assert_clean(store)
        for step in (1, 2, STEP_NEW):
            assert_same(store.checkout(step), states(step))


def test_an_unknown_point_is_refused_at_import(tmp_path: Path) -> None:
    done = _run_child(tmp_path / "nothing", "pack.midway")
    assert done.returncode == 1
    assert "CKSTORE_CRASH_AT='pack.midway' names no crash point" in done.stderr, done.stderr[-3000:]


# -- collective commits: 2-rank gloo jobs -------------------------------------------------------

#: (point, rank): every phase, each on rank 0 (which holds the pending checkpoint) or rank 1;
#: write and finish on both (a job takes ~4 s, so the list stays short)
COLLECTIVE = [
    ("stage", 1), ("declare", 0), ("hash", 1), ("plan_writes", 0), ("write", 0), ("write", 1), ("finish", 0),
    ("finish", 1),
]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(("point", "rank"), COLLECTIVE, ids=[f"{p}:{r}" for p, r in COLLECTIVE])
def test_a_collective_commit_killed_on_one_rank_damages_nothing(tmp_path: Path, point: str, rank: int) -> None:
    from _dist_job import CRASH_LAYOUT, crash_states
    from test_distributed import run_job

    path = tmp_path / "store"
    both = {r: crash_states(r, 1) for r in (0, 1)}
    with ckstore.open(path, run="exp", chunk_size=CHUNK, pack_size=PACK) as store:
        store.commit(1, both, world_layout=CRASH_LAYOUT)
    reports = run_job("crash", 2, path, tmp_path, env={"CKSTORE_CRASH_AT": f"{point}:{rank}"}, dies=rank)
    survivor = reports[1 - rank]
    assert reports[rank] is None and survivor["ok"], reports
    # once rank 0 holds every rank's packs and manifests, rank 1's death cannot stop the commit
    visible = (point, rank) == ("finish", 1)
    if visible:  # rank 0 made it visible and returns it, though it could not tell rank 1
        assert survivor.get("committed") == 2, survivor
    elif point == "finish":
        # rank 1 lost rank 0 while rank 0 was making the checkpoint visible: it cannot know the
        # outcome, and says so instead of claiming nothing was committed
        assert "committed" not in survivor and "may have committed" in survivor["error"], survivor
    else:
        # (the job reports only a DistributedCommitError as "error"; any other fails the job)
        assert "committed" not in survivor and "nothing was committed" in survivor["error"], survivor

    new = {r: crash_states(r, 2) for r in (0, 1)}
    with ckstore.open(path, run="exp") as store:
        assert [c.step for c in store.checkpoints()] == ([1, 2] if visible else [1])
        assert_same(store.checkout(1, world_layout=CRASH_LAYOUT), both)
        # a dead rank 0 leaves its pending checkpoint (from hash on); a live one aborts its own
        opened = rank == 0 and point != "declare"
        assert [p.step for p in store.catalog.pending()] == ([2] if opened else [])
        if not visible:  # the next commit of the step takes over
            store.commit(2, new, world_layout=CRASH_LAYOUT)
            assert store.catalog.pending() == []
        assert_clean(store)
        assert_same(store.checkout(1, world_layout=CRASH_LAYOUT), both)
        assert_same(store.checkout(2, world_layout=CRASH_LAYOUT), new)


def _child(store: str) -> None:
    with ckstore.open(store, run="exp", create=False) as s:
        s.commit(STEP_NEW, states(STEP_NEW))
    print("committed: the crash point was never reached")


if __name__ == "__main__":
    _child(sys.argv[1])
