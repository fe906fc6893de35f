"""Catalog engines: SQLite (WAL, busy timeout, serialized writers) and PostgreSQL, statements
run on a connection's own driver cursor, and the schema check that runs Alembic from code."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.pool import QueuePool

from ..errors import CatalogError, SchemaVersionError
from ..urls import redact, scrub
from ._schema import Base, postgresql_options

__all__ = [
    "Rows",
    "on_driver",
    "make_engine",
    "write_txn",
    "check_schema",
    "upgrade_schema",
    "migrations_dir",
    "head_revision",
    "SCHEMA_REVISION",
    "redact",
    "describe_database_error",
    "PG_CONNECT_DEFAULTS",
]

_WRITE = "ckstore_write"
# a write transaction that need not be durable on its own (see write_txn), and the SQLite
# connection's current ``synchronous`` setting
_LAZY = "ckstore_lazy"
_SYNC = "ckstore_synchronous"
# advisory lock key shared by commits (shared mode) and gc sweeps (exclusive mode)
GC_LOCK_KEY = 0x636B73746F7265  # "ckstore"


# libpq settings a PostgreSQL catalog starts from (a URL's own ``?connect_timeout=`` wins): give
# up connecting after 10 s, and notice a server that vanished mid-query within about a minute
PG_CONNECT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "application_name": "ckstore",
}


def _enter_wal(cur: Any, wait: float = 120.0) -> None:
    """Put a SQLite database in WAL mode. Switching needs the database to itself, and SQLite
    answers "database is locked" at once (no busy wait) while another connection, say a second
    process creating the same store, holds it: retry until ``wait`` seconds have passed."""
    import sqlite3
    import time

    deadline = time.monotonic() + wait
    delay = 0.005
    while True:
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
                return  # persistent: set once by whoever created the file
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(delay)  # another connection holds the lock: wait for it, with backoff
            delay = min(delay * 2, 0.2)


class Rows:
    """What a statement run on the driver's cursor returned: its rows (named tuples, with the
    result methods of SQLAlchemy's that ckstore uses) and the count of rows it changed."""

    __slots__ = ("rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)

    def all(self) -> list[Any]:
        return self.rows

    def first(self) -> Any:
        return self.rows[0] if self.rows else None

    def one(self) -> Any:
        if len(self.rows) != 1:
            raise sa_exc.NoResultFound("no row") if not self.rows else sa_exc.MultipleResultsFound("several rows")
        return self.rows[0]

    def scalar(self) -> Any:
        return self.rows[0][0] if self.rows else None

    def scalars(self) -> list[Any]:
        return [r[0] for r in self.rows]


def on_driver(
    conn: Connection,
    sql: str,
    params: Any,
    *,
    many: bool = False,
    row: Any = None,
    convert: Callable[[Any], Sequence[Callable[[Any], Any] | None]] | None = None,
) -> Rows:
    """Run ``sql`` on the driver's own cursor, inside the transaction of ``conn``; rows as
    ``row`` tuples, each column passed through the function ``convert(cursor.description)``
    gives for it, if any.

    As from ``conn.execute``: the engine's ``before_cursor_execute`` and
    ``after_cursor_execute`` listeners see the statement (SQL logging, tracing; ``context`` is
    None), driver errors are raised as SQLAlchemy's, and a lost connection is invalidated."""
    dialect = conn.dialect
    dbapi_error = dialect.loaded_dbapi.Error
    dbapi_conn = conn.connection.dbapi_connection
    assert dbapi_conn is not None
    cursor = dbapi_conn.cursor()
    events = conn.dispatch
    try:
        if events.before_cursor_execute:
            events.before_cursor_execute(conn, cursor, sql, params, None, many)
        if many:
            cursor.executemany(sql, params)
        else:
            cursor.execute(sql, params)
        if events.after_cursor_execute:
            events.after_cursor_execute(conn, cursor, sql, params, None, many)
        if row is None:
            return Rows([], int(cursor.rowcount))
        funcs = () if convert is None else convert(cursor.description)
        if any(funcs):
            return Rows([row._make(v if f is None else f(v) for f, v in zip(funcs, r)) for r in cursor.fetchall()], -1)
        return Rows([row._make(r) for r in cursor.fetchall()], -1)
    except dbapi_error as e:
        lost = bool(dialect.is_disconnect(e, dbapi_conn, cursor))
        if lost:
            conn.invalidate(e)
        raise sa_exc.DBAPIError.instance(sql, None, e, dbapi_error, connection_invalidated=lost, dialect=dialect) from e
    finally:
        cursor.close()


def make_engine(url: str) -> Engine:
    """An engine for an (already expanded) catalog URL."""
    try:
        if url.startswith("sqlite"):
            engine = create_engine(
                url,
                connect_args={"timeout": 120, "check_same_thread": False},
                poolclass=QueuePool, pool_size=2, max_overflow=8,
            )

            @event.listens_for(engine, "connect")
            def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
                dbapi_conn.isolation_level = None  # ckstore emits BEGIN itself, below
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA busy_timeout=120000")
                _enter_wal(cur)
                cur.execute("PRAGMA synchronous=FULL")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()
                _rec.info[_SYNC] = "FULL"

            @event.listens_for(engine, "begin")
            def _on_begin(conn: Connection) -> None:
                # Writers take the database's write lock up front, so two writers never
                # deadlock upgrading read locks; readers run beside them under WAL.
                if not conn.info.get(_WRITE):
                    on_driver(conn, "BEGIN", ())
                    return
                want = "NORMAL" if conn.info.get(_LAZY) else "FULL"
                if conn.info.get(_SYNC) != want:  # set outside a transaction, kept by the connection
                    on_driver(conn, f"PRAGMA synchronous={want}", ())
                    conn.info[_SYNC] = want
                on_driver(conn, "BEGIN IMMEDIATE", ())

        elif url.startswith("postgresql"):
            postgresql_options()
            given = make_url(url).query
            connect_args = {k: v for k, v in PG_CONNECT_DEFAULTS.items() if k not in given}
            # pre-ping: a pooled connection that died (the server restarted) is replaced before use
            engine = create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=8, connect_args=connect_args)
        else:
            engine = create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=8)
    except Exception as e:  # noqa: BLE001 - bad URL, missing driver
        raise CatalogError(f"cannot open catalog {redact(url)}: {scrub(str(e))}") from e
    _forget_in_forked_children(engine)
    return engine


