"""The catalog's side of blob-store records (``ckstore.format.record``): the facts a checkpoint
record is written from, the identities gc and fsck match records against, and the inserts that
rebuild a lost catalog from records (``ckstore recover``) — each one idempotent, so a rebuild may
run twice.

A checkpoint's *identity* is ``(run, step, created_at)``: the time its commit began, which a
rebuilt catalog restores, so a record keeps naming its checkpoint across rebuilds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from operator import itemgetter
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from ._access import execute
from ._queries import QueriesMixin
from ._rows import (
    CHECKPOINTS,
    CHUNK_REFS,
    CHUNKS,
    ENTRIES,
    METRICS,
    PACKS,
    RUNS,
    TAGS,
    ChunkRow,
    aware,
    batches,
    utcnow,
)
from ._schema import COMMITTED

__all__ = ["Ident", "RecordFacts", "RecordsMixin", "RestoredChunk"]

#: ``(run, step, created_at)``
Ident = tuple[str, int, datetime]


@dataclass(frozen=True, slots=True)
class RecordFacts:
    """What the catalog knows of a pending checkpoint that its record needs."""

    run: str
    step: int
    kind: str
    created_at: datetime
    run_created_at: datetime
    world_layout: str  # JSON
    parent: Ident | None
    chunks: tuple[tuple[bytes, str, int, int, int, int], ...]  # digest, pack key, offset, length, raw, codec


@dataclass(frozen=True, slots=True)
class RestoredChunk:
    digest: bytes
    pack_key: str
    offset: int
    length: int
    raw_size: int
    codec: int
    base: bytes | None = None  # a delta's base chunk, from its frame's header
    chain: int | None = None


# statements built once: building one costs more than running it, at every commit
_FACTS = (
    select(CHECKPOINTS, RUNS.c.name.label("run_name"), RUNS.c.created_at.label("run_created"))
    .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
    .where(CHECKPOINTS.c.id == bindparam("ckpt"))
)
_CHUNKS_OF = (
    select(CHUNKS.c.digest, PACKS.c.key, CHUNKS.c.offset, CHUNKS.c.length, CHUNKS.c.raw_size, CHUNKS.c.codec)
    .select_from(CHUNK_REFS.join(CHUNKS, CHUNKS.c.id == CHUNK_REFS.c.chunk_id).join(PACKS, PACKS.c.id == CHUNKS.c.pack_id))
    .where(CHUNK_REFS.c.checkpoint_id == bindparam("ckpt"))
    .order_by(CHUNKS.c.digest)
)
# the same for the chunks outside some packs (those a commit just wrote), unordered
_CHUNKS_OUTSIDE = _CHUNKS_OF.order_by(None).where(CHUNKS.c.pack_id.not_in(bindparam("packs", expanding=True)))
_PACK_KEYS = select(PACKS.c.id, PACKS.c.key).where(PACKS.c.id.in_(bindparam("packs", expanding=True)))
#: the most written packs whose chunk locations are taken as given (else all are read back)
_GIVEN_PACKS = 1000
_IDENT = (
    select(RUNS.c.name, CHECKPOINTS.c.step, CHECKPOINTS.c.created_at)
    .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
    .where(CHECKPOINTS.c.id == bindparam("ckpt"))
)


def read_facts(
    conn: Connection, ckpt_id: int, written: Sequence[tuple[int, int, Sequence[ChunkRow]]] = ()
) -> RecordFacts:
    """:meth:`RecordsMixin.record_facts` inside a transaction of the caller's.

    ``written``: packs ``(pack_id, size, chunks)`` whose every chunk row this transaction
    inserted, as given: their chunks' locations are taken from there, and only the checkpoint's
    other chunks (those stored already) are read back (an Adam state's 4,800 chunks, all new:
    15.0 ms to read back and sort, against 2.2 ms)."""
    row = execute(conn, _FACTS, {"ckpt": ckpt_id}).one()
    parent = _ident(conn, row.parent_checkpoint_id)
    return RecordFacts(
        row.run_name, int(row.step), row.kind, aware(row.created_at), aware(row.run_created),
        row.world_layout, parent, _locations(conn, ckpt_id, written),
    )  # fmt: skip


def _locations(
    conn: Connection, ckpt_id: int, written: Sequence[tuple[int, int, Sequence[ChunkRow]]]
) -> tuple[tuple[bytes, str, int, int, int, int], ...]:
    """Every chunk location of a checkpoint, by digest: rows as the driver gave them (bytes, str
    and ints on both dialects), one per chunk, not copied (100,000 chunks: 9 MiB)."""
    ids = [pack_id for pack_id, _, chunks in written if chunks]
    if not ids or len(ids) > _GIVEN_PACKS:
        return tuple(execute(conn, _CHUNKS_OF, {"ckpt": ckpt_id}).all())
    keys = dict(execute(conn, _PACK_KEYS, {"packs": ids}).all())
    out: list[Any] = [
        (c.digest, keys[pack_id], c.offset, c.length, c.raw_size, c.codec) for pack_id, _, chunks in written for c in chunks
    ]
    out += execute(conn, _CHUNKS_OUTSIDE, {"ckpt": ckpt_id, "packs": ids}).all()
    out.sort(key=itemgetter(0))  # by digest, as _CHUNKS_OF orders them (bytes compare as the databases do)
    return tuple(out)


class RecordsMixin(QueriesMixin):
    # -- writing records ------------------------------------------------------------------------
    def record_facts(self, ckpt_id: int) -> RecordFacts:
        """Run, step, times, layout, parent and chunk locations of checkpoint ``ckpt_id``."""
        with self._read() as conn:
            return read_facts(conn, ckpt_id)

    def identity(self, ckpt_id: int) -> tuple[Ident, datetime] | None:
        """A checkpoint's identity and its run's creation time (None: no such row)."""
        with self._read() as conn:
            ident = _ident(conn, ckpt_id)
            if ident is None:
                return None
            return ident, self._run_created(conn, ident[0]) or utcnow()

    def run_created(self, name: str) -> datetime | None:
        with self._read() as conn:
            return self._run_created(conn, name)

    def _run_created(self, conn: Connection, name: str) -> datetime | None:
        return aware(conn.execute(select(RUNS.c.created_at).where(RUNS.c.name == name)).scalar())

    def identities(self) -> dict[Ident, str]:
        """Every checkpoint row's identity and status (committed, and pending commits in flight).
        A row changed outside ckstore (a step or time of another type) is left out: fsck names
        it as damage of its own."""
        q = select(RUNS.c.name, CHECKPOINTS.c.step, CHECKPOINTS.c.created_at, CHECKPOINTS.c.status).select_from(
            CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
        )
        with self._read() as conn:
            try:
                rows = conn.execute(q).all()
            except (ValueError, TypeError):  # a time the driver cannot convert: read them one by one
                rows = []
                for (i,) in conn.execute(select(CHECKPOINTS.c.id)).all():
                    try:
                        rows += conn.execute(q.where(CHECKPOINTS.c.id == i)).all()
                    except (ValueError, TypeError):
                        continue
        return {
            (r.name, r.step, aware(r.created_at)): r.status
            for r in rows
            if type(r.step) is int and isinstance(r.created_at, datetime)
        }

    # -- rebuilding -----------------------------------------------------------------------------
    def restore_packs(self, packs: Sequence[tuple[str, int]]) -> None:
        """Record pack objects ``(key, size)`` (known keys are left as they are)."""
        now = utcnow()
        with self._write(lock="shared") as conn:
            for batch in batches(list(packs)):
                conn.execute(
                    self._insert(PACKS).on_conflict_do_nothing(index_elements=["key"]),
                    [{"key": k, "size": s, "created_at": now, "owner_checkpoint_id": None} for k, s in batch],
                )

    def restore_chunks(self, chunks: Sequence[RestoredChunk]) -> None:
        """Record chunks in packs :meth:`restore_packs` recorded (a known digest keeps its row)."""
        with self._write(lock="shared") as conn:
            keys = sorted({c.pack_key for c in chunks})
            ids: dict[str, int] = {}
            for batch in batches(keys):
                ids.update({r.key: r.id for r in conn.execute(select(PACKS.c.id, PACKS.c.key).where(PACKS.c.key.in_(batch)))})
            for cbatch in batches(list(chunks)):
                conn.execute(
                    self._insert(CHUNKS).on_conflict_do_nothing(index_elements=["digest"]),
                    [
                        {"digest": c.digest, "pack_id": ids[c.pack_key], "offset": c.offset, "length": c.length,
                         "raw_size": c.raw_size, "codec": c.codec, "base": c.base, "chain": c.chain}
                        for c in cbatch
                    ],
                )  # fmt: skip

    def restore_run(
        self, name: str, created_at: datetime, *, parent: Ident | None = None, parent_ref: str | None = None,
        policy: str | None = None, set_policy: bool = False,
    ) -> None:  # fmt: skip
        """Create run ``name`` as it was (an existing run keeps its creation time); set its fork
        origin when ``parent_ref`` is given, and its policy when ``set_policy``."""
        with self._write() as conn:
            conn.execute(
                self._insert(RUNS).values(name=name, created_at=created_at).on_conflict_do_nothing(index_elements=["name"])
            )
            values: dict[str, object] = {}
            if parent_ref is not None:
                values.update(parent_ref=parent_ref, parent_checkpoint_id=_find(conn, parent) if parent else None)
            if set_policy:
                values["policy"] = policy
            if values:
                conn.execute(update(RUNS).where(RUNS.c.name == name).values(**values))

    def restore_checkpoint(
        self,
        ident: Ident,
        *,
        run_created_at: datetime,
        kind: str,
        committed_at: datetime,
        world_layout: str,
        parent: Ident | None,
        logical_bytes: int,
        stored_bytes_added: int,
        entries: Sequence[tuple[int, str, bytes, int]],
        metrics: dict[str, float],
        digests: Sequence[bytes],
    ) -> bool:
        """Insert a committed checkpoint with its entries, metrics and chunk references, in one
        transaction; False when a checkpoint of this identity (or a committed one of its step)
        is already there. Every digest must have a chunk row."""
        run, step, created_at = ident
        with self._write(lock="shared") as conn:
            conn.execute(
                self._insert(RUNS).values(name=run, created_at=run_created_at).on_conflict_do_nothing(index_elements=["name"])
            )
            rid = conn.execute(select(RUNS.c.id).where(RUNS.c.name == run)).scalar_one()
            if conn.execute(
                select(CHECKPOINTS.c.id).where(
                    CHECKPOINTS.c.run_id == rid, CHECKPOINTS.c.step == step, CHECKPOINTS.c.status == COMMITTED
                )
            ).first():
                return False
            res = conn.execute(
                CHECKPOINTS.insert().values(
                    run_id=rid, step=step, status=COMMITTED, kind=kind, created_at=created_at,
                    committed_at=committed_at, heartbeat_at=committed_at, owner="recovered",
                    world_layout=world_layout, logical_bytes=logical_bytes, stored_bytes_added=stored_bytes_added,
                    parent_checkpoint_id=_find(conn, parent) if parent else None,
                )
            )  # fmt: skip
            ckpt_id = int(res.inserted_primary_key[0])  # type: ignore[index]
            for batch in batches(list(entries), 100):
                conn.execute(
                    ENTRIES.insert(),
                    [{"checkpoint_id": ckpt_id, "rank": r, "sub_key": k, "manifest": m, "logical_bytes": n} for r, k, m, n in batch],
                )
            if metrics:
                conn.execute(
                    METRICS.insert(),
                    [{"checkpoint_id": ckpt_id, "name": k, "value": None if math.isnan(v) else v} for k, v in metrics.items()],
                )
            for dbatch in batches(sorted(set(digests))):
                ids = conn.execute(select(CHUNKS.c.id).where(CHUNKS.c.digest.in_(dbatch))).scalars().all()
                if ids:
                    conn.execute(CHUNK_REFS.insert(), [{"checkpoint_id": ckpt_id, "chunk_id": i} for i in ids])
            return True

    def restore_tag(self, run: str, name: str, target: Ident | None) -> bool:
        """Point tag ``name`` of ``run`` at checkpoint ``target`` (None: remove the tag); False
        when the target is not in the catalog."""
        with self._write() as conn:
            rid = conn.execute(select(RUNS.c.id).where(RUNS.c.name == run)).scalar()
            if rid is None:
                return False
            if target is None:
                conn.execute(TAGS.delete().where(TAGS.c.run_id == rid, TAGS.c.name == name))
                return True
            ckpt_id = _find(conn, target)
            if ckpt_id is None:
                return False
            stmt = self._insert(TAGS).values(run_id=rid, name=name, checkpoint_id=ckpt_id)
            conn.execute(
                stmt.on_conflict_do_update(index_elements=["run_id", "name"], set_={"checkpoint_id": stmt.excluded.checkpoint_id})
            )
            return True

    def forget_checkpoint(self, target: Ident) -> bool:
        """Delete the checkpoint of identity ``target`` (a delete event replayed); False if absent."""
        with self._write(lock="shared") as conn:
            ckpt_id = _find(conn, target)
            if ckpt_id is None:
                return False
            conn.execute(CHECKPOINTS.delete().where(CHECKPOINTS.c.id == ckpt_id))
            return True


def _ident(conn: Connection, ckpt_id: int | None) -> Ident | None:
    if ckpt_id is None:
        return None
    row = execute(conn, _IDENT, {"ckpt": ckpt_id}).first()
    return None if row is None else (row.name, int(row.step), aware(row.created_at))


def _find(conn: Connection, ident: Ident | None) -> int | None:
    """The id of the checkpoint row of identity ``ident`` (times compared in Python: SQLite
    keeps them as text)."""
    if ident is None:
        return None
    run, step, created_at = ident
    rows = conn.execute(
        select(CHECKPOINTS.c.id, CHECKPOINTS.c.created_at)
        .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
        .where(RUNS.c.name == run, CHECKPOINTS.c.step == step)
    ).all()
    for r in rows:
        if aware(r.created_at) == created_at:
            return int(r.id)
    return None
