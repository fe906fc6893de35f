"""Which catalog transactions of a commit wait for the disk.

A commit's earlier transactions (pending row, claim) commit without waiting for the disk; its
final transaction, which records its chunk rows and makes the checkpoint visible, does, and so
makes the earlier ones durable with it (both SQLite's and PostgreSQL's write-ahead logs are flushed in order).
Every other write (tags, deletes, gc) waits for the disk as before. These tests ask the database
itself, from inside each transaction, whether its COMMIT will wait.

A local object's bytes start going to the disk while it is written, and are durable when it
appears: the last tests write objects through a local blob store and watch the flushes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from conformance import sample_states
from sqlalchemy import event

import ckstore
from ckstore.blobstore import _local

# what the database answers inside a transaction whose COMMIT waits for the disk, and one whose does not
_ASK = {
    "sqlite": ("PRAGMA synchronous", {2: "waits", 1: "no wait"}),  # FULL, NORMAL
    "postgresql": ("SHOW synchronous_commit", {"on": "waits", "off": "no wait"}),
}

# a statement of each step of a commit, in order, and whether its transaction's COMMIT waits
_COMMIT = [
    ("INSERT INTO checkpoints", "no wait"),  # the pending row
    ("SELECT chunks.id, chunks.digest", "no wait"),  # the claim, which records the packs too
    ("INSERT INTO chunks", "waits"),  # every pack's chunk rows, in the transaction that makes it
    ("UPDATE checkpoints SET status", "waits"),  # visible
]


def _watch(store: ckstore.Store) -> list[tuple[str, str]]:
    """Record each statement with what the database says of its transaction's COMMIT, asked on
    the same connection right after the statement ran."""
    engine = store.catalog.engine
    ask, answers = _ASK[engine.dialect.name]
    seen: list[tuple[str, str]] = []

    def after(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith(("PRAGMA", "SHOW", "BEGIN")):
            return
        cur = conn.connection.dbapi_connection.cursor()
        try:
            cur.execute(ask)
            seen.append((" ".join(statement.split()), answers[cur.fetchone()[0]]))
        finally:
            cur.close()

    event.listen(engine, "after_cursor_execute", after)
    return seen


def _when(seen: list[tuple[str, str]], prefix: str) -> str:
    found = {how for statement, how in seen if statement.startswith(prefix)}
    assert len(found) == 1, (prefix, seen)
    return found.pop()


def _check(store: ckstore.Store) -> None:
    store.commit(1, sample_states(1))  # a first commit: the run exists, the store has chunks
    seen = _watch(store)
    begun: list[object] = []

    def began(conn: object) -> None:
        begun.append(conn)

    event.listen(store.catalog.engine, "begin", began)
    store.commit(2, sample_states(2))
    event.remove(store.catalog.engine, "begin", began)
    assert [(prefix, _when(seen, prefix)) for prefix, _ in _COMMIT] == _COMMIT
    # a single process's commit: the pending row with the claim, then the chunk rows with the
    # record and the checkpoint made visible
    assert len(begun) == 2, seen
    seen.clear()
    store.tag(2, "best")  # an ordinary write: waits, also on a connection a commit left
    assert _when(seen, "INSERT INTO tags") == "waits"
    seen.clear()
    store.delete(1)
    assert {how for _, how in seen} == {"waits"}, seen
    assert [c.step for c in store.checkpoints()] == [2]


def test_a_commit_on_sqlite_waits_for_the_disk_only_to_make_its_checkpoint_visible(tmp_path: Path) -> None:
    with ckstore.open(tmp_path / "store", run="exp", chunk_size=4096, pack_size=65536) as store:
        _check(store)


@pytest.mark.postgres
def test_a_commit_on_postgresql_waits_for_the_disk_only_to_make_its_checkpoint_visible(
    tmp_path: Path, pg_catalog_url: str
) -> None:
    with ckstore.open(
        tmp_path / "store", catalog=pg_catalog_url, run="exp", chunk_size=4096, pack_size=65536
    ) as store:
        _check(store)


def _write_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mib: int) -> tuple[list[str], int]:
    """Write ``mib`` MiB (and a tail) to a local store in 256 KiB pieces and read it back; returns
    the thread of every ``fdatasync`` in order, and how many bytes' writeback the writer had
    started when the last piece was written."""
    real = os.fdatasync
    synced: list[str] = []

    def fdatasync(fd: int) -> None:
        synced.append(threading.current_thread().name)
        real(fd)

    monkeypatch.setattr(_local.os, "fdatasync", fdatasync)
    store = _local.LocalBlobStore(tmp_path / "blobs")
    data = os.urandom(mib * 2**20 + 12345)
    with store.writer("packs/ab/abcdef") as w:
        for i in range(0, len(data), 256 << 10):
            w.write(data[i : i + (256 << 10)])
        started = int(w._f.started)  # noqa: SLF001 - what the writer had started before the object was finished
    assert store.read("packs/ab/abcdef") == data
    return synced, started


def test_a_local_object_starts_going_to_the_disk_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if _local._sync_file_range() is None:  # noqa: SLF001
        pytest.skip("sync_file_range is Linux's")
    synced, started = _write_in_pieces(tmp_path, monkeypatch, 3)
    # every whole megabyte's writeback was started before the object was finished; one
    # fdatasync at the end, in the writing thread, makes it all durable
    assert started == 3 << 20
    assert synced == [threading.current_thread().name]


def test_without_sync_file_range_a_background_fdatasync_runs_while_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_local, "_sync_file_range_fn", None)
    synced, started = _write_in_pieces(tmp_path, monkeypatch, 20)
    me = threading.current_thread().name
    assert started == 0
    assert synced[-1] == me  # the last, which reports errors, in the writing thread
    assert any(name != me for name in synced[:-1]), synced  # and at least one while writing
