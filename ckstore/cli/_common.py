"""Shared CLI plumbing: the store option, error rendering and formatting helpers."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any, TypeVar

import click
from rich.console import Console

from ..errors import CkstoreError

F = TypeVar("F", bound=Callable[..., Any])

def _console(stderr: bool = False) -> Console:
    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal:  # pipes and logs: wide enough for a log table, never wrapped at 80
        c = Console(stderr=stderr, highlight=False, width=200)
    return c


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

    def open(self, *, create: bool = False) -> Any:
        if self._store is None:
            import ckstore

            self._store = ckstore.open(self.require_location(), catalog=self.catalog, run=self.run, create=create)
        return self._store


pass_ctx = click.make_pass_decorator(Ctx)


def handle_errors(fn: F) -> F:
    """Turn ckstore errors into a one-line message and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CkstoreError as e:
            err_console.print(f"[bold red]error:[/] {type(e).__name__}: {e}", soft_wrap=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


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
