"""Run every benchmark in this folder, one after another, and print every table.

    python benchmarks/run_all.py                 # each with the arguments of its section in docs/benchmarks.md
    python benchmarks/run_all.py --quick         # small sizes, one round: checks that everything runs
    python benchmarks/run_all.py --only bench_core,bench_every_step --log bench.log

Each script runs as a subprocess of this Python, with this checkout first on ``PYTHONPATH``
and in the current folder (scripts write their temporary stores there: run it on the disk to
measure). Its output streams through, under a header naming the command. A script that fails
fails the whole run: the others still run, then the run exits non-zero naming it (``--fail-fast``
stops at the first). ``gpu_check.py`` runs only where torch sees a CUDA device;
``bench_backends.py`` needs PostgreSQL (``CKSTORE_BENCH_PG``) and moto's server, and
``bench_gc.py`` measures PostgreSQL where it is reachable (SQLite only otherwise), and
``bench_deepspeed.py`` runs where DeepSpeed is installed: a script left
out, or run on fewer backends, is named in the summary. A script this file does not know runs
with its own defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
NOT_SCRIPTS = {"common.py", "run_all.py"}
#: scripts that need arguments only their user can give, left out with this note
BY_HAND = {
    "bench_revisions.py": "compares git revisions: run it by hand with --rev A --rev B",
}

# script: (full arguments, --quick arguments), in the order they run
SCRIPTS: dict[str, tuple[list[str], list[str]]] = {
    "bench_core.py": ([], ["--rounds", "1", "--size-mib", "16", "--tiny-count", "2000"]),
    "bench_every_step.py": ([], ["--steps", "20", "--rounds", "1", "--gc-every", "5"]),
    "cpu_commit.py": ([], ["--commits", "5"]),
    "profile_commit.py": ([], ["--only", "4mib,minilm-bf16,adam"]),
    "bench_memory.py": ([], ["--tiny-count", "5000"]),
    "bench_resume.py": ([], ["--only", "4mib", "--rounds", "1"]),
    "timeline_commit.py": ([], ["--commits", "10", "--floor-rounds", "10"]),
    "bench_distributed.py": ([], ["--sharded-mib", "16", "--replicated-mib", "8", "--repeat", "1"]),
    "bench_async_dcp.py": ([], ["--size-mib", "16", "--rounds", "1"]),
    "bench_deepspeed.py": ([], ["--configs", "2", "--width", "256", "--layers", "2", "--rounds", "1"]),
    "bench_backends.py": ([], ["--mib", "8", "--grow", "20", "--seconds", "0.3"]),
    "bench_gc.py": ([], ["--checkpoints", "100"]),  # a multiple of its 4 runs
    "bench_repack.py": (
        ["--min-dead", "0.2", "0.35", "0.5", "0.65", "0.8"],
        ["--commits", "30", "--min-dead", "0.5"],
    ),
    "bench_copy.py": ([], ["--commits", "4"]),
    "bench_diff.py": ([], ["--tensors", "4", "--mib", "2"]),
    "delta_codec.py": ([], ["--base", "3", "--distances", "1,2"]),
    "bench_delta.py": ([], ["--steps", "4", "--warmup", "2", "--rounds", "1", "--reads", "3"]),
    "bench_planes.py": ([], ["--calls", "3"]),
    "bench_cli.py": ([], ["--rounds", "1"]),
    "gpu_check.py": (["--gib", "4"], ["--gib", "0.25"]),
}


def reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 2
        ):
            return True
    except OSError:
        return False


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def plan(args: argparse.Namespace) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The scripts to run with their arguments, and notes on what was left out or narrowed."""
    found = sorted(p.name for p in HERE.glob("*.py") if p.name not in NOT_SCRIPTS)
    order = [s for s in SCRIPTS if s in found] + [s for s in found if s not in SCRIPTS]
    pick = (
        {s if s.endswith(".py") else s + ".py" for s in args.only.split(",")} if args.only else None
    )
    skip = (
        {s if s.endswith(".py") else s + ".py" for s in args.skip.split(",")}
        if args.skip
        else set()
    )
    for name in (pick or set()) | skip:
        if name not in found:
            raise SystemExit(f"no benchmark {name} in {HERE}; there are: {', '.join(order)}")
    pg = os.environ.get("CKSTORE_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    runs, notes = [], []
    for name in order:
        if (pick is not None and name not in pick) or name in skip:
            continue
        if name in BY_HAND:
            if pick is not None:
                raise SystemExit(f"{name} {BY_HAND[name]}")
            notes.append(f"{name}: left out, it {BY_HAND[name]}")
            continue
        full, quick = SCRIPTS.get(name, ([], []))
        argv = list(quick if args.quick else full)
        if name not in SCRIPTS:
            notes.append(f"{name}: not known to run_all.py, ran with its own defaults")
        if name == "gpu_check.py" and not has_cuda():
            notes.append(f"{name}: left out, torch sees no CUDA device")
            continue
        if name == "bench_deepspeed.py" and importlib.util.find_spec("deepspeed") is None:
            notes.append(f"{name}: left out, DeepSpeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")
            continue
        if name == "bench_backends.py":
            if not reachable(pg, 5432):
                notes.append(f"{name}: left out, no PostgreSQL at {pg} (set CKSTORE_BENCH_PG)")
                continue
            if not (Path(sys.executable).parent / "moto_server").exists():
                notes.append(f"{name}: left out, no moto_server next to {sys.executable}")
                continue
        if name == "bench_gc.py" and not reachable(pg, 5432):
            argv += ["--backends", "sqlite"]
            notes.append(f"{name}: SQLite only, no PostgreSQL at {pg}")
        runs.append((name, argv))
    return runs, notes


def run(name: str, argv: list[str], log: IO[str] | None) -> tuple[int, float]:
    cmd = [sys.executable, str(HERE / name), *argv]
    shown = " ".join(["python", f"benchmarks/{name}", *argv])
    header = f"\n{'=' * 100}\n## {name}: {shown}\n{'=' * 100}\n"
    emit(header, log)
    root = str(HERE.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PYTHONUNBUFFERED": "1",  # lines stream through as they are printed
    }
    t0 = time.perf_counter()
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            emit(line, log)
    return proc.returncode, time.perf_counter() - t0


def emit(text: str, log: IO[str] | None) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
    if log is not None:
        log.write(text)
        log.flush()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes and one round each")
    ap.add_argument("--only", default=None, help="scripts to run, comma-separated (.py optional)")
    ap.add_argument("--skip", default=None, help="scripts to leave out, comma-separated")
    ap.add_argument("--fail-fast", action="store_true", help="stop at the first failing script")
    ap.add_argument("--log", default=None, help="also write everything printed to this file")
    args = ap.parse_args()
    runs, notes = plan(args)
    log = open(args.log, "w") if args.log else None  # noqa: SIM115
    results: list[tuple[str, str, float]] = []
    failed: list[str] = []
    t0 = time.perf_counter()
    try:
        emit(
            f"{len(runs)} benchmark(s){' (quick)' if args.quick else ''} with {sys.executable}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, in {os.getcwd()}\n",
            log,
        )
        for name, argv in runs:
            code, seconds = run(name, argv, log)
            results.append((name, "ok" if code == 0 else f"FAILED (exit code {code})", seconds))
            if code != 0 and args.fail_fast:
                break
        failed = [n for n, status, _ in results if status != "ok"]
        lines = [f"\n{'=' * 100}\n## summary ({time.perf_counter() - t0:.0f} s in all)\n"]
        lines += [f"{name:24} {status:24} {seconds:8.0f} s" for name, status, seconds in results]
        lines += [f"not run: {n}" for n, _ in runs[len(results) :]]
        lines += [f"note: {n}" for n in notes]
        if failed:
            lines.append(f"FAILED: {', '.join(failed)}")
        emit("\n".join(lines) + "\n", log)
    finally:
        if log is not None:
            log.close()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
