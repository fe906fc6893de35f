"""Space accounting over the catalog: logical, unique, stored and exclusive bytes of every run
and checkpoint, in a few set-based queries (chunks are never loaded into Python).

Bytes are chunk bytes: logical (what was saved), unique (raw bytes of the distinct chunks
referenced), stored (their compressed size) and exclusive (stored bytes of the chunks nothing
else holds: what dropping it would free). A checkpoint holds the chunks it references and, in a
store with delta chunks, every base its deltas decode through: dropping it frees a base only
other checkpoints' deltas do not need, and never a chunk that a delta still needs as its base.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import exists, func, select, text

from ._queries import QueriesMixin
from ._rows import (
    CHECKPOINTS,
    CHUNK_REFS,
    CHUNKS,
    PACKS,
    RUNS,
    bases_held_by_checkpoint,
    needed_bases,
    run_id,
    unreferenced_chunk,
)
from ._schema import COMMITTED

__all__ = ["StoreUsage", "Usage", "UsageMixin"]


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
class StoreUsage:
    """Usage of every run and of the checkpoints asked for, and the store's totals."""

    runs: tuple[Usage, ...]
    checkpoints: tuple[Usage, ...]
    unique_bytes: int  # of the chunks committed checkpoints reference
    stored_bytes: int
    pack_bytes: int  # size of every pack object the catalog records
    garbage_bytes: int  # stored bytes of chunks no checkpoint references (the next gc frees them)
    #: stored bytes of chunks no checkpoint references that gc keeps as the bases of referenced
    #: deltas (each checkpoint's exclusive bytes count the bases only it holds)
    base_bytes: int = 0


