"""``gc --repack``: packs whose bytes are mostly dead are rewritten, safely."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_same

import ckstore
from ckstore.cli import main
from ckstore.retention import LatestN


def _state(step: int) -> dict[int, dict[str, Any]]:
    g = torch.Generator().manual_seed(step)
    return {0: {"m": {"frozen": torch.arange(2000, dtype=torch.float32), "w": torch.randn(30_000, generator=g)}}}


def _pack_bytes(s: ckstore.Store) -> int:
    return sum(i.size for i in s.blobs.list("packs/"))


def _partly_dead(path: Path) -> ckstore.Store:
    """Packs that hold a long-lived chunk beside chunks of dropped checkpoints."""
    s = ckstore.open(path, run="a", chunk_size=1 << 20, pack_size=1 << 20)
    for step in range(1, 6):
        s.commit(step, _state(step))
    s.gc(LatestN(1), grace=0)
    return s


def test_repack_rewrites_partly_dead_packs(store_path: Path) -> None:
    s = _partly_dead(store_path)
    keep = s.checkout(5)
    before = _pack_bytes(s)
    dry = s.gc(grace=0, repack=True, dry_run=True).repack
    assert dry is not None and dry.packs_rewritten >= 1 and _pack_bytes(s) == before
    rep = s.gc(grace=3600, repack=True).repack
    assert rep is not None and rep.packs_rewritten == dry.packs_rewritten and rep.chunks_moved >= 1
    assert rep.bytes_after < rep.bytes_before
    # the old packs wait out the grace period: a reader that planned earlier still finds them
    s.gc(grace=3600)
    assert _pack_bytes(s) == before + rep.bytes_after
    assert_same(s.checkout(5), keep)
    assert s.fsck(deep=True).ok
    s.close()


def test_repacked_store_shrinks_once_the_grace_has_passed(store_path: Path) -> None:
    s = _partly_dead(store_path)
    keep = s.checkout(5)
    before = _pack_bytes(s)
    rep = s.gc(grace=0, repack=True).repack
    assert rep is not None
    s.gc(grace=0)  # deletes the old packs
    assert _pack_bytes(s) == before - rep.bytes_reclaimable < before
    assert_same(s.checkout(5), keep)
    assert s.fsck(deep=True).ok
    assert s.gc(grace=0, repack=True).repack.packs_rewritten == 0  # type: ignore[union-attr]
    s.commit(6, _state(6))  # commits dedup against moved chunks
    assert_same(s.checkout(6), _state(6))
    s.close()


def test_a_repack_that_fails_before_moving_changes_nothing(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _partly_dead(store_path)
    keep = s.checkout(5)
    keys = {i.key for i in s.blobs.list("packs/")}

    def crash(*a: Any, **k: Any) -> None:
        raise KeyboardInterrupt  # as if killed between writing the new pack and moving the rows

    monkeypatch.setattr(type(s.catalog), "move_chunks", crash)
    with pytest.raises(KeyboardInterrupt):
        s.gc(grace=0, repack=True)
    monkeypatch.undo()
    assert {i.key for i in s.blobs.list("packs/")} > keys  # the new pack was written
    assert_same(s.checkout(5), keep)
    assert s.fsck(deep=True).ok
    s.gc(grace=0)  # the new pack has no chunk rows and no owner: swept
    assert {i.key for i in s.blobs.list("packs/")} == keys
    assert_same(s.checkout(5), keep)
    s.close()


def test_cli_gc_repack(store_path: Path) -> None:
    _partly_dead(store_path).close()
    res = CliRunner().invoke(main, ["--store", str(store_path), "gc", "--grace", "0", "--repack", "--min-dead", "0.3"])
    assert res.exit_code == 0, res.output
    assert "repacked 1 packs" in res.output or "repacked" in res.output
    res = CliRunner().invoke(main, ["--store", str(store_path), "gc", "--repack", "--min-dead", "1.5"])
    assert res.exit_code == 2
