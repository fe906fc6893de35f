"""Memory of commits and checkouts of states with many tensors, against torch.save / torch.load.

A state of many small tensors (an optimizer's, RNG states, counters) costs memory per tensor,
not per byte: Python objects for every tensor and chunk while it is flattened, hashed, written,
described in a manifest and recorded. For each workload and method this measures, each in a
process of its own (so that no earlier call's freed memory hides a peak):

* the peak resident memory above the process's before the call (the kernel's ``VmHWM``, reset
  as the call starts; the state itself was built before),
* the peak of Python's own allocations during the call (tracemalloc, in a second process: it
  slows the call; deterministic for the same code, unlike resident memory),
* for ckstore's commit, the Python allocations still held when the checkpoint's record is built
  (after every chunk is written, inside the finishing transaction).

    python benchmarks/bench_memory.py                        # 100,000 tiny tensors and the Adam state
    python benchmarks/bench_memory.py --only tiny --tiny-count 20000

Workloads: ``tiny`` (``--tiny-count`` tensors of 4 fp32 elements in one state dict) and ``adam``
(``torch.optim.Adam``'s state after two steps of a 1,200-layer MLP: 7,200 tensors), as in
bench_core.py. Times are one call each, for scale only (bench_core.py times them properly).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import adam_state, measure, table, tiny_state  # noqa: E402

METHODS = ["ckstore commit", "ckstore checkout", "torch.save", "torch.load"]


def _state(workload: str, tiny_count: int) -> Any:
    if workload == "tiny":
        return tiny_state(tiny_count)
    return {"optim_states": adam_state()} if workload == "adam" else None


def _child(workload: str, method: str, tiny_count: int, traced: bool, folder: str) -> dict[str, float]:
    """One measurement, in this (fresh) process: the state is saved first when the method loads."""
    import tracemalloc

    import torch

    import ckstore
    from ckstore.format import recordio

    state = _state(workload, tiny_count)
    sub = "optim_states" if workload == "adam" else "model_states"
    body = state["optim_states"] if workload == "adam" else state
    store = ckstore.open(os.path.join(folder, "store"), run="m", create=True)
    store.commit(0, {0: {sub: {"x": torch.zeros(4)}}})  # statements, threads and imports warm
    store.checkout(0)
    path = os.path.join(folder, "state.pt")
    if method == "ckstore checkout":
        store.commit(1, {0: {sub: body}})
    elif method == "torch.load":
        torch.save(body, path)
    held: list[int] = []
    if traced and method == "ckstore commit":
        build = recordio.record_from_catalog

        def measured(*args: Any, **kwargs: Any) -> Any:
            held.append(tracemalloc.get_traced_memory()[0])
            return build(*args, **kwargs)

        recordio.record_from_catalog = measured  # type: ignore[assignment]

    def call() -> Any:
        if method == "ckstore commit":
            return store.commit(1, {0: {sub: body}})
        if method == "ckstore checkout":
            return store.checkout(1)
        if method == "torch.save":
            with open(path, "wb") as f:
                torch.save(body, f)
                f.flush()
                os.fsync(f.fileno())
            return None
        return torch.load(path, weights_only=True)

    out: dict[str, float] = {}
    if traced:
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        t = time.perf_counter()
        result = call()
        out["seconds"] = time.perf_counter() - t
        out["traced_peak"] = tracemalloc.get_traced_memory()[1] - start
        if held:
            out["held_at_record"] = held[0] - start
        tracemalloc.stop()
    else:
        with measure() as m:
            result = call()
        out["seconds"], out["rss_peak"] = m.seconds, m.peak_extra
    del result
    store.close()
    return out


def run(workload: str, method: str, tiny_count: int, traced: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ckstore-bench-", dir=os.getcwd()) as folder:
        cmd = [sys.executable, __file__, "--child", json.dumps([workload, method, tiny_count, traced, folder])]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"{method} on {workload} failed:\n{done.stderr}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="tiny,adam", help="comma-separated workloads: tiny, adam")
    ap.add_argument("--tiny-count", type=int, default=100_000)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(*json.loads(args.child))))
        return
    workloads = [w.strip() for w in args.only.split(",") if w.strip()]
    for w in workloads:
        if w not in ("tiny", "adam"):
            ap.error(f"unknown workload {w!r} (tiny, adam)")
    mib = 1 << 20
    for w in workloads:
        name = f"{args.tiny_count:,} tiny tensors" if w == "tiny" else "Adam state, 7,200 tensors"
        rows = []
        for method in METHODS:
            r = run(w, method, args.tiny_count, traced=False)
            t = run(w, method, args.tiny_count, traced=True)
            held = f"{t['held_at_record'] / mib:.1f}" if "held_at_record" in t else "-"
            rows.append([method, f"{r['seconds']:.2f}", f"{r['rss_peak'] / mib:.1f}", f"{t['traced_peak'] / mib:.1f}", held])
            print(f"  [{name}] {method}: {rows[-1][1]} s, peak +{rows[-1][2]} MiB resident, {rows[-1][3]} MiB traced", flush=True)
        print(f"\n### {name}\n")
        print(table(["method", "s (one call)", "peak resident +MiB", "peak traced MiB", "traced MiB held at the record"], rows))
        print()
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; each figure from one call in a process of its own.")


if __name__ == "__main__":
    main()
