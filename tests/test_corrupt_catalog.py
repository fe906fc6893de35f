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
        # everything else still works: the other checkpoints, fsck (which names the damaged rows),
        # du, and best-by-metric refs, where a metric that is not a number ranks like a missing one
        assert_same(s.checkout(4), state(4))
        assert_same(s.checkout("other@1"), state(101))
        assert s.resolve("max:val_loss").ref == "exp@1"  # exp@3's 'abc' is not the largest
        with pytest.raises(ckstore.IntegrityError, match="exp@2"):  # the best one is the damaged one
            s.resolve("min:val_loss")
        rep = s.fsck(deep=True)
        assert rep.damaged_checkpoints == ["exp@2", "exp@3"]
        assert "world layout" in rep.damage[0].problem and "metric 'val_loss'" in rep.damage[1].problem
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


# a column holding a value of another type (SQLite keeps any value in any column): each case is
# (SQL, what names the checkpoint, the column named, whether listings skip the checkpoint)
WRONG_TYPES = {
    "step not an integer": (f"UPDATE checkpoints SET step = 'abc' WHERE id = {_ckpt('exp', 2)}", "exp@abc", "checkpoints.step", True),
    "created_at not a time": (
        f"UPDATE checkpoints SET created_at = 'garbage' WHERE id = {_ckpt('exp', 2)}", "exp@2", "checkpoints.created_at", True,
    ),
    "rank not an integer": (f"UPDATE entries SET rank = 'x' WHERE checkpoint_id = {_ckpt('exp', 2)}", "exp@2", "entries.rank", True),
    "chunk offset not an integer": (
        f"UPDATE chunks SET offset = 'abc' WHERE id IN (SELECT chunk_id FROM chunk_refs WHERE checkpoint_id = {_ckpt('exp', 2)})",
        "exp@2", "chunks.offset", False,
    ),
    "manifest text, not bytes": (
        f"UPDATE entries SET manifest = 'hello' WHERE checkpoint_id = {_ckpt('exp', 2)}", "exp@2", "entries.manifest", False,
    ),
    "manifest an integer": (
        f"UPDATE entries SET manifest = 1000000000000 WHERE checkpoint_id = {_ckpt('exp', 2)}", "exp@2", "entries.manifest", False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_a_value_of_another_type_is_a_clear_error_naming_checkpoint_and_column(store_path: Path, case: str) -> None:
    """Listings skip the checkpoint (or are unaffected), its checkout is an IntegrityError naming
    run, step and column, fsck reports it, and the CLI lists and checks without a bare error
    (before: ValueError or TypeError from int(), bytes() or the driver's time parser, and
    ``bytes(10**12)`` of an integer manifest)."""
    sql, ref, column, skipped = WRONG_TYPES[case]
    with ckstore.open(store_path, run="exp") as s:
        for step in (1, 2, 3):
            s.commit(step, state(step))
    assert catalog_tools.execute(store_path / "catalog.db", sql) >= 1
    with ckstore.open(store_path, run="exp") as s:
        if skipped:
            with pytest.warns(CorruptRowWarning, match=f"{ref}.*{column}"):
                assert [c.ref for c in s.checkpoints()] == ["exp@1", "exp@3"]
        else:
            assert [c.ref for c in s.checkpoints()] == ["exp@1", "exp@2", "exp@3"]
        assert {r.name: r.checkpoints for r in s.runs()} == {"exp": 3}
        assert_same(s.checkout(3), state(3))
        if ref == "exp@2":
            with pytest.raises(ckstore.IntegrityError, match=f"{ref}.*{column}"):
                s.checkout(2)
        rep = s.fsck(deep=True)
        assert not rep.ok and len(rep.damaged_checkpoints) == 1
        assert all(ref in d.describe() and column in d.describe() for d in rep.damage)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKSTORE_")}
    env["PYTHONPATH"] = str(ROOT)
    for args, status in ((["log", "exp"], 0), (["fsck"], 1)):
        out = subprocess.run(
            [sys.executable, "-m", "ckstore", "--store", str(store_path), *args],
            env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == status, out.stderr
        assert "unexpected" not in out.stderr and "Traceback" not in out.stderr
    assert ref in out.stdout and column in out.stdout
