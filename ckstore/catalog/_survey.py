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

from ._queries import entry_values, load_records, pending_checkpoints
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


def _digest(value: object) -> bytes | None:
    """A binary column's value as bytes; None for NULL or a value of another type (never
    ``bytes(n)`` of an integer: that allocates ``n`` bytes)."""
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


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
        """Every committed checkpoint, by run and step; one whose step is not an integer (a row
        damaged outside ckstore) is left out, and :meth:`corrupt_records` names it."""
        rows = self._conn.execute(
            select(CHECKPOINTS.c.id, RUNS.c.name, CHECKPOINTS.c.step)
            .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
            .where(CHECKPOINTS.c.status == COMMITTED)
            .order_by(RUNS.c.id, CHECKPOINTS.c.step)
        )
        return [CheckpointId(int(r.id), r.name, r.step) for r in rows if type(r.step) is int]

    def corrupt_records(self) -> list[tuple[str, int | None, str]]:
        """``(run, step, problem)`` of every committed checkpoint whose rows do not read as its
        record (as a listing skips it); step None where the step itself is damaged."""
        ids = [
            int(i)
            for (i,) in self._conn.execute(
                select(CHECKPOINTS.c.id).where(CHECKPOINTS.c.status == COMMITTED).order_by(CHECKPOINTS.c.id)
            )
        ]
        corrupt = load_records(self._conn, ids).corrupt.values()
        return [(c.run, c.step if type(c.step) is int else None, c.describe()) for c in corrupt]

    def entries(self, ckpt_id: int) -> list[tuple[int, str, bytes]]:
        """``(rank, sub_key, manifest)`` of a checkpoint's entries, by rank; a value of another
        type is an :class:`~ckstore.errors.IntegrityError` naming the checkpoint and the column."""
        rows = self._conn.execute(
            select(ENTRIES.c.rank, ENTRIES.c.sub_key, ENTRIES.c.manifest)
            .where(ENTRIES.c.checkpoint_id == ckpt_id)
            .order_by(ENTRIES.c.rank, ENTRIES.c.id)
        )
        return entry_values(self._conn, ckpt_id, rows)

    def referenced_chunks(self, ckpt_id: int) -> dict[bytes, int | str]:
        """Digest -> raw size of the chunks a checkpoint references (what protects them from gc);
        for a chunk row whose offset, length or raw size is not an integer (damaged outside
        ckstore), what is wrong with it instead. A row whose digest is not bytes is left out."""
        rows = self._conn.execute(
            select(CHUNKS.c.digest, CHUNKS.c.raw_size, CHUNKS.c.offset, CHUNKS.c.length)
            .select_from(CHUNK_REFS.join(CHUNKS, CHUNKS.c.id == CHUNK_REFS.c.chunk_id))
            .where(CHUNK_REFS.c.checkpoint_id == ckpt_id)
        )
        out: dict[bytes, int | str] = {}
        for d, raw, offset, length in rows:
            digest = _digest(d)
            if digest is None:
                continue
            columns = (("raw_size", raw), ("offset", offset), ("length", length))
            bad = next((f"chunks.{n} holds {v!r}"[:80] for n, v in columns if type(v) is not int), None)
            out[digest] = raw if bad is None else (
                f"its catalog row is corrupt (column {bad}, not an integer); it was changed outside ckstore: "
                "restore the catalog from a backup, or fix that row"
            )  # fmt: skip
        return out

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
        # a row damaged outside ckstore (a value of another type) is left out: referenced_chunks
        # names it for the checkpoints that use it
        return [
            ChunkSpan(digest, r.offset, r.length, r.raw_size, base)
            for r in rows
            if (digest := _digest(r.digest)) is not None
            and type(r.offset) is int and type(r.length) is int and type(r.raw_size) is int
            and ((base := _digest(r.base)) is not None or r.base is None)
        ]  # fmt: skip

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
