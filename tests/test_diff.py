"""Diffs between checkpoints: digests decide for free, changed tensors get exact statistics,
sharded tensors compare as global tensors whatever layouts saved them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore
from ckstore.diff import _leaves, module_of
from ckstore.errors import NotFoundError, StoreConfigError

VOCAB, DIM = 1024, 256  # a 1 MiB fp32 embedding: 16 chunks of 64 KiB


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, 32)
        self.head = torch.nn.Linear(32, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(self.embed(tokens).mean(1))))


def _train(model: TinyLM, opt: torch.optim.Optimizer, steps: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (8, 12), generator=gen)
        target = torch.randint(0, 16, (8,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(tokens), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _states(model: TinyLM, opt: torch.optim.Optimizer, step: int) -> dict[int, dict[str, Any]]:
    return {
        0: {
            "model_states": model.state_dict(),
            "optim_states": opt.state_dict(),
            "meta": {"step": step},
        }
    }


def _new_opt(model: TinyLM, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ckstore.Store]:
    """Run ``base`` trains 20 steps; run ``ft`` forks from base@10 and trains 10 steps on other
    data at another learning rate. Both keep the embedding frozen."""
    store = ckstore.open(
        tmp_path_factory.mktemp("two_runs") / "store", chunk_size=64 * 1024, pack_size=1024 * 1024
    )
    torch.manual_seed(0)
    model = TinyLM()
    model.embed.weight.requires_grad_(False)
    opt = _new_opt(model, 1e-2)
    loss = _train(model, opt, 10, seed=1)
    store.commit(10, _states(model, opt, 10), {"val_loss": loss}, run="base")
    loss = _train(model, opt, 10, seed=2)
    store.commit(20, _states(model, opt, 20), {"val_loss": loss}, run="base")

    fork_point = store.fork("base@10", "ft")
    states = store.load(fork_point)[0]
    ft = TinyLM()
    ft.load_state_dict(states["model_states"])
    ft.embed.weight.requires_grad_(False)
    ft_opt = _new_opt(ft, 3e-3)
    ft_opt.load_state_dict(states["optim_states"])
    for group in ft_opt.param_groups:
        group["lr"] = 3e-3
    loss = _train(ft, ft_opt, 10, seed=3)
    store.commit(20, _states(ft, ft_opt, 20), {"val_loss": loss, "ft_acc": 0.5}, run="ft")
    yield store
    store.close()


def _full_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    return {
        "max_abs_diff": float((y - x).abs().max()),
        "rel_l2": float(torch.linalg.vector_norm(y - x) / torch.linalg.vector_norm(x)),
        "frac_changed": float((x != y).double().mean()),
        "cosine": float(
            torch.dot(x, y) / (torch.linalg.vector_norm(x) * torch.linalg.vector_norm(y))
        ),
    }


def test_frozen_embedding_is_identical_and_never_read(two_runs: ckstore.Store) -> None:
    store = two_runs
    embed_digests = {
        d for m in store.manifests(store.resolve("ft@20"), sub_keys=["model_states"]).values()
        for t in m.tensors if t.path == "embed.weight" for d in t.chunks
    }  # fmt: skip
    embed_stored = sum(loc.length for loc in store.catalog.chunk_locations(embed_digests).values())
    assert len(embed_digests) == 16

    store.blobs.stats.reset()
    only_embed = store.diff("base@20", "ft@20", key="model_states/embed.*")
    assert store.blobs.stats.snapshot()["reads"] == 0
    assert only_embed.identical and [t.status for t in only_embed.tensors] == ["identical"]

    store.blobs.stats.reset()
    res = store.diff("base@20", "ft@20")
    read = store.blobs.stats.snapshot()["bytes_read"]
    by_key = {t.key: t for t in res.tensors}
    emb = by_key["model_states/embed.weight"]
    assert emb.status == "identical" and emb.read_bytes == 0 and emb.stats is None
    # the changed tensors were read, but the 1 MiB embedding was not: all reads together are
    # smaller than its stored chunks
    assert 0 < read < embed_stored
    assert res.differs and not res.identical
    assert {t.key for t in res.changed} >= {"model_states/proj.weight", "model_states/head.bias"}
    assert res.metrics["val_loss"][0] == store.resolve("base@20").metrics["val_loss"]
    assert res.metrics["ft_acc"] == (None, 0.5)
    assert res.sharing.shared_chunks >= 16 and res.sharing.shared_bytes >= embed_stored
    assert res.sharing.only_a_bytes > 0 and res.sharing.only_b_bytes > 0
    # both runs stopped at step 20; the learning rate was changed by the fine-tune
    assert "meta/step" not in {v.key for v in res.values} and res.values_equal > 0


def test_statistics_match_torch_on_full_tensors(two_runs: ckstore.Store) -> None:
    store = two_runs
    res = store.diff("base@20", "ft@20")
    a = store.checkout("base@20")[0]
    b = store.checkout("ft@20")[0]
    checked = 0
    for t in res.changed:
        sub_key, _, path = t.key.partition("/")
        if sub_key != "model_states":
            continue
        want = _full_stats(a[sub_key][path], b[sub_key][path])
        st = t.stats
        assert st is not None and st.numel == a[sub_key][path].numel()
        assert st.max_abs_diff == pytest.approx(want["max_abs_diff"], rel=1e-12)
        assert st.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-9)
        assert st.frac_changed == pytest.approx(want["frac_changed"], rel=1e-12)
        assert st.cosine == pytest.approx(want["cosine"], rel=1e-9)
        assert t.read_bytes > 0
        checked += 1
    assert checked == 4  # proj and head, weight and bias
    # optimizer moments are nested under state/<param>/exp_avg
    assert any(
        t.key.startswith("optim_states/state/") and t.key.endswith("exp_avg") for t in res.changed
    )
    assert [v.key for v in res.values if v.key.endswith("/lr")] == [
        "optim_states/param_groups/0/lr"
    ]


def test_stats_off_reads_nothing_when_chunks_line_up(two_runs: ckstore.Store) -> None:
    store = two_runs
    store.blobs.stats.reset()
    res = store.diff("base", "ft", stats=False)  # bare run names: their latest checkpoints
    assert store.blobs.stats.snapshot()["reads"] == 0
    assert (res.a.ref, res.b.ref) == ("base@20", "ft@20")
    assert res.differs and all(t.stats is None for t in res.tensors)
    with pytest.raises(StoreConfigError, match="tolerance"):
        store.diff("base", "ft", stats=False, tolerance=1e-3)


def test_restricting_by_sub_key_and_glob(two_runs: ckstore.Store) -> None:
    store = two_runs
    res = store.diff("base@20", "ft@20", sub_key="model_states")
    assert {t.key.split("/")[0] for t in res.tensors} == {"model_states"} and not res.values
    res = store.diff("base@20", "ft@20", key="proj.*")
    assert sorted(t.key for t in res.tensors) == [
        "model_states/proj.bias",
        "model_states/proj.weight",
    ]
    with pytest.raises(NotFoundError, match="no key matches"):
        store.diff("base@20", "ft@20", key="nothing*")
    with pytest.raises(NotFoundError, match="sub-checkpoint 'lr_scheduler'"):
        store.diff("base@20", "ft@20", sub_key="lr_scheduler")


def _sharded(full: torch.Tensor, mesh: dict[str, int], dim: int = 0) -> dict[int, dict[str, Any]]:
    """Rank states of a {dp, tp} layout: ``w`` split over tp along ``dim``, ``b`` replicated,
    ``rng`` a per-rank value."""
    layout = ckstore.WorldLayout(mesh)
    tp = mesh.get("tp", 1)
    out: dict[int, dict[str, Any]] = {}
    for r in range(layout.world_size):
        c = layout.coords(r).get("tp", 0)
        piece = full.chunk(tp, dim)[c].clone()
        out[r] = {
            "model_states": {
                "w": ckstore.Shard(piece, mesh_dim="tp", dim=dim),
                "b": torch.arange(8.0),
            }
        }
    return out


def test_reshard_aware_diff(store: ckstore.Store) -> None:
    torch.manual_seed(5)
    full = torch.randn(256, 256)  # 64 KiB per 64 rows: tp:2 and tp:4 pieces are whole chunks
    odd = torch.randn(96, 300)  # pieces that do not end on chunk boundaries
    for run, mesh, dim in (
        ("tp2", {"tp": 2}, 0),
        ("tp4", {"tp": 4}, 0),
        ("dp2tp2", {"dp": 2, "tp": 2}, 0),
        ("cols", {"tp": 4}, 1),
    ):
        layout = ckstore.WorldLayout(mesh)
        store.commit(1, _sharded(full, mesh, dim), run=run, world_layout=layout)
        states = _sharded(odd, mesh, dim)
        store.commit(2, states, run=run, world_layout=layout)
    store.commit(1, {0: {"model_states": {"w": full, "b": torch.arange(8.0)}}}, run="single")
    store.commit(2, {0: {"model_states": {"w": odd, "b": torch.arange(8.0)}}}, run="single")

    store.blobs.stats.reset()
    res = store.diff("tp2@1", "tp4@1")
    assert (
        res.identical and store.blobs.stats.snapshot()["reads"] == 0
    )  # chunks line up: digests decide
    assert [t.key for t in res.tensors] == ["model_states/w", "model_states/b"]
    assert res.tensors[0].sharded and res.tensors[0].shape_a == (256, 256)

    for a, b, read in (  # chunks that do not line up are read and compared: no difference
        ("tp2@2", "tp4@2", True),
        ("tp4@2", "dp2tp2@2", True),
        ("single@2", "cols@2", True),
        ("cols@1", "tp2@1", True),
        ("single@1", "tp4@1", False),  # chunks line up: digests decide, nothing read
    ):
        res = store.diff(a, b)
        assert res.identical, (a, b, res.changed)
        stats = res.tensors[0].stats
        if read:
            assert res.tensors[0].read_bytes > 0 and stats is not None, (a, b)
            assert (stats.changed, stats.max_abs_diff, stats.rel_l2) == (0, 0.0, 0.0), (a, b, stats)
        else:
            assert (stats, res.tensors[0].read_bytes) == (None, 0), (a, b)
    assert store.diff("single@2", "cols@2").tensors[0].read_bytes > 0  # needed reading to tell

    changed = odd.clone()
    changed[70, 290] += 1.0  # in the last tp:2 piece, the last tp:4 column block
    store.commit(
        3, _sharded(changed, {"tp": 2}), run="tp2", world_layout=ckstore.WorldLayout({"tp": 2})
    )
    res = store.diff("cols@2", "tp2@3")
    w = res.tensors[0]
    assert w.status == "changed" and w.stats is not None
    assert w.stats.changed == 1 and w.stats.max_abs_diff == pytest.approx(1.0, rel=1e-6)
    assert w.stats.rel_l2 == pytest.approx(_full_stats(odd, changed)["rel_l2"], rel=1e-9)
    assert store.diff("cols@2", "tp2@3", stats=False).tensors[0].status == "changed"

    # the same layout on both sides: pieces at the same place decide by digests, even when they
    # are column blocks
    store.commit(
        3,
        _sharded(changed, {"tp": 4}, dim=1),
        run="cols",
        world_layout=ckstore.WorldLayout({"tp": 4}),
    )
    store.blobs.stats.reset()
    assert store.diff("cols@2", "cols@3", stats=False).tensors[0].status == "changed"
    assert store.blobs.stats.snapshot()["reads"] == 0


def test_per_rank_values_compare_rank_by_rank(store: ckstore.Store) -> None:
    def states(seed_of_rank1: int) -> dict[int, dict[str, Any]]:
        return {
            r: {"rng": {"seed": seed_of_rank1 if r == 1 else r, "w": torch.ones(4)}}
            for r in range(2)
        }

    store.commit(1, states(1), run="r")
    store.commit(2, states(7), run="r")
    res = store.diff("r@1", "r@2")
    assert [(v.key, v.rank, v.a, v.b) for v in res.values] == [("rng/seed", 1, 1, 7)]
    assert [(t.key, t.rank, t.status) for t in res.tensors] == [("rng/w", None, "identical")]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.float8_e4m3fn]
)
def test_statistics_per_dtype(store: ckstore.Store, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(300, 70, generator=gen, dtype=torch.float64)
    a = (base * 4).to(dtype) if not dtype.is_complex else torch.complex(base, -base).to(dtype)
    b = a.clone()
    b[::7] = (b[::7].to(torch.complex128 if dtype.is_complex else torch.float64) * 1.5).to(dtype)
    store.commit(1, {0: {"m": {"x": a}}}, run="d")
    store.commit(2, {0: {"m": {"x": b}}}, run="d")
    st = store.diff("d@1", "d@2").tensors[0].stats
    assert st is not None
    wide = torch.complex128 if dtype.is_complex else torch.float64
    x, y = a.to(wide).reshape(-1), b.to(wide).reshape(-1)
    d = (y - x).abs()
    assert st.max_abs_diff == pytest.approx(float(d.max()), rel=1e-12)
    assert st.changed == int((x != y).sum())
    assert st.rel_l2 == pytest.approx(
        float(torch.linalg.vector_norm(y - x) / torch.linalg.vector_norm(x)), rel=1e-9
    )
    cos = torch.vdot(x, y).real / (torch.linalg.vector_norm(x) * torch.linalg.vector_norm(y))
    assert st.cosine == pytest.approx(float(cos), rel=1e-9)


def test_dtype_shape_and_kind_changes_and_tolerance(store: ckstore.Store) -> None:
    x = torch.linspace(-1, 1, 5000)
    store.commit(
        1,
        {0: {"m": {"a": x, "b": torch.zeros(4, 4), "c": torch.ones(3), "d": x, "n": float("nan")}}},
        run="k",
    )
    nudged = x.clone()
    nudged[100] += 1e-6
    store.commit(
        2,
        {
            0: {
                "m": {
                    "a": x.bfloat16(),
                    "b": torch.zeros(2, 8),
                    "c": 3,
                    "d": nudged,
                    "n": float("nan"),
                }
            }
        },
        run="k",
    )
    res = store.diff("k@1", "k@2")
    t = {d.key: d for d in res.tensors}
    assert t["m/a"].dtype_changed and t["m/a"].status == "changed" and t["m/a"].stats is not None
    assert t["m/b"].shape_changed and t["m/b"].stats is None and t["m/b"].read_bytes == 0
    assert t["m/d"].status == "changed" and t["m/d"].stats.changed == 1  # type: ignore[union-attr]
    assert [(v.key, v.a, v.b) for v in res.values] == [("m/c", "<tensor float32 [3]>", 3)]
    assert res.values_equal == 1  # nan equals nan
    close = store.diff("k@1", "k@2", key="m/d", tolerance=1e-5)
    assert close.identical and close.tensors[0].status == "close"
    assert store.diff("k@1", "k@2", key="m/d", tolerance=1e-7).differs
    with pytest.raises(StoreConfigError, match="tolerance"):
        store.diff("k@1", "k@2", tolerance=-1.0)


def test_module_paths() -> None:
    assert module_of("model_states/layers.0.attn.weight") == "model_states/layers.0.attn"
    assert module_of("optim_states/state/0/exp_avg") == "optim_states/state/0"
    assert module_of("meta/step") == "meta"


def test_json_is_strict(store: ckstore.Store, tmp_path: Path) -> None:
    import json

    store.commit(1, {0: {"m": {"z": torch.zeros(3), "n": torch.tensor([1.0, math.nan])}}}, run="j")
    store.commit(2, {0: {"m": {"z": torch.ones(3), "n": torch.tensor([1.0, 2.0])}}}, run="j")
    doc = store.diff("j@1", "j@2").to_json()

    def refuse(name: str) -> None:
        raise AssertionError(f"non-strict JSON constant {name}")

    back = json.loads(json.dumps(doc), parse_constant=refuse)
    z = next(t for t in back["tensors"] if t["key"] == "m/z")
    assert z["stats"]["rel_l2"] == "inf" and z["stats"]["cosine"] == "nan"
    n = next(t for t in back["tensors"] if t["key"] == "m/n")
    assert n["stats"]["max_abs_diff"] == "nan" and n["stats"]["changed"] == 1


def test_shared_chunks_of_a_changed_tensor_are_read_once(store: ckstore.Store) -> None:
    x = torch.randn(8 * 16384)  # eight 64 KiB chunks
    y = x.clone()
    y[3 * 16384 + 5] += 1.0  # one chunk changes
    store.commit(1, {0: {"m": {"x": x}}}, run="p")
    store.commit(2, {0: {"m": {"x": y}}}, run="p")
    (t,) = store.diff("p@1", "p@2").tensors
    assert t.status == "changed" and t.stats is not None and t.stats.changed == 1
    assert t.read_bytes == 9 * 64 * 1024  # the changed chunk from both sides, the other seven once
    store.blobs.stats.reset()
    assert store.diff("p@1", "p@2", stats=False).tensors[0].status == "changed"
    assert store.blobs.stats.snapshot()["reads"] == 0


def test_windows_stream_a_tensor_in_blocks_of_rows(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:

    a = torch.randn(600, 100)  # 4 chunks; windows of one chunk's worth of rows: 163 rows
    b = a * 1.1
    b[599, 99] = 0.0
    layout = ckstore.WorldLayout({"tp": 4})
    store.commit(1, {0: {"m": {"w": a}}}, run="s")
    store.commit(
        2,
        {r: {"m": {"w": ckstore.Shard(b.chunk(4, 1)[r].clone(), "tp", 1)}} for r in range(4)},
        run="s",
        world_layout=layout,
    )
    whole = store.diff("s@1", "s@2").tensors[0].stats
    windows: list[Any] = []
    real = _leaves._windows
    monkeypatch.setattr(_leaves, "_WINDOW_ELEMS", 1)
    monkeypatch.setattr(
        _leaves,
        "_windows",
        lambda shape, elems: windows.extend(real(shape, elems)) or real(shape, elems),
    )
    streamed = store.diff("s@1", "s@2").tensors[0].stats
    assert len(windows) == 4 and windows[-1][0] == (489, 600)
    assert whole is not None and streamed is not None
    want = _full_stats(a, b)
    for st in (whole, streamed):
        assert st.changed == 60000 and st.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-9)
        assert st.cosine == pytest.approx(want["cosine"], rel=1e-9)
        assert st.max_abs_diff == pytest.approx(want["max_abs_diff"], rel=1e-12)


def test_a_container_that_changes_type_is_a_change(store: ckstore.Store) -> None:
    store.commit(
        1, {0: {"m": {"t": [1, 2], "d": {0: 5}, "x": {"k": 1}, "e": [], "same": (1, [2])}}}, run="c"
    )
    store.commit(
        2, {0: {"m": {"t": (1, 2), "d": [5], "x": [1], "e": (), "same": (1, [2])}}}, run="c"
    )
    res = store.diff("c@1", "c@2")
    assert res.differs
    assert [(v.key, v.a, v.b) for v in res.values] == [
        ("m/t", "<list>", "<tuple>"),  # the same items
        ("m/d", "<dict>", "<list>"),  # the same item under the same key path
        ("m/x", "<dict>", "<list>"),
        ("m/e", [], []),  # empty containers were compared by type already
    ]
    # the items of a container are listed on their own, the container once
    assert [x.key for x in res.only_in_a] == ["m/x/k"] and [x.key for x in res.only_in_b] == [
        "m/x/0"
    ]
    # containers of the same type are no values of their own: equal items count, as before
    assert res.values_equal == 5  # t/0, t/1, d/0, same/0, same/1/0
    store.commit(3, {0: {"m": {"t": (1, 2, 3)}}}, run="c")
    store.commit(4, {0: {"m": {"t": (1, 2)}}}, run="c")
    grown = store.diff("c@4", "c@3")
    assert not grown.values and [x.key for x in grown.only_in_b] == ["m/t/2"]


def test_a_rank_gaining_or_losing_a_key_is_a_change(store: ckstore.Store) -> None:
    def states(**extra_of_rank: dict[str, Any]) -> dict[int, dict[str, Any]]:
        return {r: {"m": {"w": torch.ones(2), **extra_of_rank.get(f"r{r}", {})}} for r in range(2)}

    store.commit(1, states(r0={"v": 1}), run="g")  # v on rank 0 only
    store.commit(2, states(r0={"v": 1}, r1={"v": 1}), run="g")  # now on both ranks, equal
    res = store.diff("g@1", "g@2")
    assert res.differs and not res.values
    assert [(x.key, x.rank, x.value) for x in res.only_in_b] == [("m/v", 1, 1)]
    back = store.diff("g@2", "g@1")
    assert [(x.key, x.rank) for x in back.only_in_a] == [("m/v", 1)] and not back.only_in_b
    # a tensor a rank gained, and a key added on one rank only
    store.commit(3, states(r0={"v": 1}, r1={"v": 1, "t": torch.zeros(3)}), run="g")
    res = store.diff("g@2", "g@3")
    assert [(x.key, x.rank, x.kind) for x in res.only_in_b] == [("m/t", 1, "tensor")]
    assert store.diff("g@2", "g@2").identical and res.values_equal == 1
    # a rank the other checkpoint does not have lacks nothing: one rank grew to two, v on rank 0
    store.commit(1, {0: {"m": {"w": torch.ones(2), "v": 1}}}, run="h")
    store.commit(2, states(r0={"v": 1}), run="h")
    assert store.diff("h@1", "h@2").identical and store.diff("h@2", "h@1").identical


def test_large_int64_values_compare_exactly(store: ckstore.Store) -> None:
    big = 2**60
    top, bottom = 2**63 - 1, -(2**63)
    u64 = torch.uint64
    a = {"i": torch.tensor([big, 5, top]), "u": torch.tensor([7, 0], dtype=u64)}
    b = {"i": torch.tensor([big + 1, 5, top]), "u": torch.tensor([7, 2**64 - 1], dtype=u64)}
    store.commit(1, {0: {"m": a}}, run="i")
    store.commit(2, {0: {"m": b}}, run="i")
    store.commit(3, {0: {"m": {"i": torch.tensor([big, 5, bottom])}}}, run="i")
    res = store.diff("i@1", "i@2", tolerance=0)
    t = {d.key: d for d in res.tensors}
    st = t["m/i"].stats
    assert t["m/i"].status == "changed" and st is not None
    assert (st.changed, st.max_abs_diff) == (1, 1.0)
    u = t["m/u"].stats
    assert t["m/u"].status == "changed" and u is not None and u.max_abs_diff == float(2**64 - 1)
    assert store.diff("i@1", "i@2", key="m/i", tolerance=1).tensors[0].status == "close"
    assert store.diff("i@1", "i@2", key="m/i", tolerance=0.5).tensors[0].status == "changed"
    # the difference of int64 extremes does not wrap around: 2**64 - 1 apart
    (w,) = store.diff("i@1", "i@3", tolerance=2.0**63).tensors
    assert (
        w.status == "changed" and w.stats is not None and w.stats.max_abs_diff == float(2**64 - 1)
    )
    assert store.diff("i@1", "i@3", tolerance=2.0**64).tensors[0].status == "close"
    # a difference float64 rounds down is decided exactly: 2**53 + 1 is beyond a tolerance of 2**53
    store.commit(4, {0: {"m": {"j": torch.tensor([0, 2**53 + 1])}}}, run="i")
    store.commit(5, {0: {"m": {"j": torch.tensor([0, 0])}}}, run="i")
    assert store.diff("i@4", "i@5", tolerance=2.0**53).tensors[0].status == "changed"
    assert store.diff("i@4", "i@5", tolerance=2.0**53 + 2).tensors[0].status == "close"
