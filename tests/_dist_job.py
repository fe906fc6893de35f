"""One rank of a real torch.distributed (gloo) job, for tests/test_distributed.py.

    python tests/_dist_job.py SCENARIO STORE PORT RANK WORLD OUT

Each scenario checks what it can on its own rank and writes a JSON report to OUT/rank<R>.json;
an assertion that fails makes the process exit non-zero with the traceback on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from helpers import bits, expected_piece, random_tensor

import ckstore
from ckstore import Shard, WorldLayout

SAVED = WorldLayout({"dp": 2, "tp": 2})
SPLITS = {"qkv": ((0, "tp"),), "proj": ((1, "tp"),), "flat": ((0, "dp"),)}
FLAT_CUT = 150_001  # the dp=0 rank holds flat[:FLAT_CUT]: an uneven, explicit partition


def global_tensors() -> dict[str, torch.Tensor]:
    """The global tensors the job's ranks hold pieces of (the same on every process)."""
    gen = torch.Generator().manual_seed(1234)
    return {
        "qkv": random_tensor(torch.float32, (96, 640), gen),  # 240 KiB: several 64 KiB chunks
        "proj": random_tensor(torch.bfloat16, (130, 512), gen),
        "emb": random_tensor(torch.float16, (300, 256), gen),
        "flat": random_tensor(torch.float32, (250_000,), gen),
        "dt_row": random_tensor(torch.float32, (99, 300), gen),
        "dt_grid": random_tensor(torch.int32, (50, 41), gen),
        "dt_nested": random_tensor(torch.float32, (202, 64), gen),
        "dt_rep": random_tensor(torch.float64, (17,), gen),
        "dt_sub": random_tensor(torch.float16, (33, 8), gen),
    }


