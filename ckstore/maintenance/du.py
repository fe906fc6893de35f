"""Space accounting: :func:`usage` behind ``ckstore du``.

For the whole store, each run and each checkpoint: logical bytes (what was saved), unique bytes
(raw bytes of the distinct chunks referenced: logical / unique is the dedup ratio), stored bytes
(their compressed size: unique / stored is the compression ratio) and exclusive bytes (stored
bytes of the chunks nothing else references: what dropping it would free). All of it is a few
set-based queries; chunks are never loaded into Python.

Bytes are chunk bytes. A pack object is deleted once none of its chunks is referenced, so the
blob store may hold more than the referenced chunks (``pack_bytes`` shows how much it holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, text

from ..catalog import Catalog
from ..catalog._schema import COMMITTED
from ..errors import NotFoundError
from .gc import RUNS, C, K, P, R, catalog_read

__all__ = ["DuReport", "Usage", "usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    name: str  # a run, "run@step", or "(all)"
    checkpoints: int
    logical_bytes: int
    unique_bytes: int
    stored_bytes: int
    exclusive_bytes: int  # freed if this run or checkpoint were dropped

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.unique_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(frozen=True, slots=True)
class DuReport:
    total: Usage
    runs: tuple[Usage, ...]
    checkpoints: tuple[Usage, ...]
    pack_bytes: int  # size of every pack object the catalog records
    garbage_bytes: int  # stored bytes of chunks no checkpoint references (the next gc frees them)


def usage(catalog: Catalog, run: str | None = None) -> DuReport:
    """Usage of every run, and of every checkpoint (of ``run`` only, when given)."""
    committed = C.c.status == COMMITTED
    with catalog_read(catalog) as conn:
        if catalog.dialect == "postgresql":  # the aggregates below hash ~all references at once
            conn.execute(text("SET LOCAL work_mem = '64MB'"))
        if (
            run is not None
            and conn.execute(select(RUNS.c.id).where(RUNS.c.name == run)).first() is None
        ):
            raise NotFoundError(f"no run named {run!r} in this store (see `ckstore runs`)")
        # how many checkpoints and runs hold each chunk (any status: a pending commit holds too)
        holders = (
            select(
                R.c.chunk_id,
                func.count().label("n"),
                func.min(C.c.run_id).label("run_id"),
                func.max(C.c.run_id).label("last_run_id"),
            )
            .select_from(R.join(C, C.c.id == R.c.checkpoint_id))
            .group_by(R.c.chunk_id)
            .subquery()
        )

        # -- per checkpoint
        refs = (
            select(
                R.c.checkpoint_id,
                func.sum(K.c.raw_size).label("raw"),
                func.sum(K.c.length).label("stored"),
                func.sum(K.c.length).filter(holders.c.n == 1).label("solo"),
            )
            .select_from(
                R.join(K, K.c.id == R.c.chunk_id).join(holders, holders.c.chunk_id == R.c.chunk_id)
            )
            .group_by(R.c.checkpoint_id)
            .subquery()
        )
        q = (
            select(RUNS.c.name, C.c.step, C.c.logical_bytes, refs.c.raw, refs.c.stored, refs.c.solo)
            .select_from(
                C.join(RUNS, RUNS.c.id == C.c.run_id).outerjoin(
                    refs, refs.c.checkpoint_id == C.c.id
                )
            )
            .where(committed)
            .order_by(RUNS.c.id, C.c.step)
        )
        if run is not None:
            q = q.where(RUNS.c.name == run)
        ckpts = tuple(
            Usage(
                f"{r.name}@{r.step}",
                1,
                int(r.logical_bytes or 0),
                int(r.raw or 0),
                int(r.stored or 0),
                int(r.solo or 0),
            )
            for r in conn.execute(q)
        )

        # -- per run: distinct chunks of its committed checkpoints
        run_chunks = (
            select(C.c.run_id, R.c.chunk_id)
            .select_from(R.join(C, C.c.id == R.c.checkpoint_id))
            .where(committed)
            .distinct()
            .subquery()
        )
        stored = {
            rid: (int(raw or 0), int(st or 0))
            for rid, raw, st in conn.execute(
                select(run_chunks.c.run_id, func.sum(K.c.raw_size), func.sum(K.c.length))
                .select_from(run_chunks.join(K, K.c.id == run_chunks.c.chunk_id))
                .group_by(run_chunks.c.run_id)
            )
        }
        solo = {
            rid: int(b or 0)
            for rid, b in conn.execute(
                select(holders.c.run_id, func.sum(K.c.length))
                .select_from(holders.join(K, K.c.id == holders.c.chunk_id))
                .where(holders.c.run_id == holders.c.last_run_id)
                .group_by(holders.c.run_id)
            )
        }
        counts = (
            select(
                C.c.run_id, func.count().label("n"), func.sum(C.c.logical_bytes).label("logical")
            )
            .where(committed)
            .group_by(C.c.run_id)
            .subquery()
        )
        runs = tuple(
            Usage(
                name,
                int(n or 0),
                int(logical or 0),
                stored.get(rid, (0, 0))[0],
                stored.get(rid, (0, 0))[1],
                solo.get(rid, 0),
            )
            for rid, name, n, logical in conn.execute(
                select(RUNS.c.id, RUNS.c.name, counts.c.n, counts.c.logical)
                .select_from(RUNS.outerjoin(counts, counts.c.run_id == RUNS.c.id))
                .order_by(RUNS.c.id)
            )
        )

        # -- the whole store
        used = (
            select(R.c.chunk_id)
            .select_from(R.join(C, C.c.id == R.c.checkpoint_id))
            .where(R.c.chunk_id == K.c.id, committed)
        )
        raw, st = conn.execute(
            select(func.sum(K.c.raw_size), func.sum(K.c.length)).where(used.exists())
        ).one()
        garbage = conn.execute(
            select(func.coalesce(func.sum(K.c.length), 0)).where(
                ~select(R.c.chunk_id).where(R.c.chunk_id == K.c.id).exists()
            )
        ).scalar_one()
        pack_bytes = conn.execute(select(func.coalesce(func.sum(P.c.size), 0))).scalar_one()
    total = Usage(
        "(all)",
        sum(r.checkpoints for r in runs),
        sum(r.logical_bytes for r in runs),
        int(raw or 0),
        int(st or 0),
        int(st or 0),
    )
    return DuReport(total, runs, ckpts, int(pack_bytes), int(garbage))