def _forget_in_forked_children(engine: Engine) -> None:
    """A forked child (a DataLoader worker, say) must not reuse its parent's pooled connections:
    drop the pool there, without closing the parent's connections."""
    ref = weakref.ref(engine)

    def after_fork() -> None:
        e = ref()
        if e is not None:
            e.dispose(close=False)

    os.register_at_fork(after_in_child=after_fork)


@contextmanager
def write_txn(engine: Engine, lock: str | None = None, *, durable: bool = True) -> Iterator[Connection]:
    """A write transaction. ``lock`` is ``"shared"`` (commits) or ``"exclusive"`` (gc sweeps).

    On SQLite every write transaction already excludes every other writer; on PostgreSQL the
    lock is a transaction-scoped advisory lock.

    ``durable=False``: the transaction is atomic and visible to every reader at once, but its
    COMMIT does not wait for the disk (SQLite's ``synchronous=NORMAL`` in WAL mode, PostgreSQL's
    ``synchronous_commit=off`` for this transaction): a power loss or operating-system crash
    may lose it, a process crash cannot. The next durable transaction makes it durable too,
    since both write-ahead logs are flushed in order. A commit's earlier steps (pending row,
    claim; a streamed commit's chunk rows) are such transactions: losing them leaves garbage,
    never a visible checkpoint, and the commit's final, durable transaction flushes them with it.
    """
    pg = engine.dialect.name == "postgresql"
    with engine.connect() as conn:
        conn.info[_WRITE] = True
        conn.info[_LAZY] = not durable
        try:
            with conn.begin():
                if pg and (lock or not durable):  # one round trip for both
                    fn = "pg_advisory_xact_lock_shared" if lock == "shared" else "pg_advisory_xact_lock"
                    calls = [f"{fn}(:k)"] if lock else []
                    if not durable:
                        calls.append("set_config('synchronous_commit', 'off', true)")
                    conn.execute(text(f"SELECT {', '.join(calls)}"), {"k": GC_LOCK_KEY} if lock else {})
                yield conn
        finally:
            conn.info.pop(_WRITE, None)
            conn.info.pop(_LAZY, None)