def rank_states(rank: int, g: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What rank ``rank`` of the saved {dp: 2, tp: 2} world commits."""
    c = SAVED.coords(rank)
    a, b = (0, FLAT_CUT) if c["dp"] == 0 else (FLAT_CUT, g["flat"].numel())
    return {
        "model_states": {
            "qkv": Shard(torch.chunk(g["qkv"], 2, 0)[c["tp"]].clone(), mesh_dim="tp", dim=0),
            "proj": Shard(torch.chunk(g["proj"], 2, 1)[c["tp"]].clone(), mesh_dim="tp", dim=1),
            "emb": g["emb"].clone(),
            "step": 7,
        },
        "optim_states": {
            "flat": Shard(g["flat"][a:b].clone(), mesh_dim="dp", offsets=(a,), global_shape=(g["flat"].numel(),)),
            "rng": torch.tensor([rank, 1000 + rank]),
        },
    }


def check_step1(got: dict[str, Any], g: dict[str, torch.Tensor], layout: WorldLayout, rank: int) -> None:
    c = layout.coords(rank)
    m, o = got["model_states"], got["optim_states"]
    for name in ("qkv", "proj"):
        assert type(m[name]) is torch.Tensor, type(m[name])
        assert bits(m[name]) == bits(expected_piece(g[name], SPLITS[name], layout, c)), (layout, rank, name)
    assert bits(m["emb"]) == bits(g["emb"]) and m["step"] == 7
    assert bits(o["flat"]) == bits(expected_piece(g["flat"], SPLITS["flat"], layout, c)), (layout, rank)


DT_PLACEMENTS = {  # name: placements on the ("dp", "tp") mesh, as (kind, dim)
    "dt_row": (("R", 0), ("S", 0)),
    "dt_grid": (("S", 0), ("S", 1)),
    "dt_nested": (("S", 0), ("S", 0)),
    "dt_rep": (("R", 0), ("R", 0)),
}


DT_SUB = "dt_sub"  # Shard(0) on the sub-mesh mesh["tp"]
DT_NAMES = [*DT_PLACEMENTS, DT_SUB]


def dt_splits(name: str) -> tuple[tuple[int, str], ...]:
    if name == DT_SUB:
        return ((0, "tp"),)
    return tuple((d, m) for (kind, d), m in zip(DT_PLACEMENTS[name], ("dp", "tp")) if kind == "S")


# -- scenarios ----------------------------------------------------------------------------------


def scenario_main(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    g = global_tensors()
    ck = store.commit(1, {rank: rank_states(rank, g)}, {"loss": 0.5 + rank}, world_layout=SAVED, tags=["first"])
    records = [None] * world
    dist.all_gather_object(records, (ck.id, ck.ref, ck.ranks, ck.metrics, ck.tags, ck.world_layout.mesh))
    assert all(r == records[0] for r in records), records
    assert ck.ranks == (0, 1, 2, 3) and ck.metrics == {"loss": 0.5} and ck.tags == ("first",)
    out["stored_bytes_added"] = ck.stored_bytes_added

    # the saved layout: each rank gets back its own pieces (reading only its own entries)
    mine = store.checkout("latest", world_layout=SAVED)
    assert list(mine) == [rank]
    want = rank_states(rank, g)
    assert bits(mine[rank]["model_states"]["qkv"]) == bits(want["model_states"]["qkv"].tensor)
    assert bits(mine[rank]["optim_states"]["flat"]) == bits(want["optim_states"]["flat"].tensor)
    assert mine[rank]["optim_states"]["rng"].tolist() == [rank, 1000 + rank]

    # 4 ranks as {tp: 4}: per-rank rng has no source for tp = 2, 3 unless a fallback is chosen
    tp4 = WorldLayout({"tp": 4})
    try:
        got = store.checkout("latest", world_layout=tp4)
        assert rank < 2, "ranks at tp=2,3 must not silently get another rank's rng"
        assert got[rank]["optim_states"]["rng"].tolist() == [rank, 1000 + rank]
    except ckstore.LayoutError as e:
        assert rank >= 2 and "'rng'" in str(e), str(e)
        out["tp4_error"] = str(e)
    got = store.checkout("latest", world_layout=tp4, fallback="modulo")
    assert list(got) == [rank]
    check_step1(got[rank], g, tp4, rank)

    # a DTensor state dict on a named device mesh; the world layout comes from the mesh
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dts = {
        name: distribute_tensor(g[name], mesh, [DShard(d) if kind == "S" else Replicate() for kind, d in pl])
        for name, pl in DT_PLACEMENTS.items()
    }
    dts[DT_SUB] = distribute_tensor(g[DT_SUB], mesh["tp"], [DShard(0)])
    ck2 = store.commit(2, {rank: {"model_states": {**dts, "extra": torch.arange(3)}}})
    assert ck2.world_layout == SAVED, ck2.world_layout
    mine = store.checkout(2, world_layout=SAVED)[rank]["model_states"]
    for name, dt in dts.items():
        assert isinstance(dt, DTensor) and type(mine[name]) is torch.Tensor
        assert bits(mine[name]) == bits(dt.to_local()), name
    # ...and reshards: 4 ranks along dp, and the full tensors rebuilt with DTensor itself
    dp4 = WorldLayout({"dp": 4})
    got = store.checkout(2, world_layout=dp4)[rank]["model_states"]
    for name in dts:
        assert bits(got[name]) == bits(expected_piece(g[name], dt_splits(name), dp4, dp4.coords(rank))), name
    flat_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    for name in ("dt_grid", "dt_nested"):  # split along dim 0 by dp (dt_row is split by tp only)
        rebuilt = DTensor.from_local(got[name], flat_mesh, [DShard(0)], shape=g[name].shape, stride=g[name].stride())
        assert bits(rebuilt.full_tensor()) == bits(g[name]), name
    out["ok"] = True


def scenario_tp2(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    """A job of another shape: 2 ranks as {tp: 2}."""
    g = global_tensors()
    tp2 = WorldLayout({"tp": 2})
    got = store.checkout(1, world_layout=tp2)
    assert list(got) == [rank]
    check_step1(got[rank], g, tp2, rank)
    assert got[rank]["optim_states"]["rng"].tolist() == [rank, 1000 + rank]  # the dp=0 ranks' own
    got2 = store.checkout(2, world_layout=tp2)[rank]["model_states"]
    for name in DT_NAMES:
        assert bits(got2[name]) == bits(expected_piece(g[name], dt_splits(name), tp2, {"tp": rank})), name
    # every rank of a job may also ask for the consolidated states
    full = store.checkout(1, world_layout=WorldLayout.single())
    assert list(full) == [0]
    check_step1(full[0], g, WorldLayout.single(), 0)
    with_bad_size = None
    try:
        store.checkout(1, world_layout=WorldLayout({"tp": 4}))
    except ckstore.LayoutError as e:
        with_bad_size = str(e)
    assert with_bad_size and "process group has 2" in with_bad_size
    out["ok"] = True


def _expect_failure(out: dict[str, Any], name: str, fn: Any) -> None:
    try:
        fn()
    except ckstore.DistributedCommitError as e:
        out[name] = str(e)
        return
    raise AssertionError(f"{name}: the commit did not fail")


def scenario_fail(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    g = global_tensors()
    states = rank_states(rank, g)

    # a rank whose states cannot be stored fails before anything is written
    bad = {**states, "extra": {"obj": object()}} if rank == 1 else states
    _expect_failure(out, "early", lambda: store.commit(3, {rank: bad}, world_layout=SAVED))

    # a rank whose writes fail mid-commit, after the others wrote their packs
    real_writer = store.blobs.writer

    def failing_writer(key: str, size_hint: int | None = None) -> Any:
        raise OSError(f"injected write failure on rank {rank}")

    if rank == 2:
        store.blobs.writer = failing_writer  # type: ignore[method-assign]
    _expect_failure(out, "mid", lambda: store.commit(3, {rank: states}, world_layout=SAVED))
    store.blobs.writer = real_writer  # type: ignore[method-assign]

    # rank 0 itself failing (the step exists) is reported to every rank too
    store.commit(4, {rank: states}, world_layout=SAVED)
    _expect_failure(out, "exists", lambda: store.commit(4, {rank: states}, world_layout=SAVED))

    # pieces that overlap only in their union: every rank refuses them before anything is written
    cut = (0, 5) if rank == 0 else (4 + 3 * (rank - 1), 4 + 3 * rank)  # ranks 0 and 1 both hold flat[4]
    piece = Shard(torch.zeros(cut[1] - cut[0]), "dp", offsets=(cut[0],), global_shape=(1 + 3 * world,))
    try:
        store.commit(3, {rank: {"m": {"flat": piece}}}, world_layout=WorldLayout.flat(world))
        raise AssertionError("overlapping pieces were committed")
    except ckstore.LayoutError as e:
        out["overlap"] = str(e)

    # ranks that disagree on the step
    _expect_failure(out, "disagree", lambda: store.commit(5 + (rank == 3), {rank: states}, world_layout=SAVED))

    # DTensors that cannot be stored as they are: partial sums, an unnamed mesh
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    partial = DTensor.from_local(torch.ones(4), mesh, [Replicate(), Partial()])
    _expect_failure(out, "partial", lambda: store.commit(3, {rank: {"m": {"grad": partial}}}))
    unnamed = DTensor.from_local(torch.ones(4), init_device_mesh("cpu", (4,)), [Replicate()])
    _expect_failure(out, "unnamed", lambda: store.commit(3, {rank: {"m": {"w": unnamed}}}))

    # the group is still usable, and a later commit of the failed step succeeds
    ck = store.commit(3, {rank: states}, world_layout=SAVED)
    out["final"] = ck.step
    out["ok"] = True


def scenario_kill(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    """Rank 2 dies (SIGKILL) while writing its packs; the others must fail, not hang."""
    g = global_tensors()
    if rank == 2:
        real_writer = store.blobs.writer

        def dying_writer(key: str, size_hint: int | None = None) -> Any:
            os.kill(os.getpid(), 9)
            return real_writer(key, size_hint)

        store.blobs.writer = dying_writer  # type: ignore[method-assign]
    _expect_failure(out, "killed", lambda: store.commit(1, {rank: rank_states(rank, g)}, world_layout=SAVED))
    out["ok"] = True


def scenario_lease(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    """Rank 0's pending checkpoint is taken over while it writes: it must stop writing, and
    every rank must fail."""
    import threading

    chunks = 8  # this many 64 KiB chunks per rank, all distinct: each rank writes its own
    states = {rank: {"m": {f"w{i}": torch.full((16 * 1024,), float(rank * 100 + i)) for i in range(chunks)}}}
    calls: list[int] = []

    def progress(done: int, total: int) -> None:
        calls.append(done)

    if rank == 0:
        lost = threading.Event()
        real_heartbeat = store.catalog.heartbeat

        def heartbeat(ckpt_id: int, owner: Any) -> bool:
            alive = real_heartbeat(ckpt_id, owner)
            if not alive:
                lost.set()
            return alive

        store.catalog.heartbeat = heartbeat  # type: ignore[method-assign]

        def progress(done: int, total: int) -> None:  # noqa: F811 - rank 0's own
            calls.append(done)
            if len(calls) == 1:  # another process judges the commit abandoned and reaps it
                for ckpt_id, *_ in store.catalog.pending():
                    store.catalog.delete_checkpoint(ckpt_id)
                assert lost.wait(60), "the heartbeat never noticed the lost claim"

    _expect_failure(out, "lost", lambda: store.commit(1, states, progress=progress))
    out["calls"] = len(calls)
    out["chunks"] = chunks
    out["ok"] = True


def replica_states(rank: int, world: int = 4) -> dict[str, Any]:
    """Rank ``rank`` of a data-parallel job of ``world`` ranks: a replicated 1 MiB tensor (16
    chunks of 64 KiB), then its part of a sharded 512 KiB one (8 chunks in all)."""
    gen = torch.Generator().manual_seed(77)
    w = torch.randn(256 * 1024, generator=gen)
    s = torch.randn(4 * 32 * 1024, generator=gen)
    return {"m": {"w": w, "s": Shard(torch.chunk(s, world)[rank].clone(), mesh_dim="dp", dim=0)}}


def scenario_replicated(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    """Commit and check out (as ``{dp: world}``) a replicated tensor; report the blob store's
    counters for each."""
    layout = WorldLayout({"dp": world})
    stats = store.blobs.stats
    before = stats.snapshot()
    store.commit(1, {rank: replica_states(rank, world)}, world_layout=layout)
    after = stats.snapshot()
    out["written"] = {k: after[k] - before[k] for k in ("writes", "bytes_written", "reads", "bytes_read")}
    got = store.checkout(1, world_layout=layout)
    done = stats.snapshot()
    out["read"] = {k: done[k] - after[k] for k in ("reads", "bytes_read", "writes")}
    want = replica_states(rank, world)["m"]
    assert list(got) == [rank]
    assert bits(got[rank]["m"]["w"]) == bits(want["w"]) and bits(got[rank]["m"]["s"]) == bits(want["s"].tensor)
    out["ok"] = True


def scenario_lost_commit(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    """Rank 0's catalog connection (through tests/pgproxy.py) drops at the COMMIT that makes step 1
    visible, once the server committed it; then every rank retries the commit."""
    from pgproxy import PgProxy

    layout = WorldLayout({"dp": world})
    states = {rank: replica_states(rank, world)}
    committer = store
    if rank == 0:  # only rank 0 talks to the catalog
        proxy = PgProxy.in_front_of(store.catalog.url)
        committer = ckstore.open(store.location, catalog=proxy.url(store.catalog.url), run="exp", create=False)
        proxy.cut_commit("INSERT INTO entries", "after")
    _expect_failure(out, "lost", lambda: committer.commit(1, states, world_layout=layout))
    if rank == 0:
        out["cut"] = proxy.cut is not None and proxy.cut.server_committed
    _expect_failure(out, "retry", lambda: committer.commit(1, states, world_layout=layout))
    if rank == 0:
        committer.close()
        proxy.close()
    out["ok"] = True


CRASH_LAYOUT = WorldLayout({"dp": 2})


def crash_states(rank: int, step: int) -> dict[str, Any]:
    """What rank ``rank`` commits at ``step`` in the ``crash`` scenario: a replicated tensor
    (written by one rank) and one of its own, over several tiny packs."""
    gen = torch.Generator().manual_seed(step)
    rep = torch.randn(5000, generator=gen)
    own = torch.randn(4000 + rank, generator=torch.Generator().manual_seed(100 * step + rank))
    return {"m": {"rep": rep, "own": own, "step": step}}


def scenario_crash(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    """Step 2 of a {dp: 2} job; one rank dies at the kill point ``CKSTORE_CRASH_AT`` names."""
    try:
        out["committed"] = store.commit(2, {rank: crash_states(rank, 2)}, world_layout=CRASH_LAYOUT).step
    except ckstore.DistributedCommitError as e:
        out["error"] = str(e)
    out["ok"] = True


def delta_states(rank: int, step: int) -> dict[str, Any]:
    """Step ``step`` of a {dp: world} job whose tensors drift a little each step: a shard of
    its own per rank and a replicated tensor (written by one rank)."""
    g = torch.Generator().manual_seed(99)
    own, rep = torch.randn(2, 30_000, generator=g), torch.randn(30_000, generator=g)
    for _ in range(step + 1):
        own += 1e-4 * torch.randn(own.shape, generator=g)
        rep += 1e-4 * torch.randn(rep.shape, generator=g)
    return {"model_states": {"own": Shard(own[rank : rank + 1].clone(), mesh_dim="dp", dim=0), "rep": rep.clone()}}


def scenario_delta(store: ckstore.Store, rank: int, world: int, out: dict[str, Any]) -> None:
    """Four collective commits writing deltas (``delta_chain=2``), each checked out again."""
    store.write_deltas(2)
    layout = WorldLayout({"dp": world})  # of 2 ranks
    for step in range(4):
        store.commit(step, {rank: delta_states(rank, step)}, world_layout=layout)
    for step in range(4):
        got = store.checkout(step, layout, ranks=[rank])[rank]["model_states"]
        want = delta_states(rank, step)["model_states"]
        assert bits(got["rep"]) == bits(want["rep"]), step
        assert bits(got["own"]) == bits(want["own"].tensor), step
    out["ok"] = True


def main() -> None:
    scenario, store_path, port, rank_s, world_s, out_dir = sys.argv[1:7]
    rank, world = int(rank_s), int(world_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=40)
    )
    out: dict[str, Any] = {"rank": rank}
    store = ckstore.open(store_path, run="exp", create=False, workers=2)
    try:
        globals()[f"scenario_{scenario}"](store, rank, world, out)
    except BaseException:
        out["traceback"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        store.close()
    if scenario in ("kill", "crash"):
        os._exit(0)  # the group lost a rank: tearing it down could wait on the dead peer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
