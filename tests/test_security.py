"""Hostile input that must never run code, leak a secret or delete outside ckstore's namespaces:
catalog URLs and the secrets in them, URLs read from a store's config, imported files, catalog
rows naming foreign keys, and gc racing a stalled writer."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from services import S3Server

import ckstore
from ckstore.errors import CatalogError, StoreConfigError
from ckstore.urls import check_no_secret, expand_given, expand_stored, redact, scrub

SECRET = "hunter2-secret-value"


# -- literal passwords, in every form -------------------------------------------------------------
LITERAL_FORMS = [
    f"postgresql+psycopg://ck:{SECRET}@db/ck",
    f"postgresql+psycopg://ck:pa/ss{SECRET}@db/ck",  # a "/" slipped past the old pattern
    f"postgresql+psycopg://ck:a@b{SECRET}@db/ck",  # a bare "@"
    f"postgresql+psycopg://ck@db/ck?password={SECRET}",
    f"postgresql+psycopg://ck@db/ck?options=-csearch_path%3Ds&password={SECRET}",
    f"postgresql+psycopg://ck@db/ck?sslpassword={SECRET}",
    f"postgresql+psycopg://ck@db/ck?PASSWORD={SECRET}",
    f"postgresql+psycopg://ck:{SECRET}${{PGPASSWORD}}@db/ck",  # not one whole reference
]


@pytest.mark.parametrize("url", LITERAL_FORMS)
def test_literal_passwords_are_refused_and_never_recorded_or_shown(tmp_path: Path, url: str) -> None:
    with pytest.raises(StoreConfigError) as e:
        ckstore.init(tmp_path / "s", catalog=url)
    assert "password" in str(e.value) and SECRET not in str(e.value)
    assert not (tmp_path / "s" / "ckstore.json").exists()
    with pytest.raises(StoreConfigError):
        check_no_secret(url)
    shown = redact(url)
    assert SECRET not in shown and "***" in shown
    assert SECRET not in scrub(f"connecting to {url} failed: timeout")


def test_references_in_the_password_are_not_secrets() -> None:
    for url in ("postgresql+psycopg://ck:${PGPASSWORD}@db/ck", "postgresql+psycopg://ck:$CKSTORE_PW@db/ck",
                "postgresql+psycopg://ck@db/ck", "sqlite:////tmp/x.db"):  # fmt: skip
        check_no_secret(url)


def test_redact_hides_query_secrets_and_keeps_the_rest() -> None:
    url = f"postgresql+psycopg://ck@db:5433/ck?options=-csearch_path%3Ds&password={SECRET}"
    shown = redact(url)
    assert shown == "postgresql+psycopg://ck@db:5433/ck?options=-csearch_path%3Ds&password=***"
    assert redact(f"postgresql://ck:{SECRET}@db/ck") == "postgresql://ck:***@db/ck"
    # not a URL SQLAlchemy parses (a bad port): masked by pattern instead of shown as given
    assert SECRET not in redact(f"postgresql://ck:{SECRET}@db:notaport/ck?password={SECRET}")
    assert scrub("s3://bucket/prefix is fine") == "s3://bucket/prefix is fine"


def test_scrub_leaves_the_punctuation_after_a_url_as_it_was() -> None:
    for before, after in (
        (f"cannot open catalog postgresql+psycopg://ck:{SECRET}@db:5432/ck?connect_timeout=2: refused",
         "cannot open catalog postgresql+psycopg://ck:***@db:5432/ck?connect_timeout=2: refused"),
        (f"at postgresql://ck:{SECRET}@db/ck, then at postgresql://ck@db/ck?password={SECRET}.",
         "at postgresql://ck:***@db/ck, then at postgresql://ck@db/ck?password=***."),
        (f"see postgresql://ck@db/ck?sslpassword={SECRET}: no; s3://bucket/x, fine",
         "see postgresql://ck@db/ck?sslpassword=***: no; s3://bucket/x, fine"),
    ):  # fmt: skip
        assert scrub(before) == after


def test_a_given_url_whose_variable_holds_url_syntax_keeps_it_in_its_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--catalog 'postgresql+psycopg://ck:${PGPASSWORD}@host/db'`` with a password holding "@",
    ":" and "/": the value lands in the password whole (it split the URL: part of it became the
    host or port, and showed in errors)."""
    from click.testing import CliRunner
    from sqlalchemy.engine import make_url

    from ckstore.cli import main

    password = f"p@ss:w/{SECRET}"
    monkeypatch.setenv("PGPASSWORD", password)
    monkeypatch.setenv("CKSTORE_DB", "ck")
    parsed = make_url(expand_given("postgresql+psycopg://ck:${PGPASSWORD}@db:5433/$CKSTORE_DB?options=-csearch_path%3Ds"))
    assert (parsed.username, parsed.password, parsed.host, parsed.port, parsed.database) == ("ck", password, "db", 5433, "ck")
    assert dict(parsed.query) == {"options": "-csearch_path=s"}
    assert expand_given("postgresql+psycopg://ck@db/ck") == "postgresql+psycopg://ck@db/ck"  # nothing to expand
    url = "postgresql+psycopg://ck:${PGPASSWORD}@127.0.0.1:1/ck?connect_timeout=2"
    res = CliRunner().invoke(main, ["--store", str(tmp_path / "s"), "init", "--catalog", url])
    assert res.exit_code == 2 and "CatalogError" in res.output and "127.0.0.1:1/ck" in res.output, res.output
    assert "p@ss" not in res.output and SECRET not in res.output and "invalid literal" not in res.output, res.output