class UsageMixin(QueriesMixin):
    def usage(self, run: str | None = None) -> StoreUsage:
        """Usage of every run, and of every checkpoint (of ``run`` only, when given)."""
        committed = CHECKPOINTS.c.status == COMMITTED
        with self._read() as conn:
            if self.dialect == "postgresql":  # the aggregates below hash ~all references at once
                conn.execute(text("SET LOCAL work_mem = '64MB'"))
            if run is not None:
                run_id(conn, run)
            # the chunks each checkpoint holds: those it references, and with delta chunks the bases
            # they decode through (a store without deltas skips the recursive query)
            has_deltas = conn.execute(select(CHUNKS.c.id).where(CHUNKS.c.base.is_not(None)).limit(1)).first()
            if has_deltas is None:
                held = select(CHUNK_REFS.c.checkpoint_id, CHUNK_REFS.c.chunk_id).subquery()
            else:
                needs = bases_held_by_checkpoint()
                held = (
                    select(CHUNK_REFS.c.checkpoint_id, CHUNK_REFS.c.chunk_id)
                    .union(
                        select(needs.c.checkpoint_id, CHUNKS.c.id).join(CHUNKS, CHUNKS.c.digest == needs.c.digest)
                    )
                    .subquery()
                )
            # how many checkpoints and runs hold each chunk (any status: a pending commit holds too)
            holders = (
                select(
                    held.c.chunk_id,
                    func.count().label("n"),
                    func.min(CHECKPOINTS.c.run_id).label("run_id"),
                    func.max(CHECKPOINTS.c.run_id).label("last_run_id"),
                )
                .select_from(held.join(CHECKPOINTS, CHECKPOINTS.c.id == held.c.checkpoint_id))
                .group_by(held.c.chunk_id)
                .subquery()
            )

            # -- per checkpoint
            if has_deltas is None:  # what a checkpoint holds is what it references: one pass
                refs = (
                    select(
                        CHUNK_REFS.c.checkpoint_id,
                        func.sum(CHUNKS.c.raw_size).label("raw"),
                        func.sum(CHUNKS.c.length).label("stored"),
                        func.sum(CHUNKS.c.length).filter(holders.c.n == 1).label("solo"),
                    )
                    .select_from(
                        CHUNK_REFS.join(CHUNKS, CHUNKS.c.id == CHUNK_REFS.c.chunk_id).join(
                            holders, holders.c.chunk_id == CHUNK_REFS.c.chunk_id
                        )
                    )
                    .group_by(CHUNK_REFS.c.checkpoint_id)
                    .subquery()
                )
                solo_col = refs.c.solo
                joined = CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id).outerjoin(
                    refs, refs.c.checkpoint_id == CHECKPOINTS.c.id
                )
            else:
                refs = (
                    select(
                        CHUNK_REFS.c.checkpoint_id,
                        func.sum(CHUNKS.c.raw_size).label("raw"),
                        func.sum(CHUNKS.c.length).label("stored"),
                    )
                    .select_from(CHUNK_REFS.join(CHUNKS, CHUNKS.c.id == CHUNK_REFS.c.chunk_id))
                    .group_by(CHUNK_REFS.c.checkpoint_id)
                    .subquery()
                )
                alone = (
                    select(held.c.checkpoint_id, func.sum(CHUNKS.c.length).label("solo"))
                    .select_from(
                        held.join(holders, holders.c.chunk_id == held.c.chunk_id).join(
                            CHUNKS, CHUNKS.c.id == held.c.chunk_id
                        )
                    )
                    .where(holders.c.n == 1)
                    .group_by(held.c.checkpoint_id)
                    .subquery()
                )
                solo_col = alone.c.solo
                joined = (
                    CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
                    .outerjoin(refs, refs.c.checkpoint_id == CHECKPOINTS.c.id)
                    .outerjoin(alone, alone.c.checkpoint_id == CHECKPOINTS.c.id)
                )
            q = (
                select(RUNS.c.name, CHECKPOINTS.c.step, CHECKPOINTS.c.logical_bytes, refs.c.raw, refs.c.stored, solo_col)
                .select_from(joined)
                .where(committed)
                .order_by(RUNS.c.id, CHECKPOINTS.c.step)
            )
            if run is not None:
                q = q.where(RUNS.c.name == run)
            ckpts = tuple(
                Usage(
                    f"{r.name}@{r.step}", 1, int(r.logical_bytes or 0), int(r.raw or 0), int(r.stored or 0),
                    int(r.solo or 0),
                )
                for r in conn.execute(q)
            )  # fmt: skip

            # -- per run: distinct chunks of its committed checkpoints
            run_chunks = (
                select(CHECKPOINTS.c.run_id, CHUNK_REFS.c.chunk_id)
                .select_from(CHUNK_REFS.join(CHECKPOINTS, CHECKPOINTS.c.id == CHUNK_REFS.c.checkpoint_id))
                .where(committed)
                .distinct()
                .subquery()
            )
            stored = {
                rid: (int(raw or 0), int(st or 0))
                for rid, raw, st in conn.execute(
                    select(run_chunks.c.run_id, func.sum(CHUNKS.c.raw_size), func.sum(CHUNKS.c.length))
                    .select_from(run_chunks.join(CHUNKS, CHUNKS.c.id == run_chunks.c.chunk_id))
                    .group_by(run_chunks.c.run_id)
                )
            }
            run_solo = {
                rid: int(b or 0)
                for rid, b in conn.execute(
                    select(holders.c.run_id, func.sum(CHUNKS.c.length))
                    .select_from(holders.join(CHUNKS, CHUNKS.c.id == holders.c.chunk_id))
                    .where(holders.c.run_id == holders.c.last_run_id)
                    .group_by(holders.c.run_id)
                )
            }
            counts = (
                select(
                    CHECKPOINTS.c.run_id,
                    func.count().label("n"),
                    func.sum(CHECKPOINTS.c.logical_bytes).label("logical"),
                )
                .where(committed)
                .group_by(CHECKPOINTS.c.run_id)
                .subquery()
            )
            runs = tuple(
                Usage(
                    name, int(n or 0), int(logical or 0), stored.get(rid, (0, 0))[0], stored.get(rid, (0, 0))[1],
                    run_solo.get(rid, 0),
                )
                for rid, name, n, logical in conn.execute(
                    select(RUNS.c.id, RUNS.c.name, counts.c.n, counts.c.logical)
                    .select_from(RUNS.outerjoin(counts, counts.c.run_id == RUNS.c.id))
                    .order_by(RUNS.c.id)
                )
            )  # fmt: skip

            # -- the whole store
            used = (
                select(CHUNK_REFS.c.chunk_id)
                .select_from(CHUNK_REFS.join(CHECKPOINTS, CHECKPOINTS.c.id == CHUNK_REFS.c.checkpoint_id))
                .where(CHUNK_REFS.c.chunk_id == CHUNKS.c.id, committed)
            )
            raw, st = conn.execute(
                select(func.sum(CHUNKS.c.raw_size), func.sum(CHUNKS.c.length)).where(used.exists())
            ).one()
            garbage = conn.execute(
                select(func.coalesce(func.sum(CHUNKS.c.length), 0)).where(unreferenced_chunk())
            ).scalar_one()
            bases = 0
            if has_deltas is not None:
                needed = needed_bases()
                bases = conn.execute(
                    select(func.coalesce(func.sum(CHUNKS.c.length), 0)).where(
                        ~exists().where(CHUNK_REFS.c.chunk_id == CHUNKS.c.id),
                        exists().where(needed.c.digest == CHUNKS.c.digest),
                    )
                ).scalar_one()
            pack_bytes = conn.execute(select(func.coalesce(func.sum(PACKS.c.size), 0))).scalar_one()
        return StoreUsage(runs, ckpts, int(raw or 0), int(st or 0), int(pack_bytes), int(garbage), int(bases))
