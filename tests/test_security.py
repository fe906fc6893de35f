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

import ckstore
from ckstore.errors import CatalogError, StoreConfigError
from ckstore.urls import check_no_secret, expand_stored, redact, scrub

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
