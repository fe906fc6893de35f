"""Checkpoint every training step: how much slower does training get, and does the store stay
bounded by its retention policy?

The model and trainer are the demo's (``ckstore demo``, ``ckstore/cli/demo_train.py``): a
character-level GRU trained by AdamW, default ``DemoConfig``; a checkpoint is
``Trainer.state()`` (model, optimizer, scheduler, trainer step and RNG states). Each mode runs
``--steps`` training steps on a fresh trainer (same seed, same work) and, for the checkpointing
modes, a fresh store with the retention policy ``LatestN(--keep-last) | BestN(--keep-best,
"loss")``:

* ``none``: no checkpointing;
* ``async``: ``store.commit(step, {0: trainer.state()}, {"loss": loss}, blocking=False)`` after
  every step;
* ``async-changed``: the same with ``stage="changed"`` (stages only the tensors that changed);
* ``async-delta``: ``async`` into a store opened with ``delta_chain=--delta-chain``: each changed
  chunk is stored as its XOR with the previous step's, where that is smaller;
* ``async-gc-bg``: ``async``, its gcs as ``store.gc(blocking=False)`` (whatever ``--gc-in`` says);
* ``async-fresh``: ``async`` into a store opened with ``recycle_bytes=0``: gc unlinks the pack
  files it releases and every pack goes to a fresh file (``async`` writes its packs over the
  files gc released, up to the default bound);
* ``blocking``: ``store.commit(step, {0: trainer.state()}, {"loss": loss})`` after every step.

Every ``--gc-every`` steps ``store.gc()`` applies the policy: in the training loop (the default,
its time counts as training time), with ``--gc-in background`` as ``store.gc(blocking=False)``
(the store's own gc thread; the call's time counts), or with ``--gc-in thread`` in a thread of
the benchmark's with its own store handle. At the end the run waits for every commit still in flight; that wait counts in
the total. Rounds run the modes in an order rotated from round to round; each figure is the
median over the rounds (one timing on a shared machine can be off by 2x). Before the first round
one trainer runs a few steps and commits once, untimed (imports, first-call costs); every
trainer then runs ``--warmup`` untimed steps before its timed ones.

    python benchmarks/bench_every_step.py                       # 200 steps, 3 rounds
    python benchmarks/bench_every_step.py --steps 20 --rounds 1 # a quick check
    python benchmarks/bench_every_step.py --gc-in background --modes none,async
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import mib, scratch_dir, table  # noqa: E402

import ckstore  # noqa: E402
from ckstore.cli.demo_train import DemoConfig, Trainer  # noqa: E402
from ckstore.retention import BestN, LatestN  # noqa: E402

RUN = "every-step"
TARGET_SLOWDOWN = 0.05  # the target: < 5% slower than no checkpointing
MODES = {
    "none": "no checkpointing",
    "async": "commit(blocking=False) every step",
    "async-changed": "commit(blocking=False, stage='changed') every step",
    "async-delta": "commit(blocking=False) every step, deltas",
    "async-gc-bg": "commit(blocking=False) every step, gc(blocking=False)",
    "async-fresh": "commit(blocking=False) every step, no recycled pack files",
    "blocking": "commit() (blocking) every step",
}


def has_delta() -> bool:
    return "delta_chain" in inspect.signature(ckstore.open).parameters


def has_recycle() -> bool:
    return "recycle_bytes" in inspect.signature(ckstore.open).parameters


def has_stage() -> bool:
    return "stage" in inspect.signature(ckstore.Store.commit).parameters


def stored_bytes(path: Path, recycled: bool = True) -> int:
    """Bytes on disk under ``path`` (SQLite's shared-memory index file left out); without
    ``recycled``, less the released pack files kept for later commits (``tmp/*.free``)."""
    return sum(
        f.stat().st_size
        for f in path.rglob("*")
        if f.is_file() and not f.name.endswith("-shm") and (recycled or f.suffix != ".free")
    )


class GcThread:
    """``store.gc()`` on request, in a background thread with a store handle of its own."""

    def __init__(self, path: Path) -> None:
        self.store = ckstore.open(path, run=RUN, create=False)
        self.seconds, self.runs = 0.0, 0
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="bench-gc", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            t = time.perf_counter()
            try:
                self.store.gc()
            except BaseException as e:  # raised again by close()
                self.error = e
                return
            self.seconds += time.perf_counter() - t
            self.runs += 1

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()
        self.store.close()
        if self.error is not None:
            raise self.error


def run_mode(mode: str, args: argparse.Namespace, root: Path, rnd: int) -> dict[str, float]:
    cfg = DemoConfig(steps=args.steps + args.warmup)
    trainer = Trainer(cfg)
    for _ in range(args.warmup):
        trainer.train_step()
    path = root / f"{mode}-r{rnd}"
    store = gcs = None
    gc_in = "background" if mode == "async-gc-bg" else args.gc_in
    if mode != "none":
        opts: dict[str, Any] = {"delta_chain": args.delta_chain} if mode == "async-delta" else {}
        if mode == "async-fresh":
            opts["recycle_bytes"] = 0
        if args.workers:
            opts["workers"] = args.workers
        store = ckstore.open(path, run=RUN, **opts)
        store.set_policy(RUN, LatestN(args.keep_last) | BestN(args.keep_best, "loss"))
        if gc_in == "thread":
            gcs = GcThread(path)
    kwargs: dict[str, Any] = {"stage": "changed"} if mode == "async-changed" else {}
    results: list[Any] = []  # checkpoints (blocking) or pending commits
    background: list[Any] = []  # pending gcs (--gc-in background)
    blocked = gc_s = excluded = 0.0
    gc_runs, largest = 0, 0
    gc.collect()
    t0 = time.perf_counter()
    step_times: list[float] = []
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = trainer.train_step()
        step_times.append(time.perf_counter() - t)
        if store is None:
            continue
        t = time.perf_counter()
        if mode == "blocking":
            results.append(store.commit(trainer.step, {0: trainer.state()}, {"loss": loss}))
        else:
            results.append(
                store.commit(
                    trainer.step, {0: trainer.state()}, {"loss": loss}, blocking=False, **kwargs
                )
            )
        blocked += time.perf_counter() - t
        if trainer.step % args.gc_every == 0:
            t = (
                time.perf_counter()
            )  # the store's size before each gc (its peak), outside the timing
            largest = max(largest, stored_bytes(path))
            excluded += time.perf_counter() - t
            if gcs is not None:
                gcs.request()
            elif gc_in == "background":
                t = time.perf_counter()
                background.append(store.gc(blocking=False))
                gc_s += time.perf_counter() - t
                gc_runs += 1
            else:
                t = time.perf_counter()
                store.gc()
                gc_s += time.perf_counter() - t
                gc_runs += 1
    t = time.perf_counter()
    if store is not None:
        store.wait()
    final_wait = time.perf_counter() - t
    total = time.perf_counter() - t0 - excluded
    r = {
        "total": total,
        "train": total - blocked - gc_s - final_wait,  # the training steps alone
        "step_ms": 1000 * statistics.median(step_times),
        "blocked": blocked,
        "gc": gc_s,
        "gc_runs": gc_runs,
        "gc_background": sum(p.seconds for p in background),
        "final_wait": final_wait,
    }
    if store is not None:
        if gcs is not None:
            gcs.close()
            r["gc"], r["gc_runs"] = gcs.seconds, gcs.runs
        ckpts = [x if mode == "blocking" else x.wait() for x in results]
        r["added"] = sum(c.stored_bytes_added for c in ckpts)
        r["logical"] = ckpts[-1].logical_bytes
        store.gc()  # untimed: what the policy keeps once everything landed
        r["kept"] = len(store.checkpoints(RUN))
        store.close()
        r["store_end"] = stored_bytes(path, recycled=False)
        r["recycled_end"] = stored_bytes(path) - r["store_end"]
        r["largest"] = max(largest, r["store_end"] + r["recycled_end"])
        shutil.rmtree(path, ignore_errors=True)
    return r


def warm_up(root: Path) -> None:
    """Imports and first-call costs (the first training steps of a process are slow)."""
    trainer = Trainer(DemoConfig())
    for _ in range(3):
        trainer.train_step()
    store = ckstore.open(root / "warm-up", run=RUN)
    store.commit(trainer.step, {0: trainer.state()}, {"loss": 1.0}, blocking=False).wait()
    store.gc()
    store.close()
    shutil.rmtree(root / "warm-up", ignore_errors=True)


def report(
    args: argparse.Namespace, modes: list[str], res: dict[str, list[dict[str, float]]]
) -> str:
    med = {m: {k: statistics.median(r[k] for r in res[m]) for k in res[m][0]} for m in modes}
    base = med["none"]["total"] if "none" in med else None
    rows = []
    for m in modes:
        r = med[m]
        slow = f"{r['total'] / base - 1:+.1%}" if base else "-"
        ck = "logical" in r
        rows.append(
            [
                MODES[m],
                f"{r['total']:.2f}",
                f"{args.steps / r['total']:.2f}",
                slow,
                f"{r['train']:.2f}",
                f"{r['step_ms']:.1f}",
                f"{r['blocked']:.2f} ({1000 * r['blocked'] / args.steps:.1f} ms/step)"
                if ck
                else "-",
                (
                    f"{r['gc']:.3f} ({r['gc_runs']:.0f} runs; {r['gc_background']:.2f} s on the gc thread)"
                    if r["gc_background"]
                    else f"{r['gc']:.2f} ({r['gc_runs']:.0f} runs)"
                )
                if ck
                else "-",
                f"{r['final_wait']:.2f}" if ck else "-",
                f"{r['kept']:.0f}" if ck else "-",
                mib(r["store_end"]) if ck else "-",
                mib(r["recycled_end"]) if ck else "-",
                mib(r["largest"]) if ck else "-",
                mib(r["logical"]) if ck else "-",
                f"{r['store_end'] / r['logical']:.2f}x" if ck else "-",
                f"{r['added'] / args.steps / 2**20:.2f}" if ck else "-",
            ]
        )
    head = [
        "mode",
        "total s",
        "steps/s",
        "vs no checkpointing",
        "in training steps s",
        "median step ms",
        "blocked in commit calls s",
        "gc s (in the loop)",
        "final wait s",
        "kept",
        "store MiB at end",
        "recycled MiB at end",
        "largest MiB (before a gc)",
        "one checkpoint MiB",
        "store / checkpoint",
        "stored MiB per step",
    ]
    policy = f"LatestN({args.keep_last}) | BestN({args.keep_best}, 'loss')"
    lines = [
        f"### Checkpoint every step: {args.steps} steps of the demo's GRU (median of "
        f"{args.rounds} round{'s' if args.rounds > 1 else ''})",
        "",
        table(head, rows),
        "",
        f"Retention {policy}, store.gc() every {args.gc_every} steps "
        + {
            "loop": "in the training loop (its time is training time)",
            "background": "as store.gc(blocking=False) (the calls' time is training time; the "
            "collections ran on the store's gc thread)",
            "thread": "in a background thread with its own store handle",
        }[args.gc_in]
        + (" (async-gc-bg: as store.gc(blocking=False))" if "async-gc-bg" in med and args.gc_in != "background" else "")
        + "; 'largest MiB' is the store's size right before a gc, its peak, recycled files included"
        + "; total = the steps, the commit calls, gc and the wait for commits still in flight at "
        "the end; 'in training steps' is the total less the rest: when it grows over no "
        "checkpointing's, the commits' background threads slowed the steps down (CPU contention); "
        "'median step ms' is the median training step alone, the figure least moved by other "
        "work on the machine. 'one checkpoint MiB' is the logical size of one checkpoint (its tensors' bytes); "
        "'store MiB at end' is every file of the store after a last gc once every commit landed "
        "(packs, checkpoint records, the SQLite catalog), and 'recycled MiB at end' the pack files "
        "that gc released and kept for later commits to write over (tmp/*.free; bounded by "
        "recycle_bytes; `ckstore gc` deletes them); 'stored MiB per step' is the chunk bytes "
        "each commit added (compressed, after dedup).",
    ]  # fmt: skip
    if base:
        for m in ("async", "async-changed", "async-delta", "async-gc-bg", "async-fresh", "blocking"):
            if m in med:
                s = med[m]["total"] / base - 1
                verdict = "meets" if s < TARGET_SLOWDOWN else "misses"
                lines.append(
                    f"\n{MODES[m]}: training {s:+.1%} against no checkpointing; "
                    f"{verdict} the target (< {TARGET_SLOWDOWN:.0%})."
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=200, help="timed training steps per mode")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are shown")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each fresh trainer")
    ap.add_argument("--gc-every", type=int, default=50, help="store.gc() every N steps")
    ap.add_argument(
        "--gc-in", choices=["loop", "background", "thread"], default="loop", help="where gc runs"
    )
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--keep-best", type=int, default=1, help="best N by the step's loss")
    ap.add_argument(
        "--delta-chain", type=int, default=4, help="async-delta's delta_chain (deltas per chain)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: as the demo)")
    ap.add_argument(
        "--workers", type=int, default=0, help="the stores' threads (ckstore.open(workers=...); default: its own)"
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ",".join(MODES))
    ap.add_argument(
        "--dir", default=None, help="where the stores go (default: a folder in the cwd)"
    )
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if "async-changed" in modes and not has_stage():
        print("this ckstore has no commit(stage=...): async-changed left out", file=sys.stderr)
        modes.remove("async-changed")
    if "async-delta" in modes and not has_delta():
        print("this ckstore writes no deltas: async-delta left out", file=sys.stderr)
        modes.remove("async-delta")
    if "async-fresh" in modes and not has_recycle():
        print("this ckstore recycles no pack files: async-fresh left out", file=sys.stderr)
        modes.remove("async-fresh")
    if args.rounds < 1 or args.steps < 1 or args.gc_every < 1:
        ap.error("--rounds, --steps and --gc-every must be at least 1")
    # as the demo does, unless --threads says otherwise
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads()))
    root = Path(scratch_dir(args.dir or os.getcwd(), "ckstore-bench-every-step-"))
    env = (
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch "
        f"threads, load average {os.getloadavg()[0]:.1f} at the start"
    )
    print(env + f"; writing under {root}", file=sys.stderr, flush=True)
    res: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    t0 = time.perf_counter()
    try:
        warm_up(root)
        for rnd in range(args.rounds):
            k = rnd % len(modes)
            for m in modes[k:] + modes[:k]:
                r = run_mode(m, args, root, rnd)
                res[m].append(r)
                extra = (
                    f", blocked {r['blocked']:.2f} s, gc {r['gc']:.2f} s, final wait "
                    f"{r['final_wait']:.2f} s, store {mib(r['store_end'])} MiB"
                    if "logical" in r
                    else ""
                )
                print(
                    f"  round {rnd + 1}/{args.rounds} {m}: {r['total']:.2f} s{extra}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = (
        report(args, modes, res)
        + f"\n\n{env}, {os.getloadavg()[0]:.1f} at the end; {time.perf_counter() - t0:.0f} s in all."
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