def test_opening_an_existing_store_never_creates_its_catalog(tmp_path: Path) -> None:
    """A store's config naming a catalog that is missing (or holds no ckstore schema) is refused,
    naming both, and nothing is created there: on open with create=False or True, and on the CLI."""
    import sqlite3

    from click.testing import CliRunner

    from ckstore.cli import main

    store = tmp_path / "s"
    elsewhere, foreign = tmp_path / "elsewhere.db", tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE notes (x)")
    ckstore.init(store).close()
    cfg = json.loads((store / "ckstore.json").read_text())
    for target in (elsewhere, foreign):
        (store / "ckstore.json").write_text(json.dumps({**cfg, "catalog": f"sqlite:///{target}"}))
        for create in (False, True):
            with pytest.raises(StoreConfigError, match="never creates its catalog") as e:
                ckstore.open(store, create=create)
            assert str(target) in str(e.value) and f"store {store} " in str(e.value)
        res = CliRunner().invoke(main, ["--store", str(store), "runs"])
        assert res.exit_code == 2 and str(target) in res.output and res.output.strip().count("\n") == 0, res.output
    assert not elsewhere.exists()
    with sqlite3.connect(foreign) as db:
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("notes",)]

    # the store's own SQLite, lost: create=False refuses (pointing at recover) and makes nothing;
    # create=True (the default) makes it afresh, as Store.recover needs
    (store / "ckstore.json").write_text(json.dumps(cfg))
    for p in store.glob("catalog.db*"):
        p.unlink()
    with pytest.raises(StoreConfigError, match="recover"):
        ckstore.open(store, create=False)
    assert not list(store.glob("catalog.db*"))
    with ckstore.open(store) as s:
        assert s.runs() == []


def test_errors_of_an_unreachable_catalog_never_show_its_password(tmp_path: Path) -> None:
    ckstore.init(tmp_path / "s").close()
    for url in (f"postgresql+psycopg://ck@127.0.0.1:1/ck?connect_timeout=2&password={SECRET}",
                f"postgresql+psycopg://ck:{SECRET}@127.0.0.1:1/ck?connect_timeout=2",
                f"postgresql+psycopg://ck:{SECRET}@127.0.0.1:notaport/ck"):  # fmt: skip
        with pytest.raises(CatalogError) as e:
            ckstore.open(tmp_path / "s", catalog=url)
        assert SECRET not in str(e.value), str(e.value)
        assert "127.0.0.1" in str(e.value)


