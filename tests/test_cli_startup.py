"""Catalog-only commands start without torch or numpy: `import ckstore` and the CLI load the
tensor modules only where tensors are touched.

Each check runs in a fresh interpreter (this test process has torch loaded already) and reads that
interpreter's ``sys.modules`` after each command, so a command that pulls torch in is named. A
control command that does read tensors must show torch loaded, proving the check can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import ckstore

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numpy")

# runs CLI commands through the entry point, one after another in this one interpreter, and prints
# a JSON list of [args, exit code, heavy modules loaded so far]
_HARNESS = r"""
import json, sys
from ckstore.cli import main

heavy = tuple(sys.argv[1].split(","))
out = []
for args in json.loads(sys.argv[2]):
    try:
        main(args, prog_name="ckstore", standalone_mode=False)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    loaded = sorted(m for m in heavy if m in sys.modules)
    out.append([args, code, loaded])
print("RESULT " + json.dumps(out))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKSTORE_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_cli(commands: list[list[str]]) -> tuple[list[tuple[list[str], int, list[str]]], str]:
    proc = subprocess.run(
        [sys.executable, "-c", _HARNESS, ",".join(HEAVY), json.dumps(commands)],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return [(a, c, m) for a, c, m in json.loads(line.removeprefix("RESULT "))], proc.stderr


def _make_store(path: Path) -> str:
    s = ckstore.open(path, run="exp", chunk_size=4096)
    w = torch.randn(64, 64)
    for step in (1, 2, 3):
        w = w + 0.01 * torch.randn(64, 64)
        s.commit(step, {0: {"model_states": {"w": w, "b": torch.zeros(8), "step": step}}}, {"loss": 1.0 / step})
    s.close()
    return str(path)


def test_catalog_only_commands_never_import_torch_or_numpy(tmp_path: Path) -> None:
    loc = _make_store(tmp_path / "s")
    base = ["--store", loc]
    catalog_only = [
        ["--help"],
        [*base, "runs"],
        [*base, "log"],
        [*base, "log", "exp", "--json"],
        [*base, "show", "exp@2"],
        [*base, "show", "--json", "latest"],
        [*base, "tag", "exp@2", "best"],
        [*base, "untag", "exp@best"],
        [*base, "policy", "set", "exp", "--keep-last", "2"],
        [*base, "policy", "show"],
        [*base, "gc", "--dry-run"],
        [*base, "du"],
        [*base, "fsck"],
        [*base, "db", "current"],
        [*base, "db", "upgrade"],
        [*base, "fork", "exp@2", "branch"],
        [*base, "gc"],
        [*base, "policy", "clear", "exp"],
        [*base, "rm", "exp@2"],
    ]
    # the control, in its own interpreter: a diff of changed tensors reads and compares them
    ((_, code, loaded),), stderr = _run_cli([[*base, "diff", "exp@2", "exp@3"]])
    assert code == 1, f"the control diff compares two different checkpoints: {stderr}"
    assert loaded == ["numpy", "torch"], "the check sees a command that does read tensors"

    results, stderr = _run_cli(catalog_only)
    assert [args for args, _, _ in results] == catalog_only
    for args, code, loaded in results:
        assert code == 0, f"ckstore {' '.join(args)} exited {code}: {stderr}"
        assert loaded == [], f"ckstore {' '.join(args)} imported {loaded}"
    # what the commands did happened: gc dropped step 1 under keep-last 2, rm dropped step 2
    s = ckstore.open(loc)
    assert [c.step for c in s.checkpoints("exp")] == [3]
    assert "branch" in [r.name for r in s.runs()]
    s.close()


def test_fsck_deep_needs_numpy_but_not_torch(tmp_path: Path) -> None:
    loc = _make_store(tmp_path / "s")
    ((args, code, loaded),), stderr = _run_cli([["--store", loc, "fsck", "--deep"]])
    assert code == 0 and loaded == ["numpy"], stderr


def test_importtime_of_runs_lists_no_torch(tmp_path: Path) -> None:
    """`python -X importtime -m ckstore … runs`: the interpreter's own list of every module it
    imported, for the entry point exactly as a user starts it."""
    loc = _make_store(tmp_path / "s")
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ckstore", "--store", loc, "runs"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "exp" in proc.stdout
    imported = {
        ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")
    }
    assert "ckstore.catalog" in imported and "sqlalchemy" in imported  # the list is complete
    tops = {name.split(".")[0] for name in imported}
    assert not tops & {"torch", "numpy", "alembic"}, sorted(tops & {"torch", "numpy", "alembic"})
    # a SQLite catalog loads SQLite's dialect, not PostgreSQL's (45 ms: every DBAPI module it has)
    assert "sqlalchemy.dialects.sqlite" in imported
    assert not {m for m in imported if m.startswith("sqlalchemy.dialects.postgresql")}


def test_import_ckstore_loads_neither_torch_nor_the_catalog() -> None:
    code = (
        "import sys, ckstore\n"
        "layout = ckstore.WorldLayout({'dp': 2, 'tp': 2})\n"
        "assert isinstance(ckstore.Shard, type) and ckstore.Shard.__module__ == 'ckstore.layout'\n"
        "before = sorted(m for m in ('torch', 'numpy', 'sqlalchemy') if m in sys.modules)\n"
        "opened = ckstore.open, ckstore.Store, ckstore.init\n"
        "after = sorted(m for m in ('torch', 'numpy', 'sqlalchemy') if m in sys.modules)\n"
        "print(before, after, layout.world_size)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "['sqlalchemy']", "4"]


def test_schema_revision_constant_is_alembics_head(tmp_path: Path) -> None:
    """Opening a catalog compares its revision with SCHEMA_REVISION by plain SQL; that constant
    must be the migrations' head, or every catalog would take the slow path (or be refused)."""
    from ckstore.catalog._engine import SCHEMA_REVISION, head_revision, make_engine

    engine = make_engine(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        assert head_revision(engine) == SCHEMA_REVISION
    finally:
        engine.dispose()


def test_dtype_table_is_this_torchs_stored_dtypes() -> None:
    """Manifests are validated without torch against a table of dtype names; it must list exactly
    the dtypes this torch has and ckstore stores, with torch's element sizes."""
    from ckstore.format.dtypes import STORED_ITEMSIZES
    from ckstore.format.tensorio import dtype_name

    quantized = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
    have = {dtype_name(d): d.itemsize for d in vars(torch).values() if isinstance(d, torch.dtype) and d not in quantized}
    assert have == STORED_ITEMSIZES
