"""Sharding metadata and the read planner: pure planning tests first (no I/O: manifests are built
in memory and plans are run by a tiny executor here), then single-process end-to-end reshards
through a real store, counting the bytes read from the blob store."""

from __future__ import annotations

import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_same, bits, expected_piece, random_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckstore
from ckstore import LayoutError, Shard, WorldLayout
from ckstore.checkout.readplan import ReadPlan, touches_box
from ckstore.checkout.reshard import PieceInfo, plan_checkout, resolve_shards, target_box
from ckstore.commit._stage import (
    build_manifests,
    prepare_entries,
    resolve_entry_shards,
    stage_and_hash,
)
from ckstore.format.manifest import Manifest, ShardSpec
from ckstore.format.tensorio import dtype_from_name, itemsize, unflatten
from ckstore.layout import chunk_range

POOL = ThreadPoolExecutor(2)


# -- in-memory saving and a tiny plan executor -------------------------------------------------


def save(rank_states: dict[int, dict[str, Any]], layout: WorldLayout, chunk_size: int):
    """What a commit would record: manifests by (rank, sub_key), and chunk bytes by digest."""
    entries = prepare_entries(rank_states, allow_pickle=False)
    specs = resolve_entry_shards(entries, layout)
    staged = stage_and_hash(entries, specs, chunk_size, POOL)
    chunks = {}
    for s in staged:
        for i, d in enumerate(s.digests):
            chunks[d] = bytes(s.chunk(i, chunk_size))
    mans = {(r, k): Manifest.from_bytes(m) for r, k, m, _ in build_manifests(entries, staged, chunk_size)}
    return mans, chunks


def sizes_of(mans) -> dict[str, int]:
    return {t.dtype: itemsize(dtype_from_name(t.dtype)) for m in mans.values() for t in m.tensors}


def plan(mans, source, target, ranks=None, fallback=None) -> ReadPlan:
    return plan_checkout(mans, source, target, ranks, sizes_of(mans), fallback=fallback)


def run_plan(p: ReadPlan, chunks: dict[bytes, bytes]) -> dict[int, dict[str, Any]]:
    """Execute a plan in memory; unfilled bytes keep random garbage so gaps show up."""
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in p.buffers]
    for c in p.copies:
        raw = chunks[c.digest]
        assert len(raw) == c.raw_size
        bufs[c.buffer][c.dst_offset : c.dst_offset + c.src_stop - c.src_start] = np.frombuffer(
            raw[c.src_start : c.src_stop], dtype=np.uint8
        )

    def tensor(i: int) -> torch.Tensor:
        b = p.buffers[i]
        dt = dtype_from_name(b.dtype)
        if b.nbytes == 0:
            return torch.empty(b.shape, dtype=dt)
        return torch.from_numpy(bufs[i]).view(dt).reshape(b.shape)

    for bx in p.boxes:
        tensor(bx.dst)[tuple(slice(*r) for r in bx.dst_box)] = tensor(bx.src)[tuple(slice(*r) for r in bx.src_box)]
    out: dict[int, dict[str, Any]] = {}
    for e in p.entries:
        out.setdefault(e.rank, {})[e.sub_key] = unflatten(e.tree, lambda i, e=e: tensor(e.buffers[i]).clone())
    return out


# -- layout basics ---------------------------------------------------------------------------------


def test_chunk_range_is_torch_chunk() -> None:
    for n in range(13):
        for k in range(1, 7):
            parts = torch.chunk(torch.arange(n), k) if n else ()
            for i in range(k):
                a, b = chunk_range(n, k, i)
                want = parts[i].tolist() if i < len(parts) else []
                assert list(range(a, b)) == want, (n, k, i)


