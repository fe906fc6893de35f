"""Backends benchmark: blob stores (a local folder vs an S3-compatible server) and catalogs
(SQLite vs PostgreSQL), in one run.

1. Commit and checkout time, and the requests they make, on a local folder and on a local moto
   S3 server (both with an SQLite catalog, so only the blob store differs), and on S3 with a
   PostgreSQL catalog (the shared setup).
2. Catalog operations per second on SQLite and PostgreSQL: the commit protocol's round trips
   (one thread and four), resolving a ref, locating chunks.
3. Commit cost as the catalog grows: the time of a small commit among the first and the last
   of many, on each catalog; it must stay flat.

Needs ``moto[server]`` and a PostgreSQL server (``CKSTORE_BENCH_PG``, default
``postgresql://postgres@127.0.0.1:5432/postgres``; a database is made and dropped)::

    python benchmarks/bench_backends.py [--mib 48] [--grow 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import ckstore
from ckstore.catalog import Catalog, NewChunk, Owner
from ckstore.format.pack import new_pack_key
from ckstore.layout import WorldLayout

console = Console(width=140)
REGION = "eu-west-1"
PACK_SIZE = 16 * 2**20  # a few packs per commit, so uploads can overlap


# -- services -------------------------------------------------------------------------------------
@contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    exe = Path(sys.executable).parent / "moto_server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log_dir / "moto.log", "wb") as log:
        proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def pg_database() -> Iterator[str]:
    import psycopg

    admin = os.environ.get("CKSTORE_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    name = f"ckstore_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield "postgresql+psycopg://" + admin.split("://", 1)[1].rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"bench-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="bench",
                 aws_secret_access_key="bench").create_bucket(
        Bucket=name, CreateBucketConfiguration={"LocationConstraint": REGION})  # fmt: skip
    return name


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"region_name": REGION},
    }


# -- part 1: blob stores ----------------------------------------------------------------------------
def model_state(mib: int, seed: int) -> dict[int, dict[str, Any]]:
    """Two ranks; bf16 weights and fp32 optimizer moments, ``mib`` MiB in all."""
    g = torch.Generator().manual_seed(seed)
    per_rank = mib * 2**20 // 2
    n_layers = 8
    rows = 1024
    # per layer: a bf16 weight (2 B) and two fp32 moments (8 B) of rows*cols elements
    cols = max(1, per_rank // (n_layers * rows * 10))
    out: dict[int, dict[str, Any]] = {}
    for r in range(2):
        model, optim = {}, {}
        for i in range(n_layers):
            w = torch.randn(rows, cols, generator=g)
            model[f"layer{i}.weight"] = w.to(torch.bfloat16)
            optim[f"layer{i}.exp_avg"] = torch.randn(rows, cols, generator=g) * 1e-3
            optim[f"layer{i}.exp_avg_sq"] = torch.rand(rows, cols, generator=g) * 1e-6
        out[r] = {"model_states": model, "optim_states": optim}
    return out


def perturb(states: dict[int, dict[str, Any]], fraction_layers: int) -> dict[int, dict[str, Any]]:
    """A next step: the first layers' weights and moments change, the rest stay."""
    out: dict[int, dict[str, Any]] = {}
    for r, subs in states.items():
        out[r] = {k: dict(v) for k, v in subs.items()}
        for i in range(fraction_layers):
            out[r]["model_states"][f"layer{i}.weight"] = (
                subs["model_states"][f"layer{i}.weight"] + 1
            )
            out[r]["optim_states"][f"layer{i}.exp_avg"] = (
                subs["optim_states"][f"layer{i}.exp_avg"] * 0.9
            )
    return out


