"""Asynchronous commits in one process: staging, bounded slots, errors, a killed process.

The collective case runs in tests/test_dcp.py's real gloo jobs (tests/_dcp_job.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import bits

import ckstore
from ckstore.commit.pending import PendingCommit

ROOT = Path(__file__).resolve().parent.parent


def _state(seed: int, n: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model_states": {f"w{i}": torch.randn(128, 256, generator=g) for i in range(n)},
        "optim_states": {"step": torch.tensor(seed), "lr": 0.1, "half": torch.randn(33, generator=g).half()},
    }


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    return {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in d.items()} for k, d in state.items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a:
        for n, v in a[k].items():
            if isinstance(v, torch.Tensor):
                assert bits(v) == bits(b[k][n]), (k, n)
            else:
                assert v == b[k][n]


def test_state_changed_after_commit_returns_checks_out_as_it_was(store: ckstore.Store) -> None:
    state = _state(0)
    before = _copy(state)
    pending = store.commit(1, {0: state}, {"loss": 1.0}, tags=["a"], blocking=False)
    assert isinstance(pending, PendingCommit)
    for t in state["model_states"].values():  # training goes on, in place, at once
        t.mul_(-3).add_(1)
    state["optim_states"]["step"].add_(5)
    ck = pending.wait()
    assert pending.done() and ck.step == 1 and ck.tags == ("a",) and ck.metrics == {"loss": 1.0}
    assert pending.blocked_seconds > 0 and pending.seconds is not None
    _same(before, store.checkout(1)[0])

    # the staging buffer is reused: no fresh allocation for a state of the same size
    buf = store._async._buffers[0]._buf  # type: ignore[union-attr]
    assert buf is not None and store.staging_bytes >= sum(t.numel() * 4 for t in state["model_states"].values())
    second = _copy(state)
    p2 = store.commit(2, {0: state}, blocking=False)
    for t in state["model_states"].values():
        t.zero_()
    assert p2.wait().step == 2
    assert store._async._buffers[0]._buf is buf and len(store._async._buffers) == 1  # type: ignore[union-attr]
    _same(second, store.checkout(2)[0])
    assert store.checkout(1)[0]["model_states"]["w0"].sum() == before["model_states"]["w0"].sum()
    store.wait()  # nothing in flight, nothing failed


def _gate_writes(store: ckstore.Store) -> tuple[threading.Event, list[int]]:
    """Hold every pack write until the returned event is set; count the writes."""
    gate, writes = threading.Event(), []
    real = store.blobs.writer

    def writer(key: str, size_hint: int | None = None) -> Any:
        writes.append(1)
        assert gate.wait(60), "the test never opened the gate"
        return real(key, size_hint)

    store.blobs.writer = writer  # type: ignore[method-assign]
    return gate, writes


def test_max_inflight_commits_are_in_flight_and_the_next_waits(store: ckstore.Store) -> None:
    store.max_inflight = 2
    gate, writes = _gate_writes(store)
    states = [_state(s) for s in range(3)]
    p1 = store.commit(1, {0: states[0]}, blocking=False)
    p2 = store.commit(2, {0: states[1]}, blocking=False)
    assert not p1.done() and not p2.done()
    returned = threading.Event()
    third: list[PendingCommit] = []

    def commit_third() -> None:
        third.append(store.commit(3, {0: states[2]}, blocking=False))
        returned.set()

    t = threading.Thread(target=commit_third)
    t.start()
    assert not returned.wait(0.5), "a third commit was staged while two were in flight"
    assert len(store._async.in_flight()) == 2  # type: ignore[union-attr]
    gate.set()
    t.join(60)
    assert returned.is_set()
    assert [p.wait().step for p in (p1, p2, third[0])] == [1, 2, 3]
    assert len(store._async._buffers) == 2  # type: ignore[union-attr]
    assert [c.step for c in store.checkpoints("exp")] == [1, 2, 3]
    for i, s in enumerate(states):
        _same(s, store.checkout(i + 1)[0])


def test_background_failure_raises_on_wait_next_commit_and_close(store_path: Path) -> None:
    store = ckstore.open(store_path, run="exp", chunk_size=64 * 1024, pack_size=1024 * 1024)
    store.commit(1, {0: _state(1)})
    real = store.blobs.writer

    def read_only(key: str, size_hint: int | None = None) -> Any:
        raise PermissionError(f"read-only blob store: cannot write {key}")

    store.blobs.writer = read_only  # type: ignore[method-assign]
    p = store.commit(2, {0: _state(2)}, blocking=False)
    with pytest.raises(PermissionError, match="read-only"):
        p.wait()
    with pytest.raises(PermissionError):  # wait() raises it every time it is asked
        p.wait()
    store.wait()  # already raised by wait(): the store does not raise it again

    # a failure nobody waited for surfaces on the next commit...
    p3 = store.commit(3, {0: _state(3)}, blocking=False)
    assert p3._done.wait(60)  # failed, and nobody asked
    store.blobs.writer = real  # type: ignore[method-assign]
    with pytest.raises(PermissionError) as info:
        store.commit(4, {0: _state(4)})
    assert any("step 3" in n for n in getattr(info.value, "__notes__", []))
    ck4 = store.commit(4, {0: _state(4)})  # reported once; the store works on

    # ...and at close
    store.blobs.writer = read_only  # type: ignore[method-assign]
    store.commit(5, {0: _state(5)}, blocking=False)
    with pytest.raises(PermissionError):
        store.close()

    s = ckstore.open(store_path, run="exp")
    assert [c.step for c in s.checkpoints("exp")] == [1, 4]  # nothing half-visible
    assert s.resolve("latest").id == ck4.id
    report = s.fsck(deep=True)
    assert not report.damage and not report.pending, report
    _same(_state(1), s.checkout(1)[0])
    s.close()


def test_sigkill_during_background_write_leaves_earlier_checkpoints(tmp_path: Path) -> None:
    path = tmp_path / "store"
    s = ckstore.open(path, run="r", chunk_size=64 * 1024, pack_size=256 * 1024)
    s.commit(1, {0: _state(1)})
    s.close()
    script = f"""
        import os, signal, sys, torch, ckstore
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_async_commit import _state
        s = ckstore.open({str(path)!r}, run="r")
        real = s.blobs.writer
        def dying(key, size_hint=None):
            print("writing", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            return real(key, size_hint)
        s.blobs.writer = dying
        p = s.commit(2, {{0: _state(2, n=12)}}, blocking=False)
        print("staged", flush=True)
        p.wait()
        print("survived", flush=True)
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    out = proc.stdout.decode().split()
    assert "staged" in out and "writing" in out and "survived" not in out
    s = ckstore.open(path, run="r")
    assert [c.step for c in s.checkpoints("r")] == [1]
    _same(_state(1), s.checkout("latest")[0])
    report = s.fsck(deep=True)
    assert not report.damage, report
    s.close()


def test_async_commit_refuses_bad_arguments_at_once(store: ckstore.Store) -> None:
    with pytest.raises(ckstore.CkstoreError, match="step"):
        store.commit(-1, {0: _state(0)}, blocking=False)
    with pytest.raises(ckstore.UnsupportedValueError):
        store.commit(1, {0: {"m": {"o": object()}}}, blocking=False)
    # the slot was handed back: a good commit still goes through
    assert store.commit(1, {0: _state(0)}, blocking=False).wait().step == 1
    assert store.staging_bytes > 0


def test_interpreter_exit_waits_for_commits_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "store"
    ckstore.open(path, run="r").close()
    script = f"""
        import sys, threading, ckstore
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_async_commit import _state
        s = ckstore.open({str(path)!r}, run="r")
        gate, real = threading.Event(), s.blobs.writer
        def held(key, size_hint=None):
            gate.wait()
            return real(key, size_hint)
        s.blobs.writer = held
        s.commit(7, {{0: _state(7)}}, blocking=False)
        # the commit stays blocked until a moment after the store's exit handler started waiting
        threading.Timer(1.0, gate.set).start()
        print("leaving", flush=True)
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert "waiting for 1 checkpoint commit(s) still in flight: commit of run 'r', step 7" in proc.stderr.decode()
    s = ckstore.open(path, run="r")
    _same(_state(7), s.checkout(7)[0])
    s.close()


def test_stage_changed_copies_only_changed_tensors(store: ckstore.Store) -> None:
    state = _state(0, n=6)
    assert store.commit(1, {0: state}, blocking=False, stage="changed").wait().step == 1
    buf = store._async._buffers[0]  # type: ignore[union-attr]
    assert buf.copied == 7 + 1 and buf.kept == 0  # nothing held yet: every tensor copied (8 tensors)
    state["model_states"]["w2"].add_(1)
    snapshot = _copy(state)
    p = store.commit(2, {0: state}, blocking=False, stage="changed")
    assert (buf.copied, buf.kept) == (1, 7)  # only the changed tensor was copied
    state["model_states"]["w2"].zero_()
    state["model_states"]["w3"].zero_()  # changed after the call: must not leak into step 2
    p.wait()
    _same(snapshot, store.checkout(2)[0])
    assert store.resolve(2).stored_bytes_added < store.resolve(1).stored_bytes_added / 4
    p = store.commit(3, {0: state}, blocking=False, stage="changed")
    assert (buf.copied, buf.kept) == (2, 6)
    p.wait()
    _same(state, store.checkout(3)[0])
    with pytest.raises(ckstore.CkstoreError, match="stage"):
        store.commit(4, {0: state}, blocking=False, stage="some")


def test_a_failed_commit_keeps_no_tensor_of_its_state_and_close_frees_staging(store: ckstore.Store) -> None:
    import gc
    import weakref

    store.commit(1, {0: _state(1)})
    state = _state(2)
    held = weakref.ref(state["model_states"]["w0"])
    p = store.commit(1, {0: state}, blocking=False)  # step 1 exists: fails in the background
    with pytest.raises(ckstore.errors.AlreadyExistsError, match="step 1"):
        p.wait()
    del state
    gc.collect()
    assert held() is None, "the failed commit (or its error) still holds the caller's tensors"
    assert store.staging_bytes > 0  # kept for the next commit...
    assert store.commit(2, {0: _state(2)}, blocking=False).wait().step == 2
    store.close()
    assert store.staging_bytes == 0  # ...and let go with the store


def test_checkout_of_a_commit_still_in_flight_says_so(store: ckstore.Store) -> None:
    gate, _ = _gate_writes(store)
    p = store.commit(5, {0: _state(5)}, blocking=False)
    for call in (lambda: store.checkout(5), lambda: store.resolve("latest")):
        with pytest.raises(ckstore.errors.NotFoundError, match=r"1 asynchronous commit\(s\) in flight.*step 5.*wait"):
            call()
    gate.set()
    p.wait()
    _same(_state(5), store.checkout(5)[0])
    with pytest.raises(ckstore.errors.CheckpointNotFoundError) as info:
        store.checkout(6)
    assert "in flight" not in str(info.value)


@pytest.mark.parametrize("value", [True, 0, 2.0, "2"])
def test_max_inflight_is_checked_when_set(store: ckstore.Store, value: Any) -> None:
    with pytest.raises(ckstore.CkstoreError, match="max_inflight must be an int of at least 1"):
        store.max_inflight = value
    assert store.max_inflight == 1


def test_max_inflight_makes_buffers_as_needed_and_a_later_change_is_refused(store: ckstore.Store) -> None:
    store.max_inflight = 10**12  # a bound, not 10**12 buffers made up front
    assert store.commit(1, {0: _state(1)}, blocking=False).wait().step == 1
    assert store.commit(2, {0: _state(2)}, blocking=False).wait().step == 2
    assert len(store._async._buffers) == 1  # type: ignore[union-attr]
    with pytest.raises(ckstore.CkstoreError, match="before the first asynchronous commit"):
        store.max_inflight = 2  # would be silently ignored
    assert store.max_inflight == 10**12
