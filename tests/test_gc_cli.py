"""`ckstore gc`, `policy`, `du`, `rm` and `fsck` through click's runner."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner

import ckstore
from ckstore.cli import main


def _run(loc: Path, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["--store", str(loc), *args], catch_exceptions=False)
    return res.exit_code, res.output


def _fill(loc: Path) -> None:
    s = ckstore.open(loc, run="exp", chunk_size=64 * 1024, pack_size=1024 * 1024)
    shared = torch.arange(50_000, dtype=torch.float32)
    for step in range(1, 9):
        g = torch.Generator().manual_seed(step)
        s.commit(
            step, {0: {"model_states": {"shared": shared, "w": torch.randn(64, 256, generator=g)}}},
            {"val_loss": abs(step - 4) + 0.1} if step != 6 else {}, kind="epoch" if step % 4 == 0 else "recovery",
            tags=["first"] if step == 1 else [],
        )  # fmt: skip
    s.commit(1, {0: {"m": {"w": torch.ones(3)}}}, run="other")
    s.close()


def test_gc_dry_run_then_real_run(tmp_path: Path) -> None:
    loc = tmp_path / "s"
    _fill(loc)
    flags = [
        "--run",
        "exp",
        "--keep-last",
        "1",
        "--keep-best",
        "1:val_loss:min",
        "--keep-kind",
        "epoch:all",
    ]
    code, dry = _run(loc, "gc", "--dry-run", *flags)
    assert code == 0, dry
    assert "dry run" in dry and "would drop 5: steps 1, 2, 3, 5, 7" in dry
    assert "kept without val_loss" in dry and "steps 6" in dry
    code, out = _run(loc, "gc", "--json", *flags)
    rep = json.loads(out)
    assert (
        rep["dropped"] == ["exp@1", "exp@2", "exp@3", "exp@5", "exp@7"] and rep["chunks_freed"] > 0
    )
    assert [k["step"] for k in rep["runs"][0]["kept"]] == [4, 6, 8]
    assert [c.step for c in ckstore.open(loc).checkpoints("exp")] == [4, 6, 8]
    code, out = _run(loc, "gc")  # no stored policy: everything stays
    assert (
        code == 0
        and "no retention policy, keeps all 3 checkpoints" in out
        and "dropped 0 checkpoints" in out
    )


def test_policy_set_show_clear_and_gc_uses_it(tmp_path: Path) -> None:
    loc = tmp_path / "s"
    _fill(loc)
    code, out = _run(
        loc, "policy", "set", "exp", "--keep-last", "2", "--keep-tagged", "--keep-within", "0s"
    )
    assert code == 0 and "last 2 + within 0s + tagged" in out
    code, out = _run(loc, "policy", "show")
    assert (
        "exp: last 2 + within 0s + tagged" in out and "other: (no policy: keeps everything)" in out
    )
    code, out = _run(loc, "policy", "show", "exp", "--json")
    assert json.loads(out)["exp"]["rule"] == "any_of"
    code, out = _run(loc, "gc")
    assert (
        code == 0
        and "policy last 2 + within 0s + tagged (stored)" in out
        and "dropped 5 checkpoints" in out
    )
    assert [c.step for c in ckstore.open(loc).checkpoints("exp")] == [1, 7, 8]
    code, out = _run(loc, "policy", "clear", "exp")
    assert code == 0 and ckstore.open(loc).policy("exp") is None
    code, out = _run(loc, "policy", "set", "exp")
    assert code == 2 and "at least one --keep-* rule" in out


def test_bad_rules_and_unknown_runs_are_clear_errors(tmp_path: Path) -> None:
    loc = tmp_path / "s"
    _fill(loc)
    code, out = _run(loc, "gc", "--keep-best", "3:val_loss:avg")
    assert code == 2 and "PolicyError" in out and "'min' or 'max'" in out
    code, out = _run(loc, "gc", "--keep-kind", "recovery")
    assert code == 2 and "KIND:N" in out
    code, out = _run(loc, "gc", "--grace", "soon")
    assert code == 2 and "invalid duration" in out
    code, out = _run(loc, "gc", "--min-dead", "0.3")  # was ignored without --repack
    assert code == 2 and "PolicyError" in out and "(--repack)" in out, out
    code, out = _run(loc, "gc", "--run", "nope", "--keep-last", "1")
    assert code == 2 and "no run named 'nope'" in out
    code, out = _run(loc, "policy", "show", "nope")
    assert code == 2 and "no run named 'nope'" in out


def test_du_rm_and_fsck(tmp_path: Path) -> None:
    loc = tmp_path / "s"
    _fill(loc)
    code, out = _run(loc, "du")
    assert (
        code == 0
        and "exp" in out
        and "other" in out
        and "freed if dropped" in out
        and "(all)" in out
    )
    code, out = _run(loc, "du", "exp")
    assert code == 0 and "exp@8" in out
    code, out = _run(loc, "du", "--json")
    rep = json.loads(out)
    assert {r["name"] for r in rep["runs"]} == {"exp", "other"} and len(rep["checkpoints"]) == 9
    code, out = _run(loc, "rm", "exp@first")
    assert code == 2 and "ProtectedCheckpointError" in out and "--force" in out
    code, out = _run(loc, "rm", "exp@2")
    assert code == 0 and "deleted exp@2" in out and "next `ckstore gc`" in out
    code, out = _run(loc, "rm", "exp@first", "--force", "--sweep")
    assert code == 0 and "swept: freed" in out
    assert [c.step for c in ckstore.open(loc).checkpoints("exp")] == [3, 4, 5, 6, 7, 8]
    code, out = _run(loc, "fsck", "--deep")
    assert code == 0 and "ok" in out and "intact" in out
