"""Asynchronous commits and DCP on ckstore, against DCP's own file system storage.

    python benchmarks/bench_async_dcp.py [--size-mib 256] [--tensors 16] [--rounds 3] [--dir DIR]

One process, one state dict of ``--tensors`` fp32 matrices (``--size-mib`` in all). Every round
uses fresh stores and folders and runs the methods in a rotated order (so no method always runs
first, on a cold allocator or page cache); the table gives each figure's median over the rounds.

* blocking time: ``store.commit(blocking=False)`` until it returns (first commit into a fresh
  store, then a second one after every tensor changed: its staging buffer is reused, a third
  of a state identical to the second, and with ``stage="changed"`` of an identical state and of
  one with 10% of its tensors changed), ``dcp.async_save`` with ``FileSystemWriter`` until
  it returns, and a plain ``clone()`` of every tensor;
* total time: the asynchronous commit until ``wait()`` returns, a blocking ``store.commit``, and
  ``dcp.save`` with ``FileSystemWriter``;
* ``dcp.save`` through ckstore's ``Writer`` vs ``FileSystemWriter``: time, bytes on disk, and bytes
  a second save adds after 10% of the tensors changed (DCP writes a new folder each time);
* ``dcp.load`` through ckstore's ``Reader`` vs ``FileSystemReader`` (page cache warm).

Both systems make what they write durable (fsync).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import du, mib, table  # noqa: E402

import ckstore  # noqa: E402
from ckstore.integrations import dcp as ckdcp  # noqa: E402

warnings.filterwarnings("ignore")


def make_state(size_mib: int, n: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    rows = size_mib * 2**20 // 4 // n // 1024
    return {"model": {f"layer{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(n)}}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def one_round(base: Path, size_mib: int, n: int, seed: int, order: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    state = make_state(size_mib, n, seed)
    tensors = list(state["model"].values())
    r: dict[str, float] = {}

    def async_commits() -> None:
        own = {"model": {k: v.clone() for k, v in state["model"].items()}}  # it changes them
        mine = list(own["model"].values())
        s = ckstore.open(base / "async", run="b", create=True)
        block, p = timed(lambda: s.commit(1, {0: own}, blocking=False))
        r["async_block_first"] = block
        r["async_total_first"] = block + timed(p.wait)[0]
        for t in mine:
            t.add_(1.0)
        block, p = timed(lambda: s.commit(2, {0: own}, blocking=False))
        r["async_block_reused"] = block
        r["async_total_reused"] = block + timed(p.wait)[0]
        block, p = timed(lambda: s.commit(3, {0: own}, blocking=False))
        r["async_block_same"] = block
        r["async_total_same"] = block + timed(p.wait)[0]
        block, p = timed(lambda: s.commit(4, {0: own}, blocking=False, stage="changed"))
        r["async_block_changed_same"] = block
        p.wait()
        for t in mine[: max(1, n // 10)]:
            t.add_(1.0)
        block, p = timed(lambda: s.commit(5, {0: own}, blocking=False, stage="changed"))
        r["async_block_changed_10"] = block
        p.wait()
        s.close()

    def blocking_commit() -> None:
        s = ckstore.open(base / "blocking", run="b", create=True)
        r["commit_total"] = timed(lambda: s.commit(1, {0: state}))[0]
        s.close()

    def dcp_async() -> None:
        block, fut = timed(
            lambda: dcp.async_save(state, storage_writer=FileSystemWriter(str(base / "dcp_async")))
        )
        r["dcp_async_block"] = block
        r["dcp_async_total"] = block + timed(fut.result)[0]

    def clone() -> None:
        r["clone"] = timed(lambda: [t.clone() for t in tensors])[0]

    def dcp_save_fs() -> None:
        r["dcp_fs_save"] = timed(
            lambda: dcp.save(state, storage_writer=FileSystemWriter(str(base / "fs1")))
        )[0]
        r["dcp_fs_bytes"] = du(str(base / "fs1"))

    def dcp_save_writer() -> None:
        s = ckstore.open(base / "writer", run="b", create=True)
        r["dcp_ck_save"] = timed(lambda: dcp.save(state, storage_writer=ckdcp.Writer(s, step=1)))[0]
        r["dcp_ck_bytes"] = du(str(base / "writer"))
        s.close()

    steps = [async_commits, blocking_commit, dcp_async, clone, dcp_save_fs, dcp_save_writer]
    for fn in steps[order % len(steps) :] + steps[: order % len(steps)]:
        fn()

    # a second save after 10% of the tensors changed
    for t in tensors[: max(1, n // 10)]:
        t.mul_(1.5)
    s = ckstore.open(base / "writer", run="b")
    before = du(str(base / "writer"))
    dcp.save(state, storage_writer=ckdcp.Writer(s, step=2))
    r["dcp_ck_second_bytes"] = du(str(base / "writer")) - before
    dcp.save(state, storage_writer=FileSystemWriter(str(base / "fs2")))
    r["dcp_fs_second_bytes"] = du(str(base / "fs2"))

    # loads, alternating
    def load_ck() -> None:
        target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        r["dcp_ck_load"] = timed(lambda: dcp.load(target, storage_reader=ckdcp.Reader(s, 2)))[0]
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())

    def load_fs() -> None:
        target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        r["dcp_fs_load"] = timed(
            lambda: dcp.load(target, storage_reader=FileSystemReader(str(base / "fs2")))
        )[0]
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())

    def checkout() -> None:
        r["checkout"] = timed(lambda: s.checkout(2))[0]

    for fn in [load_ck, load_fs, checkout] if order % 2 == 0 else [load_fs, checkout, load_ck]:
        fn()
    s.close()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    rounds = []
    for i in range(a.rounds):
        base = Path(tempfile.mkdtemp(prefix="bench-async-dcp-", dir=a.dir))
        try:
            rounds.append(one_round(base, a.size_mib, a.tensors, seed=i, order=i))
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(f"round {i + 1}/{a.rounds} done", file=sys.stderr)
    m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}

    def s(x: float) -> str:
        return f"{x:.3f} s"

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}x"

    print(f"\n### {a.size_mib} MiB fp32 in {a.tensors} tensors, median of {a.rounds} rounds\n")
    print(table(["blocking time (training stalled)", "time", "vs clone()"], [
        ["plain clone() of every tensor", s(m["clone"]), "1.00x"],
        ["commit(blocking=False), first into a fresh store", s(m["async_block_first"]), ratio(m["async_block_first"], m["clone"])],
        ["commit(blocking=False), staging buffer reused", s(m["async_block_reused"]), ratio(m["async_block_reused"], m["clone"])],
        ["commit(blocking=False), state identical to the parent", s(m["async_block_same"]), ratio(m["async_block_same"], m["clone"])],
        ["commit(blocking=False, stage='changed'), state identical", s(m["async_block_changed_same"]),
         ratio(m["async_block_changed_same"], m["clone"])],
        ["commit(blocking=False, stage='changed'), 10% of tensors changed", s(m["async_block_changed_10"]),
         ratio(m["async_block_changed_10"], m["clone"])],
        ["dcp.async_save (FileSystemWriter)", s(m["dcp_async_block"]), ratio(m["dcp_async_block"], m["clone"])],
    ]))  # fmt: skip
    print()
    print(table(["total time until durable", "time", "vs dcp.save"], [
        ["dcp.save (FileSystemWriter)", s(m["dcp_fs_save"]), "1.00x"],
        ["store.commit (blocking)", s(m["commit_total"]), ratio(m["commit_total"], m["dcp_fs_save"])],
        ["commit(blocking=False) until wait() returns", s(m["async_total_first"]), ratio(m["async_total_first"], m["dcp_fs_save"])],
        ["dcp.async_save until its future is done", s(m["dcp_async_total"]), ratio(m["dcp_async_total"], m["dcp_fs_save"])],
    ]))  # fmt: skip
    print()
    print(table(["dcp.save / dcp.load", "ckstore Writer / Reader", "FileSystemWriter / Reader", "ratio"], [
        ["save time", s(m["dcp_ck_save"]), s(m["dcp_fs_save"]), ratio(m["dcp_ck_save"], m["dcp_fs_save"])],
        ["MiB on disk", mib(m["dcp_ck_bytes"]), mib(m["dcp_fs_bytes"]), ratio(m["dcp_ck_bytes"], m["dcp_fs_bytes"])],
        ["MiB added by a 2nd save, 10% of tensors changed", mib(m["dcp_ck_second_bytes"]), mib(m["dcp_fs_second_bytes"]),
         ratio(m["dcp_ck_second_bytes"], m["dcp_fs_second_bytes"])],
        ["load time (page cache warm)", s(m["dcp_ck_load"]), s(m["dcp_fs_load"]), ratio(m["dcp_ck_load"], m["dcp_fs_load"])],
    ]))  # fmt: skip
    print(f"\n(store.checkout of the same checkpoint, for reference: {s(m['checkout'])})")


if __name__ == "__main__":
    main()
