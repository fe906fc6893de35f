"""The catalog's side of garbage collection: the statements of one gc transaction (drop what
policies release, reap abandoned commits, sweep unreferenced chunks and dead packs into the
trash) and the trash's bookkeeping afterwards.

Every statement over chunks and references is set-based; Python only sees checkpoints,
pending rows and packs. ``docs/format.md`` ("Garbage collection and concurrency") says why the
order of :func:`ckstore.maintenance.gc.collect` is safe while other processes commit and read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import ColumnElement, DateTime, and_, delete, exists, literal, or_, select

from ._queries import QueriesMixin
from ._rows import (
    CHECKPOINTS,
    CHUNKS,
    METRICS,
    PACKS,
    RUNS,
    TAGS,
    TRASH,
    Pending,
    aware,
    batches,
    owned_by_live_commit,
    unreferenced_chunk,
)
from ._schema import COMMITTED, PENDING
from ._survey import Survey

__all__ = ["Candidate", "GcMixin", "GcTransaction", "Swept"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A committed checkpoint as retention policies see it."""

    id: int
    run: str
    step: int
    kind: str
    committed_at: datetime | None
    metrics: Mapping[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Swept:
    """What a sweep removed: chunk rows no reference pointed to, and the pack rows it moved to
    the trash (``{key: size}``)."""

    chunks: int
    chunk_bytes: int
    trashed: Mapping[str, int]


def _dead_pack() -> ColumnElement[bool]:
    """A pack row that holds no chunk and that no commit in flight owns."""
    return and_(
        ~exists().where(CHUNKS.c.pack_id == PACKS.c.id),
        or_(PACKS.c.owner_checkpoint_id.is_(None), ~owned_by_live_commit()),
    )


class GcTransaction(Survey):
    """The writes of one gc transaction, beside the reads of :class:`Survey`."""

    def stored_policies(self, run: str | None) -> list[tuple[str, str | None]]:
        """``(run, policy JSON or None)`` of every run (or of ``run``), in creation order."""
        # without ORDER BY, PostgreSQL returns rows in heap order, which an UPDATE (set_policy)
        # changes, so reports would list runs in another order than on SQLite
        q = select(RUNS.c.name, RUNS.c.policy).order_by(RUNS.c.id)
        if run is not None:
            q = q.where(RUNS.c.name == run)
        return [(name, policy) for name, policy in self._conn.execute(q)]

    def candidates(self, run: str | None) -> dict[str, list[Candidate]]:
        """Committed checkpoints by run (every run, or one) and step, with metrics and tags; on
        PostgreSQL their rows stay locked until the transaction ends, so a tag added meanwhile
        waits. A metric that is not a number (a damaged row) reads as missing: never a reason
        to drop a checkpoint."""
        cond = [CHECKPOINTS.c.status == COMMITTED]
        if run is not None:
            cond.append(RUNS.c.name == run)
        ckpts = CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
        rows = self._conn.execute(
            select(CHECKPOINTS.c.id, RUNS.c.name, CHECKPOINTS.c.step, CHECKPOINTS.c.kind, CHECKPOINTS.c.committed_at)
            .select_from(ckpts)
            .where(*cond)
            .order_by(RUNS.c.id, CHECKPOINTS.c.step)
            .with_for_update(of=CHECKPOINTS)
        ).all()
        metrics: dict[int, dict[str, float]] = {}
        q = select(METRICS.c.checkpoint_id, METRICS.c.name, METRICS.c.value).select_from(
            ckpts.join(METRICS, METRICS.c.checkpoint_id == CHECKPOINTS.c.id)
        )
        for m in self._conn.execute(q.where(*cond)):
            value = m.value if isinstance(m.value, (int, float)) else math.nan
            metrics.setdefault(m.checkpoint_id, {})[m.name] = float(value)
        tags: dict[int, list[str]] = {}
        q = select(TAGS.c.checkpoint_id, TAGS.c.name).select_from(
            ckpts.join(TAGS, TAGS.c.checkpoint_id == CHECKPOINTS.c.id)
        )
        for t in self._conn.execute(q.where(*cond).order_by(TAGS.c.name)):
            tags.setdefault(t.checkpoint_id, []).append(t.name)
        out: dict[str, list[Candidate]] = {}
        for r in rows:
            out.setdefault(r.name, []).append(
                Candidate(
                    r.id, r.name, int(r.step), r.kind, aware(r.committed_at),
                    metrics.get(r.id, {}), tuple(tags.get(r.id, ())),
                )
            )  # fmt: skip
        return out

    def drop_checkpoints(self, ids: Sequence[int]) -> None:
        """Delete committed checkpoints; their chunk references go with them."""
        for batch in batches(list(ids)):
            self._conn.execute(
                delete(CHECKPOINTS).where(CHECKPOINTS.c.id.in_(batch), CHECKPOINTS.c.status == COMMITTED)
            )

    def reap(self, pending: Pending, *, silent_before: datetime | None = None) -> bool:
        """Delete a pending checkpoint judged abandoned; its references and pack ownership go
        with it. The row is re-checked (same owner; with ``silent_before``, a heartbeat still
        older than that), so a commit that heartbeats meanwhile is left alone. True if deleted."""
        cond = [
            CHECKPOINTS.c.id == pending.id,
            CHECKPOINTS.c.status == PENDING,
            CHECKPOINTS.c.owner == pending.owner,
        ]
        if silent_before is not None:
            cond.append(CHECKPOINTS.c.heartbeat_at < silent_before)
        return bool(self._conn.execute(delete(CHECKPOINTS).where(*cond)).rowcount)

    def sweep(self, now: datetime) -> Swept:
        """Delete unreferenced chunk rows, then move dead pack rows to the trash.

        Must run under the exclusive gc lock: commits reference existing chunks, and insert
        chunk rows, only under the shared lock.
        """
        n, nbytes = self.unreferenced_chunks()
        if n:
            self._conn.execute(delete(CHUNKS).where(unreferenced_chunk()))
        trashed = {k: int(s) for k, s in self._conn.execute(select(PACKS.c.key, PACKS.c.size).where(_dead_pack()))}
        if trashed:
            self._conn.execute(
                TRASH.insert().from_select(
                    ["key", "created_at"],
                    select(PACKS.c.key, literal(now, DateTime(timezone=True))).where(_dead_pack()),
                )
            )
            self._conn.execute(delete(PACKS).where(_dead_pack()))
        return Swept(n, nbytes, trashed)


class _Rollback(Exception):
    pass


class GcMixin(QueriesMixin):
    @contextmanager
    def snapshot(self) -> Iterator[Survey]:
        """A read transaction that sees one snapshot of the catalog (REPEATABLE READ on
        PostgreSQL), through :class:`Survey`'s named reads."""
        with self._read() as conn:
            yield Survey(conn)

    @contextmanager
    def gc_transaction(self, *, exclusive: bool = True, dry_run: bool = False) -> Iterator[GcTransaction]:
        """A gc write transaction; ``exclusive`` (for sweeps) keeps commits from claiming chunks
        meanwhile. ``dry_run`` rolls it back at the end, so it reports exactly what a real run
        would do. A failure rolls it back too, and gc can simply run again."""
        try:
            with self._write("exclusive" if exclusive else None) as conn:
                yield GcTransaction(conn)
                if dry_run:
                    raise _Rollback
        except _Rollback:
            pass

    def trash(self) -> list[str]:
        """Keys of the objects gc has yet to delete (a gc stopped half-way left them), sorted."""
        with self.snapshot() as survey:
            return survey.trash_keys()

    def forget_trash(self, keys: Sequence[str]) -> None:
        """Drop the trash rows of objects gc deleted."""
        with self._write() as conn:
            for batch in batches(list(keys)):
                conn.execute(delete(TRASH).where(TRASH.c.key.in_(batch)))
