"""Copy benchmark: ``Store.copy`` of a whole run between two local stores — bytes sent against
the run's logical size, throughput, and a second copy of the same run (which sends nothing).

The run: ``--commits`` commits of ``--tensors`` float32 tensors of ``--elems`` elements, ``--change``
of them rewritten per step (so consecutive checkpoints share most chunks)::

    python benchmarks/bench_copy.py [--commits 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

import ckstore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--commits", type=int, default=20)
    p.add_argument("--tensors", type=int, default=60)
    p.add_argument("--elems", type=int, default=256 * 1024)
    p.add_argument("--change", type=float, default=0.10)
    p.add_argument("--json")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckstore-bench-copy-"))
    try:
        src = ckstore.open(root / "src", run="r")
        rng = random.Random(0)
        gen = torch.Generator().manual_seed(0)
        tensors = [torch.randn(args.elems, generator=gen) for _ in range(args.tensors)]
        for step in range(1, args.commits + 1):
            for i in rng.sample(range(args.tensors), max(1, int(args.change * args.tensors))):
                tensors[i] = torch.randn(args.elems, generator=gen)
            src.commit(
                step,
                {0: {"model_states": {f"l{i}": t for i, t in enumerate(tensors)}}},
                {"loss": 1 / step},
            )
        logical = sum(c.logical_bytes for c in src.checkpoints())
        dest = ckstore.open(root / "dest")
        t0 = time.perf_counter()
        first = src.copy([], dest, run="r")
        t_first = time.perf_counter() - t0
        dest.blobs.stats.reset()
        t0 = time.perf_counter()
        second = src.copy([], dest, run="r")
        t_second = time.perf_counter() - t0
        written_again = dest.blobs.stats.snapshot()["bytes_written"]
        out = {
            "checkpoints": len(first.copied),
            "logical_bytes": logical,
            "bytes_sent": first.bytes_sent,
            "seconds": t_first,
            "sent_mib_per_s": first.bytes_sent / 2**20 / t_first,
            "second_bytes_sent": second.bytes_sent,
            "second_bytes_written": written_again,
            "second_seconds": t_second,
        }
        print(json.dumps(out, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "result": out}, indent=2))
        src.close()
        dest.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