def test_world_layout_coords_row_major() -> None:
    lay = WorldLayout({"pp": 2, "dp": 3, "tp": 2})
    assert lay.world_size == 12
    assert lay.coords(7) == {"pp": 1, "dp": 0, "tp": 1}
    assert [lay.rank(lay.coords(r)) for r in range(12)] == list(range(12))
    assert WorldLayout.single().world_size == 1 and WorldLayout.single().coords(0) == {}
    with pytest.raises(LayoutError, match="rank 12 is outside"):
        lay.coords(12)
    with pytest.raises(LayoutError, match="appears twice"):
        WorldLayout((("dp", 2), ("dp", 2)))


def test_shard_rejects_bad_declarations() -> None:
    with pytest.raises(LayoutError, match="0-d"):
        Shard(torch.tensor(1.0), "tp")
    with pytest.raises(LayoutError, match="out of range"):
        Shard(torch.zeros(2, 3), "tp", dim=2)
    with pytest.raises(LayoutError, match="together"):
        Shard(torch.zeros(4), "dp", offsets=(0,))
    with pytest.raises(LayoutError, match="does not fit"):
        Shard(torch.zeros(4), "dp", offsets=(7,), global_shape=(10,))
    with pytest.raises(LayoutError, match="twice"):
        Shard(torch.zeros(4, 4), ("tp", "tp"), dim=(0, 1))



def test_shard_refuses_what_a_manifest_cannot_hold(store: ckstore.Store) -> None:
    """A placement a manifest cannot record is refused when declared, not written and then found
    corrupt at checkout; integers of numpy or a torch.Size are taken as ints."""
    t = torch.arange(6.0)
    for bad in ((1.5,), (True,), ("0",)):
        with pytest.raises(LayoutError, match="offsets"):
            Shard(t, "dp", offsets=bad, global_shape=(10,))
    with pytest.raises(LayoutError, match="global_shape"):
        Shard(t, "dp", offsets=(0,), global_shape=(10.0,))
    with pytest.raises(LayoutError, match="torch.Tensor"):
        Shard(np.arange(6), "dp")
    with pytest.raises(LayoutError, match="mesh dim"):
        Shard(t, None)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="tensor dim"):
        Shard(t, "dp", dim="0")  # type: ignore[arg-type]
    ok = Shard(t, "dp", offsets=(np.int64(4),), global_shape=torch.Size([10]))
    rest = Shard(torch.arange(6.0, 10.0), "dp", offsets=(0,), global_shape=(10,))
    assert ok.offsets == (4,) and type(ok.offsets[0]) is int and type(ok.global_shape[0]) is int
    store.commit(1, {0: {"m": {"w": rest}}, 1: {"m": {"w": ok}}}, world_layout=WorldLayout({"dp": 2}))
    full = store.checkout(1, world_layout=WorldLayout.single())[0]["m"]["w"]
    assert bits(full) == bits(torch.cat([torch.arange(6.0, 10.0), t]))


def test_target_box_nests_mesh_dims_like_dtensor() -> None:
    spec = ShardSpec((11, 6), (0, 0), ((0, "dp"), (0, "tp"), (1, "cp")))
    lay = WorldLayout({"dp": 2, "cp": 3, "tp": 2})
    g = torch.arange(66).reshape(11, 6)
    for r in range(lay.world_size):
        c = lay.coords(r)
        box = target_box(spec, lay, c)
        got = g[tuple(slice(a, b) for a, b in box)]
        assert torch.equal(got, expected_piece(g, spec.splits, lay, c)), c
    # a mesh dim the target lacks counts as size 1
    assert target_box(spec, WorldLayout({"tp": 4}), {"tp": 3}) == ((9, 11), (0, 6))


def test_touches_box_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        shape = tuple(int(x) for x in rng.integers(1, 5, rng.integers(1, 4)))
        box = []
        for n in shape:
            a = int(rng.integers(0, n))
            box.append((a, int(rng.integers(a + 1, n + 1))))
        item = int(rng.choice([1, 2, 4]))
        total = math.prod(shape) * item
        lo = int(rng.integers(0, total))
        hi = int(rng.integers(lo + 1, total + 1))
        inside = np.zeros(shape, dtype=bool)
        inside[tuple(slice(a, b) for a, b in box)] = True
        per_byte = np.repeat(inside.reshape(-1), item)
        assert touches_box(lo, hi, shape, tuple(box), item) == bool(per_byte[lo:hi].any())


