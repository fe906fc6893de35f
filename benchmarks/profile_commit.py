"""Where a commit's and a checkout's time goes, stage by stage.

Every stage function is wrapped with a ``perf_counter`` timer from outside, for the length of this
script only (ckstore's code holds no timing code). Times are exclusive (a stage nested in another,
such as fsync inside a pack write, is counted once, in the inner stage) and summed over every
thread: hashing, encoding, pack writes and reads run on worker threads while the calling thread
waits, so the stages can add up to more than the wall time. "calling thread, unattributed" is the
wall time the calling thread spent outside every stage: Python glue, and waiting on the workers.

    python benchmarks/profile_commit.py                 # every workload
    python benchmarks/profile_commit.py --only tiny,adam

The checkout reads the checkpoint just written (page cache warm); ``--cold`` drops the page cache
first (root only; it slows everything else on the machine).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    adam_state,
    drop_caches,
    minilm_state,
    scratch_dir,
    synthetic_state,
    table,
    tiny_state,
)

import ckstore  # noqa: E402
from ckstore.blobstore import _local  # noqa: E402
from ckstore.catalog import Catalog  # noqa: E402
from ckstore.checkout import executor, reshard  # noqa: E402
from ckstore.commit import _arguments, _stage  # noqa: E402
from ckstore.format import codec, hashing, manifest, pack, tensorio  # noqa: E402


class StageTimer:
    """Exclusive time per stage, summed over threads, with the calling thread's share apart."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.main_seconds = 0.0  # time inside stages on the calling thread
        self._local = threading.local()
        self._lock = threading.Lock()
        self._main = threading.get_ident()
        self._undo: list[Callable[[], None]] = []
        self.missing: list[str] = []

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.main_seconds = 0.0

    def _timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack: list[float] = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                children = stack.pop()
                if stack:
                    stack[-1] += elapsed
                with self._lock:
                    self.seconds[stage] += elapsed - children
                    self.calls[stage] += 1
                    if not stack and threading.get_ident() == self._main:
                        self.main_seconds += elapsed

        return timed

    def wrap(self, owner: Any, attr: str, stage: str) -> None:
        """Time ``owner.attr`` (a module function or a class's method) as ``stage``."""
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if raw is None:
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        if isinstance(raw, classmethod):
            new: Any = classmethod(self._timed(stage, raw.__func__))
        elif isinstance(raw, staticmethod):
            new = staticmethod(self._timed(stage, raw.__func__))
        else:
            new = self._timed(stage, raw)
        setattr(owner, attr, new)
        self._undo.append(lambda: setattr(owner, attr, raw))

    def undo(self) -> None:
        for u in reversed(self._undo):
            u()
        self._undo.clear()


COMMIT_STAGES = [
    "flatten/validate", "staging", "hashing", "encoding", "pack writes", "fsync",
    "catalog transactions", "manifests", "waiting on pack completion",
]  # fmt: skip
CHECKOUT_STAGES = [
    "catalog transactions", "manifest decode/validate", "planning", "reads", "decode",
    "digest verify", "assembly",
]  # fmt: skip


def install(t: StageTimer) -> None:
    # commit
    t.wrap(_stage, "prepare_entries", "flatten/validate")
    t.wrap(_arguments, "check_arguments", "flatten/validate")
    t.wrap(_stage, "stage_tensors", "staging")
    t.wrap(hashing, "digest", "hashing")  # commit: hashing; checkout: relabelled below
    t.wrap(codec, "encode", "encoding")
    t.wrap(codec, "encode_many", "encoding")  # small chunks, a batch at a time
    for name in ("add", "_open", "_finish", "close"):
        t.wrap(pack.PackWriter, name, "pack writes")
    # the pack writer waits here for finished packs written and recorded on its background thread
    t.wrap(pack.PackWriter, "_settle", "waiting on pack completion")
    t.wrap(pack.PackWriter, "_shutdown", "waiting on pack completion")
    t.wrap(os, "fdatasync", "fsync")
    t.wrap(os, "fsync", "fsync")
    t.wrap(_local, "fsync_dir", "fsync")
    t.wrap(_stage, "build_manifests", "manifests")
    t.wrap(manifest.Manifest, "to_bytes", "manifests")
    for name, fn in list(vars(Catalog).items()):
        if callable(fn) and not name.startswith("_"):
            t.wrap(Catalog, name, "catalog transactions")
    for cls in Catalog.__mro__[1:]:
        if cls.__module__.startswith("ckstore.catalog"):
            for name, fn in list(vars(cls).items()):
                if callable(fn) and not name.startswith("_") and name not in vars(Catalog):
                    t.wrap(cls, name, "catalog transactions")
    # checkout
    t.wrap(manifest.Manifest, "from_bytes", "manifest decode/validate")
    t.wrap(reshard, "plan_checkout", "planning")
    t.wrap(_local.LocalBlobStore, "_read", "reads")
    t.wrap(codec, "decode_into", "decode")
    t.wrap(executor, "empty_tensor", "assembly")
    t.wrap(executor, "_deliver", "assembly")
    t.wrap(tensorio, "unflatten", "assembly")


