"""Real processes: a commit killed mid-write, and two processes committing at once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_same

import ckstore

ROOT = Path(__file__).resolve().parent.parent


def _spawn(script: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_commit_killed_mid_write_leaves_store_consistent(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "store"
    s = ckstore.open(path, run="r", chunk_size=64 * 1024, pack_size=256 * 1024)
    s.commit(1, {0: {"model_states": _state(1)}})
    proc = _spawn(
        f"""
        import torch, ckstore
        s = ckstore.open({str(path)!r}, run="r")
        g = torch.Generator().manual_seed(99)
        big = {{f"w{{i}}": torch.randn(512, 1024, generator=g) for i in range(40)}}
        print("ready", flush=True)
        for step in range(2, 1000):
            s.commit(step, {{0: {{"model_states": big}}}})
            big["w0"].add_(1)
        """
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready", proc.stderr.read() if proc.stderr else ""
    time.sleep(random.Random(seed).uniform(0.05, 1.5))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    s2 = ckstore.open(path, run="r")
    assert_same(s2.checkout(1)[0]["model_states"], _state(1))
    committed = s2.checkpoints()
    for ck in committed:  # every visible checkpoint is whole
        s2.checkout(ck.step)
    # the killed commit's step can be committed again at once: its dead owner is taken over
    next_step = max(c.step for c in committed) + 1
    s2.commit(next_step, {0: {"model_states": _state(2)}})
    assert_same(s2.checkout(next_step)[0]["model_states"], _state(2))
    assert all(p[1] != "r" or p[2] != next_step for p in s2.catalog.pending())


def test_two_processes_commit_to_one_sqlite_store(tmp_path: Path) -> None:
    path = tmp_path / "store"
    ckstore.open(path, chunk_size=64 * 1024, pack_size=256 * 1024).close()
    procs = []
    for who in ("a", "b"):
        procs.append(
            _spawn(
                f"""
                import torch, ckstore
                s = ckstore.open({str(path)!r}, run={who!r})
                shared = {{"emb": torch.arange(200_000, dtype=torch.float32)}}
                for step in range(6):
                    g = torch.Generator().manual_seed(step + {ord(who)})
                    s.commit(step, {{0: {{"model_states": {{**shared, "w": torch.randn(300, 300, generator=g)}}}}}})
                print("ok", flush=True)
                """
            )
        )
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()
        assert out.strip() == b"ok"
    s = ckstore.open(path)
    assert len(s.checkpoints()) == 12
    for who in ("a", "b"):
        for step in range(6):
            g = torch.Generator().manual_seed(step + ord(who))
            out = s.checkout(f"{who}@{step}")[0]["model_states"]
            assert torch.equal(out["w"], torch.randn(300, 300, generator=g))
            assert torch.equal(out["emb"], torch.arange(200_000, dtype=torch.float32))


def test_live_commit_of_same_step_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store"
    s = ckstore.open(path, run="r")
    from ckstore.catalog import Owner
    from ckstore.layout import WorldLayout

    # a pending row owned by a live process (this one) blocks another commit of the step
    s.catalog.begin_checkpoint(
        "r", 5, kind="checkpoint", replace=False, owner=Owner.me(), world_layout=WorldLayout.flat(1),
        lease_seconds=60,
    )  # fmt: skip
    with pytest.raises(ckstore.CommitInProgressError, match=f"process {os.getpid()}"):
        s.commit(5, {0: {"m": {"w": torch.ones(1)}}})
    s.commit(6, {0: {"m": {"w": torch.ones(1)}}})