# -- resolving shard declarations ----------------------------------------------------------------


def test_even_split_global_shape_is_derived_from_every_rank() -> None:
    lay = WorldLayout({"dp": 2, "tp": 2})
    pieces = [
        PieceInfo(r, "m", "w", (3 + lay.coords(r)["tp"], 5), ((0, "tp"),), None, None) for r in range(4)
    ]
    specs = resolve_shards(lay, pieces)
    assert specs[(0, "m", "w")] == ShardSpec((7, 5), (0, 0), ((0, "tp"),))
    assert specs[(3, "m", "w")] == ShardSpec((7, 5), (3, 0), ((0, "tp"),))
    # a missing rank makes derivation impossible, and the error names it
    with pytest.raises(LayoutError, match="rank 3 has no piece"):
        resolve_shards(lay, pieces[:3])
    # replicas that disagree on their size
    bad = pieces[:3] + [PieceInfo(3, "m", "w", (9, 5), ((0, "tp"),), None, None)]
    with pytest.raises(LayoutError, match="different global shapes"):
        resolve_shards(lay, bad)
    with pytest.raises(LayoutError, match="does not have"):
        resolve_shards(WorldLayout({"dp": 4}), pieces)


def test_two_mesh_dims_on_one_tensor_dim_nest_in_mesh_order() -> None:
    lay = WorldLayout({"dp": 2, "tp": 3})
    # declared in the other order: nesting follows the mesh, as in DTensor
    pieces = [PieceInfo(r, "m", "w", (2,), ((0, "tp"), (0, "dp")), None, None) for r in range(6)]
    specs = resolve_shards(lay, pieces)
    assert [specs[(r, "m", "w")].offsets for r in range(6)] == [(0,), (2,), (4,), (6,), (8,), (10,)]
    assert specs[(0, "m", "w")].splits == ((0, "dp"), (0, "tp"))


def test_explicit_offsets_must_agree() -> None:
    lay = WorldLayout({"dp": 2})
    ok = [PieceInfo(r, "o", "f", (3,), ((0, "dp"),), (3 * r,), (6,)) for r in range(2)]
    assert resolve_shards(lay, ok)[(1, "o", "f")].offsets == (3,)
    with pytest.raises(LayoutError, match="disagree on the global shape"):
        resolve_shards(lay, [ok[0], PieceInfo(1, "o", "f", (3,), ((0, "dp"),), (3,), (7,))])
    with pytest.raises(LayoutError, match="explicit offsets and others"):
        resolve_shards(lay, [ok[0], PieceInfo(1, "o", "f", (3,), ((0, "dp"),), None, None)])



def test_pieces_must_tile_the_global_tensor() -> None:
    """Pieces that overlap or leave a gap are refused when committed, not when checked out."""
    lay = WorldLayout({"dp": 2})

    def flat(*parts: tuple[int, int]) -> list[PieceInfo]:
        return [PieceInfo(r, "o", "f", (b - a,), ((0, "dp"),), (a,), (10,)) for r, (a, b) in enumerate(parts)]

    with pytest.raises(LayoutError, match=r"rank 1's piece of shape \[6\] at \[4\] overlap"):
        resolve_shards(lay, flat((0, 6), (4, 10)))
    with pytest.raises(LayoutError, match="cover only 8 of its 10 elements"):
        resolve_shards(lay, flat((0, 4), (6, 10)))
    with pytest.raises(LayoutError, match="cover only 5 of its 10 elements"):
        resolve_shards(lay, flat((0, 5))[:1])
    # replicas (same offsets and shape) are one piece; empty pieces anywhere are fine
    resolve_shards(lay, flat((0, 10), (0, 10)))
    resolve_shards(WorldLayout({"dp": 3}), flat((0, 4), (4, 10), (10, 10)))
    # an even split whose dp lines cut the tensor at different places
    grid = WorldLayout({"dp": 2, "tp": 2})
    cuts = {0: 3, 1: 3, 2: 4, 3: 2}
    with pytest.raises(LayoutError, match="overlap"):
        resolve_shards(grid, [PieceInfo(r, "m", "w", (cuts[r],), ((0, "tp"),), None, None) for r in range(4)])
    # ranks that disagree on the dtype of one tensor
    typed = [PieceInfo(r, "m", "w", (3,), ((0, "dp"),), None, None, dt) for r, dt in enumerate(("float32", "float64"))]
    with pytest.raises(LayoutError, match="dtypes"):
        resolve_shards(lay, typed)


