"""Records in the blob store and rebuilding a lost catalog from them (``ckstore recover``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_same

import ckstore
from ckstore.cli import main
from ckstore.cli._durability import open_for_recovery
from ckstore.errors import IntegrityError, StoreConfigError
from ckstore.format.record import CHECKPOINTS_PREFIX, EVENTS_PREFIX, decode
from ckstore.retention import BestN, LatestN

SETTINGS = {"chunk_size": 4096, "pack_size": 64 * 1024}


def _state(seed: int, step: int) -> dict[int, dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(3000, generator=g)  # shared across steps: dedups
    return {
        0: {"model_states": {"w": base, "b": torch.full((10,), float(step)), "step": step}},
        1: {"model_states": {"w": base + step, "note": f"rank1-{step}"}},
    }


def build(path: Path, catalog: str | None = None) -> ckstore.Store:
    """A store with several runs, a fork, tags (moved and removed), a policy that gc applied, a
    deleted checkpoint and a replaced step."""
    s = ckstore.open(path, catalog=catalog, run="a", **SETTINGS)
    for step in range(1, 7):
        s.commit(step, _state(1, step), {"loss": 1.0 / step, "acc": float("nan") if step == 2 else step / 10},
                 tags=["first"] if step == 1 else (), kind="epoch" if step % 2 else "recovery")  # fmt: skip
    s.tag(3, "best")
    s.tag(5, "best", move=True)
    s.tag(4, "tmp")
    s.untag("tmp")
    s.fork("a@3", "b")
    s.commit(10, _state(2, 10), {"loss": 0.5}, run="b")
    s.commit(11, _state(2, 11), {"loss": 0.4}, run="b", tags=["keep"])
    s.commit(11, _state(3, 11), {"loss": 0.3}, run="b", replace=True, tags=["keep"])
    s.set_policy("a", LatestN(2) | BestN(1, "loss", mode="min"))
    s.set_policy("b", LatestN(5))
    s.set_policy("b", None)
    s.gc(grace=0)
    s.delete(6, run="a")
    s.commit(7, _state(1, 7), {"loss": 0.01}, run="a")
    s.commit(1, _state(4, 1), run="c")
    return s


def snapshot(s: ckstore.Store) -> dict[str, Any]:
    runs = [(r.name, r.created_at, r.checkpoints, r.latest_step, r.parent, r.logical_bytes) for r in s.runs()]
    ckpts = {c.ref: c.to_json() for c in s.checkpoints()}
    policies = {r.name: s.catalog.run_policy(r.name) for r in s.runs()}
    lineage = {r.name: s.catalog.lineage(r.name) for r in s.runs()}
    return {"runs": runs, "checkpoints": ckpts, "policies": policies, "lineage": lineage}


def states(s: ckstore.Store) -> dict[str, Any]:
    return {c.ref: s.load(c) for c in s.checkpoints()}


def drop_sqlite(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        p = path / f"catalog.db{suffix}"
        if p.exists():
            p.unlink()


def test_each_commit_writes_a_record_before_it_is_visible(store_path: Path) -> None:
    s = ckstore.open(store_path, run="a", **SETTINGS)
    ck = s.commit(1, _state(0, 1), {"loss": 2.0}, tags=["t"])
    keys = [i.key for i in s.blobs.list(CHECKPOINTS_PREFIX)]
    assert len(keys) == 1
    rec = decode(s.blobs.read(keys[0]), keys[0])
    assert rec.ident.ref == "a@1" and rec.metrics == {"loss": 2.0} and rec.tags == ("t",)  # type: ignore[union-attr]
    assert rec.committed_at == ck.committed_at and rec.ident.created_at == ck.created_at  # type: ignore[union-attr]
    assert sorted((r, k) for r, k, _, _ in rec.entries) == [(0, "model_states"), (1, "model_states")]  # type: ignore[union-attr]
    s.close()


def test_records_are_checked_on_read(store_path: Path) -> None:
    s = ckstore.open(store_path, run="a", **SETTINGS)
    s.commit(1, _state(0, 1))
    key = next(i.key for i in s.blobs.list(CHECKPOINTS_PREFIX))
    good = s.blobs.read(key)
    import zstandard

    raw = zstandard.ZstdDecompressor().decompress(good)
    for bad in (b"junk", zstandard.ZstdCompressor().compress(raw.replace(b'"version":1', b'"version":9')),
                zstandard.ZstdCompressor().compress(raw.replace(b'"a"', b'"a b"'))):  # fmt: skip
        with pytest.raises(IntegrityError):
            decode(bad, key)
    s.close()


def test_recover_after_losing_the_catalog_restores_everything(store_path: Path) -> None:
    s = build(store_path)
    before, data = snapshot(s), states(s)
    assert "a@6" not in before["checkpoints"] and "b@11" in before["checkpoints"]
    s.close()
    drop_sqlite(store_path)

    s = ckstore.open(store_path, run="a")
    assert s.runs() == []
    with pytest.raises(StoreConfigError, match="recover"):
        s.gc(grace=0)  # an empty catalog over records: gc would delete everything
    rep = s.recover()
    assert rep.ok, rep
    assert sorted(rep.restored) == sorted(before["checkpoints"]) or set(before["checkpoints"]) <= set(rep.restored)
    assert snapshot(s) == before
    for ref, st in states(s).items():
        assert_same(st, data[ref])
    again = s.recover()  # safe to run twice
    assert again.restored == () and snapshot(s) == before
    assert s.fsck(deep=True).ok
    s.close()


def test_recover_from_sqlite_into_postgresql(store_path: Path, pg_catalog_url: str) -> None:
    s = build(store_path)
    before, data = snapshot(s), states(s)
    s.close()
    r = open_for_recovery(str(store_path), pg_catalog_url)
    assert r.catalog.dialect == "postgresql" and r.runs() == []
    rep = r.recover()
    assert rep.ok, rep
    assert snapshot(r) == before
    for ref, st in states(r).items():
        assert_same(st, data[ref])
    r.close()


def test_cli_recover_moves_a_damaged_catalog_aside(store_path: Path) -> None:
    s = build(store_path)
    before = snapshot(s)
    s.close()
    drop_sqlite(store_path)
    (store_path / "catalog.db").write_bytes(b"this is not a database" * 100)
    res = CliRunner().invoke(main, ["--store", str(store_path), "recover"])
    assert res.exit_code == 0, res.output
    assert "moved it aside" in res.output and "recovered" in res.output
    assert any(p.name.startswith("catalog.db.damaged-") for p in store_path.iterdir())
    with ckstore.open(store_path) as s2:
        assert snapshot(s2) == before


def test_incomplete_checkpoints_and_bad_records_are_reported(store_path: Path) -> None:
    s = ckstore.open(store_path, run="a", **SETTINGS)
    s.commit(1, _state(0, 1))
    s.commit(2, {0: {"m": {"x": torch.randn(5000)}}})
    victim = s.catalog.chunk_locations(
        next(iter(s.manifests(s.resolve(2)).values())).digests()
    )
    pack = next(iter(victim.values())).pack_key
    s.blobs.put(EVENTS_PREFIX + "00000000000000000001-bad", b"not a record")
    s.close()
    drop_sqlite(store_path)
    os.unlink(store_path / pack)
    s = ckstore.open(store_path)
    rep = s.recover()
    assert not rep.ok
    assert [ref for ref, n in rep.incomplete] == ["a@2"]
    assert "a@2" in rep.restored  # reported, not dropped: fsck names what it lacks
    assert [k for k, _ in rep.bad_records] == [EVENTS_PREFIX + "00000000000000000001-bad"]
    assert not s.fsck().ok and "a@2" in s.fsck().damaged_checkpoints
    s.close()


def test_old_store_without_records_reports_it_and_backfills(store_path: Path) -> None:
    s = build(store_path)
    before, data = snapshot(s), states(s)
    shutil.rmtree(store_path / "records")  # as a store written before records existed
    rep = s.fsck()
    assert set(rep.records.unrecorded) == set(before["checkpoints"])  # type: ignore[union-attr]
    s.close()
    shutil.copytree(store_path, store_path.with_name("copy"))
    drop_sqlite(store_path.with_name("copy"))
    with ckstore.open(store_path.with_name("copy")) as old:
        assert old.recover().no_records

    s = ckstore.open(store_path)
    assert s.backfill_records() > 0
    assert s.fsck().records.unrecorded == ()  # type: ignore[union-attr]
    s.close()
    drop_sqlite(store_path)
    with ckstore.open(store_path) as s:
        assert s.recover().ok
        got = snapshot(s)
        # a backfill records tags as they are now and the times of the catalog
        assert got["checkpoints"] == before["checkpoints"] and got["policies"] == before["policies"]
        for ref, st in states(s).items():
            assert_same(st, data[ref])


def test_gc_deletes_records_of_dropped_checkpoints(store_path: Path) -> None:
    s = ckstore.open(store_path, run="a", **SETTINGS)
    for step in range(1, 5):
        s.commit(step, _state(0, step))
    assert len(list(s.blobs.list(CHECKPOINTS_PREFIX))) == 4
    s.gc(LatestN(1), grace=3600)
    assert len(list(s.blobs.list(CHECKPOINTS_PREFIX))) == 1
    rep = s.fsck()
    assert rep.records is not None and rep.records.ok and rep.records.unknown == ()
    s.close()


def test_recover_over_a_catalog_with_packs_in_the_trash(store_path: Path) -> None:
    """Recover rerun over a catalog whose trash holds a pack (a repack's old pack, waiting out
    the grace): every later gc failed with a raw UNIQUE-constraint error on the trash table."""
    s = ckstore.open(store_path, run="a", chunk_size=1 << 20, pack_size=1 << 20)
    for step in range(1, 4):
        s.commit(step, {0: {"m": {"frozen": torch.arange(2000.0), "w": torch.randn(30_000)}}})
    s.gc(LatestN(1), grace=0)
    keep = s.checkout(3)
    rep = s.gc(grace=3600, repack=True).repack
    assert rep is not None and rep.packs_rewritten >= 1  # the old packs are in the trash
    assert s.recover().ok
    s.gc(grace=3600)
    s.gc(grace=0)
    assert s.fsck(deep=True).ok
    assert_same(s.checkout(3), keep)
    s.close()


def test_a_delta_whose_base_is_lost_is_reported_incomplete(store_path: Path) -> None:
    """Recover reported a checkpoint of delta chunks whose base pack was lost as complete (and
    ``ok``), though no checkout of it could succeed."""
    s = ckstore.open(store_path, run="a", chunk_size=16384, pack_size=1 << 20, delta_chain=2)
    w = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    s.commit(1, {0: {"m": {"w": w}}})
    s.commit(2, {0: {"m": {"w": w + 1e-4}}})  # deltas against step 1's chunks
    first = {loc.pack_key for loc in s.catalog.chunk_locations(s.manifests(s.resolve(1))[(0, "m")].digests()).values()}
    second = s.catalog.chunk_locations(s.manifests(s.resolve(2))[(0, "m")].digests())
    assert all(loc.base is not None and loc.pack_key not in first for loc in second.values())
    s.close()
    drop_sqlite(store_path)
    for key in first:
        os.unlink(store_path / key)
    with ckstore.open(store_path) as s:
        rep = s.recover()
        assert not rep.ok and sorted(ref for ref, _ in rep.incomplete) == ["a@1", "a@2"]
        with pytest.raises(IntegrityError, match="step 2"):
            s.checkout("a@2")
