"""A resume: the first checkout of a fresh process, against ``torch.load`` in a fresh process.

    python benchmarks/bench_resume.py                     # 4 MiB, 87 MiB fp32 and the Adam state
    python benchmarks/bench_resume.py --only 4mib --rounds 9

``bench_core.py`` times checkouts through a store handle that has committed and checked out
before, as in a job that checkpoints again and again. A job that resumes does it once, in a
process that has imported torch and nothing of ckstore yet: this measures that. Each round runs,
for every workload and method in an order rotated from round to round, a fresh Python process
that imports torch (not timed, as a training script has) and then, timed: ``import ckstore``,
``ckstore.open(store)`` and ``store.checkout("latest")``; or ``torch.load(file)``. Once from the
page cache (hot) and, as root, after dropping it (cold). Medians over ``--rounds``; ckstore's
time is split into its import, its open and its checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    adam_state,
    drop_caches,
    fsync_path,
    minilm_state,
    scratch_dir,
    small_state,
    table,
)

CHILD = r"""
import json, sys, time
import torch
method, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if method == "torch.load":
    torch.load(path, weights_only=True)
    print(json.dumps({"total": time.perf_counter() - t0}))
else:
    import ckstore
    t1 = time.perf_counter()
    store = ckstore.open(path, run="resume")
    t2 = time.perf_counter()
    store.checkout("latest")
    t3 = time.perf_counter()
    print(json.dumps({"total": t3 - t0, "import": t1 - t0, "open": t2 - t1, "checkout": t3 - t2}))
"""

WORKLOADS = {
    "4mib": "4 MiB fp32 (4 tensors)",
    "fp32": "87 MiB fp32, real weights",
    "adam": "Adam state, 7,200 tensors",
}


def _state(name: str) -> Any:
    import torch

    if name == "4mib":
        return small_state(4)
    if name == "fp32":
        return minilm_state(torch.float32)
    return {"optim_states": adam_state()}


def _child(method: str, path: Path, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, method, str(path)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the {method} child failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the stores and files go (default: a temporary folder)")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    for n in names:
        if n not in WORKLOADS:
            raise SystemExit(f"unknown workload {n!r}: use {', '.join(WORKLOADS)}")
    import shutil

    import torch

    import ckstore

    own = args.dir is None
    root = Path(scratch_dir(args.dir, "ckstore-bench-resume-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    can_drop = drop_caches()
    results: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    try:
        paths: dict[str, dict[str, Path]] = {}
        for n in names:
            state = _state(n)
            file = root / f"{n}.pt"
            with open(file, "wb") as f:
                torch.save(state, f)
            fsync_path(str(file))
            with ckstore.open(root / f"{n}-store", run="resume", create=True) as store:
                store.commit(1, {0: {"model_states": state}})
            paths[n] = {"torch.load": file, "ckstore": root / f"{n}-store"}
            del state
        methods = ["ckstore", "torch.load"]
        caches = ["hot", "cold"] if can_drop else ["hot"]
        for r in range(args.rounds):
            for n in names:
                for cache in caches:
                    order = methods[r % 2 :] + methods[: r % 2]
                    for m in order:
                        if cache == "cold":
                            drop_caches()
                        else:
                            _child(m, paths[n][m], env)  # (its files in the page cache)
                        got = _child(m, paths[n][m], env)
                        results.setdefault((n, cache, m), []).append(got)
                        print(f"  round {r + 1}: {WORKLOADS[n]}, {cache}, {m}: {got['total']:.3f} s", flush=True)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)

    def med(key: tuple[str, str, str], field: str) -> float:
        return statistics.median(x[field] for x in results[key])

    rows = []
    for n in names:
        for cache in ["hot", "cold"]:
            if (n, cache, "ckstore") not in results:
                continue
            ck, tl = med((n, cache, "ckstore"), "total"), med((n, cache, "torch.load"), "total")
            rows.append([
                WORKLOADS[n], cache, f"{tl:.3f}", f"{ck:.3f}", f"{ck / tl:.2f}x",
                f"{med((n, cache, 'ckstore'), 'import'):.3f}", f"{med((n, cache, 'ckstore'), 'open'):.3f}",
                f"{med((n, cache, 'ckstore'), 'checkout'):.3f}",
            ])  # fmt: skip
    print(f"\n### A resume: a fresh process's first checkout (median of {args.rounds} rounds; torch imported before)\n")
    print(table(["workload", "page cache", "torch.load s", "ckstore s", "ratio", "import ckstore s", "open s", "checkout s"], rows))
    if not can_drop:
        print("\n(cold rows left out: dropping the page cache needs root)")
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s in all")
