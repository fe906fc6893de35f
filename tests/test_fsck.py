"""fsck against blobs deleted, truncated and corrupted by hand; repair; the CLI's exit status."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import catalog_tools
import pytest
import torch
from click.testing import CliRunner

import ckstore
from ckstore.catalog import Owner
from ckstore.cli import main
from ckstore.layout import WorldLayout

SHARED = torch.arange(100_000, dtype=torch.float32)


def rank_state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {
        "model_states": {"emb": SHARED, "layer.w": torch.randn(96, 256, generator=g)},
        "optim_states": {"exp_avg": torch.randn(64, 128, generator=g)},
    }


@pytest.fixture
def filled(store: ckstore.Store) -> ckstore.Store:
    for step in (1, 2, 3):
        store.commit(step, {r: rank_state(step, r) for r in (0, 1)})
    return store


Use = tuple[str, int, str, str, str]  # ref, rank, sub_key, tensor path, chunk digest


def uses(s: ckstore.Store) -> dict[Use, Any]:
    """Every chunk use of every checkpoint, with the chunk's location (computed without fsck)."""
    out = {}
    for ck in s.checkpoints():
        for (rank, key), man in s.manifests(ck).items():
            locs = s.catalog.chunk_locations([d for t in man.tensors for d in t.chunks])
            for t in man.tensors:
                for d in t.chunks:
                    out[(ck.ref, rank, key, t.path, d.hex())] = locs[d]
    return out


def found(rep: Any) -> set[Use]:
    return {(d.ref, d.rank, d.sub_key, d.path, d.chunk) for d in rep.damage}


def pack_of(s: ckstore.Store, ref: str, rank: int, key: str, path: str) -> Any:
    return next(loc for u, loc in uses(s).items() if u[:4] == (ref, rank, key, path))


def test_a_deleted_pack_names_every_checkpoint_rank_key_and_chunk_it_breaks(
    filled: ckstore.Store, store_path: Path
) -> None:
    assert filled.fsck().ok and filled.fsck(deep=True).ok
    before = uses(filled)
    victim = pack_of(filled, "exp@2", 1, "model_states", "layer.w").pack_key
    os.unlink(store_path / victim)
    expected = {u for u, loc in before.items() if loc.pack_key == victim}
    assert any(u[0] == "exp@2" and u[1] == 1 for u in expected)

    for deep in (False, True):
        rep = filled.fsck(deep=deep)
        assert not rep.ok
        assert found(rep) == expected
        assert all(d.pack == victim and "missing" in d.problem for d in rep.damage)
        assert set(rep.damaged_checkpoints) == {u[0] for u in expected}

    res = CliRunner().invoke(main, ["--store", str(store_path), "fsck"])
    assert res.exit_code == 1
    assert (
        "DAMAGED" in res.output
        and "exp@2" in res.output
        and "rank 1 model_states layer.w chunk" in res.output
    )
    # repair never touches what a checkpoint references, even when it is damaged
    rep = filled.fsck(repair=True)
    assert found(rep) == expected and not rep.repaired_orphans


def test_a_truncated_pack_breaks_only_the_chunks_past_the_cut(
    filled: ckstore.Store, store_path: Path
) -> None:
    before = uses(filled)
    loc = pack_of(filled, "exp@3", 0, "optim_states", "exp_avg")
    cut = loc.offset + 1
    with open(store_path / loc.pack_key, "r+b") as f:
        f.truncate(cut)
    expected = {
        u for u, l in before.items() if l.pack_key == loc.pack_key and l.offset + l.length > cut
    }
    assert any(u[:4] == ("exp@3", 0, "optim_states", "exp_avg") for u in expected)
    assert len(expected) < sum(1 for l in before.values() if l.pack_key == loc.pack_key)
    rep = filled.fsck()
    assert found(rep) == expected
    assert all("shorter" in d.problem for d in rep.damage)