class S3Requests:
    """Counts the HTTP requests an S3 store's client sends, by operation."""

    def __init__(self, store: ckstore.Store) -> None:
        self.counts: Counter[str] = Counter()
        store.blobs.fs.connect()  # type: ignore[attr-defined]
        store.blobs.fs.s3.meta.events.register("before-send.s3", self._hook)  # type: ignore[attr-defined]

    def _hook(self, **kw: Any) -> None:
        self.counts[kw["event_name"].rsplit(".", 1)[-1]] += 1

    def take(self) -> str:
        text = ", ".join(f"{op} {n}" for op, n in sorted(self.counts.items()))
        self.counts.clear()
        return text or "-"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_blobstores(mib: int, tmp: Path, endpoint: str, pg_url: str) -> list[dict[str, Any]]:
    base = model_state(mib, 0)
    nxt = perturb(base, 2)
    logical = sum(
        t.numel() * t.element_size() for r in base.values() for s in r.values() for t in s.values()
    )
    backends = [
        ("local folder + SQLite", str(tmp / "local"), None, None),
        (
            "S3 (moto) + SQLite",
            f"s3://{make_bucket(endpoint)}/store",
            f"sqlite:///{tmp / 's3cat.db'}",
            s3_options(endpoint),
        ),
        (
            "S3 (moto) + PostgreSQL",
            f"s3://{make_bucket(endpoint)}/store",
            pg_url,
            s3_options(endpoint),
        ),
    ]
    rows: list[dict[str, Any]] = []
    for name, location, catalog, opts in backends:
        store = ckstore.open(
            location, catalog=catalog, storage_options=opts, run="bench", pack_size=PACK_SIZE
        )
        reqs = S3Requests(store) if opts else None

        def step(label: str, fn: Callable[[], Any], nbytes: int) -> None:
            store.blobs.stats.reset()
            secs, _ = timed(fn)
            st = store.blobs.stats.snapshot()
            rows.append({
                "backend": name, "operation": label, "seconds": secs, "MB/s": nbytes / secs / 1e6,
                "blob writes": st["writes"], "blob reads": st["reads"],
                "MiB moved": (st["bytes_written"] + st["bytes_read"]) / 2**20,
                "S3 requests": reqs.take() if reqs else "-",
            })  # fmt: skip

        step("commit, all new", lambda: store.commit(1, base), logical)
        step("commit, 25% changed", lambda: store.commit(2, nxt), logical)
        step("commit, unchanged", lambda: store.commit(3, nxt), logical)
        step("checkout, all", lambda: store.checkout(2), logical)
        step(
            "checkout, 1 rank 1 key",
            lambda: store.checkout(1, ranks=[0], sub_keys=["model_states"]),
            logical // 10,
        )
        store.close()
    return rows


# -- part 2: catalog operations per second -------------------------------------------------------
def _protocol_round(cat: Catalog, run: str, step: int, n_chunks: int) -> None:
    owner = Owner.me()
    ck = cat.begin_checkpoint(run, step, kind="checkpoint", replace=False, owner=owner,
                              world_layout=WorldLayout.flat(1), lease_seconds=60)  # fmt: skip
    digests = [os.urandom(16) for _ in range(n_chunks)]
    missing = cat.claim_chunks(ck, owner, digests)
    pack = cat.register_pack(ck, owner, new_pack_key())
    cat.add_chunks(
        ck,
        owner,
        pack,
        1000,
        [NewChunk(d, 8 + 10 * i, 10, 10, 0) for i, d in enumerate(sorted(missing))],
    )
    cat.finish_checkpoint(ck, owner, entries=[(0, "model_states", b"x" * 200, 100)], metrics={"loss": 0.5},
                          tags=(), logical_bytes=100, stored_bytes_added=10, replace=False)  # fmt: skip


def bench_catalogs(tmp: Path, pg_url: str, seconds: float) -> list[dict[str, Any]]:
    from ckstore.refs import parse_ref

    rows: list[dict[str, Any]] = []
    for name, url in (
        ("SQLite", f"sqlite:///{tmp / 'ops.db'}"),
        ("PostgreSQL", pg_url + "?options=-csearch_path%3Dops"),
    ):
        if name == "PostgreSQL":
            import sqlalchemy as sa

            eng = sa.create_engine(pg_url)
            with eng.begin() as conn:
                conn.exec_driver_sql("CREATE SCHEMA ops")
            eng.dispose()
        cat = Catalog(url)
        counter = iter(range(10**9))

        def rate(label: str, fn: Callable[[], None], threads: int = 1) -> None:
            stop = time.perf_counter() + seconds
            done = [0] * threads

            def loop(i: int) -> None:
                while time.perf_counter() < stop:
                    fn()
                    done[i] += 1

            ts = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            rows.append(
                {
                    "catalog": name,
                    "operation": label,
                    "per second": sum(done) / (time.perf_counter() - t0),
                }
            )

        rate(
            "commit protocol (16 chunks), 1 thread",
            lambda: _protocol_round(cat, "a", next(counter), 16),
        )
        rate(
            "commit protocol (16 chunks), 4 threads",
            lambda: _protocol_round(cat, "a", next(counter), 16),
            threads=4,
        )
        ref = parse_ref("a@latest")
        rate("resolve latest", lambda: cat.resolve(ref) and None)
        some = [os.urandom(16) for _ in range(256)]
        rate("locate 256 chunks", lambda: cat.chunk_locations(some) and None)
        latest = cat.resolve(ref)
        rate("move a tag", lambda: cat.tag(latest, "best", move=True))
        cat.close()
    return rows


