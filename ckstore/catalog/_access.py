"""The catalog's connection handling, shared by every part of :class:`~ckstore.catalog.Catalog`:
read snapshots, write transactions, dialect-specific inserts, database errors translated to
:class:`CatalogError`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Table, text
from sqlalchemy import exc as sa_exc

from ..errors import OUTCOME_UNKNOWN, CatalogError
from ._engine import check_schema, head_revision, make_engine, redact, upgrade_schema, write_txn

__all__ = ["CatalogBase", "DriverStatement", "ListStatement"]


class DriverStatement:
    """An INSERT compiled once for a dialect and run as the database driver's own executemany.

    SQLAlchemy processes every row of an executemany in Python (~7 µs a row: a commit of 20,000
    chunks spent 0.14 s of its catalog time there); for rows of plain ints and bytes, which need
    no conversion on either dialect, the driver takes them as they are. ``keys`` name the
    columns each row gives, in order.
    """

    def __init__(self, stmt: Any, dialect: Any, keys: Sequence[str]) -> None:
        compiled = stmt.compile(dialect=dialect, column_keys=list(keys))
        self.sql = str(compiled)
        self.keys = tuple(keys)
        order = compiled.positiontup  # None for a driver that takes named parameters
        self.order = None if order is None else [self.keys.index(k) for k in order]
        if self.order is not None and len(self.order) != len(self.keys):
            raise AssertionError(f"{self.sql} does not take exactly {self.keys}")

    def executemany(self, conn: Connection, rows: Sequence[tuple[Any, ...]]) -> int:
        """Run it for every row; returns the rows the driver reports inserted (-1: unknown)."""
        if not rows:
            return 0
        if self.order is None:
            params: list[Any] = [dict(zip(self.keys, r)) for r in rows]
        elif self.order == list(range(len(self.keys))):
            params = list(rows)
        else:
            params = [tuple(r[i] for i in self.order) for r in rows]
        return int(conn.exec_driver_sql(self.sql, params).rowcount)


class ListStatement:
    """A statement with one list parameter (an expanding ``IN``), rendered for the driver once
    per list length and run as the driver's own statement.

    SQLAlchemy renders an expanding parameter anew at every call (a commit of 20,000 chunks runs
    such statements with 500 digests 120 times); rendered once, a call only binds the values.
    Values and results must need no type conversion (ints, bytes and strings on both
    dialects). Up to :attr:`KEPT` lengths are kept (a commit's batches are full but its last).
    """

    KEPT = 64

    def __init__(self, stmt: Any, dialect: Any, name: str) -> None:
        self.name = name
        self._compiled = stmt.compile(dialect=dialect)
        self._scalars = [k for k in self._compiled.binds if k != name]
        self._rendered: dict[int, tuple[str, tuple[str, ...] | None]] = {}

    def execute(self, conn: Connection, values: Sequence[Any], **scalars: Any) -> Any:
        n = len(values)
        rendered = self._rendered.get(n)
        if rendered is None:
            state = self._compiled.construct_expanded_state({self.name: [None] * n, **dict.fromkeys(self._scalars)})
            order = state.positiontup
            rendered = (state.statement, None if order is None else tuple(order))
            if len(self._rendered) < self.KEPT:
                self._rendered[n] = rendered
        sql, order = rendered
        named = {f"{self.name}_{i}": v for i, v in enumerate(values, 1)}
        named.update(scalars)
        return conn.exec_driver_sql(sql, named if order is None else tuple(named[k] for k in order))


class CatalogBase:
    """Engine, transactions and schema of one catalog (SQLite or PostgreSQL)."""

    def __init__(self, url: str, *, upgrade_hint: str = "ckstore db upgrade", check: bool = True) -> None:
        self.url = url
        self.engine: Engine = make_engine(url)
        self.dialect = self.engine.dialect.name
        if check:
            check_schema(self.engine, upgrade_hint)

    def __repr__(self) -> str:
        return f"Catalog({redact(self.url)!r})"

    def close(self) -> None:
        self.engine.dispose()

    # -- schema ---------------------------------------------------------------------------------
    def upgrade(self) -> tuple[str | None, str]:
        """Upgrade the schema to this ckstore's; returns ``(from_revision, to_revision)``."""
        return upgrade_schema(self.engine)

    def revisions(self) -> tuple[str | None, str]:
        """``(the catalog's schema revision or None, the revision this ckstore needs)``."""
        try:
            with self._read() as conn:
                rev = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except (CatalogError, sa_exc.ProgrammingError, sa_exc.OperationalError):
            rev = None  # no version table yet
        return rev, head_revision(self.engine)

    # -- transactions -----------------------------------------------------------------------------
    @contextmanager
    def _write(self, lock: str | None = None, *, durable: bool = True) -> Iterator[Connection]:
        """A write transaction; ``lock="shared"`` for commits, ``"exclusive"`` for gc sweeps;
        ``durable=False`` for one a later durable transaction makes durable (see ``write_txn``)."""
        try:
            with write_txn(self.engine, lock, durable=durable) as conn:
                yield conn
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as e:
            raise CatalogError(
                f"catalog {redact(self.url)} failed during a write ({_reason(e)}); the transaction "
                "was rolled back, unless the connection dropped while it was committing. Retry once "
                "the catalog is reachable (a commit that did get through reports its step as taken)"
            ) from e

    def _lost_at_commit(self, e: CatalogError, what: str) -> CatalogError:
        """The error for a :meth:`_write` that ran every statement of its transaction and then
        failed (``e``): the COMMIT was sent, so the server may have committed ``what``."""
        cause = e.__cause__
        reason = _reason(cause) if isinstance(cause, sa_exc.DBAPIError) else str(e)
        return CatalogError(
            f"{what} {OUTCOME_UNKNOWN}: catalog {redact(self.url)} failed while committing it "
            f"({reason}). Retry once the catalog is reachable: if it did get through, the retry "
            "reports it as committed already; if not, the retry commits it"
        )

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        """A read transaction that sees one snapshot of the catalog."""
        try:
            with self.engine.connect() as conn:
                if self.dialect == "postgresql":  # one snapshot for every statement, as SQLite gives
                    conn = conn.execution_options(isolation_level="REPEATABLE READ")
                with conn.begin():
                    yield conn
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as e:
            raise CatalogError(
                f"reading catalog {redact(self.url)} failed ({_reason(e)}); retry once it is reachable"
            ) from e

    def _insert(self, table: Table) -> Any:
        """An INSERT with this dialect's ``on_conflict_do_*``."""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return postgresql.insert(table)
        if self.dialect == "sqlite":
            from sqlalchemy.dialects import sqlite

            return sqlite.insert(table)
        raise CatalogError(f"catalog dialect {self.dialect} is not supported; use SQLite or PostgreSQL")


def _reason(e: sa_exc.DBAPIError) -> str:
    return " ".join(str(e.orig if e.orig is not None else e).split())
