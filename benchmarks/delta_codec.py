"""Would a delta codec pay? XOR each chunk against the same tensor's chunk in the parent
checkpoint, then encode with ckstore's own byte-plane zstd codec; compare the stored bytes with
encoding the chunk as it is.

The states are real: the demo's character-level GRU (``ckstore demo``'s model) trained with real
gradients by AdamW, checkpointed (model weights and optimizer state) at a base step and 1, 10 and
100 steps later. Chunks identical to the parent's are free in both columns (dedup stores them
once); the ratio is stored bytes over the child checkpoint's raw tensor bytes.

    python benchmarks/delta_codec.py                   # base step 100, distances 1, 10, 100
    python benchmarks/delta_codec.py --base 20 --distances 1,10
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from ckstore.cli.demo_train import DemoConfig, Trainer  # noqa: E402
from ckstore.config import DEFAULT_CHUNK_SIZE  # noqa: E402
from ckstore.format import codec  # noqa: E402


def tensors(state: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state, by path, as contiguous CPU copies."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state["model_states"].items():
        out[f"model/{k}"] = v.detach().clone().contiguous()
    for idx, st in state["optim_states"]["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{names[idx]}/{k}"] = v.detach().clone().contiguous().view(-1)
    return out


def group(path: str) -> str:
    if path.startswith("model/"):
        return "weights"
    return path.rsplit("/", 1)[1]  # exp_avg, exp_avg_sq, step


def chunks(t: torch.Tensor, chunk_size: int) -> list[np.ndarray]:
    a = t.reshape(-1).view(torch.uint8).numpy()
    return [a[i : i + chunk_size] for i in range(0, a.size, chunk_size)]


def measure(
    parent: dict[str, torch.Tensor], child: dict[str, torch.Tensor], chunk_size: int, level: int
) -> dict[str, list[int]]:
    """``{group: [raw, stored plain, stored delta]}``."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for path, t in child.items():
        g = out[group(path)]
        item = t.element_size()
        pc = chunks(parent[path], chunk_size)
        for i, c in enumerate(chunks(t, chunk_size)):
            g[0] += c.size
            if np.array_equal(c, pc[i]):
                continue  # dedup: stored once already, in both schemes
            g[1] += codec.encode(memoryview(c), item, level).length
            x = np.bitwise_xor(c, pc[i])
            g[2] += codec.encode(memoryview(x), item, level).length
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--base", type=int, default=100, help="training steps before the parent checkpoint"
    )
    ap.add_argument("--distances", default="1,10,100", help="steps between parent and child")
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    ap.add_argument("--level", type=int, default=1, help="zstd level (ckstore's default: 1)")
    args = ap.parse_args()
    distances = sorted(int(d) for d in args.distances.split(","))
    torch.set_num_threads(1)

    cfg = DemoConfig()
    tr = Trainer(cfg)
    names = [n for n, _ in tr.model.named_parameters()]
    t0 = time.perf_counter()
    wanted = {args.base, *(args.base + d for d in distances)}
    states: dict[int, dict[str, torch.Tensor]] = {}
    while tr.step < max(wanted):
        tr.train_step()
        if tr.step in wanted:
            states[tr.step] = tensors(tr.state(), names)
    raw_total = sum(t.numel() * t.element_size() for t in states[args.base].values())
    print(
        f"demo GRU + AdamW, {len(states[args.base])} tensors, {raw_total / 2**20:.2f} MiB per checkpoint; "
        f"trained {max(wanted)} steps in {time.perf_counter() - t0:.0f} s; chunk size "
        f"{args.chunk_size // 1024} KiB, zstd level {args.level}\n"
    )
    rows = []
    for d in distances:
        res = measure(states[args.base], states[args.base + d], args.chunk_size, args.level)
        total = [sum(v[i] for v in res.values()) for i in range(3)]
        for name, (raw, plain, delta) in [*sorted(res.items()), ("all", total)]:
            gain = 1 - delta / plain if plain else 0.0
            rows.append([
                f"{d}", name, f"{raw / 2**20:.2f}", f"{100 * plain / raw:.1f}%", f"{100 * delta / raw:.1f}%",
                f"{100 * gain:+.1f}%",
            ])  # fmt: skip
    print(
        table(
            [
                "steps apart",
                "tensors",
                "raw MiB",
                "stored/raw",
                "with XOR delta",
                "bytes saved by delta",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
