"""The catalog's side of repacking (``ckstore gc --repack``): packs whose bytes are mostly dead,
the live chunks of a pack, and the one transaction that moves chunk rows into their new pack
and sends the old pack to the trash.

Moving a chunk row changes only where its frame lies (``pack_id``, ``offset``, ``length``): its id,
and so every checkpoint's reference to it, stays. A trash row's ``created_at`` is the time its
object may be deleted from; a repacked pack's lies one grace period ahead, so a checkout that
planned its reads before the move still finds the old object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update

from ._queries import QueriesMixin
from ._rows import CHUNKS, PACKS, TRASH, ChunkRow, NewChunk, utcnow

__all__ = ["RepackCandidate", "RepackMixin"]

#: bytes of a pack that are not frames: header, footer and index entries (see format/pack.py)
_PACK_FIXED = 16
_PER_CHUNK = 32


@dataclass(frozen=True, slots=True)
class RepackCandidate:
    id: int
    key: str
    size: int
    live_bytes: int  # frames of chunk rows, plus the pack's own header, footer and index
    chunks: int

    @property
    def dead_fraction(self) -> float:
        return 1.0 - self.live_bytes / self.size if self.size else 0.0


class RepackMixin(QueriesMixin):
    def repack_candidates(self, min_dead: float) -> list[RepackCandidate]:
        """Packs holding chunk rows, not being written by a commit, whose dead fraction
        exceeds ``min_dead``; most dead first."""
        with self._read() as conn:
            rows = conn.execute(
                select(PACKS.c.id, PACKS.c.key, PACKS.c.size, func.sum(CHUNKS.c.length).label("live"), func.count().label("n"))
                .select_from(PACKS.join(CHUNKS, CHUNKS.c.pack_id == PACKS.c.id))
                .where(PACKS.c.owner_checkpoint_id.is_(None))
                .group_by(PACKS.c.id, PACKS.c.key, PACKS.c.size)
            ).all()
        out = [
            RepackCandidate(int(r.id), r.key, int(r.size), int(r.live) + _PACK_FIXED + _PER_CHUNK * int(r.n), int(r.n))
            for r in rows
        ]
        return sorted((c for c in out if c.dead_fraction > min_dead), key=lambda c: (-c.dead_fraction, c.id))

    def live_chunks(self, pack_id: int) -> list[NewChunk]:
        """The chunk rows of a pack, by offset."""
        with self._read() as conn:
            rows = conn.execute(
                select(
                    CHUNKS.c.digest, CHUNKS.c.offset, CHUNKS.c.length, CHUNKS.c.raw_size, CHUNKS.c.codec,
                    CHUNKS.c.base, CHUNKS.c.chain,
                )
                .where(CHUNKS.c.pack_id == pack_id)
                .order_by(CHUNKS.c.offset)
            ).all()
        return [
            NewChunk(
                bytes(r.digest), int(r.offset), int(r.length), int(r.raw_size), int(r.codec),
                None if r.base is None else bytes(r.base), None if r.chain is None else int(r.chain),
            )
            for r in rows
        ]  # fmt: skip

    def register_repack(self, key: str) -> int:
        """Record a new pack before a repack writes it (no owner: a crash leaves it to the sweep)."""
        with self._write(lock="shared") as conn:
            res = conn.execute(PACKS.insert().values(key=key, size=0, created_at=utcnow(), owner_checkpoint_id=None))
            return int(res.inserted_primary_key[0])  # type: ignore[index]

    def move_chunks(
        self,
        new_packs: Sequence[tuple[int, int, Sequence[ChunkRow]]],
        old: Sequence[tuple[int, str]],
        delete_after: datetime,
    ) -> int | None:
        """In one transaction under the exclusive gc lock: point the chunk rows of packs ``old``
        (``(id, key)``) at their frames in ``new_packs`` (``(pack_id, size, chunks)``), then move
        every old pack left without chunk rows to the trash, deletable from ``delete_after``.
        Returns the chunk rows moved, or None (nothing changed) when a new pack's row is gone (a
        concurrent gc swept it while it was written)."""
        old_ids = [i for i, _ in old]
        with self._write(lock="exclusive") as conn:
            ids = [i for i, _, _ in new_packs]
            if len(set(conn.execute(select(PACKS.c.id).where(PACKS.c.id.in_(ids))).scalars())) != len(set(ids)):
                return None
            moved = 0
            for pack_id, size, chunks in new_packs:
                conn.execute(update(PACKS).where(PACKS.c.id == pack_id).values(size=size))
                for c in chunks:
                    res = conn.execute(
                        update(CHUNKS)
                        .where(CHUNKS.c.digest == c.digest, CHUNKS.c.pack_id.in_(old_ids))
                        .values(pack_id=pack_id, offset=c.offset, length=c.length)
                    )
                    moved += res.rowcount or 0
            left = set(conn.execute(select(CHUNKS.c.pack_id).where(CHUNKS.c.pack_id.in_(old_ids))).scalars())
            for pack_id, key in old:
                if pack_id in left:
                    continue
                conn.execute(
                    self._insert(TRASH).values(key=key, created_at=delete_after).on_conflict_do_nothing(index_elements=["key"])
                )
                conn.execute(PACKS.delete().where(PACKS.c.id == pack_id))
            return moved