def test_a_commit_refuses_pieces_that_do_not_tile(store: ckstore.Store) -> None:
    g = torch.arange(10.0)
    lay = WorldLayout({"dp": 2})

    def at(a: int, b: int) -> Shard:
        return Shard(g[a:b].clone(), "dp", offsets=(a,), global_shape=(10,))

    with pytest.raises(LayoutError, match="overlap"):
        store.commit(1, {0: {"m": {"w": at(0, 6)}}, 1: {"m": {"w": at(4, 10)}}}, world_layout=lay)
    with pytest.raises(LayoutError, match="cover only 8"):
        store.commit(1, {0: {"m": {"w": at(0, 4)}}, 1: {"m": {"w": at(6, 10)}}}, world_layout=lay)
    wide = Shard(g[7:].double(), "dp", offsets=(7,), global_shape=(10,))  # checkout: "its stored pieces disagree"
    with pytest.raises(LayoutError, match=r"different dtypes \['float32', 'float64'\]"):
        store.commit(1, {0: {"m": {"w": at(0, 7)}}, 1: {"m": {"w": wide}}}, world_layout=lay)
    assert store.checkpoints() == []
    store.commit(1, {0: {"m": {"w": at(0, 7)}}, 1: {"m": {"w": at(7, 10)}}}, world_layout=lay)
    assert bits(store.checkout(1, world_layout=WorldLayout.single())[0]["m"]["w"]) == bits(g)


# -- planning ------------------------------------------------------------------------------------


def _mixed_world(seed: int = 0):
    """A {dp:2, tp:2} world with tp-split, dp-replicated, flat-partitioned and per-rank values."""
    gen = torch.Generator().manual_seed(seed)
    lay = WorldLayout({"dp": 2, "tp": 2})
    g = {
        "qkv": random_tensor(torch.float32, (24, 10), gen),
        "proj": random_tensor(torch.bfloat16, (6, 20), gen),
        "emb": random_tensor(torch.float16, (9, 4), gen),
        "flat": random_tensor(torch.float32, (101,), gen),
    }
    states = {}
    for r in range(4):
        c = lay.coords(r)
        a, b = (0, 40) if c["dp"] == 0 else (40, 101)
        states[r] = {
            "model_states": {
                "qkv": Shard(torch.chunk(g["qkv"], 2, 0)[c["tp"]].clone(), "tp", 0),
                "proj": Shard(torch.chunk(g["proj"], 2, 1)[c["tp"]].clone(), "tp", 1),
                "emb": g["emb"].clone(),
                "step": 7,
            },
            "optim_states": {
                "flat": Shard(g["flat"][a:b].clone(), "dp", offsets=(a,), global_shape=(101,)),
                "rng": torch.tensor([r, 100 + r]),
            },
        }
    return lay, g, states


SPLITS = {"qkv": ((0, "tp"),), "proj": ((1, "tp"),), "flat": ((0, "dp"),)}


