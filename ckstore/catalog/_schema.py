"""The catalog's tables, as SQLAlchemy 2.x typed models.

``migrations/`` holds the Alembic scripts that build exactly this schema; a change here needs a
new migration there (and a stored catalog of the old version under ``tests/data``).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "Run", "CheckpointRow", "Entry", "Pack", "Chunk", "ChunkRef", "Metric", "Tag", "Trash"]

# status of a checkpoint row
PENDING = "pending"
COMMITTED = "committed"


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # lineage: the checkpoint this run was forked from (kept as text too, in case it is deleted)
    # (no foreign key: the parent may be deleted while its ref stays as history)
    parent_checkpoint_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    parent_ref: Mapped[str | None] = mapped_column(String(512), nullable=True)
    # retention policy as JSON (see ckstore.maintenance.retention)
    policy: Mapped[str | None] = mapped_column(Text, nullable=True)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step", "status", name="uq_checkpoints_run_step_status"),
        Index("ix_checkpoints_status_heartbeat", "status", "heartbeat_at"),
        # ids are never reused: runs.parent_checkpoint_id may outlive the row it names
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    committed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    owner: Mapped[str] = mapped_column(String(255))  # host:pid:start-time:nonce of the committer
    world_layout: Mapped[str] = mapped_column(Text)  # JSON [[dim, size], ...]
    logical_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    stored_bytes_added: Mapped[int] = mapped_column(BigInteger, default=0)
    parent_checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True
    )


class Entry(Base):
    __tablename__ = "entries"
    __table_args__ = (UniqueConstraint("checkpoint_id", "rank", "sub_key", name="uq_entries_ckpt_rank_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    sub_key: Mapped[str] = mapped_column(String(255))
    manifest: Mapped[bytes] = mapped_column(LargeBinary)
    logical_bytes: Mapped[int] = mapped_column(BigInteger)


class Pack(Base):
    __tablename__ = "packs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    size: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # the pending checkpoint writing this pack; protects a pack with no chunk rows yet from gc
    owner_checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True, index=True
    )


class Chunk(Base):
    __tablename__ = "chunks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[bytes] = mapped_column(LargeBinary(16), unique=True)
    pack_id: Mapped[int] = mapped_column(ForeignKey("packs.id", ondelete="RESTRICT"), index=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(Integer)  # stored frame length
    raw_size: Mapped[int] = mapped_column(Integer)
    codec: Mapped[int] = mapped_column(Integer)


class ChunkRef(Base):
    __tablename__ = "chunk_refs"
    __table_args__ = (Index("ix_chunk_refs_chunk", "chunk_id"),)

    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    chunk_id: Mapped[int] = mapped_column(ForeignKey("chunks.id", ondelete="RESTRICT"), primary_key=True)


class Metric(Base):
    __tablename__ = "metrics"

    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)  # NULL for NaN


class Tag(Base):
    __tablename__ = "tags"
    __table_args__ = (UniqueConstraint("run_id", "name", name="uq_tags_run_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True)


class Trash(Base):
    """Pack keys whose catalog rows are gone and whose objects gc still has to delete."""

    __tablename__ = "trash"

    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