@contextmanager
def phase(t: StageTimer) -> Iterator[dict[str, float]]:
    t.reset()
    out: dict[str, float] = {}
    gc.collect()
    t0 = time.perf_counter()
    yield out
    out["wall"] = time.perf_counter() - t0
    out.update(t.seconds)
    out["calling thread, unattributed"] = max(0.0, out["wall"] - t.main_seconds)


# -- workloads ---------------------------------------------------------------------------------
def randn_state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(mib * 2**18, generator=g)}


def count(state: Any) -> tuple[int, int]:
    tensors = [v for v in _leaves(state) if isinstance(v, torch.Tensor)]
    return len(tensors), sum(v.numel() * v.element_size() for v in tensors)


def _leaves(x: Any) -> Iterator[Any]:
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


WORKLOADS: dict[str, tuple[str, Callable[[], Any]]] = {
    "4mib": ("4 MiB fp32", lambda: randn_state(4)),
    "minilm-bf16": ("43 MiB bf16 MiniLM", lambda: minilm_state(torch.bfloat16)),
    "minilm-fp32": ("87 MiB fp32 MiniLM", lambda: minilm_state(torch.float32)),
    "256mib": ("256 MiB fp32", lambda: synthetic_state(256)),
    "tiny": ("20,000 tiny tensors", tiny_state),
    "adam": ("Adam state, 2,400 params", adam_state),
}


def profile(
    key: str, root: str, t: StageTimer, cold: bool
) -> tuple[str, int, int, dict[str, float], dict[str, float]]:
    label, make = WORKLOADS[key]
    state = make()
    n, raw = count(state)
    path = os.path.join(root, key)
    store = ckstore.open(path, run="p", create=True)
    # a first commit opens the catalog and warms imports; the measured one is a fresh state
    store.commit(0, {0: {"warm": {"x": torch.zeros(4)}}})
    with phase(t) as c:
        store.commit(1, {0: {"model_states": state}})
    if cold:
        drop_caches()
    with phase(t) as r:
        out = store.checkout(1)
    del out
    store.close()
    return label, n, raw, c, r


def render(
    label: str, n: int, raw: int, res: dict[str, float], stages: list[str], what: str
) -> str:
    wall = res["wall"]
    rows = []
    for s in [*stages, "calling thread, unattributed"]:
        v = res.get(s, 0.0)
        rows.append([s, f"{v:.3f}", f"{100 * v / wall:.0f}%"])
    rows.append(["wall", f"{wall:.3f}", "100%"])
    head = f"{what}: {label} ({n:,} tensors, {raw / 2**20:.1f} MiB)"
    return head + "\n\n" + table(["stage", "s (all threads)", "% of wall"], rows)


def summary(results: list[tuple[str, dict[str, float]]], stages: list[str], what: str) -> str:
    """One table for every workload: seconds and share of wall per stage."""
    rows = []
    for st in [*stages, "calling thread, unattributed"]:
        rows.append(
            [
                st,
                *(
                    f"{r.get(st, 0.0):.3f} ({100 * r.get(st, 0.0) / r['wall']:.0f}%)"
                    for _, r in results
                ),
            ]
        )
    rows.append(["wall", *(f"{r['wall']:.3f}" for _, r in results)])
    return f"{what}, s (% of wall)\n\n" + table(["stage", *(label for label, _ in results)], rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", help="comma-separated workloads: " + ",".join(WORKLOADS))
    ap.add_argument(
        "--cold", action="store_true", help="drop the page cache before each checkout (root)"
    )
    ap.add_argument("--dir", help="where the stores go (default: a temporary folder)")
    args = ap.parse_args()
    keys = args.only.split(",") if args.only else list(WORKLOADS)
    t = StageTimer()
    install(t)
    if t.missing:
        print("not timed (not found in this version):", ", ".join(t.missing), file=sys.stderr)
    tmp = scratch_dir(args.dir, "ckprofile-")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    commits: list[tuple[str, dict[str, float]]] = []
    checkouts: list[tuple[str, dict[str, float]]] = []
    for key in keys:
        label, n, raw, c, r = profile(key, tmp, t, args.cold)
        # on checkout, hashing is the digest check of every chunk read
        r["digest verify"] = r.pop("hashing", 0.0)
        print(render(label, n, raw, c, COMMIT_STAGES, "commit"))
        print()
        print(
            render(
                label,
                n,
                raw,
                r,
                CHECKOUT_STAGES,
                "checkout" + (" (cold cache)" if args.cold else " (warm cache)"),
            )
        )
        print(flush=True)
        commits.append((label, c))
        checkouts.append((label, r))
    print(summary(commits, COMMIT_STAGES, "commit"))
    print()
    print(
        summary(
            checkouts,
            CHECKOUT_STAGES,
            "checkout" + (" (cold cache)" if args.cold else " (warm cache)"),
        )
    )
    print()
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    t.undo()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