# -- part 3: commit cost as the catalog grows ------------------------------------------------------
def bench_growth(tmp: Path, pg_url: str, n: int, samples: int = 60) -> list[dict[str, Any]]:
    """Grow one catalog to ``n`` checkpoints, then time commits to it and to a fresh catalog
    alternately (so that other work on the machine slows both alike) and compare."""
    import sqlalchemy as sa

    eng = sa.create_engine(pg_url)
    with eng.begin() as conn:
        conn.exec_driver_sql("CREATE SCHEMA grown")
        conn.exec_driver_sql("CREATE SCHEMA fresh")
    eng.dispose()
    shared = torch.randn(64 * 1024)  # 4 chunks every commit references

    def state(step: int) -> dict[int, dict[str, Any]]:
        return {0: {"model_states": {"shared": shared, "own": torch.full((4096,), float(step))}}}

    def commit(store: ckstore.Store, step: int) -> float:
        t0 = time.perf_counter()
        store.commit(step, state(step), {"loss": 1 / (step + 1)})
        return time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    for name, catalogs in (
        ("SQLite", (None, None)),
        (
            "PostgreSQL",
            (pg_url + "?options=-csearch_path%3Dgrown", pg_url + "?options=-csearch_path%3Dfresh"),
        ),
    ):
        grown, fresh = (
            ckstore.open(
                tmp / f"{kind}-{name}",
                catalog=cat,
                run="grow",
                chunk_size=64 * 1024,
                pack_size=1 << 20,
            )
            for kind, cat in zip(("grown", "fresh"), catalogs)
        )
        t0 = time.perf_counter()
        for step in range(n):
            commit(grown, step)
        growing = (time.perf_counter() - t0) / n
        for step in range(10):  # warm the fresh one up
            commit(fresh, step)
        at_n, at_0 = [], []
        for i in range(samples):
            at_n.append(commit(grown, n + i))
            at_0.append(commit(fresh, 10 + i))
        rows.append({
            "catalog": name, "checkpoints": n, "mean ms while growing": growing * 1e3,
            "ms at 10 (median / p10)": f"{_q(at_0, 0.5) * 1e3:.1f} / {_q(at_0, 0.1) * 1e3:.1f}",
            f"ms at {n} (median / p10)": f"{_q(at_n, 0.5) * 1e3:.1f} / {_q(at_n, 0.1) * 1e3:.1f}",
            f"at {n} / at 10 (median)": _q(at_n, 0.5) / _q(at_0, 0.5),
        })  # fmt: skip
        grown.close()
        fresh.close()
    return rows


def _q(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))]


def show(title: str, rows: list[dict[str, Any]]) -> None:
    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col, justify="left" if isinstance(rows[0][col], str) else "right")
    for r in rows:
        table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()))
    console.print(table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--mib", type=int, default=48, help="logical size of the blob-store benchmark's state"
    )
    ap.add_argument(
        "--grow", type=int, default=600, help="checkpoints committed in the growth benchmark"
    )
    ap.add_argument(
        "--seconds", type=float, default=3.0, help="length of each catalog rate measurement"
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="ckstore-bench-"))
    t0 = time.perf_counter()
    try:
        with moto_server(tmp) as endpoint, pg_database() as pg_url:
            blobs = bench_blobstores(args.mib, tmp, endpoint, pg_url)
            show(f"1. commit and checkout, {args.mib} MiB state (2 ranks), packs of 16 MiB", blobs)
            cats = bench_catalogs(tmp, pg_url, args.seconds)
            show("2. catalog operations", cats)
            growth = bench_growth(tmp, pg_url, args.grow)
            show("3. commit cost as the catalog grows", growth)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    console.print(f"total {time.perf_counter() - t0:.0f}s on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(
            json.dumps({"blobstores": blobs, "catalogs": cats, "growth": growth}, indent=2)
        )
    flat = all(r[f"at {args.grow} / at 10 (median)"] < 1.5 for r in growth)
    console.print(
        "commit cost stays flat as the catalog grows"
        if flat
        else "[red]commit cost GROWS with the catalog[/]"
    )
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
