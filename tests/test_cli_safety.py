"""The command line under hostile names and failures: every user-supplied string prints as
typed (never as rich markup), and every error is one line on stderr with exit status 2, so that
``diff`` (0/1) and ``fsck`` (1) stay scriptable. Through click's runner and real processes."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckstore
from ckstore.cli import main

ROOT = Path(__file__).resolve().parent.parent

# names rich would read as markup (a closing tag with nothing open crashes it), an emoji code
HOSTILE = ["[/]", "[bold red]x", "[link=http://evil.example]click[/link]", ":smile:", "a\\", "[/bold]"]
KEYS = {f"k{i}{h}": torch.full((4,), float(i)) for i, h in enumerate(HOSTILE)}
SUB_KEY = "[/]model[bold]"
METRICS = {f"m{i}{h}": float(i) for i, h in enumerate(HOSTILE)}
# what a hostile catalog can hold where the API would refuse it
ROW_NAMES = {"run": "[bold red]run[/]", "kind": "[/]", "tag": "[link=http://evil.example]t"}


def _invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exc_info
    return res.exit_code, res.output


@pytest.fixture
def hostile_store(tmp_path: Path) -> str:
    loc = str(tmp_path / "s")
    with ckstore.open(loc, run="exp", chunk_size=64 * 1024) as store:
        layout = ckstore.WorldLayout({"[b]": 1})
        store.commit(1, {0: {SUB_KEY: dict(KEYS), "[/]values": {"[/]": "[bold]v"}}}, METRICS, world_layout=layout)
        changed = {k: v + 1 for k, v in KEYS.items()}
        store.commit(2, {0: {SUB_KEY: changed, "[/]values": {"[/]": "[red]w"}}}, METRICS, world_layout=layout)
        store.commit(3, {0: {"model": {"w": torch.ones(2)}}}, run="victim", tags=["t"])
    with sqlite3.connect(tmp_path / "s" / "catalog.db") as db:  # a hostile writer of the catalog
        db.execute("UPDATE runs SET name = ? WHERE name = 'victim'", (ROW_NAMES["run"],))
        db.execute("UPDATE checkpoints SET kind = ?", (ROW_NAMES["kind"],))
        db.execute("UPDATE tags SET name = ?", (ROW_NAMES["tag"],))
    return loc


def _printed_literally(out: str, names: list[str]) -> None:
    for name in names:
        assert name in out, f"{name!r} not printed as typed in:\n{out}"
    assert "😄" not in out


def test_show_log_diff_print_hostile_names_as_typed(hostile_store: str) -> None:
    code, out = _invoke("--store", hostile_store, "show", "exp@2")
    assert code == 0, out
    _printed_literally(out, [*KEYS, SUB_KEY, *METRICS, "[b]"])

    code, out = _invoke("--store", hostile_store, "log", "exp", "--changes")
    assert code == 0, out
    _printed_literally(out, list(METRICS))

    code, out = _invoke("--store", hostile_store, "log")
    assert code == 0, out
    _printed_literally(out, list(ROW_NAMES.values()))

    code, out = _invoke("--store", hostile_store, "diff", "exp@1", "exp@2", "--all")
    assert code == 1, out  # they differ: exit 1, not a crash
    # (diff groups a key's tensors by the module before its last "/", so only whole names here)
    _printed_literally(out, [*(k for k in KEYS if "/" not in k), SUB_KEY, *METRICS, "[/]values/[/]", "[bold]v"])
    code, out = _invoke("--store", hostile_store, "diff", "exp@2", "exp@2")
    assert code == 0, out

    for args in (["runs"], ["du"], ["du", "exp"], ["gc", "--dry-run", "--keep-last", "1"], ["policy", "show"],
                 ["du", "--checkpoints"], ["fsck"]):  # fmt: skip
        code, out = _invoke("--store", hostile_store, *args)
        assert code == 0, (args, out)
        assert "Traceback" not in out
    code, out = _invoke("--store", hostile_store, "runs")
    _printed_literally(out, [ROW_NAMES["run"]])


def test_errors_naming_hostile_strings_are_one_escaped_line(hostile_store: str) -> None:
    for args, needle in ((["show", "exp@99"], "step 99"), (["tag", "exp@1", "[/]"], "'[/]'"),
                         (["log", "[bold red]nope"], "[bold red]nope")):  # fmt: skip
        code, out = _invoke("--store", hostile_store, *args)
        assert code == 2, (args, out)
        assert out.startswith("error: ") and out.strip().count("\n") == 0, out
        assert needle in out


def test_every_error_exits_2_in_one_line(hostile_store: str, tmp_path: Path) -> None:
    # fsck finds damage: 1, and an error is 2, never 1
    pack = next(p for p in (Path(hostile_store) / "packs").rglob("*") if p.is_file())
    pack.unlink()
    code, out = _invoke("--store", hostile_store, "fsck")
    assert code == 1 and "DAMAGED" in out
    code, out = _invoke("--store", str(tmp_path / "nothing"), "fsck")
    assert code == 2 and out.strip().count("\n") == 0

    # a catalog row naming a key outside ckstore's namespaces: gc refuses it, says so, goes on
    with sqlite3.connect(Path(hostile_store) / "catalog.db") as db:
        db.execute("INSERT INTO trash (key, created_at) VALUES ('ckstore.json', '2020-01-01 00:00:00.000000')")
    code, out = _invoke("--store", hostile_store, "gc", "--grace", "0")
    assert code == 0 and "refused to delete ckstore.json" in " ".join(out.split()), out
    assert (Path(hostile_store) / "ckstore.json").exists()

    # a CkstoreError no command expects: a manifest that is not one
    with sqlite3.connect(Path(hostile_store) / "catalog.db") as db:
        db.execute("UPDATE entries SET manifest = x'00'")
    code, out = _invoke("--store", hostile_store, "show", "latest")
    assert code == 2 and "IntegrityError" in out and out.strip().count("\n") == 0, out

    # a config that is not JSON, and one that is not an object
    broken = tmp_path / "broken"
    broken.mkdir()
    for text in ("{not json", "[1, 2]"):
        (broken / "ckstore.json").write_text(text)
        code, out = _invoke("--store", str(broken), "log")
        assert code == 2 and "StoreConfigError" in out and out.strip().count("\n") == 0, out


def test_database_errors_that_escape_the_catalog_print_one_line(hostile_store: str) -> None:
    """A failure SQLAlchemy raises that ckstore does not translate (a trigger planted in the
    catalog aborts the write) still ends as one line without the SQL, exit 2."""
    with sqlite3.connect(Path(hostile_store) / "catalog.db") as db:
        db.execute(
            "CREATE TRIGGER no_tags BEFORE INSERT ON tags BEGIN "
            "SELECT RAISE(ABORT, 'planted failure'); END"
        )
    code, out = _invoke("--store", hostile_store, "tag", "exp@1", "fine")
    assert code == 2, out
    assert out.strip().count("\n") == 0 and "planted failure" in out and "INSERT" not in out, out


def test_describe_error_keeps_driver_words_and_hides_secrets() -> None:
    from sqlalchemy import create_engine, text

    from ckstore.cli._common import describe_error

    engine = create_engine("sqlite://")
    with engine.connect() as conn:
        try:
            conn.execute(text("SELECT * FROM no_such_table"))
        except Exception as e:  # noqa: BLE001 - a real SQLAlchemy error
            line = describe_error(e)
    assert line == "catalog error: OperationalError: no such table: no_such_table"
    oops = RuntimeError("first\nsecond postgresql://u:hunter2@h/db")
    line = describe_error(oops)
    assert "\n" not in line and "hunter2" not in line and line.startswith("unexpected RuntimeError: first second")
    assert describe_error(FileNotFoundError(2, "No such file", "/x")).startswith("FileNotFoundError: ")


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full.pop("CKSTORE_STORE", None)
    return subprocess.run([sys.executable, "-m", "ckstore", *args], env=full, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip


def test_a_real_process_prints_names_as_typed_and_fails_in_one_line(hostile_store: str) -> None:
    res = _cli("--store", hostile_store, "show", "exp@1")
    assert res.returncode == 0, res.stderr
    _printed_literally(res.stdout, [*KEYS, SUB_KEY])

    res = _cli("--store", hostile_store, "diff", "exp@1", "[/]@1")
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "[/]" in lines[0], res.stderr

    res = _cli("--store", hostile_store, "show", "exp@99", CKSTORE_DEBUG="1")
    assert res.returncode != 0 and "Traceback" in res.stderr  # asked for: the traceback


# -- secrets in a store's location, and what a failed or read-only command leaves behind ----------
SECRET = "hunter2-secret-value"


def test_a_location_with_credentials_is_printed_redacted(tmp_path: Path) -> None:
    """fsspec reads ``user:password@`` in a location: init, runs, log and demo print it redacted
    on success too (errors always were)."""
    loc = f"memory://ck:{SECRET}@bucket-{tmp_path.name}/store"
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    res = CliRunner().invoke(main, ["--store", loc, "init", "--catalog", catalog])
    assert res.exit_code == 0, res.output
    assert "memory://ck:***@" in res.output and SECRET not in res.output, res.output
    with ckstore.open(loc, run="exp") as store:
        store.commit(1, {0: {"model": {"w": torch.ones(2)}}})
    for args in (["runs"], ["log"], ["log", "exp"]):
        res = CliRunner().invoke(main, ["--store", loc, *args])
        assert res.exit_code == 0, (args, res.output)
        assert SECRET not in res.output, (args, res.output)
    assert "memory://ck:***@" in CliRunner().invoke(main, ["--store", loc, "runs"]).output
    res = CliRunner().invoke(main, ["--store", loc, "demo", "--steps", "2", "--commit-every", "1", "--run", "d"])
    assert res.exit_code == 0, res.output
    assert "memory://ck:***@" in res.output and SECRET not in res.output


@pytest.mark.parametrize(
    "args",
    [["log"], ["runs"], ["show"], ["du"], ["fsck"], ["gc", "--dry-run"], ["db", "current"], ["recover"]],
)
def test_read_only_commands_on_a_path_that_is_no_store_make_nothing(tmp_path: Path, args: list[str]) -> None:
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    for where in (missing, empty):
        code, out = _invoke("--store", str(where), *args)
        assert code == 2 and out.startswith("error: StoreConfigError: no ckstore store at"), (args, out)
        assert out.strip().count("\n") == 0, out
    assert not missing.exists() and list(empty.iterdir()) == []


def test_a_failed_copy_leaves_no_destination_it_made(hostile_store: str, tmp_path: Path) -> None:
    """Refs and runs are checked before the destination is made; a copy that fails later (the
    hostile catalog's kind is refused by the destination) removes the store it made, and only
    that: a folder that was there keeps what it held."""
    dest, folder = tmp_path / "dest", tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for args in (["exp@99"], ["--run", "no-such-run"], ["exp@1", "exp@99"], ["exp@1"]):
        for where in (dest, folder):
            code, out = _invoke("--store", hostile_store, "copy", *args, "--to", str(where))
            assert code == 2 and out.startswith("error: ") and out.strip().count("\n") == 0, (args, out)
        assert not dest.exists(), args
        assert [p.name for p in folder.iterdir()] == ["notes.txt"], args
    clean = str(tmp_path / "clean")
    with ckstore.open(clean, run="exp") as store:
        store.commit(1, {0: {"model": {"w": torch.ones(2)}}})
    code, out = _invoke("--store", clean, "copy", "exp@1", "--to", str(folder))
    assert code == 0 and "copied 1 checkpoints" in out, out
    with ckstore.open(folder, create=False) as copied:
        assert [c.ref for c in copied.checkpoints()] == ["exp@1"]
    assert (folder / "notes.txt").read_text() == "mine"


def test_show_refuses_ranks_the_checkpoint_lacks_and_log_a_limit_below_1(tmp_path: Path) -> None:
    loc = str(tmp_path / "s")
    with ckstore.open(loc, run="exp") as store:
        store.commit(1, {0: {"model": {"w": torch.ones(2)}}, 1: {"model": {"w": torch.zeros(2)}}})
        store.commit(2, {0: {"model": {"w": torch.ones(2)}}, 1: {"model": {"w": torch.zeros(2)}}})
    code, out = _invoke("--store", loc, "show", "exp@1", "--rank", "5")
    assert code == 2 and "[0, 1]" in out and "[5]" in out and out.strip().count("\n") == 0, out
    code, out = _invoke("--store", loc, "show", "exp@1", "--rank", "1")
    assert code == 0 and "rank 1" in out and "rank 0" not in out, out
    for bad in ("0", "-2"):
        for args in (["log", "-n", bad], ["show", "--rank", "-1"]):
            code, out = _invoke("--store", loc, *args)
            assert code == 2 and "is not in the range" in out, (args, out)
    code, out = _invoke("--store", loc, "log", "-n", "1")
    assert code == 0 and "│    2 │" in out and "│    1 │" not in out, out


def test_demo_refuses_commit_every_0_and_fewer_steps_than_commit_every(tmp_path: Path) -> None:
    where = tmp_path / "demo"
    code, out = _invoke("--store", str(where), "demo", "--commit-every", "0")
    assert code == 2 and "--commit-every" in out and "ZeroDivisionError" not in out, out
    code, out = _invoke("--store", str(where), "demo", "--steps", "3")
    assert code == 2 and "--steps 3" in out and "--commit-every 20" in out, out
    assert not where.exists()


def test_db_current_on_a_missing_store_is_one_line(tmp_path: Path) -> None:
    code, out = _invoke("--store", str(tmp_path / "nothing"), "db", "current")
    assert code == 2 and out.strip().count("\n") == 0 and "Usage:" not in out, out
    assert out.startswith("error: StoreConfigError: no ckstore store at"), out
