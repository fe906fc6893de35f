"""The catalog's side of a commit, on SQLite and PostgreSQL: what a commit's chunk rows add when
another commit recorded some of the same chunks first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import ckstore
from ckstore.catalog import Catalog, NewChunk, Owner
from ckstore.layout import WorldLayout


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Catalog]:
    url = None if request.param == "sqlite" else request.getfixturevalue("pg_catalog_url")
    with ckstore.open(tmp_path / "store", catalog=url, run="exp") as store:
        yield store.catalog


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
