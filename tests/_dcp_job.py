"""One rank of a real torch.distributed (gloo) job, for tests/test_dcp.py.

    python tests/_dcp_job.py SCENARIO STORE PORT RANK WORLD OUT

``save``: asynchronous collective commits (one that succeeds while the training's collectives
run, one that fails on one rank), then DCP saves of an FSDP2-sharded model and optimizer through
ckstore's Writer (``dcp.save``, ``dcp.async_save`` with frozen layers, one failing rank).
``load``: the same model sharded over another number of ranks, loaded through ckstore's Reader.
Each rank writes a JSON report to OUT/rank<R>.json; a failed assertion exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from helpers import bits

import ckstore
from ckstore import Shard
from ckstore.integrations import dcp as ckdcp

warnings.filterwarnings("ignore")

FROZEN = ("0", "1")  # layers frozen for the second save: only layer 2 trains


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 8))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 256, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def shard(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full(sd: Any) -> Any:
    """A state dict with every DTensor gathered to its full tensor (a collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(sd, DTensor):
        return sd.full_tensor()
    if isinstance(sd, dict):
        return {k: full(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [full(v) for v in sd]
    return sd


def expect_failure(fn: Any) -> str:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"{type(e).__name__}: {e}"
    raise AssertionError("did not fail")


def scenario_save(store: ckstore.Store, rank: int, world: int, out: dict[str, Any], tmp: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # -- an asynchronous collective commit: the state changes and training collectives run
    g = torch.Generator().manual_seed(5)
    full_w = torch.randn(world * 64, 300, generator=g)
    mine = full_w[rank * 64 : (rank + 1) * 64].clone()
    rep = torch.arange(1000, dtype=torch.float32)
    pending = store.commit(10, {rank: {"m": {"w": Shard(mine, "dp", 0), "rep": rep, "r": torch.tensor([rank])}}},
                           {"loss": 0.25}, blocking=False)  # fmt: skip
    mine.mul_(-1)
    rep.add_(1)
    total = torch.ones(1)
    dist.all_reduce(total)  # the training's own collective, on the default group, meanwhile
    ck = pending.wait()
    ids = [None] * world
    dist.all_gather_object(ids, ck.id)
    assert total.item() == world and len(set(ids)) == 1 and ck.ranks == tuple(range(world))
    got = store.checkout(10, world_layout=ckstore.WorldLayout.single())[0]["m"]
    assert bits(got["w"]) == bits(full_w) and bits(got["rep"]) == bits(torch.arange(1000, dtype=torch.float32))

    # ...and one whose rank 1 cannot write: every rank's wait() raises, nothing becomes visible
    real = store.blobs.writer
    if rank == 1:
        def failing(key: str, size_hint: int | None = None) -> Any:
            raise PermissionError("read-only blob store")

        store.blobs.writer = failing  # type: ignore[method-assign]
    pending = store.commit(11, {rank: {"m": {"w": torch.randn(64, 300), "r": torch.tensor([rank])}}}, blocking=False)
    out["async_failure"] = expect_failure(pending.wait)
    store.blobs.writer = real  # type: ignore[method-assign]

    # -- DCP: an FSDP2-sharded model and optimizer, saved by every rank through the Writer
    model = shard(make_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    writer = ckdcp.Writer(store, step=1, metrics={"loss": 1.0}, tags=["dcp"])
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    expected = full({"model": msd, "optim": osd})
    if rank == 0:
        assert writer.checkpoint is not None and writer.checkpoint.step == 1
        torch.save(expected, tmp / "expected1.pt")
        out["step1_added"] = writer.checkpoint.stored_bytes_added

    # frozen layers: the second save (asynchronous, through DCP) adds the trainable bytes only
    for name, p in model.named_parameters():
        if name.split(".")[0] in FROZEN:
            p.requires_grad_(False)
    train_step(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    future = dcp.async_save({"model": msd, "optim": osd}, storage_writer=ckdcp.Writer(store, step=2))
    future.result()
    expected2 = full({"model": msd, "optim": osd})
    if rank == 0:
        torch.save(expected2, tmp / "expected2.pt")
        trainable = sum(t.numel() * t.element_size() for t in (expected2["model"]["2.weight"], expected2["model"]["2.bias"]))
        out["trainable_bytes"] = 3 * trainable  # the parameters and Adam's two moments

    # a rank that fails: the save fails everywhere and nothing becomes visible
    if rank == 2:
        def failing(key: str, size_hint: int | None = None) -> Any:
            raise PermissionError("read-only blob store")

        store.blobs.writer = failing  # type: ignore[method-assign]
    train_step(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    out["dcp_failure"] = expect_failure(lambda: dcp.save({"model": msd, "optim": osd}, storage_writer=ckdcp.Writer(store, step=3)))
    store.blobs.writer = real  # type: ignore[method-assign]
    out["ok"] = True


def scenario_load(store: ckstore.Store, rank: int, world: int, out: dict[str, Any], tmp: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = shard(make_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 99)  # optimizer state exists, with other values
    for step in (1, 2):
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=ckdcp.Reader(store, step))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got = full(dict(zip(("model", "optim"), get_state_dict(model, opt))))
        expected = torch.load(tmp / f"expected{step}.pt", weights_only=True)
        for name, t in expected["model"].items():
            assert bits(got["model"][name]) == bits(t), (step, name)
        for name, st in expected["optim"]["state"].items():
            for k, t in st.items():
                assert bits(got["optim"]["state"][name][k]) == bits(t), (step, name, k)
        assert got["optim"]["param_groups"][0]["lr"] == expected["optim"]["param_groups"][0]["lr"]
    out["ok"] = True


def scenario_latest_race(store: ckstore.Store, rank: int, world: int, out: dict[str, Any], tmp: Path) -> None:
    """Rank 0's Reader names "latest" before a commit of step 2, the other ranks' after it."""
    alone = dist.new_group([0])
    if rank == 0:
        store.commit(1, {0: {"m": {"w": torch.zeros(8)}}}, process_group=alone)
    dist.barrier()
    reader = ckdcp.Reader(store, "latest") if rank == 0 else None
    dist.barrier()
    if rank == 0:
        store.commit(2, {0: {"m": {"w": torch.ones(8)}}}, process_group=alone)
    dist.barrier()
    if reader is None:
        reader = ckdcp.Reader(store, "latest")
    out["step"] = reader.checkpoint.step
    sd = {"m": {"w": torch.full((8,), -1.0)}}
    try:
        dcp.load(sd, storage_reader=reader)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        out["failure"] = f"{type(e).__name__}: {e}"
    out["w"] = sd["m"]["w"].tolist()
    out["ok"] = True


def main() -> None:
    scenario, store_path, port, rank_s, world_s, out_dir = sys.argv[1:7]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    out: dict[str, Any] = {"rank": rank}
    store = ckstore.open(store_path, run="exp", create=False, workers=2)
    try:
        globals()[f"scenario_{scenario}"](store, rank, world, out, Path(store_path).parent)
    except BaseException:
        out["traceback"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        store.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
