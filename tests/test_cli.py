"""The command line, end to end through click's runner and a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

import ckstore
from ckstore.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.output


def _row(table: str, first: str) -> list[str]:
    """The cells of the row of a rendered table whose first cell is ``first``."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").replace("┃", "│").split("│")]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{table}")


def test_init_log_show_tag(tmp_path: Path) -> None:
    loc = str(tmp_path / "s")
    code, out = _run("init", loc, "--chunk-size", "65536")
    assert code == 0 and "created store" in out
    code, out = _run("init", loc)
    assert code == 2 and "already exists" in out
    s = ckstore.open(loc, run="exp")
    s.commit(10, {0: {"model_states": {"layer.weight": torch.randn(4, 4)}}}, {"val_loss": 0.5}, tags=["first"])
    s.commit(20, {0: {"model_states": {"layer.weight": torch.randn(4, 4)}}}, {"val_loss": 0.25}, kind="epoch")

    code, out = _run("--store", loc, "runs")
    assert code == 0 and _row(out, "exp")[:3] == ["exp", "2", "20"]
    code, out = _run("--store", loc, "runs", "--json")
    assert [(r["name"], r["checkpoints"], r["latest_step"]) for r in json.loads(out)] == [("exp", 2, 20)]
    code, out = _run("--store", loc, "log", "exp")
    assert code == 0 and "val_loss" in _row(out, "step")
    assert [c for c in _row(out, "10") if c in ("checkpoint", "0.5", "first")] == ["checkpoint", "0.5", "first"]
    assert [c for c in _row(out, "20") if c in ("epoch", "0.25")] == ["epoch", "0.25"]
    code, out = _run("--store", loc, "log", "--json")
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [10, 20] and rows[1]["metrics"] == {"val_loss": 0.25}
    code, out = _run("--store", loc, "show", "exp@min:val_loss")
    assert code == 0 and "layer.weight" in out and "float32 [4, 4]" in out
    code, out = _run("--store", loc, "show", "--json", "first")
    assert json.loads(out)["checkpoint"]["step"] == 10
    code, out = _run("--store", loc, "tag", "exp@20", "best")
    assert code == 0 and "tagged exp@20 as best" in out
    assert s.resolve("best").step == 20
    code, out = _run("--store", loc, "untag", "exp@best")
    assert code == 0 and "removed tag exp@best" in out
    assert s.resolve(20).tags == ()  # the tag is gone from the catalog, the checkpoint stays
    code, out = _run("--store", loc, "show", "best")
    assert code == 2 and "no checkpoint tagged 'best'" in out
    code, out = _run("--store", loc, "show", "nosuchtag")
    assert code == 2 and "CheckpointNotFoundError" in out


def test_store_from_environment_and_missing_store(tmp_path: Path) -> None:
    loc = str(tmp_path / "s")
    ckstore.open(loc, run="e").commit(1, {0: {"m": {"w": torch.ones(1)}}})
    res = CliRunner().invoke(main, ["log", "--json"], env={"CKSTORE_STORE": loc})
    assert res.exit_code == 0, res.output
    assert [(r["run"], r["step"]) for r in json.loads(res.output)] == [("e", 1)]
    res = CliRunner().invoke(main, ["log"])
    assert res.exit_code == 2 and "--store" in res.output
    res = CliRunner().invoke(main, ["--store", str(tmp_path / "none"), "log"])
    assert res.exit_code == 2 and "no ckstore store" in res.output


def test_python_dash_m_and_demo(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ckstore", "demo", "--steps", "30", "--commit-every", "10", "--run", "t"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "resumed 10 steps from step" in proc.stdout
    assert "identical without reading a byte (model_states/embed.weight)" in proc.stdout
    s = ckstore.open(tmp_path / "ckstore-demo")
    # gc kept the last two and the best by val_loss; the fine-tune forked from the best
    kept = [c.step for c in s.checkpoints("t")]
    best = s.resolve("t@min:val_loss").step
    assert kept == sorted({20, 30, best})
    assert s.lineage("t-ft")[0].ref == f"t@{best}"
    assert s.fsck().ok
