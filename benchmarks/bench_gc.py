"""Garbage collection at catalog scale, on SQLite and PostgreSQL, and end to end on a real store.

Catalog side: a store whose catalog holds 1,000 committed checkpoints (4 runs) and 1,000,000
chunk references, filled with bulk SQL (no blobs: the pack objects do not exist, which gc
tolerates). Each checkpoint references 200 chunks every checkpoint shares (a frozen embedding)
and 800 chunks of its own window, overlapping its neighbour's by half (layers that changed);
~400,600 distinct chunks in ~2,000 packs. A gc that keeps everything measures the sweep's scans
over the full catalog; then gc applies "keep the last 2, the best 3 by val_loss,
every 50,000 steps, and the newest epoch checkpoint" to every run; the timings are of
that ``Store.gc`` (dry run = the same transaction rolled back), of a second gc with nothing to do
(the steady-state cost of the sweep's anti-joins), and of ``Store.du`` over the full catalog.
``--delta-chain 0,4`` runs it all twice, the second time with the window chunks deltas of the
chunks one window earlier, in chains of up to 4 (what gc and du walk down).

End to end: 40 real commits of an 8 MiB state (a quarter of it changes per step) into a local
store, then ``gc`` keeping the last 2, then ``fsck --deep``.

    PYTHONPATH=. python benchmarks/bench_gc.py
    PYTHONPATH=. python benchmarks/bench_gc.py --backends sqlite --checkpoints 200
    PYTHONPATH=. python benchmarks/bench_gc.py --delta-chain 0,4 --no-e2e
    PYTHONPATH=. python benchmarks/bench_gc.py --pg postgresql+psycopg://postgres@127.0.0.1:5432/

PostgreSQL runs in a database of its own, created and dropped by the benchmark.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import text

import ckstore
from ckstore.retention import BestN, ByKind, EveryNSteps, KeepAll, LatestN

RUNS = 4
SHARED = 200  # chunks every checkpoint references
WINDOW = 800  # chunks of a checkpoint's own window
SLIDE = 400  # how far each checkpoint's window moves
CHUNKS_PER_PACK = 200


def policy() -> Any:
    return LatestN(2) | BestN(3, "val_loss") | EveryNSteps(50_000) | ByKind("epoch", LatestN(1))


def _seq(dialect: str, n: int, alias: str = "s") -> str:
    """A FROM clause yielding ``alias.i`` = 0 … n-1."""
    if dialect == "postgresql":
        return f"generate_series(0, {n - 1}) AS {alias}(i)"
    return f"(WITH RECURSIVE q(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM q WHERE i < {n - 1}) SELECT i FROM q) AS {alias}"


def populate(store: ckstore.Store, checkpoints: int, delta_chain: int = 0) -> dict[str, int]:
    """Fill the catalog with set-based inserts; returns the row counts.

    With ``delta_chain``, the chunks of a window are deltas (codec 3) of the chunks ``SLIDE``
    before them (the same layer one window earlier), in chains of up to ``delta_chain``:
    generation g of the windows is at depth ``g % (delta_chain + 1)``, so every
    ``delta_chain + 1``-th generation is whole again, as a writer's bounded chains are."""
    eng = store.catalog.engine
    d = eng.dialect.name
    n_chunks = SHARED + (checkpoints - 1) * SLIDE + WINDOW
    n_packs = -(-n_chunks // CHUNKS_PER_PACK)
    now = "now()" if d == "postgresql" else "CURRENT_TIMESTAMP"
    ago = (lambda i: f"now() - ({checkpoints} - {i}) * interval '1 minute'") if d == "postgresql" else (
        lambda i: f"datetime('now', '-' || ({checkpoints} - {i}) || ' minutes')")  # fmt: skip
    digest = "decode(md5(i::text), 'hex')" if d == "postgresql" else "randomblob(16)"
    key = "'packs/' || substr(md5(i::text), 1, 2) || '/' || md5(i::text)" if d == "postgresql" else (
        "'packs/' || lower(hex(randomblob(1))) || '/' || lower(hex(randomblob(16)))")  # fmt: skip
    per_run = checkpoints // RUNS
    t0 = time.perf_counter()
    with eng.begin() as conn:
        for r in range(RUNS):
            conn.execute(
                text(f"INSERT INTO runs (id, name, created_at) VALUES ({r + 1}, 'run{r}', {now})")
            )
        conn.execute(text(
            f"INSERT INTO checkpoints (id, run_id, step, status, kind, created_at, committed_at, heartbeat_at, owner, "
            f"world_layout, logical_bytes, stored_bytes_added) "
            f"SELECT i + 1, 1 + i / {per_run}, 1000 * (i % {per_run}), 'committed', "
            f"CASE WHEN i % 10 = 9 THEN 'epoch' ELSE 'recovery' END, {ago('i')}, {ago('i')}, {ago('i')}, "
            f"'bench:1:1:0', '[[\"dp\", 1]]', {(SHARED + WINDOW) * 65536}, {SLIDE * 65536} FROM {_seq(d, checkpoints)}"
        ))  # fmt: skip
        conn.execute(text(
            f"INSERT INTO metrics (checkpoint_id, name, value) SELECT i + 1, 'val_loss', "
            f"1.0 / (1 + (i % {per_run})) + ((i * 7919) % 97) / 1000.0 FROM {_seq(d, checkpoints)}"
        ))  # fmt: skip
        conn.execute(text(
            f"INSERT INTO packs (id, key, size, created_at, owner_checkpoint_id) "
            f"SELECT i + 1, {key}, {CHUNKS_PER_PACK * 40000}, {now}, NULL FROM {_seq(d, n_packs)}"
        ))  # fmt: skip
        conn.execute(text(
            f"INSERT INTO chunks (id, digest, pack_id, \"offset\", length, raw_size, codec) "
            f"SELECT i + 1, {digest}, 1 + i / {CHUNKS_PER_PACK}, 8 + (i % {CHUNKS_PER_PACK}) * 40000, 40000, 65536, 2 "
            f"FROM {_seq(d, n_chunks)}"
        ))  # fmt: skip
        conn.execute(text(
            f"INSERT INTO chunk_refs (checkpoint_id, chunk_id) "
            f"SELECT c.id, CASE WHEN o.i < {SHARED} THEN o.i + 1 "
            f"ELSE {SHARED} + (c.id - 1) * {SLIDE} + (o.i - {SHARED}) + 1 END "
            f"FROM checkpoints c CROSS JOIN {_seq(d, SHARED + WINDOW, 'o')}"
        ))  # fmt: skip
        if d == "postgresql":
            for t in ("runs", "checkpoints", "packs", "chunks"):
                conn.execute(
                    text(
                        f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), (SELECT max(id) FROM {t}))"
                    )
                )
        if delta_chain:
            depth = f"(((id - {SHARED} - 1) / {SLIDE}) % {delta_chain + 1})"
            conn.execute(text(
                f"UPDATE chunks SET codec = 3, chain = {depth}, "
                f"base = (SELECT b.digest FROM chunks b WHERE b.id = chunks.id - {SLIDE}) "
                f"WHERE id > {SHARED + SLIDE} AND {depth} > 0"
            ))  # fmt: skip
    with eng.begin() as conn:
        conn.execute(text("ANALYZE"))
        counts = {
            t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one())
            for t in ("checkpoints", "chunks", "chunk_refs", "packs")
        }
        counts["deltas"] = int(
            conn.execute(text("SELECT count(*) FROM chunks WHERE base IS NOT NULL")).scalar_one()
        )
    counts["fill_s"] = round(time.perf_counter() - t0, 1)  # type: ignore[assignment]
    return counts


