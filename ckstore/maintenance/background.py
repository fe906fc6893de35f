"""gc in the background: ``Store.gc(blocking=False)``.

A training loop that applies its retention policy every N steps need not stop for it: the call
returns a :class:`PendingGc` at once and a thread of the store's own runs the collection, as
checkpoint managers that delete old checkpoints in the background do. gc is safe while commits
run, from this process or any other (``docs/format.md``, "Garbage collection and concurrency"),
so the commits that follow go on meanwhile; most of a collection is deleting files (on ext4 about
a millisecond per pack) and listing the store, time the training thread no longer waits for.

Requests run one after another, in the order made, on one thread per store (started when a
request comes and gone when none is left; a ``progress`` callback is called on it). A request
made while an identical one waits to start (same arguments) returns that one: it reads the
catalog when it starts, so it drops whatever the later request would have. Errors never vanish: a failed collection raises from its
:meth:`PendingGc.wait`, and, until raised once, from the store's next ``gc``, ``wait`` and
``close``. The thread is not a daemon: at interpreter exit Python waits for the collection
running, and an interrupted one (a killed process) leaves what any interrupted gc leaves, objects
its next run deletes.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from .._threads import Outcome, Outcomes
from .gc import GcReport

__all__ = ["BackgroundGc", "PendingGc"]


class PendingGc(Outcome[GcReport]):
    """A gc running in the background. ``wait()`` returns its report or raises its error;
    ``seconds`` runs from the request to the end of the collection."""


class BackgroundGc:
    """A store's background collections: a queue, the thread that runs it, error reporting."""

    def __init__(self, collect: Callable[..., GcReport], name: str) -> None:
        self._collect = collect
        self._name = name
        self._lock = threading.Lock()
        self._queue: deque[tuple[tuple[Any, ...], dict[str, Any], PendingGc]] = deque()
        # requested, and failed ones not yet raised
        self._pending: Outcomes[GcReport] = Outcomes("(raised by a later call: this background {what} failed)")
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def submit(self, what: str, **kwargs: Any) -> PendingGc:
        """Queue a collection with ``kwargs`` (those of ``Store.gc``); raises an earlier
        collection's failure not yet raised instead."""
        self.raise_failed()
        key = tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))
        with self._lock:
            if self._queue and _same(self._queue[-1][0], key):
                return self._queue[-1][2]
            pending = PendingGc(what)
            self._queue.append((key, kwargs, pending))
            self._pending.add(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"ckstore-gc {self._name}")
                self._thread.start()
        return pending

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                _, kwargs, pending = self._queue.popleft()
            try:
                report = self._collect(**kwargs)
            except BaseException as e:  # raised by wait(), or by the store's next call
                pending.finish(None, e)
            else:
                pending.finish(report, None)

    def _forget_if_forked(self) -> None:
        """In a forked child (a DataLoader worker, say) the parent's collections, thread and lock
        are not its own: it starts afresh (its parent waits for them)."""
        if os.getpid() != self._pid:
            self.__init__(self._collect, self._name)  # type: ignore[misc]

    def raise_failed(self) -> None:
        """Raise the first failure of an earlier collection not yet raised anywhere."""
        self._forget_if_forked()
        self._pending.raise_failed()

    def wait(self) -> None:
        """Wait for every collection requested; raise the first failure not yet raised."""
        self._forget_if_forked()
        self._pending.wait()


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an argument whose comparison fails is never the same request
        return False
