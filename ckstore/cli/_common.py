"""Shared CLI plumbing: the store option, error rendering and formatting helpers.

Two rules every command keeps:

* every string that comes from the user or the store (run names, keys, sub-keys, metric names,
  tags, kinds, refs, locations, error messages) goes through :func:`esc` before rich sees it, so
  ``[/]`` never crashes a command and ``[bold red]`` or ``[link=…]`` print as typed;
* every error ends the command with one line on stderr and exit status 2 (:func:`fail`), never a
  traceback, so that ``diff`` (0 same, 1 different) and ``fsck`` (1 damage) stay scriptable.
  ``CKSTORE_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.markup import escape

from ..errors import CkstoreError
from ..urls import scrub

F = TypeVar("F", bound=Callable[..., Any])


def _console(stderr: bool = False) -> Console:
    # no emoji codes (a key named ":smile:" prints as typed) and no guessing at highlights
    c = Console(stderr=stderr, highlight=False, emoji=False)
    if not c.is_terminal:  # pipes and logs: wide enough for a log table, never wrapped at 80
        c = Console(stderr=stderr, highlight=False, emoji=False, width=200)
    return c


def esc(value: object) -> str:
    """``value`` as text rich prints literally (markup escaped)."""
    return escape(str(value))


console = _console()
err_console = _console(stderr=True)

DEFAULT_STORE = "ckstore-demo"


class Ctx:
    """What every command gets: the store location and a lazily opened store."""

    def __init__(self, store: str | None, catalog: str | None, run: str | None) -> None:
        self.location = store
        self.catalog = catalog
        self.run = run
        self._store: Any = None

    def require_location(self) -> str:
        if not self.location:
            raise click.UsageError("name the store with --store LOCATION or the CKSTORE_STORE environment variable")
        return self.location

    def open(self, *, create: bool = False, recycle_bytes: int | None = None) -> Any:
        if self._store is None:
            import ckstore

            self._store = ckstore.open(
                self.require_location(), catalog=self.catalog, run=self.run, create=create, recycle_bytes=recycle_bytes
            )
        return self._store


pass_ctx = click.make_pass_decorator(Ctx)


def one_line(text: str) -> str:
    """``text`` on one line, with any secret in a URL redacted."""
    return scrub(" ".join(part.strip() for part in text.strip().splitlines() if part.strip()))


def describe_error(e: BaseException) -> str:
    """The one line an error prints as."""
    if isinstance(e, CkstoreError):
        return f"{type(e).__name__}: {one_line(str(e))}"
    from ..catalog import describe_database_error

    database = describe_database_error(e)
    if database is not None:
        return one_line(database)
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {one_line(str(e))}"
    return f"unexpected {type(e).__name__}: {one_line(str(e))} (CKSTORE_DEBUG=1 shows the traceback)"


def fail(e: BaseException) -> NoReturn:
    """Print ``e`` as one line on stderr and exit with status 2."""
    err_console.print(f"[bold red]error:[/] {esc(describe_error(e))}", soft_wrap=True)
    sys.exit(2)


def _passes_through(e: BaseException) -> bool:
    # click's own exits and usage errors (exit 2 already), and diff's / fsck's deliberate exits
    return isinstance(e, (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort))


def handle_errors(fn: F) -> F:
    """Turn every error into a one-line message and exit status 2 (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the CLI's boundary: nothing escapes as a traceback
            if _passes_through(e) or os.environ.get("CKSTORE_DEBUG") == "1":
                raise
            fail(e)

    return wrapper  # type: ignore[return-value]


class ErrorHandlingGroup(click.Group):
    """A command group whose subcommands (and their own subgroups) all end errors as
    :func:`handle_errors` does, whether or not each one is decorated."""

    def invoke(self, ctx: click.Context) -> Any:
        return handle_errors(super().invoke)(ctx)


@contextlib.contextmanager
def byte_progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done_bytes, total_bytes)`` callback drawing a rich bar on stderr (nothing
    when stderr is not a terminal)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    if not err_console.is_terminal:
        yield lambda done, total: None
        return
    with Progress(
        TextColumn(description), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=err_console, transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        yield update


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_time(dt: datetime | None) -> str:
    if dt is None:
        return "-"
    return dt.astimezone().strftime("%m-%d %H:%M:%S")


def ago(dt: datetime | None) -> str:
    if dt is None:
        return "-"
    s = (datetime.now(timezone.utc) - dt).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def fmt_metric(v: float) -> str:
    return f"{v:.4g}"


def print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def env_store() -> str | None:
    return os.environ.get("CKSTORE_STORE")
