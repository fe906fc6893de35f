"""Diffs and lineage, as tests every backend must pass.

Digests decide what is identical, so an identical tensor costs no blob read on any backend: the
reads are counted through the store's own blob store (``store.blobs.stats``). Changed tensors
are read from the backend and their statistics checked against torch on the full tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import assert_same

import ckstore

from .gc import SMALL, open_small
from .store import StoreSpec

__all__ = ["DiffConformance"]

_CHUNK = SMALL["chunk_size"]
_PER_CHUNK = _CHUNK // 4  # float32 elements in a chunk


def _base_states() -> dict[int, dict[str, Any]]:
    g = torch.Generator().manual_seed(11)
    model = {
        "embed": torch.randn(256, 128, generator=g),  # 128 KiB: two chunks, frozen
        "proj": torch.randn(32, 32, generator=g),
        "head": torch.randn(16, 64, generator=g).bfloat16(),
        "count": torch.randint(0, 1000, (100,), generator=g),
        "bias": torch.randn(32, generator=g),
        "big": torch.randn(4 * _PER_CHUNK, generator=g),  # four chunks
    }
    optim = {"exp_avg": torch.randn(32, 32, generator=g), "lr": 1e-3}
    return {0: {"model_states": model, "optim_states": optim, "meta": {"step": 1}}}


def _tuned_states() -> dict[int, dict[str, Any]]:
    """The base states after a fine-tune: ``embed`` and ``bias`` untouched, the rest changed."""
    g = torch.Generator().manual_seed(12)
    base = _base_states()[0]
    m = {k: v.clone() for k, v in base["model_states"].items()}
    m["proj"][::4] += 0.01 * torch.randn(8, 32, generator=g)
    m["head"][3] = (m["head"][3].float() * 1.5).bfloat16()
    m["count"][::3] += 1
    m["big"][2 * _PER_CHUNK + 5] += 1.0  # one element, in the third chunk
    optim = {"exp_avg": base["optim_states"]["exp_avg"] * 0.9, "lr": 3e-4}
    return {0: {"model_states": m, "optim_states": optim, "meta": {"step": 2}}}


_IDENTICAL = {"model_states/embed", "model_states/bias"}
_CHANGED = {
    "model_states/proj",
    "model_states/head",
    "model_states/count",
    "model_states/big",
    "optim_states/exp_avg",
}


def _two_runs(store: ckstore.Store) -> None:
    """Run ``base`` commits step 1; run ``ft`` forks from it and commits step 2."""
    store.commit(1, _base_states(), {"val_loss": 0.7}, run="base")
    store.fork("base@1", "ft")
    store.commit(2, _tuned_states(), {"val_loss": 0.5, "acc": 0.9}, run="ft")


def _stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    na, nb = torch.linalg.vector_norm(x), torch.linalg.vector_norm(y)
    return {
        "changed": float((x != y).sum()),
        "max_abs_diff": float((y - x).abs().max()),
        "rel_l2": float(torch.linalg.vector_norm(y - x) / na),
        "cosine": float(torch.dot(x, y) / (na * nb)),
        "norm_a": float(na),
        "norm_b": float(nb),
    }


def _sharded(full: torch.Tensor, odd: torch.Tensor, tp: int) -> dict[int, dict[str, Any]]:
    """Rank states of a ``{tp: N}`` layout: ``w`` and ``odd`` split along dim 0, ``b`` replicated."""
    return {
        r: {
            "model_states": {
                "w": ckstore.Shard(full.chunk(tp, 0)[r].clone(), mesh_dim="tp", dim=0),
                "odd": ckstore.Shard(odd.chunk(tp, 0)[r].clone(), mesh_dim="tp", dim=0),
                "b": torch.arange(8.0),
            }
        }
        for r in range(tp)
    }


class DiffConformance:
    @pytest.fixture
    def diff_store(self, spec: StoreSpec) -> Iterator[ckstore.Store]:
        s = open_small(spec, run=None)
        yield s
        s.close()

    def test_identical_tensors_are_never_read_and_lineage_is_recorded(
        self, diff_store: ckstore.Store
    ) -> None:
        store = diff_store
        _two_runs(store)
        base = store.resolve("base@1")
        ft = store.resolve("ft@2")
        assert ft.parent == "base@1" and base.parent is None
        (origin,) = store.lineage("ft")
        assert origin.ref == "base@1" and origin.checkpoint == base
        assert {r.name: r.parent for r in store.runs()} == {"base": None, "ft": "base@1"}
        assert store.fork("base@1", "ft").id == base.id  # forking again is a no-op

        stats = store.blobs.stats
        reads: dict[str, tuple[int, int]] = {}
        for key in sorted(_IDENTICAL | _CHANGED):
            stats.reset()
            (t,) = store.diff("base@1", "ft@2", key=key).tensors
            reads[key] = (stats.reads, stats.bytes_read)
            assert t.status == ("identical" if key in _IDENTICAL else "changed"), key
        assert all(reads[k] == (0, 0) for k in _IDENTICAL)
        assert all(reads[k][0] > 0 for k in _CHANGED)

        stats.reset()
        res = store.diff("base", "ft")  # bare run names: their latest checkpoints
        # the whole diff reads exactly what the changed tensors need, nothing for the others
        assert stats.reads == sum(n for n, _ in reads.values())
        assert stats.bytes_read == sum(b for _, b in reads.values())
        assert (res.a.ref, res.b.ref) == ("base@1", "ft@2")
        by_key = {t.key: t for t in res.tensors}
        assert set(by_key) == _IDENTICAL | _CHANGED and {t.key for t in res.changed} == _CHANGED
        for key in _IDENTICAL:
            assert by_key[key].read_bytes == 0 and by_key[key].stats is None
        assert {(v.key, v.a, v.b) for v in res.values} == {
            ("optim_states/lr", 1e-3, 3e-4),
            ("meta/step", 1, 2),
        }
        assert res.metrics == {"val_loss": (0.7, 0.5), "acc": (None, 0.9)}
        embed = store.manifests(base)[(0, "model_states")].tensors[0]
        assert embed.path == "embed" and len(embed.chunks) == 2
        sharing = res.sharing
        assert sharing.shared_chunks == 2 + 1 + 3  # embed, bias, big's unchanged chunks
        assert sharing.only_a_chunks == sharing.only_b_chunks == len(_CHANGED)  # one chunk each

        stats.reset()
        fast = store.diff("base@1", "ft@2", stats=False)
        assert stats.reads == 0 and {t.key for t in fast.changed} == _CHANGED

        # the fork point deleted: its ref stays as history, and what ft shares with it stays stored
        store.delete("base@1")
        store.gc(grace=0)
        assert [(a.ref, a.checkpoint) for a in store.lineage("ft")] == [("base@1", None)]
        assert {r.name: r.parent for r in store.runs()} == {"base": None, "ft": "base@1"}
        assert store.resolve("ft@2").parent is None
        assert_same(store.checkout("ft@2"), _tuned_states())

    def test_changed_tensor_statistics_match_torch(self, diff_store: ckstore.Store) -> None:
        store = diff_store
        _two_runs(store)
        res = store.diff("base@1", "ft@2")
        a, b = store.checkout("base@1")[0], store.checkout("ft@2")[0]
        assert len(res.changed) == len(_CHANGED)
        for t in res.changed:
            sub_key, _, path = t.key.partition("/")
            x, y = a[sub_key][path], b[sub_key][path]
            want = _stats(x, y)
            st = t.stats
            assert st is not None and st.numel == x.numel(), t.key
            assert st.changed == want["changed"] > 0, t.key
            assert st.max_abs_diff == pytest.approx(want["max_abs_diff"], rel=1e-12), t.key
            for name in ("rel_l2", "cosine", "norm_a", "norm_b"):
                assert getattr(st, name) == pytest.approx(want[name], rel=1e-9), (t.key, name)
            assert t.read_bytes > 0 and (t.dtype_a, t.shape_a) == (t.dtype_b, t.shape_b)
        big = next(t for t in res.changed if t.key == "model_states/big")
        assert big.stats is not None and big.stats.changed == 1
        assert big.read_bytes == 5 * _CHUNK  # the changed chunk from both sides, the others once

    def test_reshard_aware_diff(self, diff_store: ckstore.Store) -> None:
        store = diff_store
        g = torch.Generator().manual_seed(21)
        full = torch.randn(256, 256, generator=g)  # tp:4 pieces are one chunk each, tp:2 two
        odd = torch.randn(50, 30, generator=g)  # pieces that end inside chunks
        for tp in (2, 4):
            layout = ckstore.WorldLayout({"tp": tp})
            store.commit(1, _sharded(full, odd, tp), run=f"tp{tp}", world_layout=layout)
        whole = {"w": full, "odd": odd, "b": torch.arange(8.0)}
        store.commit(1, {0: {"model_states": whole}}, run="single")

        stats = store.blobs.stats
        stats.reset()
        res = store.diff("tp2@1", "tp4@1")
        assert res.identical, res.changed
        t = {d.key: d for d in res.tensors}
        assert t["model_states/w"].sharded and t["model_states/w"].shape_a == (256, 256)
        # digests decide where the chunks line up; pieces cut differently are read to tell
        assert t["model_states/w"].read_bytes == 0 and t["model_states/b"].read_bytes == 0
        assert t["model_states/odd"].read_bytes > 0
        assert stats.bytes_read > 0
        stats.reset()
        assert store.diff("tp2@1", "tp4@1", key="model_states/w").identical and stats.reads == 0
        assert store.diff("single@1", "tp4@1").identical
        assert store.diff("tp2@1", "single@1").identical

        nudged = odd.clone()
        nudged[40, 7] += 1.0  # in the last tp:4 piece
        layout = ckstore.WorldLayout({"tp": 4})
        store.commit(2, _sharded(full, nudged, 4), run="tp4", world_layout=layout)
        res = store.diff("tp2@1", "tp4@2")
        t = {d.key: d for d in res.tensors}
        assert [d.key for d in res.changed] == ["model_states/odd"]
        st = t["model_states/odd"].stats
        assert st is not None and st.changed == 1 and st.numel == odd.numel()
        assert st.max_abs_diff == pytest.approx(1.0, rel=1e-6)
        assert st.rel_l2 == pytest.approx(_stats(odd, nudged)["rel_l2"], rel=1e-9)
        assert t["model_states/w"].status == "identical" and t["model_states/w"].read_bytes == 0
        assert store.diff("tp2@1", "tp4@2", stats=False).changed[0].key == "model_states/odd"
