"""GPU checks: CUDA tensors commit and check out bit-exact, and how fast staging to the host is.

Needs a CUDA device. Compares ckstore's staging (contiguous on the device, asynchronous copies
into pinned memory, one synchronization) with a plain ``t.cpu()`` per tensor, and a commit and a
checkout back onto the GPU with ``torch.save``/``torch.load(map_location="cuda")``.

    python benchmarks/gpu_check.py --gib 2 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch

import ckstore
from ckstore.format.tensorio import stage_tensors


def gpu_state(gib: float, dev: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=dev).manual_seed(0)
    sd: dict[str, Any] = {}
    n = 0
    i = 0
    while n < gib * 2**30:
        w = torch.randn(4096, 4096, device=dev, generator=g) * 0.02
        sd[f"layers.{i}.weight"] = w
        sd[f"layers.{i}.weight_bf16"] = w[:2048].to(torch.bfloat16)
        n += w.numel() * 4 + 2048 * 4096 * 2
        i += 1
    sd["fp8"] = (torch.randn(1024, 1024, device=dev, generator=g)).to(torch.float8_e4m3fn)
    sd["transposed"] = torch.randn(512, 256, device=dev, generator=g).t()
    sd["step"] = torch.tensor(1234, device=dev)
    sd["mask"] = torch.rand(1000, device=dev, generator=g) > 0.5
    sd["empty"] = torch.empty(0, 3, device=dev)
    sd["ids"] = torch.arange(10_000, device=dev)
    return sd


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def timed(fn: Any) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sd = gpu_state(args.gib, dev)
    tensors = [t for t in sd.values()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bytes": nbytes,
    }

    stage_tensors(tensors[:4])  # warm the pinned-memory cache and CUDA context
    for _ in range(2):
        res["naive_cpu_s"], host = timed(lambda: [t.detach().cpu() for t in tensors])
        del host
        res["staged_s"], host = timed(lambda: stage_tensors(tensors))
        del host

    root = tempfile.mkdtemp(prefix="ckstore-gpu-")
    try:
        store = ckstore.open(os.path.join(root, "store"), run="gpu")
        res["commit_s"], ck = timed(lambda: store.commit(1, {0: {"model_states": sd}}))
        res["stored_bytes"] = ck.stored_bytes_added
        res["checkout_cuda_s"], out = timed(lambda: store.checkout(1, device="cuda"))
        got = out[0]["model_states"]
        bad = [
            k for k, v in sd.items() if not (got[k].device.type == "cuda" and bits_equal(got[k], v))
        ]
        res["bit_exact"] = not bad
        res["mismatches"] = bad
        del out, got
        p = os.path.join(root, "sd.pt")

        def save() -> None:
            torch.save(sd, p)
            with open(p, "rb") as f:
                os.fsync(f.fileno())

        res["torch_save_s"], _ = timed(save)
        res["torch_load_cuda_s"], _ = timed(
            lambda: torch.load(p, map_location="cuda", weights_only=True)
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    print(json.dumps(res, indent=2))
    print(
        f"\n{res['device']}, {gb:.2f} GB of CUDA tensors\n"
        f"  stage to host: naive .cpu() {gb / res['naive_cpu_s']:.1f} GB/s, ckstore pinned+async {gb / res['staged_s']:.1f} GB/s "
        f"({res['naive_cpu_s'] / res['staged_s']:.2f}x)\n"
        f"  commit {res['commit_s']:.2f} s vs torch.save+fsync {res['torch_save_s']:.2f} s; "
        f"stored {res['stored_bytes'] / nbytes:.1%} of raw\n"
        f"  checkout to cuda {res['checkout_cuda_s']:.2f} s vs torch.load(map_location='cuda') {res['torch_load_cuda_s']:.2f} s\n"
        f"  bit-exact: {res['bit_exact']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if not res["bit_exact"]:
        raise SystemExit(f"mismatched tensors: {res['mismatches']}")


if __name__ == "__main__":
    main()