def migrations_dir() -> Path:
    """The Alembic script folder: shipped inside the wheel, or the source tree's ``migrations/``."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise CatalogError("ckstore's migration scripts are missing from this installation; reinstall ckstore")


def _alembic_config(engine: Engine) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolates "%": a URL's own escapes (%3D, a password's %40) must be doubled
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def head_revision(engine: Engine) -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config(engine)).get_current_head()
    assert head is not None
    return head


# the head of migrations/versions, so that opening a catalog already at head needs no Alembic
# import (about half a second); a test keeps it equal to Alembic's head
SCHEMA_REVISION = "0002"


def _at_head(conn: Connection) -> bool:
    """Whether the catalog's one recorded revision is :data:`SCHEMA_REVISION` (plain SQL)."""
    rows = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    return list(rows) == [SCHEMA_REVISION]


def _current_revision(conn: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()


_OWN_TABLES = frozenset(Base.metadata.tables)


def check_schema(engine: Engine, upgrade_hint: str) -> None:
    """Create a fresh catalog at head, or verify an existing one is at head.

    An outdated catalog raises :class:`SchemaVersionError` carrying ``upgrade_hint``, the exact
    command that upgrades it.
    """
    try:
        with write_txn(engine, lock="exclusive") as conn:
            tables = set(inspect(conn).get_table_names())
            if "alembic_version" not in tables and not (tables & _OWN_TABLES):
                from alembic import command

                Base.metadata.create_all(conn)
                cfg = _alembic_config(engine)
                cfg.attributes["connection"] = conn
                command.stamp(cfg, "head")
                return
            if "alembic_version" in tables and _at_head(conn):
                return
            current = _current_revision(conn)
    except SchemaVersionError:
        raise
    except Exception as e:  # noqa: BLE001 - connection refused, permissions, …
        raise CatalogError(f"cannot open catalog {redact(str(engine.url))}: {scrub(str(e))}") from e
    head = head_revision(engine)
    if current == head:
        return
    from alembic.script import ScriptDirectory

    known = {s.revision for s in ScriptDirectory.from_config(_alembic_config(engine)).walk_revisions()}
    if current is not None and current not in known:
        raise SchemaVersionError(
            f"catalog {redact(str(engine.url))} has schema revision {current}, written by a newer "
            "ckstore than this one; upgrade ckstore to use it"
        )
    raise SchemaVersionError(
        f"catalog {redact(str(engine.url))} has schema revision {current or '(none)'} but this "
        f"ckstore needs {head}. Back it up, then run: {upgrade_hint}"
    )


def upgrade_schema(engine: Engine) -> tuple[str | None, str]:
    """Upgrade the catalog to head; returns ``(from_revision, to_revision)``."""
    from alembic import command

    cfg = _alembic_config(engine)
    with write_txn(engine, lock="exclusive") as conn:
        before = _current_revision(conn)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    return before, head_revision(engine)


def describe_database_error(e: BaseException) -> str | None:
    """One line for a SQLAlchemy or driver error that escaped the catalog (the driver's words,
    never the SQL, URLs scrubbed), or None when ``e`` is not one."""
    from sqlalchemy.exc import DBAPIError, SQLAlchemyError

    if isinstance(e, DBAPIError) and e.orig is not None:
        first = (str(e.orig).strip().splitlines() or [""])[0]
        return f"catalog error: {type(e.orig).__name__}: {scrub(first)}"
    if isinstance(e, SQLAlchemyError):
        first = (str(e).strip().splitlines() or [""])[0]
        return f"catalog error: {type(e).__name__}: {scrub(first)}"
    return None
