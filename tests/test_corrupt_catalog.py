"""Catalog rows damaged outside ckstore (written here with plain SQL into the real SQLite file):
a listing skips the damaged checkpoint with a warning naming it, resolving it is a clear
:class:`IntegrityError`, and nothing else in the store stops working."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import catalog_tools
import pytest
import torch
from helpers import assert_same

import ckstore
from ckstore.catalog import CorruptRowWarning
from ckstore.retention import BestN

ROOT = Path(__file__).resolve().parent.parent


def state(step: int) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    return {0: {"model_states": {"w": torch.full((64,), float(step))}}}


def _ckpt(run: str, step: int) -> str:
    return f"(SELECT c.id FROM checkpoints c JOIN runs r ON r.id = c.run_id WHERE r.name = '{run}' AND c.step = {step})"


@pytest.fixture
def damaged(store_path: Path) -> Path:
    """exp@1..4 with a val_loss each, other@1; then exp@2's world layout is not JSON, exp@3's
    metric is text and run other's stored policy is not JSON."""
    with ckstore.open(store_path, run="exp") as s:
        for step, loss in ((1, 1.0), (2, 0.5), (3, 0.7), (4, 0.9)):
            s.commit(step, state(step), {"val_loss": loss})
        s.commit(1, state(101), run="other")
    db = store_path / "catalog.db"
    assert catalog_tools.execute(db, f"UPDATE checkpoints SET world_layout = '{{not json' WHERE id = {_ckpt('exp', 2)}") == 1
    assert catalog_tools.execute(db, f"UPDATE metrics SET value = 'abc' WHERE checkpoint_id = {_ckpt('exp', 3)}") == 1
    assert catalog_tools.execute(db, "UPDATE runs SET policy = '{nonsense' WHERE name = 'other'") == 1
    assert catalog_tools.scalar(db, f"SELECT typeof(value) FROM metrics WHERE checkpoint_id = {_ckpt('exp', 3)}") == "text"
    return store_path


def test_listings_skip_a_damaged_checkpoint_and_name_it(damaged: Path) -> None:
    with ckstore.open(damaged, run="exp") as s:
        with pytest.warns(CorruptRowWarning) as caught:
            listed = [c.ref for c in s.checkpoints()]
        assert listed == ["exp@1", "exp@4", "other@1"]
        messages = [str(w.message) for w in caught]
        assert len(messages) == 2
        assert "exp@2" in messages[0] and "world layout" in messages[0]
        assert "exp@3" in messages[1] and "metric 'val_loss'" in messages[1] and "'abc'" in messages[1]
        with pytest.warns(CorruptRowWarning):
            assert [c.step for c in s.checkpoints("exp")] == [1, 4]
        runs = {r.name: r for r in s.runs()}  # counts come from the rows that are intact enough
        assert (runs["exp"].checkpoints, runs["exp"].latest_step, runs["other"].checkpoints) == (4, 4, 1)


def test_resolving_a_damaged_checkpoint_names_run_and_step(damaged: Path) -> None:
    with ckstore.open(damaged, run="exp") as s:
        with pytest.raises(ckstore.IntegrityError, match=r"checkpoint exp@2 are corrupt \(world layout '\{not json'"):
            s.resolve(2)
        with pytest.raises(ckstore.IntegrityError, match=r"checkpoint exp@3 are corrupt \(metric 'val_loss'"):
            s.checkout(3)
        # everything else still works: the other checkpoints, fsck, du, and best-by-metric refs,
        # where a metric that is not a number ranks like a missing one
        assert_same(s.checkout(4), state(4))
        assert_same(s.checkout("other@1"), state(101))
        assert s.resolve("max:val_loss").ref == "exp@1"  # exp@3's 'abc' is not the largest
        with pytest.raises(ckstore.IntegrityError, match="exp@2"):  # the best one is the damaged one
            s.resolve("min:val_loss")
        assert s.fsck(deep=True).ok
        assert [u.name for u in s.du().checkpoints] == ["exp@1", "exp@2", "exp@3", "exp@4", "other@1"]


def test_damaged_rows_never_make_gc_drop_or_fail_silently(damaged: Path) -> None:
    with ckstore.open(damaged, run="exp") as s:
        # a metric that is not a number ranks like a missing one: kept, and reported as such
        dry = s.gc(BestN(1, "val_loss"), run="exp", dry_run=True)
        assert dry.dropped == ["exp@1"]
        assert dry.runs[0].unranked == ((3, ("val_loss",)),)
        # a malformed stored policy stops gc with an error naming the run and the fix
        with pytest.raises(ckstore.PolicyError, match="run 'other' has a malformed stored policy.*policy clear other"):
            s.gc()
        with pytest.raises(ckstore.PolicyError, match="run 'other' has a malformed stored policy"):
            s.policy("other")
        with pytest.warns(CorruptRowWarning):
            assert len(s.checkpoints()) == 3  # nothing was dropped


def test_the_cli_lists_around_a_damaged_checkpoint(damaged: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKSTORE_")}
    env["PYTHONPATH"] = str(ROOT)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ckstore", "--store", str(damaged), *args],
            env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip

    log = cli("log", "exp")
    assert log.returncode == 0, log.stderr
    assert "exp@2" in log.stderr and "exp@3" in log.stderr and "corrupt" in log.stderr
    show = cli("show", "exp@2")
    assert show.returncode == 2 and "IntegrityError" in show.stderr and "exp@2" in show.stderr
    assert "Traceback" not in show.stderr
