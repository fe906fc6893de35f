"""One read snapshot of the catalog as maintenance sees it: packs and their chunks, references,
the trash, pending checkpoints, and which object keys the catalog knows.

``fsck`` walks a whole :class:`Survey` so that everything it compares comes from one snapshot;
gc's transaction (:class:`~ckstore.catalog._gc.GcTransaction`) extends it with the writes of a
sweep.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, func, select

from ._queries import pending_checkpoints
from ._rows import (
    CHECKPOINTS,
    CHUNK_REFS,
    CHUNKS,
    ENTRIES,
    PACKS,
    RUNS,
    TRASH,
    Pending,
    batches,
    owned_by_live_commit,
    run_id,
    unreferenced_chunk,
    utcnow,
)
from ._schema import COMMITTED

__all__ = ["ChunkSpan", "CheckpointId", "PackExtent", "Survey"]


@dataclass(frozen=True, slots=True)
class PackExtent:
    """A pack row that holds chunk rows: ``end`` is the byte its last chunk ends at."""

    id: int
    key: str
    size: int
    end: int
    chunks: int


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Where one chunk row says its frame lies in its pack."""

    digest: bytes
    offset: int
    length: int
    raw_size: int
    base: bytes | None = None  # a delta's base chunk


@dataclass(frozen=True, slots=True)
class CheckpointId:
    id: int
    run: str
    step: int

    @property
    def ref(self) -> str:
        return f"{self.run}@{self.step}"