@pytest.mark.parametrize(
    "target",
    [{}, {"tp": 2}, {"tp": 4}, {"dp": 4}, {"dp": 2, "tp": 4}, {"tp": 2, "dp": 2}, {"tp": 3, "dp": 3}, {"x": 2}],
    ids=str,
)
def test_plan_reshards_into_any_layout(target: dict[str, int]) -> None:
    lay, g, states = _mixed_world()
    mans, chunks = save(states, lay, chunk_size=24)
    tgt = WorldLayout(target)
    out = run_plan(plan(mans, lay, tgt, fallback="modulo"), chunks)
    assert sorted(out) == list(range(tgt.world_size))
    for r, got in out.items():
        c = tgt.coords(r)
        assert list(got) == ["model_states", "optim_states"]
        m, o = got["model_states"], got["optim_states"]
        assert list(m) == ["qkv", "proj", "emb", "step"] and m["step"] == 7
        for name in ("qkv", "proj"):
            assert bits(m[name]) == bits(expected_piece(g[name], SPLITS[name], tgt, c)), (r, name)
        assert bits(o["flat"]) == bits(expected_piece(g["flat"], SPLITS["flat"], tgt, c))
        assert bits(m["emb"]) == bits(g["emb"])
        src = lay.rank({"dp": c.get("dp", 0) % 2, "tp": c.get("tp", 0) % 2})
        assert o["rng"].tolist() == [src, 100 + src]


@pytest.mark.parametrize("target", [{"dp": 2}, {"dp": 2, "tp": 2}, {"tp": 2, "dp": 4}, {"dp": 8}, {}], ids=str)
def test_mesh_dims_added_removed_grown_shrunk(target: dict[str, int]) -> None:
    """A ZeRO-like flat partition over {dp: 4} (uneven, explicit offsets) into other meshes."""
    src = WorldLayout({"dp": 4})
    flat = random_tensor(torch.bfloat16, (103,), torch.Generator().manual_seed(8))
    cuts = [0, 30, 31, 70, 103]
    states = {
        r: {"o": {"flat": Shard(flat[cuts[r] : cuts[r + 1]].clone(), "dp", offsets=(cuts[r],), global_shape=(103,)),
                  "step": torch.tensor(9)}}
        for r in range(4)
    }  # fmt: skip
    mans, chunks = save(states, src, chunk_size=16)
    tgt = WorldLayout(target)
    out = run_plan(plan(mans, src, tgt), chunks)
    for r in range(tgt.world_size):
        c = tgt.coords(r)
        assert bits(out[r]["o"]["flat"]) == bits(expected_piece(flat, ((0, "dp"),), tgt, c)), (r, c)
        assert out[r]["o"]["step"].item() == 9


def test_same_layout_without_target_returns_what_was_saved() -> None:
    lay, _, states = _mixed_world()
    mans, chunks = save(states, lay, chunk_size=24)
    out = run_plan(plan(mans, lay, None, ranks=[2]), chunks)
    want = {
        k: {n: v.tensor if isinstance(v, Shard) else v for n, v in sd.items()} for k, sd in states[2].items()
    }
    assert_same(out[2], want)


def test_per_rank_values_need_a_saved_counterpart() -> None:
    lay, _, states = _mixed_world()
    mans, chunks = save(states, lay, chunk_size=24)
    # every target coordinate existed when saving: per-rank values map one to one
    out = run_plan(plan(mans, lay, WorldLayout({"tp": 2})), chunks)
    assert [out[r]["optim_states"]["rng"].tolist() for r in range(2)] == [[0, 100], [1, 101]]
    # tp grew: ranks at tp=2,3 have no saved counterpart and the saved tp ranks differ
    with pytest.raises(LayoutError, match=r"target rank 2 .*optim_states key 'rng'.*fallback='modulo'"):
        plan(mans, lay, WorldLayout({"tp": 4}))
    # a per-rank scalar is named the same way
    for r in range(4):
        states[r]["optim_states"]["rng"] = torch.tensor([0, 100])
        states[r]["model_states"]["step"] = 7 + lay.coords(r)["tp"]
    mans, chunks = save(states, lay, chunk_size=24)
    with pytest.raises(LayoutError, match="model_states key 'step'"):
        plan(mans, lay, WorldLayout({"tp": 4}))
    # values equal along the grown dim need no fallback
    for r in range(4):
        states[r]["model_states"]["step"] = 7
    mans, chunks = save(states, lay, chunk_size=24)
    assert len(plan(mans, lay, WorldLayout({"dp": 2, "tp": 4})).entries) == 16
    # a dim the saved layout did not have at all maps every new coordinate to the saved rank
    flat = WorldLayout({"dp": 2})
    per_dp = {r: {"s": {"rng": torch.tensor([r])}} for r in range(2)}
    mans, chunks = save(per_dp, flat, chunk_size=8)
    out = run_plan(plan(mans, flat, WorldLayout({"dp": 2, "tp": 2})), chunks)
    assert [out[r]["s"]["rng"].item() for r in range(4)] == [0, 0, 1, 1]


