"""`ckstore diff`, `ckstore fork` and `ckstore log --changes` through click's runner and a real
subprocess."""

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


def _make(loc: str) -> None:
    """base@1 → base@2 changes one layer; ft forks from base@1, freezes the embedding, retypes
    the head, and adds an adapter."""
    s = ckstore.open(loc, run="base", chunk_size=64 * 1024, pack_size=1024 * 1024)
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(256, 128, generator=g)
    l0 = torch.randn(64, 128, generator=g)
    head = torch.randn(10, 64, generator=g)

    def model(
        l0w: torch.Tensor, headw: torch.Tensor, **extra: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        return {
            "embed.weight": embed,
            "layers.0.weight": l0w,
            "layers.0.bias": torch.zeros(64),
            "head.weight": headw,
            **extra,
        }

    s.commit(1, {0: {"model_states": model(l0, head), "meta": {"lr": 0.1}}}, {"val_loss": 2.0})
    s.commit(
        2, {0: {"model_states": model(l0 * 1.01, head), "meta": {"lr": 0.1}}}, {"val_loss": 1.5}
    )
    s.fork("base@1", "ft")
    s.commit(
        2,
        {0: {"model_states": model(l0 + 0.5, head.bfloat16(), **{"adapter.weight": torch.ones(4, 64)}), "meta": {"lr": 0.01}}},
        {"val_loss": 1.2},
        run="ft",
    )  # fmt: skip
    s.commit(
        3,
        {
            0: {
                "model_states": model(
                    l0 + 0.5, head.bfloat16(), **{"adapter.weight": torch.ones(4, 64) * 2}
                ),
                "meta": {"lr": 0.01},
            }
        },
        run="ft",
    )
    s.close()


def test_diff_table_and_exit_statuses(tmp_path: Path) -> None:
    loc = str(tmp_path / "s")
    _make(loc)
    code, out = _run("--store", loc, "diff", "base@1", "ft@2")
    assert code == 1, out
    assert "diff base@1 → ft@2" in out and "val_loss" in out
    assert "model_states/layers.0" in out and ".weight" in out
    assert "float32 → bfloat16" in out
    assert "identical: 2 tensors" in out and "model_states/embed" in out
    assert "+ model_states/adapter.weight" in out and "meta/lr" in out
    assert "checkpoints differ" in out
    # largest change first: the retyped head before the shifted layer
    assert out.index("model_states/head") < out.index("model_states/layers.0")

    code, out = _run("--store", loc, "diff", "base@1", "base@1")
    assert code == 0 and "checkpoints are identical" in out
    code, out = _run("--store", loc, "diff", "base@1", "ft@2", "--key", "model_states/embed.*")
    assert code == 0, out
    code, out = _run("--store", loc, "diff", "base", "nosuch")
    assert code == 2 and "names no run and no tag" in out
    code, out = _run("--store", loc, "diff", "base", "ft", "--no-stats", "--tolerance", "0.1")
    assert code == 2 and "tolerance" in out
    code, out = _run("--store", loc, "diff", "base@1")
    assert code == 2  # usage error


def test_diff_json_parses_back(tmp_path: Path) -> None:
    loc = str(tmp_path / "s")
    _make(loc)
    code, out = _run("--store", loc, "diff", "--json", "base", "ft")  # bare run names: latest
    assert code == 1
    doc = json.loads(out)
    assert (doc["a"]["ref"], doc["b"]["ref"]) == ("base@2", "ft@3")
    assert doc["identical"] is False and doc["b"]["parent"] is None
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["model_states/embed.weight"]["status"] == "identical"
    assert tensors["model_states/embed.weight"]["read_bytes"] == 0
    head = tensors["model_states/head.weight"]
    assert (
        head["dtype"] == ["float32", "bfloat16"]
        and head["dtype_changed"]
        and head["stats"]["numel"] == 640
    )
    assert tensors["model_states/layers.0.weight"]["stats"]["frac_changed"] == 1.0
    assert [x["key"] for x in doc["only_in_b"]] == ["model_states/adapter.weight"]
    assert doc["values"] == [{"key": "meta/lr", "rank": None, "a": 0.1, "b": 0.01}]
    assert doc["metrics"]["val_loss"] == {"a": 1.5, "b": None}
    assert doc["summary"]["tensors_changed"] == 2 and doc["sharing"]["shared_chunks"] > 0

    code, out = _run(
        "--store", loc, "diff", "--json", "--no-stats", "--sub-key", "meta", "ft@2", "ft@3"
    )
    assert code == 0 and json.loads(out)["identical"] is True


def test_fork_runs_and_log_changes(tmp_path: Path) -> None:
    loc = str(tmp_path / "s")
    _make(loc)
    code, out = _run("--store", loc, "fork", "ft@3", "ft2")
    assert code == 0 and "run ft2 starts from ft@3" in out
    code, out = _run("--store", loc, "fork", "base@2", "ft")
    assert code == 2 and "AlreadyExistsError" in out
    code, out = _run("--store", loc, "runs", "--json")
    assert {r["name"]: r["parent"] for r in json.loads(out)} == {
        "base": None,
        "ft": "base@1",
        "ft2": "ft@3",
    }
    code, out = _run("--store", loc, "runs")
    assert "base@1" in out and "ft@3" in out

    code, out = _run("--store", loc, "log", "ft", "--changes")
    assert code == 0, out
    assert "run ft forked from base@1" in out
    assert "tensors changed" in out
    assert "2 of 4 +1 -0" in out  # vs base@1: the layer and the head; the adapter is new
    assert "1 of 5" in out  # ft@3: only the adapter
    code, out = _run("--store", loc, "log", "--changes", "--json", "-n", "1", "ft")
    (row,) = json.loads(out)
    assert row["step"] == 3 and row["changes"]["previous"] == "ft@2"
    assert row["changes"]["changed"] == ["model_states/adapter.weight"]
    code, out = _run("--store", loc, "log", "--changes", "base")
    assert code == 0 and "1 of 4" in out
    code, out = _run("--store", loc, "log")
    assert "run ft forked from base@1" in out


def test_diff_in_a_subprocess(tmp_path: Path) -> None:
    loc = str(tmp_path / "s")
    _make(loc)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ckstore", "--store", loc, "diff", "ft@2", "ft@3", "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert [t["key"] for t in json.loads(proc.stdout)["tensors"] if t["status"] == "changed"] == [
        "model_states/adapter.weight"
    ]


def test_json_of_a_metric_with_no_value_is_strict(tmp_path: Path) -> None:
    """A metric recorded as NaN (no value) is null in diff, log and show --json, as in the record."""
    loc = str(tmp_path / "s")
    s = ckstore.open(loc, run="n")
    s.commit(1, {0: {"m": {"w": torch.ones(2)}}}, {"loss": float("nan"), "acc": 0.5})
    s.commit(2, {0: {"m": {"w": torch.zeros(2)}}}, {"loss": 1.0})
    s.close()

    def refuse(name: str) -> None:
        raise AssertionError(f"non-strict JSON constant {name}")

    code, out = _run("--store", loc, "diff", "--json", "n@1", "n@2")
    doc = json.loads(out, parse_constant=refuse)
    assert code == 1 and doc["a"]["metrics"] == {"acc": 0.5, "loss": None}
    assert doc["metrics"]["loss"] == {"a": None, "b": 1.0}
    code, out = _run("--store", loc, "log", "--json", "n")
    rows = json.loads(out, parse_constant=refuse)
    assert code == 0 and {r["step"]: r["metrics"]["loss"] for r in rows} == {1: None, 2: 1.0}
    code, out = _run("--store", loc, "show", "--json", "n@1")
    assert (
        code == 0
        and json.loads(out, parse_constant=refuse)["checkpoint"]["metrics"]["loss"] is None
    )
