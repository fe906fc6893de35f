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

from sqlalchemy import case, exists, func, select, text, union_all

from ._queries import QueriesMixin
from ._rows import (
    CHECKPOINTS,
    CHUNK_REFS,
    CHUNKS,
    PACKS,
    RUNS,
    bases_reached,
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
            # the first and last checkpoint and run holding each chunk (any status: a pending
            # commit holds too): a chunk only one checkpoint (run) holds is freed with it
            referencing = (
                select(
                    CHUNK_REFS.c.chunk_id,
                    func.min(CHUNK_REFS.c.checkpoint_id).label("first"),
                    func.max(CHUNK_REFS.c.checkpoint_id).label("last"),
                    func.min(CHECKPOINTS.c.run_id).label("first_run"),
                    func.max(CHECKPOINTS.c.run_id).label("last_run"),
                )
                .select_from(CHUNK_REFS.join(CHECKPOINTS, CHECKPOINTS.c.id == CHUNK_REFS.c.checkpoint_id))
                .group_by(CHUNK_REFS.c.chunk_id)
            )
            has_deltas = conn.execute(select(CHUNKS.c.id).where(CHUNKS.c.base.is_not(None)).limit(1)).first()
            if has_deltas is None:  # a chunk is held by the checkpoints referencing it
                holders = referencing.subquery()
            else:
                # ... and by those referencing a delta that decodes through it: each delta's
                # checkpoints passed down its chain (per chunk, not per reference: a delta
                # referenced by a thousand checkpoints walks its chain once)
                direct = referencing.cte("referencing")
                reached = bases_reached()
                ranges = (direct.c.first, direct.c.last, direct.c.first_run, direct.c.last_run)
                every = union_all(
                    select(direct.c.chunk_id, *ranges),
                    select(reached.c.base_id, *ranges)
                    .select_from(direct.join(reached, reached.c.chunk_id == direct.c.chunk_id))
                    .where(reached.c.base_id.is_not(None)),
                ).subquery()
                holders = (
                    select(
                        every.c.chunk_id,
                        func.min(every.c.first).label("first"),
                        func.max(every.c.last).label("last"),
                        func.min(every.c.first_run).label("first_run"),
                        func.max(every.c.last_run).label("last_run"),
                    )
                    .group_by(every.c.chunk_id)
                    .subquery()
                )
            only_checkpoint = case((holders.c.first == holders.c.last, holders.c.first))
            only_run = case((holders.c.first_run == holders.c.last_run, holders.c.first_run))
            # one pass over what is held: the bytes of each checkpoint and run holding a chunk alone
            solo: dict[int, int] = {}
            run_solo: dict[int, int] = {}
            for ckpt, rid, nbytes in conn.execute(
                select(only_checkpoint, only_run, func.sum(CHUNKS.c.length))
                .select_from(holders.join(CHUNKS, CHUNKS.c.id == holders.c.chunk_id))
                .group_by(only_checkpoint, only_run)
            ):
                if ckpt is not None:
                    solo[int(ckpt)] = solo.get(int(ckpt), 0) + int(nbytes or 0)
                if rid is not None:
                    run_solo[int(rid)] = run_solo.get(int(rid), 0) + int(nbytes or 0)

            # -- per checkpoint: the chunks it references, and what it alone holds
            referenced = (
                select(
                    CHUNK_REFS.c.checkpoint_id,
                    func.sum(CHUNKS.c.raw_size).label("raw"),
                    func.sum(CHUNKS.c.length).label("stored"),
                )
                .select_from(CHUNK_REFS.join(CHUNKS, CHUNKS.c.id == CHUNK_REFS.c.chunk_id))
                .group_by(CHUNK_REFS.c.checkpoint_id)
                .subquery()
            )
            q = (
                select(
                    CHECKPOINTS.c.id, RUNS.c.name, CHECKPOINTS.c.step, CHECKPOINTS.c.logical_bytes, referenced.c.raw,
                    referenced.c.stored,
                )
                .select_from(
                    CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id).outerjoin(
                        referenced, referenced.c.checkpoint_id == CHECKPOINTS.c.id
                    )
                )
                .where(committed)
                .order_by(RUNS.c.id, CHECKPOINTS.c.step)
            )  # fmt: skip
            if run is not None:
                q = q.where(RUNS.c.name == run)
            ckpts = tuple(
                Usage(
                    f"{r.name}@{r.step}", 1, int(r.logical_bytes or 0), int(r.raw or 0), int(r.stored or 0),
                    solo.get(r.id, 0),
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
