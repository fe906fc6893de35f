"""The catalog's connection handling, shared by every part of :class:`~ckstore.catalog.Catalog`:
read snapshots, write transactions, dialect-specific inserts, database errors translated to
:class:`CatalogError`."""

from __future__ import annotations

import re
import weakref
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Table, text
from sqlalchemy import exc as sa_exc

from ..errors import OUTCOME_UNKNOWN, CatalogError, IntegrityError
from ._engine import (
    Rows,
    check_schema,
    head_revision,
    make_engine,
    on_driver,
    redact,
    upgrade_schema,
    write_txn,
)

__all__ = ["CatalogBase", "DriverStatement", "Rows", "execute"]


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
        return on_driver(conn, self.sql, params, many=True).rowcount


def _row_type(stmt: Any) -> Any:
    """A named-tuple type for the rows of ``stmt`` (None when it returns none): the columns a
    SELECT selects, or an INSERT, UPDATE or DELETE returns."""
    cols = list(stmt.exported_columns)
    return namedtuple("Row", [c.key for c in cols], rename=True) if cols else None


class _Plan:
    """A statement compiled for a dialect and the names of its parameters: its SQL (rendered
    once per length of its list parameter, if it has one), how to order and convert its
    parameters, and how to convert its result columns, by the statement's own column types."""

    #: lengths of the list parameter rendered and kept (a commit's batches are full but its last)
    KEPT = 64

    def __init__(self, stmt: Any, dialect: Any, keys: Sequence[str]) -> None:
        # compiled for the parameters given, as SQLAlchemy does (an INSERT names their columns)
        compiled = stmt.compile(dialect=dialect, column_keys=list(keys))
        lists = [name for name, b in compiled.binds.items() if b.expanding]
        if len(lists) > 1 or any(b.literal_execute for b in compiled.binds.values()):
            raise AssertionError(f"{compiled.string}: several lists, or values rendered at execution; use conn.execute")
        self.list = lists[0] if lists else None
        self.compiled = compiled
        self.rendered: dict[int, tuple[str, tuple[str, ...] | None]] = {}
        self.fixed: dict[str, Any] = {}  # values the statement binds itself (a status, a LIMIT)
        self.convert: dict[str, Callable[[Any], Any]] = {}
        for name, bp in compiled.binds.items():
            proc = bp.type.dialect_impl(dialect).bind_processor(dialect)
            if proc is not None:
                self.convert[name] = proc
            if not bp.required and bp.callable is None and not bp.expanding:
                self.fixed[name] = bp.value if proc is None else proc(bp.value)
        self.row = _row_type(stmt)
        self.dialect = dialect
        self.types = [c.type.dialect_impl(dialect) for c in stmt.exported_columns]
        self.results: list[Callable[[Any], Any] | None] | None = None

    def converters(self, description: Any) -> Sequence[Callable[[Any], Any] | None]:
        """Each result column's conversion, by its type and the driver's type code for it (as
        SQLAlchemy asks: PostgreSQL's numeric columns need it), looked up at the first run."""
        if self.results is None:
            codes = [d[1] for d in description] if description else [None] * len(self.types)
            self.results = [t.result_processor(self.dialect, code) for t, code in zip(self.types, codes)]
        return self.results

    def _sql(self, n: int) -> tuple[str, tuple[str, ...] | None]:
        rendered = self.rendered.get(n)
        if rendered is None:
            if self.list is None:
                order = self.compiled.positiontup
                rendered = (self.compiled.string, None if order is None else tuple(order))
            else:
                state = self.compiled.construct_expanded_state(
                    {**dict.fromkeys(self.compiled.binds), self.list: [None] * n}
                )
                order = state.positiontup
                rendered = (state.statement, None if order is None else tuple(order))
            if len(self.rendered) < self.KEPT:
                self.rendered[n] = rendered
        return rendered

    def bind(self, params: Mapping[str, Any]) -> tuple[str, Any]:
        """The SQL and the driver's parameters for ``params``."""
        values = {**self.fixed, **params}
        for name, proc in self.convert.items():
            if name in params and name != self.list:
                values[name] = proc(values[name])
        n = 0
        if self.list is not None:
            items = values.pop(self.list)
            n = len(items)
            each = self.convert.get(self.list)
            values.update({f"{self.list}_{i}": v if each is None else each(v) for i, v in enumerate(items, 1)})
        sql, order = self._sql(n)
        return sql, values if order is None else tuple(values[k] for k in order)


# each statement's plans by dialect and parameter names, for as long as the statement lives
_PLANS: weakref.WeakKeyDictionary[Any, dict[tuple[str, tuple[str, ...]], _Plan]] = weakref.WeakKeyDictionary()


def execute(conn: Connection, stmt: Any, params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> Rows:
    """``conn.execute(stmt, params)`` for a statement built once (a module-level constant), run
    on the driver's own cursor: ``params`` a mapping, or a list of them (executemany).

    SQLAlchemy's execution costs tens of µs a statement in Python, the GIL held (a commit runs
    about twenty, a background commit among them); this compiles the statement once per
    dialect and set of parameter names, and converts parameters and result columns by the
    statement's own types, as SQLAlchemy would. A statement may take one list (an expanding
    ``IN``), rendered once per length."""
    dialect = conn.dialect
    plans = _PLANS.get(stmt)
    if plans is None:
        plans = _PLANS[stmt] = {}
    rows: Sequence[Mapping[str, Any]] = [params or {}] if params is None or isinstance(params, Mapping) else params
    many = not (params is None or isinstance(params, Mapping))
    if not rows:
        return Rows([], 0)
    key = (dialect.name, tuple(sorted(rows[0])))
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _Plan(stmt, dialect, key[1])
    if many:
        if plan.list is not None:
            raise AssertionError("an executemany of a statement that takes a list")
        bound = [plan.bind(p) for p in rows]
        return on_driver(conn, bound[0][0], [b[1] for b in bound], many=True)
    sql, args = plan.bind(rows[0])
    return on_driver(conn, sql, args, row=plan.row, convert=plan.converters)


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
            column = _NOT_UTF8.search(_reason(e))
            if column is not None:  # SQLite's text that is not UTF-8: a row changed outside ckstore
                raise IntegrityError(
                    f"catalog {redact(self.url)} holds text that is not UTF-8 in column {column[1]!r}; it was "
                    "changed outside ckstore: restore the catalog from a backup, or fix that row"
                ) from e
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


#: what SQLite's driver says of a TEXT value that is not UTF-8
_NOT_UTF8 = re.compile(r"^Could not decode to UTF-8 column '([^']{1,100})'")


def _reason(e: sa_exc.DBAPIError) -> str:
    return " ".join(str(e.orig if e.orig is not None else e).split())
