"""Lineage: forking runs from checkpoints, parents of first commits, chains of ancestors."""

from __future__ import annotations

import pytest
import torch

import ckstore
from ckstore.errors import AlreadyExistsError, CheckpointNotFoundError, NotFoundError


def _w(x: float) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    return {0: {"model_states": {"w": torch.full((4, 4), x)}}}


def test_fork_sets_parent_of_first_commit_only(store: ckstore.Store) -> None:
    store.commit(100, _w(1.0), run="base")
    store.commit(200, _w(2.0), run="base")
    point = store.fork("base@100", "ft")
    assert point.ref == "base@100"
    assert store.fork("base@100", "ft").id == point.id  # forking again is a no-op
    first = store.commit(101, _w(1.5), run="ft")
    second = store.commit(102, _w(1.6), run="ft")
    assert first.parent == "base@100" and second.parent is None
    assert [(a.ref, a.checkpoint.id if a.checkpoint else None) for a in store.lineage("ft")] == [
        ("base@100", point.id)
    ]
    assert store.lineage("base") == []
    assert {r.name: r.parent for r in store.runs()} == {"base": None, "ft": "base@100"}

    # a fork of a fork: the chain goes back to the root
    store.fork("ft", "ft2")  # a bare run name forks from its latest checkpoint
    assert store.commit(1, _w(3.0), run="ft2").parent == "ft@102"
    assert [a.ref for a in store.lineage("ft2")] == ["ft@102", "base@100"]

    # the store's default run
    assert [a.ref for a in ckstore.open(store.location, run="ft2").lineage()] == [
        "ft@102",
        "base@100",
    ]


def test_fork_errors(store: ckstore.Store) -> None:
    store.commit(1, _w(1.0), run="base")
    store.commit(1, _w(1.0), run="other")
    with pytest.raises(AlreadyExistsError, match="already exists"):
        store.fork("base@1", "other")
    store.fork("base@1", "ft")
    with pytest.raises(AlreadyExistsError, match="forked from base@1"):
        store.fork("other@1", "ft")
    with pytest.raises(AlreadyExistsError, match="its own checkpoint"):
        store.fork("base@1", "base")
    with pytest.raises(CheckpointNotFoundError):
        store.fork("base@7", "x")
    with pytest.raises(CheckpointNotFoundError, match="no run and no tag"):
        store.fork("nosuch", "x")
    with pytest.raises(NotFoundError, match="no run named"):
        store.lineage("nosuch")
    with pytest.raises(ckstore.InvalidRefError):
        store.fork("base@1", "bad name")


def test_first_commit_naming_a_parent_records_the_origin(store: ckstore.Store) -> None:
    store.commit(10, _w(1.0), run="base")
    store.commit(20, _w(2.0), run="base")
    c = store.commit(0, _w(1.0), run="ft", parent="base@10")
    assert c.parent == "base@10"
    assert [a.ref for a in store.lineage("ft")] == ["base@10"]
    # later commits naming a parent do not rewrite where the run came from
    store.commit(1, _w(1.0), run="ft", parent="base@20")
    assert [a.ref for a in store.lineage("ft")] == ["base@10"]
    # an explicit parent wins over the fork point
    store.fork("base@10", "ft2")
    assert store.commit(0, _w(1.0), run="ft2", parent="base@20").parent == "base@20"
    assert [a.ref for a in store.lineage("ft2")] == ["base@10"]


def test_deleted_fork_point_stays_as_history(store: ckstore.Store) -> None:
    store.commit(10, _w(1.0), run="base")
    point = store.fork("base@10", "ft")
    store.catalog.delete_checkpoint(point.id)
    # the first commit of the fork cannot descend from a checkpoint that is gone
    assert store.commit(1, _w(1.0), run="ft").parent is None
    (anc,) = store.lineage("ft")
    assert anc.ref == "base@10" and anc.checkpoint is None


def test_runs_named_by_digits_are_runs_in_diff_and_fork(store: ckstore.Store) -> None:
    """A bare name is a run when a run of that name exists, digits included; else a ref."""
    store.commit(5, _w(1.0), run="2024")
    store.commit(6, _w(2.0), run="2025")
    store.commit(2024, _w(3.0))  # the default run, exp, has a step 2024 too
    store.commit(2026, _w(3.0))
    res = store.diff("2024", "2025")
    assert (res.a.ref, res.b.ref) == ("2024@5", "2025@6") and res.differs
    assert store.fork("2024", "ft").ref == "2024@5"
    assert store.commit(1, _w(1.0), run="ft").parent == "2024@5"
    # no run of that name: a step of the default run, as before; an int is always a step
    assert store.diff("exp@2024", "2026").b.ref == "exp@2026"
    assert store.diff(2024, "exp@2024").a.ref == "exp@2024"
    assert store.diff("exp@2024", "2025").b.ref == "2025@6"
    with pytest.raises(CheckpointNotFoundError):
        store.diff("2024", "7")  # no run 7, no step 7 of exp
