"""A small commit's timeline, and the I/O it cannot skip, against torch.save + fsync.

Two measurements of the 4 MiB state (four fp32 matrices of 1 MiB, bench_core's ``4mib``):

* **Timeline**: the commit's phases and the calls inside them (the claim, each chunk's encode,
  each frame appended to the pack, the pack's fdatasync and folder fsyncs, the record, the
  finishing transaction), wrapped with timers from outside for this script only; for each
  event (the i-th call of its kind on a kind of thread: the caller, the commit's pool, the pack
  writer's), the median over ``--commits`` commits of when it started and ended, in ms from the
  call; events that most commits lack (a new folder's fsync) are left out.
* **I/O floor**: the writes a commit of this state makes durable, done alone with the same
  system calls and no encoding, hashing or Python protocol: the pack (86.5% of the raw bytes,
  what the codec stores of this state) through a temp file with writeback started every MiB,
  fdatasync, rename and folder fsync; the checkpoint's record (a small file, the same way); and
  one durable SQLite transaction (WAL, ``synchronous=FULL``) recording four chunks and the
  checkpoint. Against ``torch.save`` + fsync of the same tensors, alternating, the median of
  ``--floor-rounds`` each. Also the same I/O with the pack written over a file an earlier pack
  left (renamed into ``tmp/``, overwritten from the start, truncated to its new length): what
  recycling the files gc releases instead of deleting them would save a commit (ckstore does
  not do this); and gc's part, deleting a pack file against renaming it aside for reuse.

    python benchmarks/timeline_commit.py
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sqlite3
import statistics
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import scratch_dir, table  # noqa: E402

import ckstore  # noqa: E402
from ckstore.blobstore import _local  # noqa: E402
from ckstore.catalog import _commit  # noqa: E402
from ckstore.commit import protocol  # noqa: E402
from ckstore.format import codec, pack  # noqa: E402
from ckstore.retention import LatestN  # noqa: E402

#: (owner, attribute, label) of every call the timeline shows
TRACED = [
    (protocol.StagedCommit, "declare", "declare"),
    (protocol.StagedCommit, "hash", "hash"),
    (_commit.CommitMixin, "begin_and_claim", "claim (catalog)"),
    (protocol.StagedCommit, "write", "write phase"),
    (codec, "encode", "encode a chunk"),
    (pack.PackWriter, "_open", "open the pack"),
    (pack.PackWriter, "add", "append a frame"),
    (_local._Flusher, "finish", "fdatasync"),
    (_local, "fsync_dir", "folder fsync"),
    (protocol, "write_record", "the record"),
    (_commit.CommitMixin, "finish_checkpoint", "finishing transaction"),
]


class Timeline:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []  # label, thread, start, end
        self.t0 = 0.0
        self._undo: list[Callable[[], None]] = []

    def trace(self) -> None:
        for owner, name, label in TRACED:
            fn = getattr(owner, name)

            def timed(*a: Any, __fn: Any = fn, __label: str = label, **k: Any) -> Any:
                start = time.perf_counter()
                try:
                    return __fn(*a, **k)
                finally:
                    thread = threading.current_thread()
                    who = "caller" if thread is threading.main_thread() else thread.name.rsplit("_", 1)[0]
                    self.events.append((__label, who, start - self.t0, time.perf_counter() - self.t0))

            setattr(owner, name, timed)
            self._undo.append(lambda o=owner, n=name, f=fn: setattr(o, n, f))

    def untrace(self) -> None:
        for undo in self._undo:
            undo()


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(512, 512, generator=g) for i in range(4)}


def timeline(commits: int, where: str) -> None:
    sd = state()
    store = ckstore.open(os.path.join(where, "timeline"), run="t")
    store.commit(step=0, rank_states={0: {"m": {"x": torch.zeros(4)}}})
    for step in range(1, 6):  # threads started, statements prepared
        store.commit(step=step, rank_states={0: {"m": sd}})
    tl = Timeline()
    tl.trace()
    rows: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
    walls = []
    try:
        for step in range(6, 6 + commits):
            for t in sd.values():
                t.add_(1e-3)
            tl.events.clear()
            tl.t0 = time.perf_counter()
            store.commit(step=step, rank_states={0: {"m": sd}})
            walls.append(time.perf_counter() - tl.t0)
            seen: dict[tuple[str, str], int] = defaultdict(int)
            for label, who, start, end in sorted(tl.events, key=lambda e: e[2]):
                rows[label, who, seen[label, who]].append((start, end))  # the i-th such call on such a thread
                seen[label, who] += 1
            if step % 50 == 0:
                store.gc(LatestN(2))
    finally:
        tl.untrace()
        store.close()
    out = []
    for (label, who, i), got in sorted(rows.items(), key=lambda kv: statistics.median(g[0] for g in kv[1])):
        if len(got) < commits // 2:
            continue  # an event of a few commits only (a new folder's fsync)
        start, end = statistics.median(g[0] for g in got), statistics.median(g[1] for g in got)
        name = f"{label} #{i + 1}" if (label, who, 1) in rows else label
        out.append([name, who, f"{start * 1e3:.2f}", f"{end * 1e3:.2f}", f"{(end - start) * 1e3:.2f}"])
    print(f"### A 4 MiB commit's timeline (medians over {commits} commits; the commit {statistics.median(walls) * 1e3:.2f} ms)\n")
    print(table(["event", "thread", "starts ms", "ends ms", "takes ms"], out))


def floor(rounds: int, where: str) -> None:
    root = Path(where) / "floor"
    for sub in ("tmp", "packs/ab", "records/cd"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(root / "catalog.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE chunks (digest BLOB PRIMARY KEY, pack INTEGER, offset INTEGER, length INTEGER)")
    db.execute("CREATE TABLE checkpoints (id INTEGER PRIMARY KEY, step INTEGER, visible INTEGER)")
    libc = ctypes.CDLL(None, use_errno=True)
    start_writeback = getattr(libc, "sync_file_range", None)
    rng = np.random.default_rng(0)
    frames = [np.frombuffer(rng.bytes(int(0.865 * (1 << 20))), dtype=np.uint8) for _ in range(4)]
    record = rng.bytes(1500)
    sd = state()

    def durable_file(parts: list[Any], folder: str, over: Path | None = None) -> Path:
        """Write ``parts`` durably into a new file of ``folder``: a fresh temp file, or the file
        ``over`` (an earlier pack set aside), overwritten from the start and cut to length."""
        tmp = root / "tmp" / uuid.uuid4().hex
        if over is not None:
            os.replace(over, tmp)
        with open(tmp, "xb" if over is None else "r+b", buffering=0) as f:
            pos = 0
            for part in parts:
                f.write(part)
                if start_writeback is not None:
                    start_writeback(f.fileno(), ctypes.c_int64(pos), ctypes.c_int64(len(part)), 2)
                pos += len(part)
            if over is not None:
                f.truncate(pos)
            os.fdatasync(f.fileno())
        dest = root / folder / uuid.uuid4().hex
        os.replace(tmp, dest)
        _local.fsync_dir(str(root / folder))  # the local store's own
        return dest

    aside: list[Path] = []  # pack files set aside for reuse (as if a gc had released them)

    def ckstore_io(step: int, reuse: bool = False) -> Path:
        pack = durable_file(frames, "packs/ab", aside.pop() if reuse else None)
        durable_file([record], "records/cd")
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT INTO chunks VALUES (?, 1, ?, ?)", [(os.urandom(16), i, 1) for i in range(4)])
        db.execute("INSERT INTO checkpoints (step, visible) VALUES (?, 1)", (step,))
        db.execute("COMMIT")
        return pack

    def torch_save() -> None:
        with open(root / "state.pt", "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    fresh_io, reused_io = "a commit's I/O alone", "the same, its pack written over an earlier pack's file"
    unlink, aside_gc = "gc: delete a pack file", "gc: rename a pack file aside for reuse"
    times: dict[str, list[float]] = {fresh_io: [], reused_io: [], "torch.save + fsync": [], unlink: [], aside_gc: []}
    os.makedirs(root / "aside", exist_ok=True)
    for _ in range(4):  # files to reuse from the first round on
        aside.append(ckstore_io(-1))
    for i in range(rounds):
        written: dict[str, Path] = {}
        order = [
            (fresh_io, lambda: written.__setitem__(fresh_io, ckstore_io(i))),
            (reused_io, lambda: written.__setitem__(reused_io, ckstore_io(i, reuse=True))),
            ("torch.save + fsync", torch_save),
        ]
        for name, fn in order[i % 3 :] + order[: i % 3]:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        # gc's part: one pack file deleted, the other set aside (keeping as many aside as before)
        t = time.perf_counter()
        os.unlink(written[reused_io])
        times[unlink].append(time.perf_counter() - t)
        t = time.perf_counter()
        dest = root / "aside" / written[fresh_io].name
        os.replace(written[fresh_io], dest)
        times[aside_gc].append(time.perf_counter() - t)
        aside.append(dest)
    db.close()
    ref = statistics.median(times["torch.save + fsync"])
    rows = [[k, f"{statistics.median(v) * 1e3:.2f}", f"{statistics.median(v) / ref:.2f}x"] for k, v in times.items()]
    print(f"\n### The I/O a 4 MiB commit makes durable, alone (medians of {rounds})\n")
    print(table(["what", "ms", "vs torch.save + fsync"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=100)
    ap.add_argument("--floor-rounds", type=int, default=200)
    ap.add_argument("--dir", default=None, help="where the stores go (default: the system's temp folder)")
    args = ap.parse_args()
    where = scratch_dir(args.dir, "ckstore-timeline-")
    try:
        timeline(args.commits, where)
        floor(args.floor_rounds, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
