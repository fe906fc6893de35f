"""Python's cyclic garbage collector is paused while a commit or a checkout builds per-tensor
objects (ckstore/_collector.py), and left as the program had it afterwards. (Pauses that nest
and overlap across threads: tests/test_stage.py.)"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import ckstore

# enough tensors that an unpaused commit or checkout collects many times (each makes several
# objects per tensor; the collector's first generation runs every 700 net allocations)
MANY = 3000


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """Collections that start while the test runs, by generation."""
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(count)
    try:
        yield seen
    finally:
        gc.callbacks.remove(count)


def _state() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((4,), float(i)) for i in range(MANY)}


def test_a_commit_and_a_checkout_of_many_tensors_collect_at_most_once(
    tmp_path: Path, collections: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paused, the collector runs no collection inside the call; at most one runs right after it,
    at the first allocation once the pause ends. Not paused (``gc.disable`` made a no-op), the
    same calls collect again and again: the counts below can fail."""
    state = _state()
    with ckstore.open(tmp_path / "store", run="exp") as store:
        store.commit(0, {0: {"warm": {"x": torch.zeros(1)}}}, run="warm-up")  # threads, connections

        def counted(call: Callable[[], object]) -> int:
            gc.collect()
            collections.clear()
            call()
            [[] for _ in range(10)]  # noqa: B018 - the first allocations after the call
            return len(collections)

        assert counted(lambda: store.commit(1, {0: {"model_states": state}})) <= 1
        assert counted(lambda: store.checkout(1)) <= 1
        assert gc.isenabled()
        out = store.checkout(1)
        assert torch.equal(out[0]["model_states"][f"t{MANY - 1}"], state[f"t{MANY - 1}"])

        monkeypatch.setattr(gc, "disable", lambda: None)
        assert counted(lambda: store.commit(2, {0: {"model_states": state}})) > 3
        assert counted(lambda: store.checkout(2)) > 3


def test_a_program_that_disabled_the_collector_keeps_it_disabled(tmp_path: Path) -> None:
    gc.disable()
    try:
        with ckstore.open(tmp_path / "store", run="exp") as store:
            store.commit(1, {0: {"model_states": _state()}})
            store.checkout(1)
            assert not gc.isenabled()
    finally:
        gc.enable()
