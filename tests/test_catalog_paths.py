"""The catalog's side of commits and checkouts, on SQLite and PostgreSQL: what a commit's chunk
rows add when another commit recorded some of the same chunks first, and where a checkout finds
its chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from sqlalchemy import delete, event

import ckstore
from ckstore.catalog import Catalog, NewChunk, Owner, RecordFacts
from ckstore.catalog._rows import CHUNK_REFS
from ckstore.layout import WorldLayout


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ckstore.Store]:
    url = None if request.param == "sqlite" else request.getfixturevalue("pg_catalog_url")
    with ckstore.open(tmp_path / "store", catalog=url, run="exp", chunk_size=4096) as s:
        yield s


@pytest.fixture
def catalog(store: ckstore.Store) -> Catalog:
    return store.catalog


def _digest(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


def _begin(cat: Catalog, step: int) -> tuple[int, Owner]:
    owner = Owner.me()
    ckpt = cat.begin_checkpoint(
        "exp", step, kind="checkpoint", replace=False, owner=owner, world_layout=WorldLayout.flat(1), lease_seconds=60
    )
    return ckpt, owner


def _chunks(ids: range, length: int) -> list[NewChunk]:
    return [NewChunk(_digest(i), 8 + k * length, length, 2 * length, 0) for k, i in enumerate(ids)]


def _finish(cat: Catalog, ckpt: int, owner: Owner, pack: int, chunks: list[NewChunk], size: int) -> tuple[int, RecordFacts]:
    """Record the pack's chunks in the transaction that makes the checkpoint visible; returns
    what that transaction handed the record (stored bytes added, facts)."""
    handed: list[tuple[int, RecordFacts]] = []

    def record(added: int, facts: RecordFacts) -> Callable[[], None]:
        handed.append((added, facts))
        return lambda: None

    ck = cat.finish_checkpoint(
        ckpt, owner, entries=[(0, "model_states", b"{}", 0)], metrics={}, tags=[], logical_bytes=0,
        replace=False, packs=[(pack, size, chunks)], record=record,
    )  # fmt: skip
    (got,) = handed
    assert ck.stored_bytes_added == got[0]
    return got


@pytest.mark.parametrize("n", [3, 1200])  # within one batch of rows, and over several
def test_chunks_recorded_first_by_another_commit_add_nothing(catalog: Catalog, n: int) -> None:
    first, first_owner = _begin(catalog, 1)
    second, second_owner = _begin(catalog, 2)
    (p1,) = catalog.register_packs(first, first_owner, ["packs/00/first"])
    (p2,) = catalog.register_packs(second, second_owner, ["packs/00/second"])
    # the first records chunks [0, n); the second then [n // 2, n + n // 2): half of them known
    added1, _ = _finish(catalog, first, first_owner, p1, _chunks(range(n), 10), 8 + n * 10)
    assert added1 == n * 10
    theirs = range(n // 2, n + n // 2)
    added2, facts = _finish(catalog, second, second_owner, p2, _chunks(theirs, 7), 8 + n * 7)
    assert added2 == (n + n // 2 - n) * 7  # only the chunks the first did not record
    # every chunk of the second is referenced, from wherever it was recorded first
    where = {d: key for d, key, *_ in facts.chunks}
    assert set(where) == {_digest(i) for i in theirs}
    assert {where[_digest(i)] for i in range(n // 2, n)} == {"packs/00/first"}
    assert {where[_digest(i)] for i in range(n, n + n // 2)} == {"packs/00/second"}
    # a commit recording nothing new adds nothing
    third, third_owner = _begin(catalog, 3)
    (p3,) = catalog.register_packs(third, third_owner, ["packs/00/third"])
    added3, facts3 = _finish(catalog, third, third_owner, p3, _chunks(range(n), 10), 8 + n * 10)
    assert added3 == 0 and len(facts3.chunks) == n


def test_a_record_takes_the_locations_of_the_chunks_its_commit_wrote_as_recorded(store: ckstore.Store) -> None:
    """A commit whose chunk rows were all its own hands its record their locations as it
    recorded them, and reads back only those of the chunks stored before (none, the first
    time): the record names the same locations, by digest, as the catalog holds."""
    from ckstore.format.record import CheckpointRecord, Identity, checkpoint_key, decode

    queries: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *_: object) -> None:
        if "chunk_refs" in statement and "chunks.raw_size" in statement:  # a record's locations
            queries.append(" ".join(statement.split()).upper())

    event.listen(store.catalog.engine, "before_cursor_execute", seen)
    g = torch.Generator().manual_seed(0)
    frozen = {f"f{i}": torch.randn(2000, generator=g) for i in range(30)}  # stored by the first commit only
    for step in range(3):
        live = {f"w{i}": torch.randn(1500, generator=g) for i in range(30)}  # new every commit
        queries.clear()
        ck = store.commit(step, {0: {"model_states": {**frozen, **live}}, 1: {"model_states": live}})
        ident = store.catalog.identity(ck.id)
        assert ident is not None
        rec = decode(store.blobs.read(checkpoint_key(Identity(*ident[0]))), "record")
        assert isinstance(rec, CheckpointRecord)
        want = store.catalog.record_facts(ck.id).chunks  # read back from the catalog, by digest
        assert [tuple(c) for c in rec.chunks] == [tuple(c) for c in want]
        assert len(rec.chunks) == 120  # two chunks of 4 KiB a tensor
        assert len(queries) == 2 and "NOT IN" in queries[0], queries  # given, then the full read above
    event.remove(store.catalog.engine, "before_cursor_execute", seen)


def test_a_whole_checkout_finds_its_chunks_in_one_query_and_a_damaged_reference_by_digest(
    store: ckstore.Store,
) -> None:
    """A checkout of every rank and sub-checkpoint reads its chunks' locations through the
    checkpoint's references, in one query, in the transaction that resolved it; a chunk whose reference went missing (a damaged
    catalog) is still found by its digest. A checkout of one rank looks its chunks up by digest."""
    states = {r: {"model_states": {f"w{i}": torch.full((3000,), float(r * 100 + i)) for i in range(40)}} for r in (0, 1)}
    ck = store.commit(1, states)
    locating: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *_: object) -> None:
        if "packs" in statement and "chunks.raw_size" in statement:  # a locations query
            locating.append(" ".join(statement.split()))

    event.listen(store.catalog.engine, "before_cursor_execute", seen)
    begun: list[object] = []

    def began(conn: object) -> None:
        begun.append(conn)

    event.listen(store.catalog.engine, "begin", began)
    out = store.checkout(1)
    assert_same(out, states)
    assert len(locating) == 1 and "chunk_refs" in locating[0], locating
    assert len(begun) == 1  # the ref, the entries and the locations: one snapshot
    event.remove(store.catalog.engine, "begin", began)

    locating.clear()
    one = store.checkout(1, ranks=[1])
    assert torch.equal(one[1]["model_states"]["w7"], states[1]["model_states"]["w7"])
    assert locating and not any("chunk_refs" in q for q in locating), locating

    # a damaged catalog: one chunk of the checkpoint lost its reference (fsck reports it); the
    # checkout still finds the chunk by its digest
    with store.catalog.engine.begin() as conn:
        victim = conn.execute(CHUNK_REFS.select().where(CHUNK_REFS.c.checkpoint_id == ck.id).limit(1)).first()
        assert victim is not None
        conn.execute(
            delete(CHUNK_REFS).where(
                CHUNK_REFS.c.checkpoint_id == victim.checkpoint_id, CHUNK_REFS.c.chunk_id == victim.chunk_id
            )
        )
    locating.clear()
    again = store.checkout(1)
    assert_same(again, states)
    assert len(locating) == 2 and "chunk_refs" not in locating[1], locating


def test_statements_run_on_the_driver_read_and_write_what_sqlalchemy_does(store: ckstore.Store) -> None:
    """The commit and checkout paths run their statements on the driver's own cursor
    (``catalog._access.execute``): parameters and result columns converted by the statement's
    types (times, bytes, NULL metrics, a list parameter, values the statement binds itself) as
    SQLAlchemy converts them, driver errors raised as SQLAlchemy's (a commit's retry depends on
    IntegrityError), and the engine's listeners seeing each statement."""
    import math
    from datetime import datetime, timezone

    from sqlalchemy import exc as sa_exc
    from sqlalchemy import select

    from ckstore.catalog._access import execute
    from ckstore.catalog._commit import _MAKE_VISIBLE, _NEW_METRICS
    from ckstore.catalog._queries import _LATEST_IN_RUN, _METRICS, _ROWS
    from ckstore.catalog._rows import CHECKPOINTS, METRICS

    store.commit(1, {0: {"model_states": {"w": torch.arange(10.0)}}}, {"loss": 0.5, "nan": math.nan})
    ck = store.commit(2, {0: {"model_states": {"w": torch.arange(12.0)}}})
    engine = store.catalog.engine
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda _c, _k, sql, *_: seen.append(sql))
    with engine.begin() as conn:
        ids = [c.id for c in store.checkpoints()]
        fast, slow = execute(conn, _ROWS, {"ids": ids}).all(), conn.execute(_ROWS, {"ids": ids}).all()
        assert [tuple(r) for r in fast] == [tuple(r) for r in slow] and len(fast) == 2
        assert isinstance(fast[0].created_at, datetime) and fast[0].run_name == "exp"
        assert sorted(map(tuple, execute(conn, _METRICS, {"ids": ids}))) == sorted(map(tuple, conn.execute(_METRICS, {"ids": ids})))
        seen.clear()
        assert execute(conn, _LATEST_IN_RUN, {"run": "exp"}).one().id == ck.id  # status and LIMIT bound by the statement
        assert len(seen) == 1 and "ORDER BY checkpoints.step DESC" in seen[0]  # listeners see driver statements
        # a time written on the driver reads back through SQLAlchemy as written
        when = datetime(2026, 1, 2, 3, 4, 5, 600700, tzinfo=timezone.utc)
        assert execute(conn, _MAKE_VISIBLE, {"ckpt": ck.id, "at": when, "logical": 7, "added": 3}).rowcount == 1
        row = conn.execute(select(CHECKPOINTS).where(CHECKPOINTS.c.id == ck.id)).one()
        assert (row.committed_at.replace(tzinfo=timezone.utc), row.logical_bytes, row.stored_bytes_added) == (when, 7, 3)
        execute(conn, _NEW_METRICS, [{"checkpoint_id": ck.id, "name": "acc", "value": None}])
        assert conn.execute(select(METRICS.c.value).where(METRICS.c.name == "acc")).scalar_one() is None
        with pytest.raises(sa_exc.IntegrityError):  # the same metric twice: the primary key
            with conn.begin_nested():
                execute(conn, _NEW_METRICS, [{"checkpoint_id": ck.id, "name": "acc", "value": 1.0}])


def test_tagging_a_checkpoint_deleted_meanwhile_names_it(store: ckstore.Store) -> None:
    """A checkpoint resolved, then deleted by another process (gc, `ckstore delete`, a commit
    replacing its step) before the tag is written: a clear `CheckpointNotFoundError` naming the
    run and step, and no tag (it was a raw foreign-key violation from the driver)."""
    store.commit(1, {0: {"model_states": {"w": torch.ones(3)}}})
    resolved = store.resolve("exp@1")
    store.delete("exp@1", force=True)
    with pytest.raises(ckstore.CheckpointNotFoundError, match="step 1 of run 'exp'"):
        store.catalog.tag(resolved, "best")
    store.commit(1, {0: {"model_states": {"w": torch.zeros(3)}}})
    with pytest.raises(ckstore.CheckpointNotFoundError, match="step 1 of run 'exp'"):
        store.catalog.tag(resolved, "best")  # the step committed again: another checkpoint
    assert store.tag("exp@1", "best").step == 1
