"""Collective commit and checkout vs torch.distributed.checkpoint (DCP), by world size.

    python benchmarks/bench_distributed.py [--sharded-mib 96] [--replicated-mib 24] [--repeat 3] [--dir DIR]
                                           [--workers N]

Runs real gloo jobs of 4, 2 and 1 ranks on this machine, one after another, all writing to the
same stores. Each job, on the same state dict and in the same run:

* sharded state (FSDP-like: a DTensor ``Shard(0)`` over ``dp``): ckstore commit vs ``dcp.save``;
  checkout in the job's own layout vs ``dcp.load``; and a reshard of the previous (larger) job's
  checkpoint into this job's layout, vs ``dcp.load`` into DTensors of this layout;
* replicated state (DDP-like: the same plain tensors on every rank): commit time and bytes that
  land on disk, for ckstore (one writer per chunk, picked by rank 0), ckstore with every rank
  writing its own copy (``writers="all"``, idempotent writes), and DCP (which dedups replicas).

Each rank's environment is what torchrun would give it (``OMP_NUM_THREADS=1``,
``LOCAL_WORLD_SIZE``), and its stores use ckstore's default threads, twice its share of the
cores, unless ``--workers`` says how many. Every job runs everything ``--repeat`` times on fresh
random data (nothing dedups against an earlier commit) and reports the best time, and beside it
the median and range of the repeats: wall clock on rank 0 between barriers. Both systems
fsync what they write; loads read from the page cache. Last, without any job, the sharded state
is saved as 1, 2 and 4 ranks from one process and each checked out into one rank: what a
reshard costs ckstore itself, apart from the jobs' scheduling.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port  # noqa: E402

TENSOR_MIB = 8  # the sharded state is made of 8 MiB fp32 matrices, the replicated one of 4 MiB
JOBS = [(4, []), (2, [4]), (1, [2, 4])]  # (world size, earlier jobs whose checkpoints it reshards)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# -- one rank --------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor import empty as dempty

    import ckstore
    from ckstore.commit import protocol
    from ckstore.commit.collective import active_group

    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))  # fmt: skip
    base = Path(args.dir)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    layout = ckstore.WorldLayout({"dp": world})
    shape = (2048, TENSOR_MIB * 1024 * 1024 // 4 // 2048)
    local_shape = (shape[0] // world, shape[1])
    # the default threads: with LOCAL_WORLD_SIZE set, as torchrun sets it, each rank's share of the cores
    threads = args.workers or None
    assigned = ckstore.open(base / "ckstore", run="bench", create=False, workers=threads)
    every = ckstore.open(base / "ckstore-all", run="bench", create=False, workers=threads)
    collective = active_group() is not None
    out: dict[str, Any] = {"world": world}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        """Rank 0's wall time between barriers; the best of every repeat is kept."""
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        took = time.perf_counter() - t0
        out[name] = min(out.get(name, float("inf")), took)
        out.setdefault(f"every_{name}", []).append(took)
        return result

    def dcp_target() -> dict[str, Any]:
        return {f"layer{i}.weight": dempty(*shape, device_mesh=mesh, placements=[Shard(0)])
                for i in range(max(1, args.sharded_mib // TENSOR_MIB))}  # fmt: skip

    def one_round(rep: int) -> None:
        # fresh data every repeat (and every job), so nothing dedups against earlier commits
        gen = torch.Generator().manual_seed(1_000_000 * world + 1000 * rep + rank)
        sharded = {
            k: DTensor.from_local(
                torch.randn(local_shape, generator=gen),
                mesh,
                [Shard(0)],
                shape=shape,
                stride=(shape[1], 1),
            )
            for k in dcp_target()
        }
        rgen = torch.Generator().manual_seed(
            1_000_000 * world + 1000 * rep + 999
        )  # the same on every rank
        replicated = {f"rep{i}.weight": torch.randn((1024, 1024), generator=rgen)
                      for i in range(max(1, args.replicated_mib // 4))}  # fmt: skip
        step, ck_dir = 1000 * world + rep, base / f"dcp-sharded-{world}-{rep}"

        # sharded state: commit / save, then load in the same layout
        timed("ck_commit", lambda: assigned.commit(step, {rank: {"model_states": sharded}}))
        timed("dcp_save", lambda: dcp.save(sharded, checkpoint_id=ck_dir))
        got = timed("ck_checkout", lambda: assigned.checkout(step, world_layout=layout))
        local = {k: v.to_local() for k, v in sharded.items()}
        assert all(torch.equal(got[rank]["model_states"][k], local[k]) for k in local)
        target = dcp_target()
        timed("dcp_load", lambda: dcp.load(target, checkpoint_id=ck_dir))
        assert all(torch.equal(target[k].to_local(), local[k]) for k in local)

        # reshard what earlier (larger) jobs saved into this job's layout
        for src in args.reshard_from:
            got = timed(
                f"ck_reshard_{src}", lambda s=src: assigned.checkout(1000 * s, world_layout=layout)
            )
            target = dcp_target()
            src_dir = base / f"dcp-sharded-{src}-0"
            timed(f"dcp_reshard_{src}", lambda t=target, d=src_dir: dcp.load(t, checkpoint_id=d))
            assert all(
                torch.equal(got[rank]["model_states"][k], target[k].to_local()) for k in target
            )

        # replicated state: time and bytes on disk, one writer per chunk vs every rank writing
        states = {rank: {"m": replicated}}
        for name, store, writers in (("ck", assigned, "assigned"), ("ckall", every, "all")):
            before = _du(Path(store.location))

            def commit(store: Any = store, writers: str = writers) -> Any:
                if collective:
                    ctx = protocol.CommitContext(
                        store.blobs, store.catalog, store.config, store.workers, store.run
                    )
                    return protocol.start(ctx, 100 + step, states, writers=writers).complete()
                return store.commit(100 + step, states)

            timed(f"{name}_rep_commit", commit)
            out[f"{name}_rep_bytes"] = _du(Path(store.location)) - before
        rep_dir = base / f"dcp-rep-{world}-{rep}"
        timed("dcp_rep_save", lambda: dcp.save(replicated, checkpoint_id=rep_dir))
        out["dcp_rep_bytes"] = _du(rep_dir)
        out["sharded_bytes"] = sum(v.numel() * 4 for v in sharded.values())
        out["replicated_bytes"] = sum(v.nbytes for v in replicated.values())

    for rep in range(args.repeat):
        one_round(rep)
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    assigned.close()
    every.close()
    dist.barrier()
    dist.destroy_process_group()


# -- the launcher ------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, world: int, reshard_from: list[int]) -> dict[str, Any]:
    out = Path(args.dir) / f"result-{world}.json"
    port = free_port()
    cmd = [sys.executable, __file__, "--worker", "--dir", args.dir, "--port", str(port), "--world", str(world),
           "--sharded-mib", str(args.sharded_mib), "--replicated-mib", str(args.replicated_mib),
           "--repeat", str(args.repeat), "--workers", str(args.workers), "--out", str(out),
           "--reshard-from", *map(str, reshard_from)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(world)}  # as torchrun sets them
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(world)]
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"the {world}-rank job failed")
    return dict(json.loads(out.read_text()))


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def report(results: list[dict[str, Any]]) -> None:
    def s(x: float) -> str:
        return f"{x:.2f}s"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x"

    print(
        "\nsharded state (DTensor Shard(0) over dp), best times of the repeats; ratio = ckstore / DCP (lower is "
        "better for ckstore); every repeat: the median (the fastest - the slowest)"
    )
    def spread(r: dict[str, Any], name: str) -> str:
        every = r.get(f"every_{name}", [r[name]])
        return f"{statistics.median(every):.2f}s ({min(every):.2f}-{max(every):.2f})"

    head = ["operation", "world", "ckstore", "DCP", "ratio", "ckstore, every repeat", "DCP, every repeat"]
    rows = []
    for r in results:
        w = r["world"]
        pairs = [("commit / save", "ck_commit", "dcp_save"), ("checkout / load, same layout", "ck_checkout", "dcp_load")]
        for src in sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("ck_reshard_")):
            pairs.append((f"reshard {src} -> {w} ranks", f"ck_reshard_{src}", f"dcp_reshard_{src}"))
        for what, a, b in pairs:
            rows.append([what, str(w), s(r[a]), s(r[b]), ratio(r[a], r[b]), spread(r, a), spread(r, b)])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    print(_row(head, widths))
    for row in rows:
        print(_row(row, widths))

    mib = 1024 * 1024
    print("\nreplicated state (every rank holds the same tensors): commit time and bytes on disk")
    head = [
        "world",
        "state",
        "ckstore",
        "bytes",
        "ckstore all-writers",
        "bytes",
        "DCP",
        "bytes",
        "ratio",
    ]
    rows = []
    for r in results:
        rows.append([str(r["world"]), f"{r['replicated_bytes'] / mib:.0f} MiB",
                     s(r["ck_rep_commit"]), f"{r['ck_rep_bytes'] / mib:.1f} MiB",
                     s(r["ckall_rep_commit"]), f"{r['ckall_rep_bytes'] / mib:.1f} MiB",
                     s(r["dcp_rep_save"]), f"{r['dcp_rep_bytes'] / mib:.1f} MiB",
                     ratio(r["ck_rep_commit"], r["dcp_rep_save"])])  # fmt: skip
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    print(_row(head, widths))
    for row in rows:
        print(_row(row, widths))


def in_process(args: argparse.Namespace) -> None:
    """The jobs' resharded checkouts without the jobs: the sharded state saved as 1, 2 and 4
    ranks from one process (``ckstore.Shard``), each checked out into one rank, in turn."""
    import ckstore
    from ckstore import Shard, WorldLayout

    g = torch.Generator().manual_seed(0)
    shape = (2048, TENSOR_MIB * 1024 * 1024 // 4 // 2048)
    full = {f"w{i}": torch.randn(*shape, generator=g) for i in range(args.sharded_mib // TENSOR_MIB)}
    store = ckstore.open(Path(args.dir) / "in-process", run="bench", chunk_size=1024 * 1024, workers=2)
    for world in (1, 2, 4):
        n = shape[0] // world
        states = {
            r: {"model": {k: Shard(v[r * n : (r + 1) * n].clone(), mesh_dim="dp", dim=0) for k, v in full.items()}}
            for r in range(world)
        }
        store.commit(step=world, rank_states=states, world_layout=WorldLayout({"dp": world}))
    times: dict[int, list[float]] = {1: [], 2: [], 4: []}
    for _ in range(15):
        for world, got in times.items():
            t0 = time.perf_counter()
            store.checkout(world, world_layout=WorldLayout.single())
            got.append(time.perf_counter() - t0)
    store.close()
    print(f"\none process, the {args.sharded_mib} MiB sharded state checked out into one rank (median of 15)")
    for world, got in times.items():
        print(f"  saved by {world} rank(s): {sorted(got)[len(got) // 2] * 1e3:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sharded-mib", type=int, default=96)
    p.add_argument("--replicated-mib", type=int, default=24)
    p.add_argument(
        "--repeat", type=int, default=3, help="runs of everything, on fresh data; the best is shown"
    )
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    p.add_argument(
        "--workers", type=int, default=0,
        help="threads of each rank's stores (default 0: ckstore's default, its share of the cores); "
        "--workers 4 is what every rank took on 2 cores before the default counted ranks",
    )  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--reshard-from", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    import ckstore

    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckstore-bench-dist-")
    try:
        for name in ("ckstore", "ckstore-all"):
            ckstore.open(Path(args.dir) / name, run="bench", chunk_size=1024 * 1024).close()
        threads = f"{args.workers} threads a rank" if args.workers else "ckstore's default threads"
        print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, {threads}, stores in {args.dir}")
        results = []
        for world, sources in JOBS:
            t0 = time.perf_counter()
            results.append(launch(args, world, sources))
            print(f"  {world}-rank job done in {time.perf_counter() - t0:.1f}s", flush=True)
        report(sorted(results, key=lambda r: r["world"]))
        in_process(args)
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