def bench_catalog(
    backend: str, checkpoints: int, pg_base: str, delta_chain: int = 0
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ckgc-"))
    dbname = None
    admin = None
    catalog = None
    if backend == "postgresql":
        from sqlalchemy import create_engine

        dbname = f"ckstore_bench_gc_{uuid.uuid4().hex[:8]}"
        admin = create_engine(pg_base.rstrip("/") + "/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{dbname}"'))
        catalog = pg_base.rstrip("/") + "/" + dbname
    try:
        store = ckstore.open(
            tmp / "store", catalog=catalog, chunk_size=64 * 1024, pack_size=16 * 2**20
        )
        counts = populate(store, checkpoints, delta_chain)
        out: dict[str, Any] = {"backend": backend, "delta_chain": delta_chain, **counts}
        t = time.perf_counter()
        store.du()  # over the full catalog
        out["du_s"] = time.perf_counter() - t
        t = time.perf_counter()
        idle = store.gc(
            KeepAll()
        )  # drops nothing: the cost of the sweep's scans over 1M references
        out["keep_all_gc_s"] = time.perf_counter() - t
        assert not idle.dropped and idle.chunks_freed == 0
        t = time.perf_counter()
        dry = store.gc(policy(), dry_run=True)
        out["dry_run_s"] = time.perf_counter() - t
        t = time.perf_counter()
        real = store.gc(policy())
        out["gc_s"] = time.perf_counter() - t
        assert real.dropped == dry.dropped and real.chunks_freed == dry.chunks_freed
        out["dropped"] = len(real.dropped)
        out["chunks_freed"] = real.chunks_freed
        out["packs_trashed"] = real.packs_deleted
        t = time.perf_counter()
        again = store.gc(policy())
        out["second_gc_s"] = time.perf_counter() - t
        assert not again.dropped and again.chunks_freed == 0
        with store.catalog.engine.connect() as c:
            out["refs_left"] = int(c.execute(text("SELECT count(*) FROM chunk_refs")).scalar_one())
        store.close()
        return out
    finally:
        if admin is not None:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
            admin.dispose()
        shutil.rmtree(tmp, ignore_errors=True)


def bench_end_to_end(commits: int = 40) -> dict[str, Any]:
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="ckgc-e2e-"))
    store = ckstore.open(tmp / "store", run="train", chunk_size=1 << 20, pack_size=8 << 20)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(512, 1024, generator=g) for i in range(4)}  # 8 MiB
    t = time.perf_counter()
    for step in range(commits):
        state[f"layer{step % 4}.weight"] = torch.randn(512, 1024, generator=g)
        store.commit(step, {0: {"model_states": state}}, {"val_loss": 1.0 / (step + 1)})
    commit_s = time.perf_counter() - t
    before = store.du().total
    packs_before = sum(
        p.stat().st_size for p in (tmp / "store" / "packs").rglob("*") if p.is_file()
    )
    t = time.perf_counter()
    report = store.gc(LatestN(2))
    gc_s = time.perf_counter() - t
    packs_after = sum(p.stat().st_size for p in (tmp / "store" / "packs").rglob("*") if p.is_file())
    t = time.perf_counter()
    fsck = store.fsck(deep=True)
    fsck_s = time.perf_counter() - t
    assert fsck.ok
    store.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "commits": commits, "commit_s": commit_s, "stored_before": before.stored_bytes, "packs_before": packs_before,
        "dropped": len(report.dropped), "chunks_freed": report.chunks_freed, "packs_deleted": report.packs_deleted,
        "bytes_freed": report.bytes_freed, "packs_after": packs_after, "gc_s": gc_s, "fsck_deep_s": fsck_s,
        "fsck_read": fsck.bytes_read,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--checkpoints", type=int, default=1000)
    ap.add_argument(
        "--pg",
        default="postgresql+psycopg://postgres@127.0.0.1:5432/",
        help="server URL, no database",
    )
    ap.add_argument(
        "--delta-chain",
        default="0",
        help="comma-separated chain lengths of delta chunks in the catalog (0: none), a row each",
    )
    ap.add_argument("--no-e2e", action="store_true")
    args = ap.parse_args()
    if args.checkpoints < RUNS or args.checkpoints % RUNS:
        ap.error(
            f"--checkpoints must be a positive multiple of {RUNS} (the checkpoints are spread evenly over {RUNS} runs)"
        )
    rows = [
        bench_catalog(b, args.checkpoints, args.pg, int(chain))
        for b in args.backends.split(",")
        if b
        for chain in args.delta_chain.split(",")
    ]
    cols = ["backend", "delta_chain", "checkpoints", "chunk_refs", "chunks", "deltas", "packs", "fill_s", "keep_all_gc_s", "dry_run_s", "gc_s", "dropped",
            "chunks_freed", "packs_trashed", "refs_left", "second_gc_s", "du_s"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print(
            "| "
            + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols)
            + " |"
        )
    if not args.no_e2e:
        e = bench_end_to_end()
        mib = 2**20
        print(
            f"\nend to end: {e['commits']} commits of 8 MiB in {e['commit_s']:.1f}s; packs {e['packs_before'] / mib:.1f} MiB; "
            f"gc keep-last-2 dropped {e['dropped']}, freed {e['chunks_freed']} chunks, deleted {e['packs_deleted']} packs "
            f"({e['bytes_freed'] / mib:.1f} MiB) in {e['gc_s']:.3f}s -> packs {e['packs_after'] / mib:.1f} MiB; "
            f"fsck --deep read {e['fsck_read'] / mib:.1f} MiB in {e['fsck_deep_s']:.2f}s"
        )


if __name__ == "__main__":
    main()
