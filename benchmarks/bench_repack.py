"""Repacking benchmark: store size with and without ``gc --repack`` on a realistic run, and the
time gc takes.

The run: ``--commits`` commits (default 200) of ``--tensors`` float32 tensors of
``--elems`` elements each, ``--change`` of them (default 10%) rewritten per step, plus small
per-step states (a step counter, an RNG state, a learning rate, a loss scale). Retention keeps
the last 3 and the best 2 by loss; gc runs every ``--every`` commits. One pass without
repacking, then one per ``--min-dead`` threshold with ``gc --repack`` (grace 0, so trashed packs
go at the next gc, as they would after the grace period)::

    python benchmarks/bench_repack.py [--commits 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ckstore
from ckstore.retention import BestN, LatestN


def pack_bytes(s: ckstore.Store) -> tuple[int, int]:
    sizes = [i.size for i in s.blobs.list("packs/")]
    return sum(sizes), len(sizes)


def run(root: Path, args: argparse.Namespace, min_dead: float | None) -> dict[str, Any]:
    path = root / f"store-{min_dead}"
    s = ckstore.open(path, run="r", chunk_size=args.chunk_kib * 1024)
    s.set_policy("r", LatestN(3) | BestN(2, "loss", mode="min"))
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(args.elems, generator=gen) for _ in range(args.tensors)]
    gc_seconds = 0.0
    gcs = 0
    commit_seconds = 0.0
    for step in range(1, args.commits + 1):
        for i in rng.sample(range(args.tensors), max(1, int(args.change * args.tensors))):
            tensors[i] = torch.randn(args.elems, generator=gen)
        states = {
            "model_states": {f"layer{i}.weight": t for i, t in enumerate(tensors)},
            "rng": {
                "torch": torch.randint(0, 255, (5056,), dtype=torch.uint8, generator=gen),
                "step": step,
            },
            "lr_scheduler": {"lr": 1e-3 * 0.99**step, "scale": float(2 ** (step % 7))},
        }
        t0 = time.perf_counter()
        s.commit(step, {0: states}, {"loss": rng.random() + 10.0 / step})
        commit_seconds += time.perf_counter() - t0
        if step % args.every == 0:
            t0 = time.perf_counter()
            if min_dead is None:
                s.gc(grace=0)
            else:
                s.gc(grace=0, repack=True, min_dead=min_dead)
                s.gc(grace=0)  # the trashed packs, once their grace (0 here) has passed
            gc_seconds += time.perf_counter() - t0
            gcs += 1
    total, packs = pack_bytes(s)
    live = s.catalog.stored_bytes()
    out = {
        "min_dead": min_dead,
        "pack_bytes": total,
        "packs": packs,
        "live_chunk_bytes": live,
        "dead_fraction": 1 - live / total if total else 0.0,
        "gc_seconds_total": gc_seconds,
        "gc_seconds_mean": gc_seconds / max(1, gcs),
        "commit_seconds_mean": commit_seconds / args.commits,
        "checkpoints": len(s.checkpoints()),
    }
    assert s.fsck().ok
    s.close()
    shutil.rmtree(path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--commits", type=int, default=200)
    p.add_argument("--tensors", type=int, default=60)
    p.add_argument("--elems", type=int, default=32 * 1024)
    p.add_argument("--change", type=float, default=0.10)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--chunk-kib", type=int, default=4096)
    p.add_argument("--min-dead", type=float, nargs="*", default=[0.2, 0.5, 0.8])
    p.add_argument("--json")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckstore-bench-repack-"))
    try:
        results = [run(root, args, None)] + [run(root, args, m) for m in args.min_dead]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = results[0]["pack_bytes"]
    print(
        f"{'repack':>12} {'packs MiB':>10} {'vs none':>8} {'packs':>6} {'dead':>6} {'gc s (mean)':>12} {'commit s':>9}"
    )
    for r in results:
        name = "none" if r["min_dead"] is None else f"> {r['min_dead']:.0%} dead"
        print(
            f"{name:>12} {r['pack_bytes'] / 2**20:>10.1f} {r['pack_bytes'] / base:>8.2f} {r['packs']:>6} "
            f"{r['dead_fraction']:>6.1%} {r['gc_seconds_mean']:>12.3f} {r['commit_seconds_mean']:>9.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