def test_divergent_replicas_of_a_piece_follow_coordinates() -> None:
    """Each tp rank partitions its own flat buffer over dp: pieces at equal offsets differ."""
    lay = WorldLayout({"dp": 2, "tp": 2})
    flats = [torch.arange(10, dtype=torch.int32) + 1000 * tp for tp in range(2)]
    states = {}
    for r in range(4):
        c = lay.coords(r)
        a, b = (0, 4) if c["dp"] == 0 else (4, 10)
        states[r] = {"o": {"flat": Shard(flats[c["tp"]][a:b].clone(), "dp", offsets=(a,), global_shape=(10,))}}
    mans, chunks = save(states, lay, chunk_size=8)
    out = run_plan(plan(mans, lay, WorldLayout({"tp": 2})), chunks)
    assert [out[r]["o"]["flat"].tolist() for r in range(2)] == [flats[0].tolist(), flats[1].tolist()]
    with pytest.raises(LayoutError, match="o key 'flat'"):
        plan(mans, lay, WorldLayout({"tp": 4}))
    out = run_plan(plan(mans, lay, WorldLayout({"tp": 4}), fallback="modulo"), chunks)
    assert out[3]["o"]["flat"].tolist() == flats[1].tolist()


def test_dim0_split_reads_only_the_target_rows() -> None:
    lay = WorldLayout({"tp": 2})
    g = random_tensor(torch.float32, (64, 32), torch.Generator().manual_seed(3))
    states = {r: {"m": {"w": Shard(torch.chunk(g, 2)[r].clone(), "tp")}} for r in range(2)}
    mans, chunks = save(states, lay, chunk_size=512)  # 4 rows a chunk
    tgt = WorldLayout({"tp": 4})
    for r in range(4):
        p = plan(mans, lay, tgt, ranks=[r])
        assert p.chunk_bytes == 16 * 32 * 4 and not p.boxes
        assert bits(run_plan(p, chunks)[r]["m"]["w"]) == bits(torch.chunk(g, 4)[r])


def test_dim1_split_skips_chunks_outside_the_box() -> None:
    lay = WorldLayout({"tp": 2})
    g = random_tensor(torch.int16, (4, 1024), torch.Generator().manual_seed(4))
    states = {r: {"m": {"w": Shard(torch.chunk(g, 2, 1)[r].clone(), "tp", 1)}} for r in range(2)}
    mans, chunks = save(states, lay, chunk_size=128)  # a saved row is 1 KiB: 8 chunks
    p = plan(mans, lay, WorldLayout({"tp": 8}), ranks=[5])
    assert p.chunk_bytes == 4 * 128 * 2  # the rank's 128 columns of each of 4 rows: one chunk a row
    assert bits(run_plan(p, chunks)[5]["m"]["w"]) == bits(torch.chunk(g, 8, 1)[5])


def test_missing_piece_is_reported() -> None:
    lay, _, states = _mixed_world()
    mans, _ = save(states, lay, chunk_size=24)
    del mans[(1, "model_states")], mans[(3, "model_states")]  # every tp=1 piece of model_states
    with pytest.raises(LayoutError, match="key 'qkv': the saved pieces cover only"):
        plan(mans, lay, WorldLayout.single())


