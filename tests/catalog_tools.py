"""The one place tests touch the catalog's tables with SQL: to build states the public API
never produces (commits that died long ago, damaged rows, a lost reference), to read rows back
for hand computation, and to compare the schema with the migrations.

Everything else in the tests goes through :class:`ckstore.catalog.Catalog`'s methods. Plain SQL
text is used where it can be, so what a test writes is what a user with ``sqlite3`` or ``psql``
could write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ckstore.catalog import Catalog, Owner, utcnow
from ckstore.catalog._schema import Base

__all__ = [
    "age_heartbeat",
    "column",
    "count",
    "delete_chunk_ref",
    "drop_pending",
    "dump",
    "execute",
    "hand_over_pending",
    "insert_chunk_meanwhile",
    "on_statement",
    "pending_pack_chunks",
    "rows",
    "schema_differences",
    "scalar",
    "set_schema_revision",
]

Target = Catalog | Path | str  # a catalog, or a SQLite file / database URL


@contextmanager
def _connect(target: Target) -> Iterator[sa.Connection]:
    if isinstance(target, Catalog):
        with target.engine.begin() as conn:
            yield conn
        return
    url = f"sqlite:///{target}" if isinstance(target, Path) else target
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            yield conn
    finally:
        engine.dispose()


def execute(target: Target, sql: str, **params: Any) -> int:
    """Run one SQL statement in its own transaction; returns the rows it changed."""
    with _connect(target) as conn:
        return int(conn.execute(sa.text(sql), params).rowcount)


def rows(target: Target, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    with _connect(target) as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql), params)]


def scalar(target: Target, sql: str, **params: Any) -> Any:
    with _connect(target) as conn:
        return conn.execute(sa.text(sql), params).scalar()


def column(target: Target, table: str, name: str) -> list[Any]:
    """Every value of one column (a table or column name from the schema, never user input)."""
    return [r[0] for r in rows(target, f"SELECT {name} FROM {table}")]


def count(target: Target, table: str) -> int:
    return int(scalar(target, f"SELECT count(*) FROM {table}"))


def dump(catalog: Catalog) -> str:
    """Every row of every table, as text (to look for what must never be stored)."""
    with _connect(catalog) as conn:
        return repr([conn.execute(sa.select(t)).all() for t in Base.metadata.tables.values()])


# -- states the API never produces --------------------------------------------------------------
def age_heartbeat(catalog: Catalog, ckpt_id: int, seconds: float) -> None:
    """Make a pending checkpoint's last heartbeat ``seconds`` old (a silent commit)."""
    at = utcnow() - timedelta(seconds=seconds)
    with _connect(catalog) as conn:
        t = Base.metadata.tables["checkpoints"]
        conn.execute(sa.update(t).where(t.c.id == ckpt_id).values(heartbeat_at=at))


def hand_over_pending(catalog: Catalog, step: int, owner: Owner) -> None:
    """Record ``owner`` (a dead process, say) as the committer of the pending checkpoint at
    ``step``: the commit's process died and left its claim."""
    execute(
        catalog, "UPDATE checkpoints SET owner = :owner WHERE step = :step AND status = 'pending'",
        owner=str(owner), step=step,
    )  # fmt: skip


def drop_pending(catalog: Catalog) -> int:
    """Delete every pending checkpoint, as a gc judging them abandoned would."""
    return execute(catalog, "DELETE FROM checkpoints WHERE status = 'pending'")


def delete_chunk_ref(catalog: Catalog, ckpt_id: int, digest: bytes) -> None:
    """Drop one checkpoint's reference to one chunk (catalog damage fsck must name)."""
    with _connect(catalog) as conn:
        chunks, refs = Base.metadata.tables["chunks"], Base.metadata.tables["chunk_refs"]
        chunk_id = conn.execute(sa.select(chunks.c.id).where(chunks.c.digest == digest)).scalar_one()
        conn.execute(sa.delete(refs).where(refs.c.checkpoint_id == ckpt_id, refs.c.chunk_id == chunk_id))


def pending_pack_chunks(catalog: Catalog, step: int) -> int:
    """Chunk rows in the packs the pending checkpoint at ``step`` owns."""
    return int(
        scalar(
            catalog,
            "SELECT count(*) FROM chunks k JOIN packs p ON p.id = k.pack_id "
            "JOIN checkpoints c ON c.id = p.owner_checkpoint_id WHERE c.step = :step AND c.status = 'pending'",
            step=step,
        )
    )


def set_schema_revision(target: Target, revision: str | None) -> None:
    """Stamp the catalog with another schema revision (None: no revision at all)."""
    if revision is None:
        execute(target, "DELETE FROM alembic_version")
    else:
        execute(target, "UPDATE alembic_version SET version_num = :v", v=revision)


@contextmanager
def insert_chunk_meanwhile(catalog: Catalog, row: Mapping[str, Any]) -> Iterator[Callable[[Mapping[str, Any]], None]]:
    """Another writer's open transaction that has inserted chunk ``row``; the context yields a
    function inserting one more chunk row in it, and commits on exit."""
    chunks = Base.metadata.tables["chunks"]
    with catalog.engine.connect() as conn:
        tx = conn.begin()
        conn.execute(sa.insert(chunks).values(dict(row)))
        yield lambda more: conn.execute(sa.insert(chunks).values(dict(more))) and None
        tx.commit()


@contextmanager
def on_statement(catalog: Catalog, hook: Callable[[str], None]) -> Iterator[None]:
    """Call ``hook(sql)`` before each statement the catalog sends (to stop a server at one)."""

    def before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        hook(statement)

    sa.event.listen(catalog.engine, "before_cursor_execute", before)
    try:
        yield
    finally:
        sa.event.remove(catalog.engine, "before_cursor_execute", before)


def schema_differences(target: Target) -> list[Any]:
    """What differs between a catalog's tables and the models (``[]``: nothing)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with _connect(target) as conn:
        return list(compare_metadata(MigrationContext.configure(conn), Base.metadata))