# -- URLs read from a store's config ------------------------------------------------------------
@dataclass
class RecordingServer:
    """A fake PostgreSQL server on loopback that records every byte clients send. It answers as a
    server would to draw out the most: no TLS, then a cleartext password challenge."""

    sock: socket.socket
    port: int
    received: bytearray = field(default_factory=bytearray)
    connections: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                try:
                    self._converse(conn)
                except OSError:
                    pass
            self.done.set()

    def _read(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = conn.recv(n - len(data))
            if not more:
                raise OSError("client went away")
            data += more
        self.received += data
        return data

    def _converse(self, conn: socket.socket) -> None:
        while True:  # SSL / GSS encryption requests, then the startup message
            (length,) = struct.unpack("!i", self._read(conn, 4))
            body = self._read(conn, length - 4)
            if struct.unpack("!i", body[:4])[0] in (80877103, 80877104):
                conn.sendall(b"N")
                continue
            break
        conn.sendall(b"R" + struct.pack("!ii", 8, 3))  # AuthenticationCleartextPassword
        kind = self._read(conn, 1)
        (length,) = struct.unpack("!i", self._read(conn, 4))
        self._read(conn, length - 4)
        if kind == b"p":
            err = b"SFATAL\0C28P01\0Mpassword authentication failed\0\0"
            conn.sendall(b"E" + struct.pack("!i", len(err) + 4) + err)


@pytest.fixture
def recording_server() -> Iterator[RecordingServer]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = RecordingServer(sock, sock.getsockname()[1])
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    yield server
    sock.shutdown(socket.SHUT_RDWR)  # wakes the accept()
    sock.close()
    t.join(timeout=30)
    assert not t.is_alive()


def _hostile_store(path: Path, catalog: str) -> None:
    path.mkdir(parents=True)
    (path / "tmp").mkdir()
    (path / "ckstore.json").write_text(json.dumps({"format_version": 1, "catalog": catalog}))


def test_the_recording_server_sees_a_secret_a_user_given_url_sends(
    tmp_path: Path, recording_server: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: a URL the user gives expands any variable, and the fake server records it."""
    monkeypatch.setenv("SOME_SECRET", SECRET)
    _hostile_store(tmp_path / "s", "postgresql+psycopg://nobody@127.0.0.1:1/x")
    url = f"postgresql+psycopg://ck:${{SOME_SECRET}}@127.0.0.1:{recording_server.port}/ck?sslmode=disable"
    with pytest.raises(CatalogError):
        ckstore.open(tmp_path / "s", catalog=url)
    assert recording_server.done.wait(30)
    assert SECRET.encode() in recording_server.received


HOSTILE_POSITIONS = [
    "postgresql+psycopg://ck:${{SOME_SECRET}}@127.0.0.1:{port}/ck?sslmode=disable",
    "postgresql+psycopg://ck:$SOME_SECRET@127.0.0.1:{port}/ck?sslmode=disable",
    "postgresql+psycopg://${{SOME_SECRET}}@127.0.0.1:{port}/ck?sslmode=disable",
    "postgresql+psycopg://ck@127.0.0.1:{port}/${{SOME_SECRET}}?sslmode=disable",
    "postgresql+psycopg://ck@127.0.0.1:{port}/ck?sslmode=disable&application_name=${{SOME_SECRET}}",
    "postgresql+psycopg://ck@127.0.0.1:{port}/ck?sslmode=disable&options=-c%20x%3D$SOME_SECRET",
    "postgresql+psycopg://ck@127.0.0.1:{port}/ck?sslmode=disable&password=${{SOME_SECRET}}",
    "postgresql+psycopg://ck:${{CKSTORE_OK}}@127.0.0.1:{port}/${{SOME_SECRET}}?sslmode=disable",
]


@pytest.mark.parametrize("template", HOSTILE_POSITIONS)
def test_a_url_read_from_a_store_never_sends_other_variables(
    tmp_path: Path, recording_server: RecordingServer, monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    monkeypatch.setenv("SOME_SECRET", SECRET)
    monkeypatch.setenv("CKSTORE_OK", "allowed-value")
    _hostile_store(tmp_path / "s", template.format(port=recording_server.port))
    with pytest.raises(StoreConfigError, match="--catalog") as e:
        ckstore.open(tmp_path / "s")
    assert SECRET not in str(e.value)
    assert recording_server.connections == 0 and SECRET.encode() not in recording_server.received
    # the CLI says the same in one line, exit status 2, and connects nowhere either
    from click.testing import CliRunner

    from ckstore.cli import main

    res = CliRunner().invoke(main, ["--store", str(tmp_path / "s"), "runs"])
    assert res.exit_code == 2 and "--catalog" in res.output and SECRET not in res.output
    assert res.output.strip().count("\n") == 0 and "Traceback" not in res.output
    assert recording_server.connections == 0


def test_a_url_read_from_a_store_may_name_pgpassword_or_ckstore_variables_as_its_password(
    tmp_path: Path, recording_server: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKSTORE_CATALOG_PASSWORD", "allowed-value")
    monkeypatch.setenv("SOME_SECRET", SECRET)
    url = f"postgresql+psycopg://ck:${{CKSTORE_CATALOG_PASSWORD}}@127.0.0.1:{recording_server.port}/ck?sslmode=disable"
    _hostile_store(tmp_path / "s", url)
    with pytest.raises(CatalogError) as e:  # the fake server refuses the password
        ckstore.open(tmp_path / "s")
    assert "allowed-value" not in str(e.value)
    assert recording_server.done.wait(30)
    assert b"allowed-value" in recording_server.received and SECRET.encode() not in recording_server.received
    monkeypatch.setenv("PGPASSWORD", "p@ss/w:rd")
    expanded = expand_stored("postgresql+psycopg://ck:${PGPASSWORD}@db/ck?options=-csearch_path%3Ds", "here")
    from sqlalchemy.engine import make_url

    parsed = make_url(expanded)  # a password with URL syntax in it arrives whole
    assert parsed.password == "p@ss/w:rd" and parsed.host == "db" and parsed.query["options"] == "-csearch_path=s"


def test_a_store_whose_recorded_url_is_refused_opens_with_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckstore.init(tmp_path / "s").close()
    cfg = json.loads((tmp_path / "s" / "ckstore.json").read_text())
    cfg["catalog"] = "postgresql+psycopg://ck@${SOME_SECRET}/ck"
    (tmp_path / "s" / "ckstore.json").write_text(json.dumps(cfg))
    with pytest.raises(StoreConfigError, match="SOME_SECRET in its host"):
        ckstore.open(tmp_path / "s")
    with ckstore.open(tmp_path / "s", catalog=f"sqlite:///{tmp_path / 's' / 'catalog.db'}") as store:
        assert store.runs() == []


def test_a_store_never_records_a_url_it_would_refuse_to_read(tmp_path: Path) -> None:
    for url in ("postgresql+psycopg://ck@${DBHOST}/ck", "postgresql+psycopg://ck:${AWS_SECRET_ACCESS_KEY}@db/ck"):
        with pytest.raises(StoreConfigError, match="--catalog"):
            ckstore.init(tmp_path / "s", catalog=url)
        assert not (tmp_path / "s" / "ckstore.json").exists()


# -- imports never unpickle without the trust flag ----------------------------------------------
class _Marker:
    """Unpickling this runs code: it creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({self.path!r}, 'w').close()",)


def _evil_torch_file(tmp_path: Path, marker: Path) -> Path:
    import torch

    p = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "payload": _Marker(marker)}, p)
    return p


