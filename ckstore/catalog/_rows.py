"""Row-level building blocks of the catalog: table handles, time and batching helpers, the
predicates several statements share, and the small value types the catalog hands out."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple, Protocol, TypeVar, overload

from sqlalchemy import ColumnElement, Connection, and_, bindparam, exists, literal, select

from ..config import MAX_DELTA_CHAIN
from ..errors import NotFoundError
from ._access import execute
from ._schema import (
    CHECKPOINTS,
    CHUNK_REFS,
    CHUNKS,
    ENTRIES,
    METRICS,
    PACKS,
    PENDING,
    RUNS,
    TAGS,
    TRASH,
)

__all__ = [
    "CHECKPOINTS", "CHUNKS", "CHUNK_REFS", "ENTRIES", "METRICS", "PACKS", "RUNS", "TAGS", "TRASH", "RUN_ID",
    "RUN_ORIGIN",
    "utcnow", "aware", "batches", "run_id", "no_such_run", "unreferenced_chunk", "owned_by_live_commit",
    "needed_bases", "bases_reached",
    "ChunkRow", "NewChunk", "ChunkLocation", "Pending",
]  # fmt: skip

_BATCH = 500
_T = TypeVar("_T")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@overload
def aware(dt: datetime) -> datetime: ...
@overload
def aware(dt: None) -> None: ...
def aware(dt: datetime | None) -> datetime | None:
    """A time read from the catalog, in UTC (SQLite hands back naive times; they are UTC)."""
    if dt is None:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def batches(items: Sequence[_T], n: int = _BATCH) -> Iterator[Sequence[_T]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def no_such_run(name: str) -> NotFoundError:
    return NotFoundError(f"no run named {name!r} in this store (see `ckstore runs`)")


#: statements built once: building one costs more than running it on the catalogs' hot paths
RUN_ID = select(RUNS.c.id).where(RUNS.c.name == bindparam("name"))
#: a run's id and the checkpoint it was forked from
RUN_ORIGIN = select(RUNS.c.id, RUNS.c.parent_checkpoint_id, RUNS.c.parent_ref).where(RUNS.c.name == bindparam("name"))


def run_id(conn: Connection, name: str) -> int:
    """The id of run ``name``; :class:`NotFoundError` when the store has no such run."""
    rid = execute(conn, RUN_ID, {"name": name}).scalar()
    if rid is None:
        raise no_such_run(name)
    return int(rid)


def unreferenced_chunk() -> ColumnElement[bool]:
    """A chunk row no checkpoint (committed or pending) references and that no chunk needs as
    the base of a delta (see :func:`needed_bases`): garbage for the next gc."""
    needed = needed_bases()
    return and_(~exists().where(CHUNK_REFS.c.chunk_id == CHUNKS.c.id), ~exists().where(needed.c.digest == CHUNKS.c.digest))


def needed_bases() -> Any:
    """The digests of every base that a referenced delta chunk decodes through, down its chain
    (a recursive CTE; ``UNION`` ends a cycle a damaged catalog might hold).

    A checkpoint references only its own chunks; the bases of its deltas are kept alive by gc
    through this, wherever they came from. The partial index on ``chunks.base`` keeps it to
    the rows that are deltas."""
    below = CHUNKS.alias("below")
    first = (
        select(CHUNKS.c.base.label("digest"))
        .where(CHUNKS.c.base.is_not(None), exists().where(CHUNK_REFS.c.chunk_id == CHUNKS.c.id))
        .cte("needed_bases", recursive=True)
    )
    deeper = select(below.c.base).join(first, below.c.digest == first.c.digest).where(below.c.base.is_not(None))
    return first.union(deeper)


def bases_reached() -> Any:
    """``(chunk_id, base_id)``: each delta chunk and every base it decodes through, down its
    chain (rows whose ``base_id`` is NULL start the walk; skip them); what a checkpoint holds in
    the store besides the chunks it references is the bases its referenced chunks reach. Walked
    once per delta chunk, not once per checkpoint referencing it (a recursive CTE, its rows left
    undeduplicated: it ends at :data:`~ckstore.config.MAX_DELTA_CHAIN` bases, the longest chain a
    reader follows, which also ends a cycle a damaged catalog might hold)."""
    base = CHUNKS.alias("base")
    first = (
        select(
            CHUNKS.c.id.label("chunk_id"), literal(None, CHUNKS.c.id.type).label("base_id"),
            CHUNKS.c.base.label("next"), literal(0).label("depth"),
        )
        .where(CHUNKS.c.base.is_not(None))
        .cte("bases_reached", recursive=True)
    )  # fmt: skip
    deeper = (
        select(first.c.chunk_id, base.c.id, base.c.base, first.c.depth + 1)
        .join(first, base.c.digest == first.c.next)
        .where(first.c.next.is_not(None), first.c.depth < MAX_DELTA_CHAIN)
    )
    return first.union_all(deeper)


def owned_by_live_commit() -> ColumnElement[bool]:
    """A pack row a commit still in flight (a pending checkpoint) owns."""
    return PACKS.c.owner_checkpoint_id.in_(select(CHECKPOINTS.c.id).where(CHECKPOINTS.c.status == PENDING))


class ChunkRow(Protocol):
    """What the catalog records of a chunk written to a pack: a :class:`NewChunk`, or the pack
    writer's own record of it, taken as it is (a commit of 7,200 tensors would otherwise build
    a second object per chunk)."""

    @property
    def digest(self) -> bytes: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def raw_size(self) -> int: ...
    @property
    def codec(self) -> int: ...
    @property
    def base(self) -> bytes | None: ...  # a delta's base chunk
    @property
    def chain(self) -> int | None: ...  # a delta's depth: its base's plus one


@dataclass(frozen=True, slots=True)
class NewChunk:
    """A :class:`ChunkRow` built by the catalog's callers (a pack's live chunks, for repacking)."""

    digest: bytes
    offset: int
    length: int
    raw_size: int
    codec: int
    base: bytes | None = None
    chain: int | None = None


class ChunkLocation(NamedTuple):
    """Where a chunk is stored (a tuple: a checkout looks up one per chunk it reads)."""

    pack_key: str
    offset: int
    length: int
    raw_size: int
    codec: int
    base: bytes | None = None  # a delta's base chunk, read and decoded first


class Pending(NamedTuple):
    """A pending checkpoint: a commit in flight, or one that died before finishing."""

    id: int
    run: str
    step: int
    owner: str
    heartbeat_at: datetime  # aware, UTC


def pending_row(r: Any) -> Pending:
    return Pending(int(r.id), r.name, int(r.step), r.owner, aware(r.heartbeat_at))
