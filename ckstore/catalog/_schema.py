"""The catalog's tables, as SQLAlchemy Core tables.

``migrations/`` holds the Alembic scripts that build exactly this schema; a change here needs a
new migration there (and a stored catalog of the old version under ``tests/data``).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

__all__ = [
    "Base", "METADATA", "RUNS", "CHECKPOINTS", "ENTRIES", "PACKS", "CHUNKS", "CHUNK_REFS", "METRICS",
    "TAGS", "TRASH", "PENDING", "COMMITTED", "postgresql_options",
]  # fmt: skip

# status of a checkpoint row
PENDING = "pending"
COMMITTED = "committed"

# SQLAlchemy Core tables: the catalog writes SQL expressions only, and Core spares every command the
# ORM's import (a fifth of a catalog-only command's start-up)
METADATA = MetaData()


class Base:
    """The schema's :class:`MetaData` as ``Base.metadata``, where Alembic's env and tools read it."""

    metadata = METADATA


def _tz() -> DateTime:
    return DateTime(timezone=True)


RUNS = Table(
    "runs",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("name", String(255), unique=True, nullable=False),
    Column("created_at", _tz(), nullable=False),
    # lineage: the checkpoint this run was forked from (kept as text too, in case it is deleted)
    # (no foreign key: the parent may be deleted while its ref stays as history)
    Column("parent_checkpoint_id", Integer, nullable=True),
    Column("parent_ref", String(512), nullable=True),
    # retention policy as JSON (see ckstore.maintenance.retention)
    Column("policy", Text, nullable=True),
)

CHECKPOINTS = Table(
    "checkpoints",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("status", String(16), nullable=False),
    Column("kind", String(64), nullable=False),
    Column("created_at", _tz(), nullable=False),
    Column("committed_at", _tz(), nullable=True),
    Column("heartbeat_at", _tz(), nullable=False),
    Column("owner", String(255), nullable=False),  # host:pid:start-time:nonce of the committer
    Column("world_layout", Text, nullable=False),  # JSON [[dim, size], ...]
    Column("logical_bytes", BigInteger, default=0, nullable=False),
    Column("stored_bytes_added", BigInteger, default=0, nullable=False),
    Column("parent_checkpoint_id", ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True),
    UniqueConstraint("run_id", "step", "status", name="uq_checkpoints_run_step_status"),
    Index("ix_checkpoints_status_heartbeat", "status", "heartbeat_at"),
    # ids are never reused: runs.parent_checkpoint_id may outlive the row it names
    sqlite_autoincrement=True,
)

ENTRIES = Table(
    "entries",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("sub_key", String(255), nullable=False),
    Column("manifest", LargeBinary, nullable=False),
    Column("logical_bytes", BigInteger, nullable=False),
    UniqueConstraint("checkpoint_id", "rank", "sub_key", name="uq_entries_ckpt_rank_key"),
)

PACKS = Table(
    "packs",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("key", String(255), unique=True, nullable=False),
    Column("size", BigInteger, default=0, nullable=False),
    Column("created_at", _tz(), nullable=False),
    # the pending checkpoint writing this pack; protects a pack with no chunk rows yet from gc
    Column(
        "owner_checkpoint_id", ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True, index=True
    ),
)

_DELTAS = text("base IS NOT NULL")  # the rows of the partial index on chunks.base

CHUNKS = Table(
    "chunks",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("digest", LargeBinary(16), unique=True, nullable=False),
    Column("pack_id", ForeignKey("packs.id", ondelete="RESTRICT"), index=True, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("length", Integer, nullable=False),  # stored frame length
    Column("raw_size", Integer, nullable=False),
    Column("codec", Integer, nullable=False),
    # a delta (codec 3): the digest of the chunk it decodes against, and how many deltas deep
    # it is (its base's depth plus one; a chunk that is no delta has neither)
    Column("base", LargeBinary(16), nullable=True),
    Column("chain", Integer, nullable=True),
    # the deltas alone, for gc's walk down their chains (most rows are no deltas); its
    # PostgreSQL WHERE clause comes with a PostgreSQL catalog (postgresql_options, below)
    Index("ix_chunks_base", "base", sqlite_where=_DELTAS),
)

CHUNK_REFS = Table(
    "chunk_refs",
    METADATA,
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True),
    Column("chunk_id", ForeignKey("chunks.id", ondelete="RESTRICT"), primary_key=True),
    Index("ix_chunk_refs_chunk", "chunk_id"),
)

METRICS = Table(
    "metrics",
    METADATA,
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True),
    Column("name", String(255), primary_key=True),
    Column("value", Float, nullable=True),  # NULL for NaN
)

TAGS = Table(
    "tags",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("name", String(255), nullable=False),
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True, nullable=False),
    UniqueConstraint("run_id", "name", name="uq_tags_run_name"),
)

# pack keys whose catalog rows are gone and whose objects gc still has to delete
TRASH = Table(
    "trash",
    METADATA,
    Column("key", String(255), primary_key=True),
    Column("created_at", _tz(), nullable=False),
)


def postgresql_options() -> None:
    """Give the partial index its PostgreSQL WHERE clause, once a PostgreSQL catalog is opened
    (which loads SQLAlchemy's PostgreSQL dialect anyway). Not at import: a ``postgresql_*``
    keyword makes SQLAlchemy load that dialect, every DBAPI module of it, to check the keyword
    (45 ms of every command's start-up on a SQLite catalog)."""
    for index in CHUNKS.indexes:
        if index.name == "ix_chunks_base":
            index.dialect_kwargs["postgresql_where"] = _DELTAS