def _evil_dcp_folder(tmp_path: Path, marker: Path) -> Path:
    """A real DCP folder whose .metadata pickle creates ``marker`` when loaded."""
    import pickle

    import torch

    from ckstore.integrations.files import write_checkpoint

    folder = tmp_path / "evil_dcp"
    write_checkpoint({"w": torch.ones(4)}, str(folder), "dcp")
    (folder / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    return folder


def test_a_malicious_torch_file_runs_nothing_without_the_flag(tmp_path: Path, store: ckstore.Store) -> None:
    from ckstore.integrations.files import import_checkpoint, read_checkpoint

    marker = tmp_path / "pwned"
    evil = _evil_torch_file(tmp_path, marker)
    for call in (lambda: read_checkpoint(str(evil)), lambda: import_checkpoint(store, str(evil), 1)):
        with pytest.raises(ckstore.UnsupportedValueError, match="allow_pickle=True") as e:
            call()
        assert "\n" not in str(e.value)
        assert not marker.exists()
    assert store.runs() == []
    read_checkpoint(str(evil), allow_pickle=True)  # the control: trusted, its pickle does run
    assert marker.exists()


def test_a_malicious_dcp_folder_runs_nothing_without_the_flag(tmp_path: Path, store: ckstore.Store) -> None:
    from ckstore.integrations.files import import_checkpoint, read_checkpoint

    marker = tmp_path / "pwned"
    evil = _evil_dcp_folder(tmp_path, marker)
    for fmt in ("auto", "dcp"):
        with pytest.raises(ckstore.UnsupportedValueError, match="allow_pickle=True") as e:
            read_checkpoint(str(evil), fmt)
        assert ".metadata" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ckstore.UnsupportedValueError, match="--allow-pickle"):
            import_checkpoint(store, str(evil), 1, fmt=fmt)
        assert not marker.exists()
    assert store.runs() == []
    with pytest.raises(ckstore.CkstoreError):  # the control: trusted, DCP's reader runs the pickle
        read_checkpoint(str(evil), allow_pickle=True)
    assert marker.exists()


