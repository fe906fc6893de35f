"""Shared benchmark helpers: timing, peak-memory sampling, cache dropping, tables."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


@dataclass
class Measure:
    seconds: float = 0.0
    peak_extra: int = 0  # peak RSS above the RSS when the measurement started
    extra: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def measure() -> Iterator[Measure]:
    """Time a block and sample its peak resident memory every 2 ms."""
    m = Measure()
    base = rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            stop.wait(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    try:
        yield m
    finally:
        m.seconds = time.perf_counter() - start
        stop.set()
        t.join()
        m.peak_extra = max(0, max(peak[0], rss()) - base)


def drop_caches() -> bool:
    """Drop the page cache so reads come from disk (needs root); False when not possible."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_path(path: str) -> None:
    """fsync a file, or every file under a folder, and the folders themselves."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] + [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| "
        + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        + " |"
        for r in rows
    ]
    return "\n".join([line, sep, *body])