def test_unknown_fallback_and_target_rank() -> None:
    lay, _, states = _mixed_world()
    mans, _ = save(states, lay, chunk_size=24)
    with pytest.raises(LayoutError, match="unknown fallback"):
        plan(mans, lay, WorldLayout({"tp": 2}), fallback="nearest")
    with pytest.raises(LayoutError, match="rank 5 is outside"):
        plan(mans, lay, WorldLayout({"tp": 2}), ranks=[5])


# -- random layouts --------------------------------------------------------------------------------

NAMES = ("a", "b", "c")


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    names = draw(st.permutations(NAMES))[: draw(st.integers(1, 3))]
    src = WorldLayout({n: draw(st.integers(1, 3)) for n in names})
    splits = tuple((draw(st.integers(0, ndim - 1)), n) for n in names if draw(st.booleans()))
    explicit = draw(st.booleans())
    # a random contiguous partition of each split tensor dim, in nesting order of the mesh dims
    cuts = {}
    for d in sorted({d for d, _ in splits}):
        parts = math.prod(src.size(m) for dd, m in splits if dd == d)
        inner = sorted(draw(st.lists(st.integers(0, shape[d]), min_size=parts - 1, max_size=parts - 1)))
        cuts[d] = [0, *inner, shape[d]]
    tnames = draw(st.permutations((*NAMES, "d")))[: draw(st.integers(0, 3))]
    tgt = WorldLayout({n: draw(st.integers(1, 4)) for n in tnames})
    dtype = draw(st.sampled_from([torch.float32, torch.int16, torch.uint8]))
    chunk_size = draw(st.sampled_from([3, 8, 20]))
    return {"shape": shape, "src": src, "splits": splits, "explicit": explicit, "cuts": cuts,
            "tgt": tgt, "dtype": dtype, "chunk_size": chunk_size}  # fmt: skip


def _saved_piece(sc: dict[str, Any], coords: dict[str, int]) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    offsets, sl = [], []
    order = [n for n, _ in sc["src"].dims]
    for d, n in enumerate(sc["shape"]):
        ms = sorted((m for dd, m in sc["splits"] if dd == d), key=order.index)
        if not ms:
            offsets.append(0)
            sl.append(slice(0, n))
            continue
        i = 0
        for m in ms:
            i = i * sc["src"].size(m) + coords[m]
        a, b = sc["cuts"][d][i], sc["cuts"][d][i + 1]
        offsets.append(a)
        sl.append(slice(a, b))
    return tuple(offsets), tuple(sl)


@settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_layouts_reshard_exactly_and_read_only_overlapping_chunks(sc: dict[str, Any]) -> None:
    src, tgt, shape, cs = sc["src"], sc["tgt"], sc["shape"], sc["chunk_size"]
    seed = zlib.crc32(str(sc).encode())  # the same on every run and machine
    g = random_tensor(sc["dtype"], shape, torch.Generator().manual_seed(seed))
    rep = torch.arange(5, dtype=torch.int64)
    states, where = {}, {}
    for r in range(src.world_size):
        c = src.coords(r)
        offsets, sl = _saved_piece(sc, c)
        where[r] = (offsets, sl)
        local = g[sl].clone()
        if not sc["splits"]:
            w: Any = local
        elif sc["explicit"]:
            w = Shard(local, tuple(m for _, m in sc["splits"]), tuple(d for d, _ in sc["splits"]),
                      offsets=offsets, global_shape=shape)  # fmt: skip
        else:
            w = Shard(local, tuple(m for _, m in sc["splits"]), tuple(d for d, _ in sc["splits"]))
        states[r] = {"m": {"w": w, "rep": rep, "rng": torch.tensor([r])}}
    mans, chunks = save(states, src, cs)
    item = g.element_size()
    for r in range(tgt.world_size):
        c = tgt.coords(r)
        p = plan(mans, src, tgt, ranks=[r], fallback="modulo")
        got = run_plan(p, chunks)[r]["m"]
        want = expected_piece(g, sc["splits"], tgt, c) if sc["splits"] else g
        assert got["w"].shape == want.shape and bits(got["w"]) == bits(want), (r, c)
        assert torch.equal(got["rep"], rep)
        folded = {n: c.get(n, 0) % s for n, s in src.dims}
        assert got["rng"].item() == src.rank(folded)
        # the chunks read are exactly those holding a byte of the target's box
        box = target_box(ShardSpec(shape, (0,) * len(shape), sc["splits"]), tgt, c) if sc["splits"] else None
        need: set[bytes] = set()
        if box is not None and all(b > a for a, b in box):
            for idx in np.ndindex(*[b - a for a, b in box]):
                gi = [a + i for (a, _), i in zip(box, idx)]
                for s in range(src.world_size):
                    offsets, sl = where[s]
                    if all(x.start <= v < x.stop for x, v in zip(sl, gi)):
                        local_shape = [x.stop - x.start for x in sl]
                        flat = np.ravel_multi_index([v - o for v, o in zip(gi, offsets)], local_shape)
                        rec = next(t for t in mans[(s, "m")].tensors if t.path == "w")
                        for byte in (flat * item, flat * item + item - 1):
                            need.add(rec.chunks[byte // cs])
                        break
        elif box is None:
            need.update(next(t for t in mans[(0, "m")].tensors if t.path == "w").chunks)
        read_w = {cp.digest for cp in p.copies if cp.source.endswith("key 'w'")}
        assert read_w == need


# -- end to end through a store ---------------------------------------------------------------------


def test_store_reshards_and_consolidates(store: ckstore.Store) -> None:
    lay, g, states = _mixed_world(seed=5)
    ck = store.commit(3, states, world_layout=lay)
    assert ck.world_layout == lay and ck.ranks == (0, 1, 2, 3)
    full = store.checkout(3, world_layout=WorldLayout.single())
    assert list(full) == [0]
    for name in ("qkv", "proj", "emb"):
        assert bits(full[0]["model_states"][name]) == bits(g[name])
    assert bits(full[0]["optim_states"]["flat"]) == bits(g["flat"])
    for target in ({"tp": 4}, {"dp": 4, "tp": 2}):
        tgt = WorldLayout(target)
        out = store.checkout(3, world_layout=tgt, fallback="modulo", ranks=[1, tgt.world_size - 1])
        assert sorted(out) == [1, tgt.world_size - 1]
        for r, got in out.items():
            c = tgt.coords(r)
            for name in ("qkv", "proj"):
                piece = got["model_states"][name]
                assert type(piece) is torch.Tensor and piece.is_contiguous()
                assert bits(piece) == bits(expected_piece(g[name], SPLITS[name], tgt, c))
    # the saved layout itself: every rank gets back its own pieces
    same = store.checkout(3, world_layout=lay)
    assert bits(same[3]["model_states"]["qkv"]) == bits(states[3]["model_states"]["qkv"].tensor)
    with pytest.raises(LayoutError, match="optim_states key 'rng'"):
        store.checkout(3, world_layout=WorldLayout({"tp": 4}))


@pytest.mark.parametrize("split_dim", [0, 1])
def test_resharding_reads_about_the_target_size(store: ckstore.Store, split_dim: int) -> None:
    """Bytes fetched from the blob store for one target rank stay within 10% of its piece."""
    shape = (64, 16384) if split_dim == 0 else (8, 131072)  # 4 MiB of incompressible bits
    g = random_tensor(torch.float32, shape, torch.Generator().manual_seed(6))
    lay = WorldLayout({"tp": 2})
    states = {r: {"m": {"w": Shard(torch.chunk(g, 2, split_dim)[r].clone(), "tp", split_dim)}} for r in range(2)}
    store.commit(1, states, world_layout=lay)
    tgt = WorldLayout({"tp": 8})
    for r in (0, 5):
        store.blobs.stats.reset()
        got = store.checkout(1, world_layout=tgt, ranks=[r])[r]["m"]["w"]
        want = torch.chunk(g, 8, split_dim)[r]
        assert bits(got) == bits(want)
        read = store.blobs.stats.snapshot()["bytes_read"]
        assert abs(read - want.nbytes) <= 0.10 * want.nbytes, (read, want.nbytes)