def test_cli_import_refuses_pickles_in_one_line(tmp_path: Path) -> None:
    """Through a real process: exit status 2, one line naming the flag, and no code run."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    marker = tmp_path / "pwned"
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("CKSTORE_STORE", None)
    for evil in (_evil_dcp_folder(tmp_path, marker), _evil_torch_file(tmp_path, marker)):
        res = subprocess.run(
            [sys.executable, "-m", "ckstore", "--store", str(tmp_path / "s"), "import", str(evil), "--step", "1"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "--allow-pickle" in lines[0] and "Traceback" not in res.stderr, res.stderr
        assert not marker.exists()


def test_safetensors_and_damaged_files_fail_in_one_line(tmp_path: Path) -> None:
    from ckstore.integrations.files import read_checkpoint

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(StoreConfigError, match="cannot read .* as a safetensors file") as e:
        read_checkpoint(str(bad))
    assert "\n" not in str(e.value)
    torn = tmp_path / "torn.pt"
    torn.write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(StoreConfigError, match="cannot read .* as a torch.save file") as e:
        read_checkpoint(str(torn))
    assert "\n" not in str(e.value)


# -- deletes only in ckstore's own namespaces --------------------------------------------------
def _insert_trash_rows(catalog_file: Path, keys: list[str]) -> None:
    """What a hostile writer of the catalog does: plain SQL into the SQLite file."""
    import sqlite3

    with sqlite3.connect(catalog_file) as db:
        db.executemany(
            "INSERT INTO trash (key, created_at) VALUES (?, '2020-01-01 00:00:00.000000')", [(k,) for k in keys]
        )


def _assert_gc_refuses(store: ckstore.Store, foreign: str, *, also_deleted: int = 0) -> None:
    """gc deletes nothing outside ckstore's namespaces, reports the key, keeps its trash row (so a
    later gc reports it again), and still does the rest of its work."""
    report = store.gc(grace=0)
    assert report.refused == (foreign,)
    assert report.packs_deleted == also_deleted
    assert store.gc(grace=0).refused == (foreign,)


@pytest.mark.parametrize("foreign", ["ckstore.json", "catalog.db", "notes/README"])
def test_a_trash_row_naming_a_foreign_key_deletes_nothing_on_a_local_store(
    tmp_path: Path, foreign: str
) -> None:
    from helpers import assert_same, small_model_state

    path = tmp_path / "s"
    state = small_model_state()
    with ckstore.open(path, run="exp") as store:
        store.commit(1, {0: state})
        (path / "notes").mkdir()
        (path / "notes" / "README").write_text("not ckstore's")
        before = {p: p.read_bytes() for p in (path / "ckstore.json", path / "notes" / "README")}
        _insert_trash_rows(path / "catalog.db", [foreign, "packs/00/00000000000000000000000000000000"])
        _assert_gc_refuses(store, foreign, also_deleted=1)
    assert {p: p.read_bytes() for p in before} == before and (path / "catalog.db").exists()
    with ckstore.open(path) as store:
        assert_same(store.checkout("exp@1")[0], state)


def test_a_link_in_the_packs_folder_never_leads_a_delete_outside(tmp_path: Path) -> None:
    path = tmp_path / "s"
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "0123456789abcdef0123456789abcdef"
    victim.write_text("someone else's file")
    with ckstore.open(path, run="exp") as store:
        (path / "packs").mkdir(exist_ok=True)
        (path / "packs" / "01").symlink_to(outside, target_is_directory=True)
        _insert_trash_rows(path / "catalog.db", [f"packs/01/{victim.name}"])
        _assert_gc_refuses(store, f"packs/01/{victim.name}")
    assert victim.read_text() == "someone else's file"


def test_a_local_delete_refused_for_one_key_deletes_none_and_a_link_is_never_listed(tmp_path: Path) -> None:
    """Every folder of a batch is checked before the first file goes (the batch's other keys
    stay for gc to retry key by key); a batch of many keys is deleted whole, missing keys
    ignored; a listing does not follow a link to a folder outside the store."""
    from ckstore.blobstore import LocalBlobStore, NotOwnedError

    blobs = LocalBlobStore(tmp_path / "b")
    keys = [f"packs/{i:02x}/{i:032x}" for i in range(12)]
    for k in keys:
        blobs.put(k, b"pack bytes")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / ("f" * 32)
    victim.write_text("someone else's file")
    (tmp_path / "b" / "packs" / "ff").rmdir()  # made empty with its siblings by the first put
    (tmp_path / "b" / "packs" / "ff").symlink_to(outside, target_is_directory=True)
    assert sorted(i.key for i in blobs.list("packs/")) == keys
    with pytest.raises(NotOwnedError, match="outside the store's own namespaces"):
        blobs.delete([*keys[:6], f"packs/ff/{victim.name}", *keys[6:]])
    assert victim.exists() and all(blobs.exists(k) for k in keys)
    assert blobs.delete([*keys, "packs/00/" + "e" * 32]) == 13
    assert [i.key for i in blobs.list("")] == [] and victim.exists()


@pytest.mark.s3
def test_a_trash_row_naming_the_config_deletes_nothing_on_s3(tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    import boto3
    import torch

    opts = s3_server.storage_options()
    location = f"s3://{s3_bucket}/team"
    catalog_file = tmp_path / "catalog.db"
    with ckstore.open(location, catalog=f"sqlite:///{catalog_file}", run="exp", storage_options=opts) as store:
        store.commit(1, {0: {"model_states": {"w": torch.ones(8)}}})
        _insert_trash_rows(catalog_file, ["ckstore.json"])
        _assert_gc_refuses(store, "ckstore.json")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="eu-west-1",
                          aws_access_key_id=opts["key"], aws_secret_access_key=opts["secret"])  # fmt: skip
    assert client.get_object(Bucket=s3_bucket, Key="team/ckstore.json")["Body"].read()
    with ckstore.open(location, storage_options=opts) as store:
        assert store.resolve("exp@1").step == 1


# -- gc never removes a live writer's temp file ----------------------------------------------
_STALLED_COMMIT = """
import sys, torch, ckstore
store = ckstore.open(sys.argv[1], run="exp")
state = {"model_states": {"w": torch.randn(400_000, generator=torch.Generator().manual_seed(0))}}
stalled = []
def progress(done, total):
    if not stalled:  # the first chunk's frame (random floats: large, written at once) is in the open temp file
        stalled.append(1)
        print("stalled", flush=True)
        assert sys.stdin.readline().strip() == "go"
