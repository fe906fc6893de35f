"""``Store.gc(blocking=False)``: the collection runs on a thread of the store while training
commits, its failures are raised, and identical requests waiting to start are one."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import ckstore
from ckstore.maintenance.background import PendingGc
from ckstore.retention import LatestN


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model_states": {"w": torch.randn(64, 256, generator=g)}, "step": {"n": step}}


class Gate:
    """A progress callback that holds the collection at its first delete batch until opened."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, phase: str, done: int, total: int) -> None:
        self.threads.add(threading.current_thread().name)
        if phase == "delete":
            self.entered.set()
            assert self.open.wait(60), "the test never opened the gate"


@pytest.fixture
def store(tmp_path: Path) -> ckstore.Store:
    s = ckstore.open(tmp_path / "s", run="exp")
    for step in range(1, 7):
        s.commit(step, {0: state(step)})
    return s


def test_commits_go_on_while_a_background_gc_deletes(store: ckstore.Store) -> None:
    gate = Gate()
    pending = store.gc(LatestN(2), blocking=False, progress=gate)
    assert isinstance(pending, PendingGc)
    assert gate.entered.wait(60)  # the collection is deleting packs now, in its own thread
    assert not pending.done()
    store.commit(7, {0: state(7)})  # a blocking commit, and an asynchronous one, meanwhile
    store.commit(8, {0: state(8)}, blocking=False).wait()
    assert_same(store.checkout("exp@8")[0], state(8))
    gate.open.set()
    report = pending.wait(60)
    assert report.dropped == ["exp@1", "exp@2", "exp@3", "exp@4"] and report.packs_deleted > 0
    assert pending.seconds is not None and all(t.startswith("ckstore-gc") for t in gate.threads)
    assert [c.step for c in store.checkpoints()] == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert_same(store.checkout(f"exp@{step}")[0], state(step))
    assert store.fsck(deep=True).ok
    store.close()


def test_identical_requests_waiting_to_start_are_one(store: ckstore.Store) -> None:
    gate = Gate()
    running = store.gc(LatestN(5), blocking=False, progress=gate)
    assert gate.entered.wait(60)
    queued = store.gc(LatestN(3), blocking=False, progress=gate)
    assert store.gc(LatestN(3), blocking=False, progress=gate) is queued  # waits behind the running one
    other = store.gc(LatestN(3), blocking=False, progress=gate, dry_run=True)
    assert other is not queued and other is not running
    gate.open.set()
    assert running.wait(60).dropped == ["exp@1"]
    assert queued.wait(60).dropped == ["exp@2", "exp@3"]
    assert other.wait(60).dropped == []  # the queued one ran first: nothing left to drop
    assert [c.step for c in store.checkpoints()] == [4, 5, 6]
    store.close()


def test_a_failed_background_gc_is_raised_once_and_drops_nothing(store: ckstore.Store) -> None:
    store.catalog.set_run_policy("exp", "{nonsense")
    pending = store.gc(blocking=False)
    with pytest.raises(ckstore.PolicyError, match="malformed stored policy"):
        pending.wait(60)
    store.gc(blocking=False)  # the failure was raised by wait(): not again
    with pytest.raises(ckstore.PolicyError, match="malformed stored policy") as e:
        store.wait()  # ... but this one's was not
    assert "raised by a later call: this background gc of every run failed" in "\n".join(e.value.__notes__)
    store.wait()
    failing = store.gc(blocking=False)
    failing._done.wait(60)
    with pytest.raises(ckstore.PolicyError):
        store.gc(LatestN(1))  # a blocking gc raises it first, and runs nothing
    assert [c.step for c in store.checkpoints()] == [1, 2, 3, 4, 5, 6]
    store.set_policy("exp", LatestN(1))
    assert store.gc(blocking=False).wait(60).dropped == [f"exp@{s}" for s in range(1, 6)]
    store.close()


def test_bad_arguments_are_refused_in_the_call(store: ckstore.Store) -> None:
    with pytest.raises(ckstore.PolicyError, match="grace"):
        store.gc(grace=-1, blocking=False)
    with pytest.raises(ckstore.PolicyError, match="Policy"):
        store.gc("keep-last-2", blocking=False)  # type: ignore[call-overload]
    with pytest.raises(ckstore.CkstoreError, match="run"):
        store.gc(run="no/such run", blocking=False)
    with pytest.raises(ckstore.PolicyError, match="min_dead must be a fraction"):
        store.gc(repack=True, min_dead=1.5, blocking=False)
    with pytest.raises(ckstore.PolicyError, match="min_dead must be a fraction"):
        store.gc(min_dead="x", blocking=False)  # type: ignore[call-overload]
    with pytest.raises(ckstore.PolicyError, match="min_dead=0.5 applies to repacking: pass repack=True"):
        store.gc(min_dead=0.5, blocking=False)  # type: ignore[call-overload]
    assert store._gcs is None  # nothing was queued
    store.close()


def test_close_waits_for_the_collection(store: ckstore.Store, tmp_path: Path) -> None:
    gate = Gate()
    pending = store.gc(LatestN(1), blocking=False, progress=gate)
    assert gate.entered.wait(60)
    closing = threading.Thread(target=store.close)
    closing.start()
    assert not pending.done()
    gate.open.set()
    closing.join(60)
    assert not closing.is_alive() and pending.done()
    with ckstore.open(tmp_path / "s") as again:
        assert [c.step for c in again.checkpoints()] == [6]
        assert again.gc().packs_deleted == 0  # nothing left behind


def test_a_forked_child_does_not_wait_for_its_parents_collection(store: ckstore.Store) -> None:
    """A forked child (a DataLoader worker, say) inherits the store object but not its gc thread:
    its wait() returns, and a collection it asks for runs on a thread of its own."""
    import os

    gate = Gate()
    pending = store.gc(LatestN(4), blocking=False, progress=gate)
    assert gate.entered.wait(60)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if all of it works, within a minute
        import signal

        signal.alarm(60)
        try:
            store.wait()
            report = store.gc(LatestN(4), blocking=False).wait(60)
            os._exit(0 if report.dropped == [] else 3)  # the parent's transaction dropped them already
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    gate.open.set()
    assert pending.wait(60).dropped == ["exp@1", "exp@2"]
    store.close()
