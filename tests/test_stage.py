"""The commit's data path (ckstore/commit/_stage.py): the garbage collector's pause around the
per-tensor work, which must always leave the collector as the caller had it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ckstore
from ckstore import _collector
from ckstore.commit import _stage
from ckstore.errors import UnsupportedValueError


@pytest.fixture
def collector() -> Iterator[None]:
    """Restore the collector's state after the test."""
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_flattening_runs_with_the_collector_paused_and_restores_it(collector: None) -> None:
    seen: list[bool] = []

    def hook(x: Any) -> None:  # asked about the Parameter (not a plain torch.Tensor)
        seen.append(gc.isenabled())

    state = {0: {"m": {"p": torch.nn.Parameter(torch.ones(2))}}}
    gc.enable()
    _stage.prepare_entries(state, allow_pickle=False, tensor_hook=hook)
    assert seen == [False] and gc.isenabled()

    with pytest.raises(UnsupportedValueError):  # a refused state restores it too
        _stage.prepare_entries({0: {"m": {"o": object()}}}, allow_pickle=False, tensor_hook=hook)
    assert gc.isenabled()

    gc.disable()  # a collector the caller turned off stays off
    _stage.prepare_entries(state, allow_pickle=False, tensor_hook=hook)
    assert not gc.isenabled()


def test_overlapping_pauses_enable_the_collector_when_the_last_ends(collector: None) -> None:
    pause = _collector._CollectorPause()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with pause():
            inside.set()
            release.wait(30)

    gc.enable()
    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(30)
        with pause():
            with pause():  # nested
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread's pause still holds
    finally:
        release.set()
        t.join(30)
    assert gc.isenabled()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "staged"])
def test_a_commit_leaves_the_collector_as_it_found_it(store: ckstore.Store, collector: None, blocking: bool) -> None:
    state = {"w": torch.randn(64, 8), "n": {f"t{i}": torch.ones(3) * i for i in range(50)}}
    for step, enabled in enumerate((True, False, True)):
        if enabled:
            gc.enable()
        else:
            gc.disable()
        if blocking:
            store.commit(step, {0: {"m": state}})
        else:
            store.commit(step, {0: {"m": state}}, blocking=False).wait()
        assert gc.isenabled() is enabled
        with pytest.raises(UnsupportedValueError):  # refused at once, asynchronous or not
            store.commit(step + 10, {0: {"m": {"bad": object()}}}, blocking=blocking)  # type: ignore[call-overload]
        assert gc.isenabled() is enabled
