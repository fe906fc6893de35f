"""The CPU a commit of the demo trainer's state takes, against ``torch.save`` + fsync of it.

Where training fills every core (the every-step benchmark's two torch threads on two cores), an
asynchronous commit hides its latency but not its CPU: what it spends comes out of the training
steps. CPU time is also a steadier figure than wall time on a shared machine. The state is the
demo's (``ckstore demo``: the GRU and AdamW, 4.5 MiB in 46 tensors), after a training step: the
script trains ``--commits`` steps first, keeping a copy of each step's state, then, in one
process, alternates for each of them:

* ``commit``: ``store.commit(step, {0: state})`` into one store (opened and warmed up before);
* ``commit again``: the same state committed once more, every chunk found stored (what a
  commit costs besides encoding and writing its chunks);
* ``torch.save + fsync``: the state saved to a new file, flushed and fsynced.

CPU is the process's user and system time over the call (``getrusage``: every thread of the
process, ckstore's pools included; not the kernel's own writeback threads). Each figure is the
median over the states.

    python benchmarks/cpu_commit.py                 # 40 states
    python benchmarks/cpu_commit.py --workers 1     # the store's threads (default: its own)
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import scratch_dir, table  # noqa: E402

import ckstore  # noqa: E402
from ckstore.cli.demo_train import DemoConfig, Trainer  # noqa: E402


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=40, help="states, each committed and saved once")
    ap.add_argument("--workers", type=int, default=0, help="the store's threads (default: its own)")
    ap.add_argument("--dir", default=None, help="where the store and files go (default: the system's temporary folder)")
    args = ap.parse_args()
    if args.commits < 1:
        ap.error("--commits must be at least 1")

    trainer = Trainer(DemoConfig(steps=args.commits + 1))
    states = []
    for _ in range(args.commits + 1):
        trainer.train_step()
        states.append(copy.deepcopy(trainer.state()))
    root = Path(scratch_dir(args.dir, "ckstore-cpu-commit-"))
    workers = 0
    try:
        opts: dict[str, Any] = {"workers": args.workers} if args.workers else {}
        store = ckstore.open(root / "store", run="cpu", **opts)
        workers = store.workers
        store.commit(10**6, {0: states[-1]}, {"loss": 1.0})  # connected, threads started, first-call costs
        times: dict[str, list[tuple[float, float]]] = {"commit": [], "commit again": [], "torch.save + fsync": []}
        for i, state in enumerate(states[:-1]):
            for what in times:
                c0, t0 = cpu_seconds(), time.perf_counter()
                if what == "commit":
                    store.commit(2 * i, {0: state}, {"loss": 1.0})
                elif what == "commit again":
                    store.commit(2 * i + 1, {0: state}, {"loss": 1.0})
                else:
                    with open(root / f"{i}.pt", "wb") as f:
                        torch.save(state, f)
                        f.flush()
                        os.fsync(f.fileno())
                times[what].append((cpu_seconds() - c0, time.perf_counter() - t0))
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    base = statistics.median(c for c, _ in times["torch.save + fsync"])
    rows = []
    for what, got in times.items():
        cpu = statistics.median(c for c, _ in got)
        wall = statistics.median(w for _, w in got)
        rows.append([what, f"{cpu * 1e3:.2f}", f"{cpu / base:.2f}x", f"{wall * 1e3:.2f}"])
    print(
        f"The demo state (4.5 MiB, 46 tensors), {args.commits} states, medians; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, store threads {workers}"
    )
    print(table(["call", "CPU ms", "CPU vs torch.save", "wall ms"], rows))


if __name__ == "__main__":
    main()