class Survey:
    """Named reads over one catalog transaction; valid only inside the ``with`` that made it."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def require_run(self, name: str) -> None:
        """Raise :class:`NotFoundError` unless the store has a run ``name``."""
        run_id(self._conn, name)

    def pending(self) -> list[Pending]:
        """Pending checkpoints, by id."""
        return pending_checkpoints(self._conn)

    def committed(self) -> list[CheckpointId]:
        """Every committed checkpoint, by run and step."""
        rows = self._conn.execute(
            select(CHECKPOINTS.c.id, RUNS.c.name, CHECKPOINTS.c.step)
            .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
            .where(CHECKPOINTS.c.status == COMMITTED)
            .order_by(RUNS.c.id, CHECKPOINTS.c.step)
        )
        return [CheckpointId(int(r.id), r.name, int(r.step)) for r in rows]

    def entries(self, ckpt_id: int) -> list[tuple[int, str, bytes]]:
        """``(rank, sub_key, manifest)`` of a checkpoint's entries, by rank."""
        rows = self._conn.execute(
            select(ENTRIES.c.rank, ENTRIES.c.sub_key, ENTRIES.c.manifest)
            .where(ENTRIES.c.checkpoint_id == ckpt_id)
            .order_by(ENTRIES.c.rank, ENTRIES.c.id)
        )
        return [(int(r.rank), r.sub_key, bytes(r.manifest)) for r in rows]

    def referenced_chunks(self, ckpt_id: int) -> dict[bytes, int]:
        """Digest -> raw size of the chunks a checkpoint references (what protects them from gc)."""
        rows = self._conn.execute(
            select(CHUNKS.c.digest, CHUNKS.c.raw_size)
            .select_from(CHUNK_REFS.join(CHUNKS, CHUNKS.c.id == CHUNK_REFS.c.chunk_id))
            .where(CHUNK_REFS.c.checkpoint_id == ckpt_id)
        )
        return {bytes(d): int(raw) for (d, raw) in rows}

    def chunk_bases(self, digests: Iterable[bytes]) -> dict[bytes, bytes | None]:
        """Digest -> base digest (None: no delta) of the chunks of ``digests`` the catalog has."""
        out: dict[bytes, bytes | None] = {}
        for batch in batches(list(digests)):
            rows = self._conn.execute(select(CHUNKS.c.digest, CHUNKS.c.base).where(CHUNKS.c.digest.in_(batch)))
            out.update((bytes(d), None if b is None else bytes(b)) for d, b in rows)
        return out

    def delta_bases(self, ckpt_id: int) -> dict[bytes, bytes]:
        """Digest -> base digest of the delta chunks a checkpoint references."""
        rows = self._conn.execute(
            select(CHUNKS.c.digest, CHUNKS.c.base)
            .select_from(CHUNK_REFS.join(CHUNKS, CHUNKS.c.id == CHUNK_REFS.c.chunk_id))
            .where(CHUNK_REFS.c.checkpoint_id == ckpt_id, CHUNKS.c.base.is_not(None))
        )
        return {bytes(d): bytes(b) for (d, b) in rows}

    def packs_in_use(self) -> list[PackExtent]:
        """Every pack row that holds chunk rows, by id."""
        rows = self._conn.execute(
            select(
                PACKS.c.id,
                PACKS.c.key,
                PACKS.c.size,
                func.max(CHUNKS.c.offset + CHUNKS.c.length).label("end"),
                func.count().label("n"),
            )
            .select_from(PACKS.join(CHUNKS, CHUNKS.c.pack_id == PACKS.c.id))
            .group_by(PACKS.c.id, PACKS.c.key, PACKS.c.size)
            .order_by(PACKS.c.id)
        )
        return [PackExtent(int(r.id), r.key, int(r.size), int(r.end), int(r.n)) for r in rows]

    def pack_chunks(self, pack_id: int, *, ending_past: int | None = None) -> list[ChunkSpan]:
        """The chunk rows of a pack by offset (only those ending past byte ``ending_past``)."""
        q = select(CHUNKS.c.digest, CHUNKS.c.offset, CHUNKS.c.length, CHUNKS.c.raw_size, CHUNKS.c.base).where(
            CHUNKS.c.pack_id == pack_id
        )
        if ending_past is not None:
            q = q.where(CHUNKS.c.offset + CHUNKS.c.length > ending_past)
        rows = self._conn.execute(q.order_by(CHUNKS.c.offset))
        return [
            ChunkSpan(bytes(r.digest), int(r.offset), int(r.length), int(r.raw_size), None if r.base is None else bytes(r.base))
            for r in rows
        ]

    def existing_packs(self, ids: Iterable[int]) -> set[int]:
        """Which of the pack rows ``ids`` still exist (gc deletes rows before objects)."""
        wanted = list(ids)
        out: set[int] = set()
        for batch in batches(wanted):
            out.update(int(i) for (i,) in self._conn.execute(select(PACKS.c.id).where(PACKS.c.id.in_(batch))))
        return out

    def unreferenced_chunks(self) -> tuple[int, int]:
        """``(count, stored bytes)`` of the chunk rows no checkpoint references."""
        n, nbytes = self._conn.execute(
            select(func.count(), func.coalesce(func.sum(CHUNKS.c.length), 0)).where(unreferenced_chunk())
        ).one()
        return int(n), int(nbytes)

    def trash_keys(self) -> list[str]:
        """Keys of the objects gc moved to the trash and has yet to delete, sorted (a trash row's
        ``created_at`` is when its object may go: a repacked pack waits out the grace period)."""
        return sorted(k for (k,) in self._conn.execute(select(TRASH.c.key).where(TRASH.c.created_at <= utcnow())))

    def unknown_keys(self, keys: Sequence[str]) -> set[str]:
        """The keys in ``keys`` that neither a pack row nor a trash row knows: orphans, when the
        keys were listed before this snapshot began."""
        unknown = set(keys)
        for batch in batches(list(keys)):
            unknown -= {k for (k,) in self._conn.execute(select(PACKS.c.key).where(PACKS.c.key.in_(batch)))}
            unknown -= {k for (k,) in self._conn.execute(select(TRASH.c.key).where(TRASH.c.key.in_(batch)))}
        return unknown

    def live_pack_keys(self, keys: Sequence[str]) -> set[str]:
        """The keys in ``keys`` of packs a commit still in flight owns."""
        out: set[str] = set()
        for batch in batches(list(keys)):
            out.update(
                k
                for (k,) in self._conn.execute(
                    select(PACKS.c.key).where(PACKS.c.key.in_(batch), owned_by_live_commit())
                )
            )
        return out
