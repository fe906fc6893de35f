"""Time `Store.diff` on a fine-tune that froze half of a model.

    python benchmarks/bench_diff.py [--tensors 24] [--mib 8] [--dir /tmp/x]

Commits a base checkpoint and a fine-tuned one whose first half of the tensors is unchanged,
then diffs them with stats off and on, and diffs one sharded tensor saved by two layouts.
Prints wall time, blob bytes read and the rate over the bytes compared.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch

import ckstore


def _timed(store: ckstore.Store, label: str, compared: int, **kw: object) -> None:
    store.blobs.stats.reset()
    t = time.perf_counter()
    res = store.diff(*kw.pop("refs"), **kw)  # type: ignore[misc]
    dt = time.perf_counter() - t
    read = store.blobs.stats.snapshot()["bytes_read"]
    print(
        f"{label:34s} {dt:7.3f} s  read {read / 2**20:8.1f} MiB  "
        f"{compared / 2**20 / dt:8.0f} MiB/s of tensors compared  "
        f"({len(res.changed)} changed, {len(res.tensors) - len(res.changed)} identical)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--dir")
    args = ap.parse_args()
    loc = args.dir or tempfile.mkdtemp(prefix="ckstore-bench-diff-")
    store = ckstore.open(loc)
    n = args.mib * 2**20 // 4
    torch.manual_seed(0)
    base = {f"layers.{i}.weight": torch.randn(n // 1024, 1024) for i in range(args.tensors)}
    ft = {
        k: (v if i < args.tensors // 2 else v + 1e-3 * torch.randn_like(v))
        for i, (k, v) in enumerate(base.items())
    }
    store.commit(1, {0: {"model_states": base}}, run="base")
    store.commit(1, {0: {"model_states": ft}}, run="ft")
    total = sum(v.numel() * 4 for v in base.values())
    print(
        f"{args.tensors} tensors of {args.mib} MiB, {total / 2**20:.0f} MiB per checkpoint, half of them frozen"
    )
    _timed(store, "diff --no-stats", total, refs=("base@1", "ft@1"), stats=False)
    _timed(store, "diff (stats)", total, refs=("base@1", "ft@1"))
    _timed(store, "diff identical checkpoints", total, refs=("base@1", "base@1"))

    w = torch.randn(4 * n // 1024 + 3, 1024)  # pieces do not end on chunk boundaries
    for tp in (2, 4):
        states = {
            r: {"m": {"w": ckstore.Shard(w.chunk(tp)[r].clone(), "tp", 0)}} for r in range(tp)
        }
        store.commit(1, states, run=f"tp{tp}", world_layout=ckstore.WorldLayout({"tp": tp}))
    _timed(
        store, "reshard tp2 vs tp4, --no-stats", w.numel() * 4, refs=("tp2@1", "tp4@1"), stats=False
    )
    _timed(store, "reshard tp2 vs tp4 (stats)", w.numel() * 4, refs=("tp2@1", "tp4@1"))
    store.close()
    if not args.dir:
        shutil.rmtree(loc, ignore_errors=True)


if __name__ == "__main__":
    main()