ck = store.commit(5, {0: state}, progress=progress)
print("committed", ck.step, flush=True)
"""


def test_gc_never_removes_the_temp_file_of_a_stalled_commit(tmp_path: Path) -> None:
    """A commit in another process stalls with its pack's temp file open, far past grace 0,
    while gc and fsck --repair run; it then completes, and its checkpoint reads back whole."""
    import os
    import subprocess
    import sys

    import torch

    path = tmp_path / "s"
    ckstore.init(path, chunk_size=1 << 20).close()  # frames of small chunks are gathered in memory first
    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen(
        [sys.executable, "-c", _STALLED_COMMIT, str(path)], env={**os.environ, "PYTHONPATH": str(root)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().strip()
        assert line == "stalled", (line, child.stderr.read() if child.stderr else "")
        live = sorted((path / "tmp").iterdir())
        assert len(live) == 1 and live[0].stat().st_size > 0
        # a leftover of a writer that is gone (nothing holds it): the control that the sweep runs
        leftover = path / "tmp" / "0123456789abcdef0123456789abcdef.part"
        leftover.write_bytes(b"half a pack")
        with ckstore.open(path) as store:
            report = store.fsck(grace=0)
            assert report.temp_files == (str(leftover),) and report.pending  # the live one is not stale
            assert store.gc(grace=0).temp_files_deleted == 1
            assert store.fsck(repair=True, grace=0).repaired_temp_files == 0
        assert not leftover.exists() and live[0].exists()
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert out.strip() == "committed 5"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    with ckstore.open(path) as store:
        got = store.checkout("exp@5")[0]["model_states"]["w"]
        assert torch.equal(got, torch.randn(400_000, generator=torch.Generator().manual_seed(0)))
        assert store.fsck(deep=True).ok
    assert list((path / "tmp").iterdir()) == []


def test_a_temp_file_is_locked_from_the_moment_it_exists(tmp_path: Path) -> None:
    """Within one process too: the sweep opens its own descriptor, which the writer's lock
    excludes; once the writer is done, nothing is left to sweep."""
    import time

    from ckstore.blobstore import LocalBlobStore

    blobs = LocalBlobStore(tmp_path / "b")
    with blobs.writer("packs/aa/x") as w:
        w.write(b"partial")
        held = blobs.stale_temp_files(time.time() + 60)
        assert held == []
        (temp,) = (tmp_path / "b" / "tmp").iterdir()
        assert blobs.discard_temp_files([str(temp)]) == 0 and temp.exists()
    assert blobs.read("packs/aa/x") == b"partial"
    assert list((tmp_path / "b" / "tmp").iterdir()) == []
    from ckstore.blobstore import NotOwnedError

    outside = tmp_path / "elsewhere.part"
    outside.write_bytes(b"x")
    with pytest.raises(NotOwnedError):
        blobs.discard_temp_files([str(outside)])
    assert outside.exists()
