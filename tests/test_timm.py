"""ckstore.integrations.timm without timm: the retention rules, the store kept in step with the
saver, bit-exact resume, frozen tensors stored once. Parity with timm's own saver:
tests/integrations_timm/."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckstore
from ckstore.errors import CheckpointNotFoundError, StoreConfigError
from ckstore.integrations import timm as cktimm
from ckstore.integrations.timm import Kept, admit


def _keep(kept: tuple[Kept, ...]) -> list[int]:
    return [k.epoch for k in kept]


def _run(metrics: list[float | None], max_history: int, decreasing: bool = False) -> tuple[list[int], Any]:
    kept: tuple[Kept, ...] = ()
    best = None
    for epoch, m in enumerate(metrics):
        a = admit(kept, Kept(epoch, epoch, m), best, max_history=max_history, decreasing=decreasing)
        kept = a.kept
        if a.new_best:
            best = m
    return _keep(kept), best


# -- the rules, case by case (timm 1.0.31's saver, read from its source) -------------------------


def test_top_k_by_metric_best_first() -> None:
    assert _run([0.1, 0.5, 0.3, 0.9, 0.2], 3) == ([3, 1, 2], 0.9)
    assert _run([0.1, 0.5, 0.3, 0.9, 0.2], 3, decreasing=True) == ([0, 4, 2], 0.1)


def test_ties_keep_the_earlier_epoch() -> None:
    # a tie ranks after the earlier equal metric, and a tie with the worst of a full list stays out
    assert _run([0.5, 0.5, 0.5], 2) == ([0, 1], 0.5)
    assert _run([0.5, 0.5, 0.7], 2) == ([2, 0], 0.7)
    assert _run([0.5, 0.5, 0.7], 2, decreasing=True) == ([0, 1], 0.5)


def test_unranked_follow_ranked_newest_first() -> None:
    # without metrics the history is the last max_history epochs
    assert _run([None, None, None, None], 2) == ([3, 2], None)
    # an unranked checkpoint never displaces a ranked one; a ranked one displaces an unranked one
    assert _run([0.5, 0.6, None], 2) == ([1, 0], 0.6)
    assert _run([None, None, 0.1], 2) == ([2, 1], 0.1)
    assert _run([0.3, None, None, 0.2], 3) == ([0, 3, 2], 0.3)


def test_max_history_one() -> None:
    assert _run([0.5, 0.4, 0.6, None], 1) == ([2], 0.6)
    assert _run([None, 0.2, None], 1) == ([1], 0.2)


# -- a tiny training job -------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self, frozen: int = 0) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(frozen or 8, frozen or 8)
        self.head = torch.nn.Linear(frozen or 8, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        if frozen:
            self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.head(torch.relu(self.backbone(x))))


def _job(seed: int = 0, frozen: int = 0) -> tuple[Net, torch.optim.Optimizer, torch.Generator]:
    torch.manual_seed(seed)
    model = Net(frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt, torch.Generator().manual_seed(seed + 1)


def _epoch(model: Net, opt: torch.optim.Optimizer, gen: torch.Generator, steps: int = 3) -> float:
    width = model.backbone.in_features
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(16, width, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(model="net", eval_metric="top1", lr=1e-2, data_dir=Path("/data"), **kw)


def _store(tmp_path: Path, run: str = "exp") -> ckstore.Store:
    return ckstore.open(tmp_path / "store", run=run, chunk_size=4096, pack_size=1 << 20)


def _epoch_refs(store: ckstore.Store, run: str = "exp") -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for c in store.checkpoints(run):
        out.setdefault(c.kind, []).append(int(c.metrics["epoch"]))
    return out


def test_saver_commits_kinds_metrics_and_tags(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model, opt, gen = _job()
    saver = cktimm.CheckpointSaver(model, opt, _args(), max_history=2, store=store)
    returns = []
    for epoch, top1 in enumerate([0.2, 0.5, 0.4, 0.1, 0.5]):
        _epoch(model, opt, gen)
        saver.save_recovery(epoch, batch_idx=7)
        returns.append(saver.save_checkpoint(epoch, top1))
    assert returns == [(0.2, 0), (0.5, 1), (0.5, 1), (0.5, 1), (0.5, 1)]
    # epoch 4 ties epoch 1's 0.5 and ranks after it; epoch 2 made room
    assert [store.resolve(r).metrics["epoch"] for r, _ in saver.checkpoint_files] == [1, 4]
    cks = {c.step: c for c in store.checkpoints("exp")}
    epochs = sorted(int(c.metrics["epoch"]) for c in cks.values() if c.kind == "epoch")
    assert epochs == [1, 4]  # the top two, `last` among them
    assert store.resolve("last").metrics == {"epoch": 4.0, "top1": 0.5}
    assert store.resolve("model_best").metrics == {"epoch": 1.0, "top1": 0.5}
    rec = [c for c in cks.values() if c.kind == "recovery"]
    assert sorted(int(c.metrics["epoch"]) for c in rec) == [3, 4]  # timm's two recovery files
    assert all(c.metrics["batch_idx"] == 7 for c in rec)
    assert saver.find_recovery() == max(rec, key=lambda c: c.step).ref
    meta = cktimm.checkpoint_dict(store, "last", sub_keys=[])
    assert meta["epoch"] == 4 and meta["version"] == 2 and meta["arch"] == "net" and meta["metric"] == 0.5
    assert meta["args"].data_dir == "/data" and meta["args"].eval_metric == "top1"


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model, opt, gen = _job()
    saver = cktimm.CheckpointSaver(model, opt, _args(), store=store)
    for epoch in range(3):
        saver.save_checkpoint(epoch, -_epoch(model, opt, gen))
    rng = gen.get_state()
    ref = store.resolve("last").ref
    expected = _epoch(model, opt, gen)  # the uninterrupted run's next epoch
    want = {k: v.clone() for k, v in model.state_dict().items()}

    fresh, fresh_opt, _ = _job(seed=99)
    start = cktimm.resume_checkpoint(fresh, store, ref, fresh_opt)
    assert start == 3
    gen.set_state(rng)
    got = _epoch(fresh, fresh_opt, gen)
    assert got == expected
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_frozen_backbone_is_stored_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model, opt, gen = _job(frozen=256)
    saver = cktimm.CheckpointSaver(model, opt, _args(), store=store)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.backbone.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert frozen_bytes > 50 * trainable
    added = []
    for epoch in range(3):
        _epoch(model, opt, gen)
        saver.save_checkpoint(epoch, float(epoch))
        added.append(store.resolve("last").stored_bytes_added)
    assert added[0] >= frozen_bytes * 0.5  # the first save stores the backbone (compressed)
    # later saves add the head, its optimizer state and the BN buffers, not the backbone again
    # measured: [230309, 8049, 8023] bytes against a 263168-byte backbone and 3108 trainable bytes
    # (weights + two AdamW moments = 9324 raw)
    assert all(a < frozen_bytes * 0.05 and a < 4 * trainable for a in added[1:]), (added, frozen_bytes, trainable)


def test_milestone_copies_last_and_is_never_deleted(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model, opt, gen = _job()
    saver = cktimm.CheckpointSaver(model, opt, _args(), max_history=1, store=store)
    with pytest.raises(CheckpointNotFoundError, match="no 'last' checkpoint"):
        saver.save_milestone(1)
    saver.save_checkpoint(0, 0.1)
    ref = saver.save_milestone(1)
    ms = store.resolve(ref)
    last = store.resolve("last")
    assert ms.kind == "milestone" and "milestone-1" in ms.tags and ms.metrics == last.metrics
    assert ms.stored_bytes_added < last.stored_bytes_added / 10  # every chunk already stored
    for epoch in range(1, 4):
        _epoch(model, opt, gen)
        saver.save_checkpoint(epoch, 0.2 + epoch)
    assert store.resolve("milestone-1").step == ms.step
    a, b = cktimm.checkpoint_dict(store, ms), cktimm.checkpoint_dict(store, store.resolve("milestone-1"))
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])


def test_saver_state_survives_a_restart(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model, opt, _ = _job()
    metrics = [0.3, 0.9, 0.1, 0.5]
    one = cktimm.CheckpointSaver(model, opt, _args(), max_history=2, store=store)
    for e, m in enumerate(metrics):
        one.save_checkpoint(e, m)
    # a new saver takes over from the last checkpoint's record, and goes on as the first would
    two = cktimm.CheckpointSaver(model, opt, _args(), max_history=2, store=store)
    assert two.load_state_dict_from_checkpoint("last")
    assert two.state_dict() == one.state_dict()
    assert two.save_checkpoint(4, 0.95) == (0.95, 4)
    assert [store.resolve(r).metrics["epoch"] for r, _ in two.checkpoint_files] == [4, 1]
    assert sorted(_epoch_refs(store)["epoch"]) == [1, 4]
    with pytest.raises(StoreConfigError, match="run"):
        cktimm.CheckpointSaver(model, opt, store=store, run="other").load_state_dict(one.state_dict())


def test_user_tags_protect_checkpoints(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model, opt, _ = _job()
    saver = cktimm.CheckpointSaver(model, opt, max_history=1, store=store)
    saver.save_checkpoint(0, 0.1)
    store.tag(store.resolve("last").ref, "paper")
    saver.save_checkpoint(1, 0.2)
    saver.save_checkpoint(2, 0.3)
    assert sorted(_epoch_refs(store)["epoch"]) == [0, 2]
    assert store.resolve("paper").metrics["epoch"] == 0


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model, opt, _ = _job()
    with pytest.raises(StoreConfigError, match="max_history"):
        cktimm.CheckpointSaver(model, opt, max_history=0, store=store)
    with pytest.raises(StoreConfigError, match="needs a run"):
        cktimm.CheckpointSaver(model, opt, store=ckstore.open(tmp_path / "s2"))
    saver = cktimm.CheckpointSaver(model, opt, store=store)
    for bad in (lambda: saver.save_checkpoint(-1), lambda: saver.save_checkpoint(0, "high"),
                lambda: saver.save_recovery(0, batch_idx=-2)):  # fmt: skip
        with pytest.raises(StoreConfigError):
            bad()
    assert saver.find_recovery() == ""
    assert store.runs() == []  # nothing was written


def test_unwrap_and_clean_like_timm() -> None:
    net = torch.nn.Linear(2, 2)
    ddp_like = torch.nn.Module()
    ddp_like.module = net
    compiled_like = torch.nn.Module()
    compiled_like._orig_mod = ddp_like
    assert cktimm.unwrap_model(compiled_like) is net
    assert cktimm.clean_state_dict({"module.w": 1, "_orig_mod.b": 2, "x": 3}) == {"w": 1, "b": 2, "x": 3}

    # torch.compile around DDP: timm strips both prefixes, in either order
    assert cktimm.clean_state_dict({"_orig_mod.module.w": 1, "module._orig_mod.b": 2}) == {"w": 1, "b": 2}


def test_resume_strips_the_prefixes_of_a_compiled_ddp_module(tmp_path: Path) -> None:
    store = _store(tmp_path)
    net = torch.nn.Linear(2, 2)
    ddp_like = torch.nn.Module()
    ddp_like.module = net
    compiled_like = torch.nn.Module()
    compiled_like._orig_mod = ddp_like  # torch.compile(DDP(net)): keys '_orig_mod.module.weight'
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    saver = cktimm.CheckpointSaver(compiled_like, opt, store=store, unwrap_fn=lambda m: m)
    saver.save_checkpoint(0, 0.5)
    assert "_orig_mod.module.weight" in cktimm.checkpoint_dict(store, "last")["state_dict"]
    fresh = torch.nn.Linear(2, 2)
    assert cktimm.resume_checkpoint(fresh, store, "last") == 1
    assert torch.equal(fresh.weight, net.weight) and torch.equal(fresh.bias, net.bias)


def test_numpy_and_tensor_metrics_are_stored_as_numbers(tmp_path: Path) -> None:
    import numpy as np

    store = _store(tmp_path)
    model, opt, _ = _job()
    saver = cktimm.CheckpointSaver(model, opt, _args(), max_history=2, store=store)
    assert saver.save_checkpoint(0, np.float32(0.25)) == (0.25, 0)
    assert saver.save_checkpoint(1, torch.tensor(0.5)) == (0.5, 1)
    assert store.resolve("model_best").metrics == {"epoch": 1.0, "top1": 0.5}
    assert cktimm.checkpoint_dict(store, "exp@0", sub_keys=[])["metric"] == 0.25
    # the saver's state is plain numbers, and a restarted saver takes it over
    assert [m for _, m in saver.checkpoint_files] == [0.5, 0.25]
    assert all(type(m) is float for _, _, m in saver.state_dict()["checkpoint_files"])
    two = cktimm.CheckpointSaver(model, opt, _args(), max_history=2, store=store)
    assert two.load_state_dict_from_checkpoint("last") and two.state_dict() == saver.state_dict()


def test_the_adapter_imports_no_timm() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'timm' or name.startswith(('timm.', 'torchvision')):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from ckstore.integrations import timm as t\n"
        "assert t.CheckpointSaver and t.resume_checkpoint\n"
        "assert not any(m == 'timm' or m.startswith(('timm.', 'torchvision')) for m in sys.modules)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    metrics=st.lists(st.one_of(st.none(), st.sampled_from([0.1, 0.2, 0.3, 0.5])), min_size=1, max_size=9),
    max_history=st.integers(1, 3),
    decreasing=st.booleans(),
)
def test_the_store_holds_what_the_saver_keeps(
    tmp_path_factory: pytest.TempPathFactory, metrics: list[float | None], max_history: int, decreasing: bool
) -> None:
    store = _store(tmp_path_factory.mktemp("s"))
    model, opt, _ = _job()
    saver = cktimm.CheckpointSaver(model, opt, max_history=max_history, decreasing=decreasing, store=store)
    for epoch, m in enumerate(metrics):
        saver.save_checkpoint(epoch, m)
        if epoch % 2:
            saver.save_recovery(epoch)
    kept_epochs, best = _run(metrics, max_history, decreasing)
    assert [int(store.resolve(r).metrics["epoch"]) for r, _ in saver.checkpoint_files] == kept_epochs
    last = len(metrics) - 1
    want = set(kept_epochs) | {last}
    tags = {c.tags[0] if c.tags else None for c in store.checkpoints("exp")}
    if best is not None:
        want.add(int(store.resolve("model_best").metrics["epoch"]))
        assert store.resolve("model_best").metrics["metric"] == best
    else:
        assert "model_best" not in tags
    assert sorted(_epoch_refs(store).get("epoch", [])) == sorted(want)
    assert store.resolve("last").metrics["epoch"] == last
    assert len(_epoch_refs(store).get("recovery", [])) == min(2, len(metrics) // 2)


def _ddp_job(rank: int, init: str, root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        store = ckstore.open(Path(root) / "store", run="ddp")
        if rank == 0:  # as timm's train.py: only the primary rank has a saver
            saver = cktimm.CheckpointSaver(model, opt, max_history=1, store=store)
            for epoch in range(3):
                saver.save_checkpoint(epoch, float(epoch))
        dist.barrier()
        fresh = torch.nn.Linear(4, 2)
        assert cktimm.resume_checkpoint(fresh, store, "model_best") == 3  # every rank reads rank 0's entries
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.module.state_dict().values()))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_only_the_primary_rank_saves_in_a_ddp_job(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_ddp_job, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    store = ckstore.open(tmp_path / "store", run="ddp")
    assert [(c.kind, c.metrics["epoch"], c.ranks) for c in store.checkpoints("ddp")] == [("epoch", 2.0, (0,))]


def test_a_diverged_metric_saves_the_epoch_unranked(tmp_path: Path) -> None:
    """A NaN or infinite metric (an evaluation that diverged) stopped training with an error at the
    save, where timm's saver saves the epoch: it is saved, kept as one without a metric, and never
    becomes the best."""
    store = _store(tmp_path)
    model, opt, _ = _job()
    saver = cktimm.CheckpointSaver(model, opt, max_history=2, store=store)
    assert saver.save_checkpoint(0, 0.5) == (0.5, 0)
    assert saver.save_checkpoint(1, float("nan")) == (0.5, 0)
    assert saver.save_checkpoint(2, torch.tensor(float("inf"))) == (0.5, 0)
    last = store.resolve("last")
    assert last.metrics["epoch"] == 2 and "metric" not in {k for k, v in last.metrics.items() if v == v}
    assert store.resolve("model_best").metrics["epoch"] == 0
    assert [ref for ref, _ in saver.checkpoint_files] == [f"exp@{store.resolve('model_best').step}", last.ref]
    assert saver.save_checkpoint(3, 0.75) == (0.75, 3)  # a ranked epoch displaces the unranked one
    assert sorted(_epoch_refs(store)["epoch"]) == [0, 3]
