"""Delta chunks (``ckstore.open(..., delta_chain=N)``) against whole chunks and torch.save, on
the states of a real training run checkpointed every step.

The states are the demo's (``ckstore demo``'s GRU trained by AdamW, ``Trainer.state()``: model,
optimizer, scheduler, RNG): ``--steps`` successive steps after ``--warmup`` steps, kept as copies
so every configuration commits the same bytes. Each round commits them all, one blocking commit
a step, into a fresh store for each configuration (whole chunks; deltas with chains of
``--chains``), in an order rotated from round to round, and ``torch.save`` + fsync of each to a
file; then checks out (and ``torch.load``s) the step whose chunks sit deepest in their chains,
from the page cache. Figures are medians over rounds of the per-step medians.

    python benchmarks/bench_delta.py                      # 12 steps, chains 2 and 4, 3 rounds
    python benchmarks/bench_delta.py --chains 1,4,8 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fsync_path, mib, scratch_dir, table, tensor_bytes  # noqa: E402

import ckstore  # noqa: E402
from ckstore.cli.demo_train import DemoConfig, Trainer  # noqa: E402


def training_states(steps: int, warmup: int) -> list[dict[str, Any]]:
    trainer = Trainer(DemoConfig(steps=steps + warmup))
    for _ in range(warmup):
        trainer.train_step()
    out = []
    for _ in range(steps):
        trainer.train_step()
        out.append(copy.deepcopy(trainer.state()))
    return out


def deepest(steps: int, chain: int) -> int:
    """The step whose chunks are deepest in their chains when every step writes a delta of the
    one before, up to ``chain`` deep (0: the last step)."""
    return min(chain, steps - 1) if chain else steps - 1


def run_store(
    root: Path, name: str, states: list[dict[str, Any]], chain: int, reads: int
) -> dict[str, float]:
    path = root / name
    s = ckstore.open(path, run="r", delta_chain=chain)
    times, added = [], 0
    for step, st in enumerate(states):
        t = time.perf_counter()
        ck = s.commit(step, {0: st})
        times.append(time.perf_counter() - t)
        if step:
            added += ck.stored_bytes_added
    target = deepest(len(states), chain)
    s.checkout(target)  # into the page cache
    reads_s = []
    for _ in range(reads):
        t = time.perf_counter()
        s.checkout(target)
        reads_s.append(time.perf_counter() - t)
    s.close()
    shutil.rmtree(path)
    return {
        "commit": statistics.median(times[1:]),
        "added": added / (len(states) - 1),
        "checkout": statistics.median(reads_s),
    }


def run_torch(root: Path, states: list[dict[str, Any]], reads: int) -> dict[str, float]:
    times = []
    for step, st in enumerate(states):
        f = str(root / f"step{step}.pt")
        t = time.perf_counter()
        torch.save(st, f)
        fsync_path(f)
        times.append(time.perf_counter() - t)
    f = str(root / f"step{len(states) - 1}.pt")
    torch.load(f, weights_only=False)
    reads_s = []
    for _ in range(reads):
        t = time.perf_counter()
        torch.load(f, weights_only=False)
        reads_s.append(time.perf_counter() - t)
    size = os.path.getsize(f)
    for step in range(len(states)):
        os.unlink(root / f"step{step}.pt")
    return {
        "commit": statistics.median(times[1:]),
        "added": size,
        "checkout": statistics.median(reads_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=12, help="successive training steps committed")
    ap.add_argument("--warmup", type=int, default=20, help="training steps before the first")
    ap.add_argument(
        "--chains", default="2,4", help="delta_chain settings to compare with whole chunks"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reads", type=int, default=20, help="checkouts (and loads) timed per round")
    ap.add_argument(
        "--dir", default=None, help="where the stores go (default: a folder in the cwd)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    chains = [int(c) for c in args.chains.split(",") if c.strip()]
    states = training_states(args.steps, args.warmup)
    raw = tensor_bytes(states[0])
    configs = ["torch.save", "whole chunks"] + [f"delta_chain={c}" for c in chains]
    res: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    root = Path(scratch_dir(args.dir or os.getcwd(), "ckstore-bench-delta-"))
    try:
        for rnd in range(args.rounds):
            k = rnd % len(configs)
            for c in configs[k:] + configs[:k]:
                if c == "torch.save":
                    r = run_torch(root, states, args.reads)
                else:
                    chain = 0 if c == "whole chunks" else int(c.split("=")[1])
                    r = run_store(root, f"{chain}-r{rnd}", states, chain, args.reads)
                res[c].append(r)
                print(f"  round {rnd + 1}/{args.rounds} {c}: {r}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {c: {k: statistics.median(r[k] for r in res[c]) for k in res[c][0]} for c in configs}
    ts = med["torch.save"]
    whole = med["whole chunks"]
    rows = []
    for c in configs:
        m = med[c]
        chain = 0 if c in ("torch.save", "whole chunks") else int(c.split("=")[1])
        rows.append([
            c,
            f"{mib(m['added'])}",
            f"{m['added'] / raw:.1%}",
            f"{m['added'] / whole['added']:.2f}x",
            f"{1000 * m['commit']:.1f}",
            f"{m['commit'] / ts['commit']:.2f}x",
            f"step {deepest(args.steps, chain)}" if c != "torch.save" else "last",
            f"{1000 * m['checkout']:.1f}",
            f"{m['checkout'] / ts['checkout']:.2f}x",
        ])  # fmt: skip
    head = [
        "configuration", "stored MiB a step", "of raw", "vs whole chunks", "commit ms", "vs torch.save+fsync",
        "checked out", "checkout ms (page cache)", "vs torch.load",
    ]  # fmt: skip
    print(
        f"### Delta chunks: {args.steps} successive steps of the demo's GRU + AdamW "
        f"({mib(raw)} MiB of tensors; median of {args.rounds} rounds)\n\n"
        + table(head, rows)
        + "\n\n'stored MiB a step': the chunk bytes each commit after the first added (compressed, after"
        " dedup; torch.save: the file). The checkout is of the step deepest in its chains (each of its"
        " changed chunks decodes through that many deltas), one torch thread, the store's default"
        f" workers; {os.cpu_count()} CPUs."
    )


if __name__ == "__main__":
    main()
