"""CLI start-up: how long catalog commands take from the shell, against the 0.5 s target.

A store with a few small checkpoints is made once (in a child process that imports torch); then
each command runs ``--rounds`` times as a fresh ``python -m ckstore`` process, commands in an
order rotated from round to round. Reported per command: the median wall time (what a user
waits for) and the median CPU time of the process (user + system; what a quiet machine's wall
time comes close to when the machine is busy). For scale, the same is measured for an empty
interpreter (``python -c pass``), for importing SQLAlchemy (the bulk of a catalog command's
start-up) and for importing torch (what every command paid before catalog commands stopped
importing it).

    python benchmarks/bench_cli.py
    python benchmarks/bench_cli.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

TARGET_S = 0.5

MAKE_STORE = r"""
import sys, torch, ckstore
with ckstore.open(sys.argv[1], run="bench") as store:
    for step in range(1, 6):
        store.commit(step, {0: {"model_states": {"w": torch.full((256,), float(step))}}}, metrics={"loss": 1.0 / step})
    store.tag("bench@5", "best")
"""

#: (label, arguments after ``python``); ``{store}`` is replaced by the store's folder
COMMANDS: list[tuple[str, list[str]]] = [
    ("ckstore --help", ["-m", "ckstore", "--help"]),
    ("ckstore runs", ["-m", "ckstore", "-s", "{store}", "runs"]),
    ("ckstore log bench", ["-m", "ckstore", "-s", "{store}", "log", "bench"]),
    ("ckstore show bench@best", ["-m", "ckstore", "-s", "{store}", "show", "bench@best"]),
    ("ckstore tag bench@4 kept", ["-m", "ckstore", "-s", "{store}", "tag", "bench@4", "kept"]),
    ("ckstore du", ["-m", "ckstore", "-s", "{store}", "du"]),
    ("ckstore gc --dry-run", ["-m", "ckstore", "-s", "{store}", "gc", "--dry-run"]),
    ("ckstore fsck", ["-m", "ckstore", "-s", "{store}", "fsck"]),
]
REFERENCES: list[tuple[str, list[str]]] = [
    ("python -c pass", ["-c", "pass"]),
    ("python -c 'import sqlalchemy'", ["-c", "import sqlalchemy"]),
    ("python -c 'import torch'", ["-c", "import torch"]),
]


def run_once(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one ``python`` process; fails loudly if the command fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"}
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(
            f"`python {' '.join(argv)}` failed ({done.returncode}):\n{done.stdout}{done.stderr}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5, help="runs of each command (median)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckstore-bench-cli-", dir=".") as tmp:
        store = os.path.join(tmp, "store")
        subprocess.run([sys.executable, "-c", MAKE_STORE, store], check=True)
        jobs = [(label, [a.replace("{store}", store) for a in argv]) for label, argv in COMMANDS]
        jobs += REFERENCES
        for _, argv in jobs:  # once untimed: bytecode compiled, files in the page cache
            run_once(argv)
        times: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in jobs}
        for r in range(args.rounds):
            for label, argv in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:
                times[label].append(run_once(argv))
    rows = []
    for label, _ in jobs:
        wall = statistics.median(w for w, _ in times[label])
        cpu = statistics.median(c for _, c in times[label])
        meets = "" if label.startswith("python") else ("yes" if wall <= TARGET_S else "no")
        rows.append([label, f"{wall:.3f}", f"{cpu:.3f}", meets])
    print(
        f"### CLI start-up (median of {args.rounds} runs each; load average "
        f"{os.getloadavg()[0]:.1f} at the end)\n"
    )
    print(table(["command", "wall s", "CPU s", f"wall <= {TARGET_S} s"], rows))


if __name__ == "__main__":
    main()