def test_corrupt_bytes_are_found_by_a_deep_check(filled: ckstore.Store, store_path: Path) -> None:
    before = uses(filled)
    target = ("exp@1", 1, "model_states", "layer.w")
    digest, loc = next((u[4], l) for u, l in before.items() if u[:4] == target)
    with open(store_path / loc.pack_key, "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert filled.fsck().ok  # sizes are right: only reading finds it
    rep = filled.fsck(deep=True)
    assert found(rep) == {u for u in before if u[4] == digest}
    assert target + (digest,) in found(rep)
    res = CliRunner().invoke(main, ["--store", str(store_path), "fsck", "--deep", "--json"])
    assert res.exit_code == 1 and '"damaged_checkpoints": [\n    "exp@1"\n  ]' in res.output
    with pytest.raises(ckstore.IntegrityError):
        filled.checkout(1)


def test_a_missing_reference_is_catalog_damage(filled: ckstore.Store) -> None:
    ck = filled.resolve(2)
    digest = filled.manifests(ck)[(1, "optim_states")].tensors[0].chunks[0]
    catalog_tools.delete_chunk_ref(filled.catalog, ck.id, digest)
    rep = filled.fsck()
    assert found(rep) == {("exp@2", 1, "optim_states", "exp_avg", digest.hex())}
    assert "no reference" in rep.damage[0].problem


def test_repair_removes_only_orphans_and_abandoned_commits(
    filled: ckstore.Store, store_path: Path
) -> None:
    old = time.time() - 7200
    filled.blobs.put("packs/ff/orphan", b"o" * 50)
    os.utime(store_path / "packs/ff/orphan", (old, old))
    (store_path / "tmp" / "x.part").write_bytes(b"p")
    os.utime(store_path / "tmp" / "x.part", (old, old))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = Owner(socket.gethostname(), proc.pid, "1", "n")
    filled.catalog.begin_checkpoint(
        "exp",
        4,
        kind="checkpoint",
        replace=False,
        owner=dead,
        world_layout=WorldLayout.flat(1),
        lease_seconds=60,
    )
    live = Owner.me()
    filled.catalog.begin_checkpoint(
        "exp",
        5,
        kind="checkpoint",
        replace=False,
        owner=live,
        world_layout=WorldLayout.flat(1),
        lease_seconds=60,
    )
    rep = filled.fsck()
    assert rep.ok and rep.orphans == (("packs/ff/orphan", 50),) and len(rep.temp_files) == 1
    assert {(p.step, p.abandoned is not None) for p in rep.pending} == {(4, True), (5, False)}
    res = CliRunner().invoke(main, ["--store", str(store_path), "fsck", "--repair"])
    assert res.exit_code == 0, res.output
    assert "deleted 1 orphans and 1 temp files, removed 1 abandoned commits" in res.output
    rep = filled.fsck()
    assert (
        rep.ok and not rep.orphans and not rep.temp_files and [p.step for p in rep.pending] == [5]
    )
    assert filled.fsck(deep=True).ok
    for step in (1, 2, 3):
        filled.checkout(step)


# -- catalog rows and pack indexes damaged outside ckstore -----------------------------------------


def _db(store_path: Path) -> Path:
    return store_path / "catalog.db"


def test_a_deep_check_refuses_a_negative_offset_that_reads_back_the_right_frame(
    filled: ckstore.Store, store_path: Path
) -> None:
    """An offset counted back from the pack's end slices out the very frame, which decodes and
    matches its digest: only the bounds checkout applies tell it is damage."""
    loc = pack_of(filled, "exp@1", 1, "model_states", "layer.w")
    size = (store_path / loc.pack_key).stat().st_size
    n = catalog_tools.execute(
        _db(store_path), "UPDATE chunks SET offset = :neg WHERE offset = :offset AND pack_id = (SELECT id FROM packs WHERE key = :key)",
        neg=loc.offset - size, offset=loc.offset, key=loc.pack_key,
    )  # fmt: skip
    assert n == 1
    rep = filled.fsck(deep=True)
    assert "exp@1" in rep.damaged_checkpoints
    assert any(f"at byte {loc.offset - size} of pack {loc.pack_key}" in d.problem for d in rep.damage)
    with pytest.raises(ckstore.IntegrityError, match=f"at byte {loc.offset - size}"):
        filled.checkout(1)


def test_a_damaged_world_layout_row_is_reported(filled: ckstore.Store, store_path: Path) -> None:
    assert catalog_tools.execute(_db(store_path), "UPDATE checkpoints SET world_layout = '{not json' WHERE step = 2") == 1
    rep = filled.fsck()
    assert rep.damaged_checkpoints == ["exp@2"]
    assert "world layout" in rep.damage[0].problem and rep.damage[0].describe().startswith("exp@2: ")
    res = CliRunner().invoke(main, ["--store", str(store_path), "fsck"])
    assert res.exit_code == 1 and "exp@2" in res.output and "world layout" in res.output


@pytest.mark.parametrize("key", ["../../etc/passwd", "packs/../../x", "", "ckstore.json"])
def test_a_malformed_pack_key_is_damage_and_the_check_goes_on(filled: ckstore.Store, store_path: Path, key: str) -> None:
    """A pack key the blob store refuses (it stopped fsck with a BlobStoreError), or one outside
    packs/ that checkout never reads (fsck called it intact), is damage of every chunk in it;
    the other packs are still checked."""
    victim = pack_of(filled, "exp@2", 1, "model_states", "layer.w").pack_key
    assert catalog_tools.execute(_db(store_path), "UPDATE packs SET key = :key WHERE key = :old", key=key, old=victim) == 1
    flipped = pack_of(filled, "exp@3", 0, "optim_states", "exp_avg")
    assert flipped.pack_key != victim
    with open(store_path / flipped.pack_key, "r+b") as f:
        f.seek(flipped.offset + flipped.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    for deep in (False, True):
        rep = filled.fsck(deep=deep)
        assert "exp@2" in rep.damaged_checkpoints
        assert any(repr(key) in d.problem and d.ref == "exp@2" for d in rep.damage)
        assert ("exp@3" in rep.damaged_checkpoints) == deep  # the corrupt byte elsewhere is still found


def _index_entry_at(data: bytes, i: int) -> int:
    count = int.from_bytes(data[-8:-4], "little")
    return len(data) - 8 - 32 * count + 32 * i


@pytest.mark.parametrize("damage", ["header magic", "footer magic", "index digest", "index offset"])
def test_a_deep_check_compares_the_pack_index_with_the_catalog(
    filled: ckstore.Store, store_path: Path, damage: str
) -> None:
    """Every frame still decodes and matches its digest: only the pack's header and index, which
    ``ckstore recover`` rebuilds a catalog from, are damaged."""
    loc = pack_of(filled, "exp@1", 0, "optim_states", "exp_avg")
    p = store_path / loc.pack_key
    data = bytearray(p.read_bytes())
    if damage == "header magic":
        data[:4] = b"XXXX"
    elif damage == "footer magic":
        data[-1:] = b"X"
    elif damage == "index digest":
        data[_index_entry_at(bytes(data), 0)] ^= 0xFF
    else:  # entry 0's offset one byte further (still within the frames)
        at = _index_entry_at(bytes(data), 0) + 16
        data[at : at + 8] = (int.from_bytes(data[at : at + 8], "little") + 1).to_bytes(8, "little")
    p.write_bytes(bytes(data))
    assert filled.fsck().ok  # sizes are right: only reading the pack finds it
    for step in (1, 2, 3):
        filled.checkout(step)  # the frames are intact
    rep = filled.fsck(deep=True)
    assert not rep.ok and "exp@1" in rep.damaged_checkpoints
    assert all(d.pack == loc.pack_key and "index" in d.problem for d in rep.damage)
