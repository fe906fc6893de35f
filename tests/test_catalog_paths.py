"""The catalog's side of commits and checkouts, on SQLite and PostgreSQL: what a commit's chunk
rows add when another commit recorded some of the same chunks first, and where a checkout finds
its chunks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from sqlalchemy import delete, event

import ckstore
from ckstore.catalog import Catalog, NewChunk, Owner
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


@pytest.mark.parametrize("n", [3, 1200])  # within one batch of rows, and over several
def test_chunks_recorded_first_by_another_commit_add_nothing(catalog: Catalog, n: int) -> None:
    first, first_owner = _begin(catalog, 1)
    second, second_owner = _begin(catalog, 2)
    (p1,) = catalog.register_packs(first, first_owner, ["packs/00/first"])
    (p2,) = catalog.register_packs(second, second_owner, ["packs/00/second"])
    # the first records chunks [0, n); the second then [n // 2, n + n // 2): half of them known
    added1, _ = catalog.record_packs(first, first_owner, [(p1, 8 + n * 10, _chunks(range(n), 10))])
    assert added1 == n * 10
    theirs = range(n // 2, n + n // 2)
    added2, facts = catalog.record_packs(second, second_owner, [(p2, 8 + n * 7, _chunks(theirs, 7))])
    assert added2 == (n + n // 2 - n) * 7  # only the chunks the first did not record
    # every chunk of the second is referenced, from wherever it was recorded first
    where = {d: key for d, key, *_ in facts.chunks}
    assert set(where) == {_digest(i) for i in theirs}
    assert {where[_digest(i)] for i in range(n // 2, n)} == {"packs/00/first"}
    assert {where[_digest(i)] for i in range(n, n + n // 2)} == {"packs/00/second"}
    # a commit recording nothing new adds nothing
    third, third_owner = _begin(catalog, 3)
    (p3,) = catalog.register_packs(third, third_owner, ["packs/00/third"])
    added3, facts3 = catalog.record_packs(third, third_owner, [(p3, 8 + n * 10, _chunks(range(n), 10))])
    assert added3 == 0 and len(facts3.chunks) == n


def test_a_whole_checkout_finds_its_chunks_in_one_query_and_a_damaged_reference_by_digest(
    store: ckstore.Store,
) -> None:
    """A checkout of every rank and sub-checkpoint reads its chunks' locations through the
    checkpoint's references, in one query; a chunk whose reference went missing (a damaged
    catalog) is still found by its digest. A checkout of one rank looks its chunks up by digest."""
    states = {r: {"model_states": {f"w{i}": torch.full((3000,), float(r * 100 + i)) for i in range(40)}} for r in (0, 1)}
    ck = store.commit(1, states)
    locating: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *_: object) -> None:
        if "packs" in statement and "chunks.raw_size" in statement:  # a locations query
            locating.append(" ".join(statement.split()))

    event.listen(store.catalog.engine, "before_cursor_execute", seen)
    out = store.checkout(1)
    assert_same(out, states)
    assert len(locating) == 1 and "chunk_refs" in locating[0], locating

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
