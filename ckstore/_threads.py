"""Worker threads kept across calls: a commit or a checkout of a small state would otherwise
spend more time starting its threads than using them (a checkout of
5 MB started four threads, ~2.5 ms of its 13 ms under a profiler).

:class:`TaskGroup` is one call's view of a process-wide pool (one per purpose and size, started
on first use): it submits to the pool and, when the call leaves it, cancels the call's tasks that
have not started and waits for those running, as leaving a ``ThreadPoolExecutor`` of its own
would (so no task of a failed call outlives it, writing into buffers it handed back). Tasks must
not wait on other tasks of the same pool. A process forked from one that had started a pool
starts its own (the parent's threads do not exist in the child).

:func:`every` calls a function at an interval from one process-wide timer thread, for periodic
work a call keeps up while it runs (a commit's lease): starting and joining a thread of its own
cost a small commit ~0.3 ms.

:func:`default_workers` is how many threads a store object takes when it is not told: twice the
cores the process may run on, or twice its share where ranks of a job share them.

:class:`Outcome` is how work a background thread does for a caller ends: an asynchronous
commit's :class:`~ckstore.commit.pending.PendingCommit`, a background gc's
:class:`~ckstore.maintenance.background.PendingGc`.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any, Generic, TypeVar

__all__ = ["Outcome", "Outcomes", "TaskGroup", "Ticking", "default_workers", "every", "usable_cores"]

T = TypeVar("T")

#: where launchers say how many processes of the job run on this machine: torchrun, DeepSpeed's
#: launcher, Open MPI, MPICH and Intel MPI (the first that holds a positive integer counts)
_LOCAL_PROCESSES_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity, where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers() -> int:
    """The threads a store object uses when it is not told: see :func:`_workers_for`."""
    cores = usable_cores()
    return _workers_for(cores, os.cpu_count() or cores, os.environ)


def _workers_for(cores: int, machine_cores: int, environ: Mapping[str, str]) -> int:
    """The threads a store object uses for hashing, zstd and reads when it is not told: all
    release the GIL, and reads wait on the disk or network, so twice the cores keep both busy
    (4 to 16). ``cores``: the CPUs this process may run on; ``machine_cores``: the machine's.

    When a launcher says that several processes of the job run on this machine
    (:data:`_LOCAL_PROCESSES_ENV`) and they share these cores (together they would have more of
    them than the machine has; not each pinned to its own), each takes twice its share, at
    least 2: with four threads each, two ranks on two cores committing 96 MiB back to back took
    1.6x as long for the median commit as with two, and checked out from the page cache 3-10%
    faster (docs/benchmarks.md, "Threads per rank")."""
    local = 1
    for name in _LOCAL_PROCESSES_ENV:
        value = environ.get(name, "").strip()
        if value.isascii() and value.isdigit() and int(value) > 0:
            local = int(value)
            break
    if local > 1 and cores * local > machine_cores:
        return max(2, min(16, 2 * cores // local))
    return max(4, min(16, 2 * cores))


_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pid = os.getpid()
_lock = threading.Lock()


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    global _pid
    with _lock:
        if os.getpid() != _pid:  # a forked child: the parent's threads are not here
            _pools.clear()
            _pid = os.getpid()
        pool = _pools.get((name, workers))
        if pool is None:
            pool = _pools[name, workers] = ThreadPoolExecutor(workers, thread_name_prefix=f"ckstore-{name}")
        return pool


class TaskGroup(Executor):
    """The tasks one call runs on the shared ``name`` pool of ``workers`` threads."""

    def __init__(self, name: str, workers: int) -> None:
        self._pool = _pool(name, max(1, workers))
        self._pending: set[Future[Any]] = set()  # done tasks leave it: their results are not kept

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        fut = self._pool.submit(fn, *args, **kwargs)
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """End the call's use of the pool (the pool's threads stay for the next call): cancel
        the tasks not started when ``cancel_futures``, then wait for the rest when ``wait``."""
        left = self._pending.copy()  # (one C call: atomic against the done-callbacks)
        if cancel_futures:
            for fut in left:
                fut.cancel()
        if wait:
            wait_for(left)

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True, cancel_futures=exc[0] is not None)



class Outcome(Generic[T]):
    """The end of work a background thread does for a caller (an asynchronous commit, a gc):
    ``wait()`` returns its result or raises its error. Its owner raises a failure ``wait()`` did
    not raise from a later call (:meth:`unreported`), so that none goes unseen."""

    def __init__(self, what: str, started: float | None = None) -> None:
        self.what = what  # "commit of run 'exp', step 3", "gc of every run"
        #: from the call to the end of the work (None while in flight)
        self.seconds: float | None = None
        self._started = time.perf_counter() if started is None else started
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._reported = False

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else ("failed" if self._error else "done")
        return f"{type(self).__name__}({self.what}, {state})"

    def done(self) -> bool:
        """Whether the work has finished (successfully or not); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> T:
        """Wait for the work; its result, or its error raised here."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.what} is still in flight after {timeout}s")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._result is not None
        return self._result

    def join(self) -> None:
        """Wait for the work to end; raises nothing (see :meth:`wait`)."""
        self._done.wait()

    def finish(self, result: T | None, error: BaseException | None) -> None:
        """Record the work's result or error (from the thread that did it)."""
        self._result, self._error = result, error
        self.seconds = time.perf_counter() - self._started
        self._done.set()

    def unreported(self) -> BaseException | None:
        """The work's error, if it failed and no one raised it yet."""
        return self._error if self._done.is_set() and not self._reported else None

    def mark_reported(self) -> None:
        self._reported = True


class Outcomes(Generic[T]):
    """The outcomes an owner's background work owes its caller: those in flight, and failures
    no one raised yet. ``note`` (with ``{what}``) is added to a failure raised by a later call."""

    def __init__(self, note: str) -> None:
        self._note = note
        self._lock = threading.Lock()
        self._items: list[Outcome[T]] = []

    def add(self, outcome: Outcome[T]) -> None:
        with self._lock:
            self._items.append(outcome)

    def in_flight(self) -> list[Outcome[T]]:
        with self._lock:
            return [o for o in self._items if not o.done()]

    def failed(self) -> list[tuple[Outcome[T], BaseException]]:
        """Failures no one raised yet (left so)."""
        with self._lock:
            return [(o, e) for o in self._items if (e := o.unreported()) is not None]

    def raise_failed(self) -> None:
        """Raise the first failure no one raised yet; the others count as raised with it."""
        with self._lock:
            failed = [(o, e) for o in self._items if (e := o.unreported()) is not None]
            self._items = [o for o in self._items if not o.done()]
        if failed:
            o, e = failed[0]
            for q, _ in failed:
                q.mark_reported()
            e.add_note(self._note.format(what=o.what))
            raise e

    def wait(self) -> None:
        """Wait for every outcome in flight; raise the first failure no one raised yet."""
        for o in self.in_flight():
            o.join()
        self.raise_failed()


class Ticking:
    """A function :func:`every` calls at an interval, until :meth:`stop`."""

    def __init__(self, fn: Callable[[], bool | None], interval: float) -> None:
        self._fn, self.interval = fn, interval
        self._lock = threading.Lock()  # held while the function runs
        self.stopped = False

    def stop(self) -> None:
        """No call starts after this returns, and one running when it was called has ended."""
        with self._lock:
            self.stopped = True

    def _tick(self) -> bool:
        """Run the function once; whether it should run again."""
        with self._lock:
            if self.stopped:
                return False
            try:
                again = self._fn()
            except Exception:  # noqa: BLE001 - the function's own business; the timer goes on
                again = True
            if again is False:
                self.stopped = True
            return not self.stopped


_due: list[tuple[float, int, Ticking]] = []  # (when, order, ticking), a heap
_order = itertools.count()
_wake = threading.Condition(threading.Lock())
_timer_started = False


def _forget_timer() -> None:
    """In a forked child: the parent's timer thread and what it was to call are not here (and
    its lock may have been held by a thread that does not exist here either)."""
    global _wake, _timer_started
    _due.clear()
    _wake = threading.Condition(threading.Lock())
    _timer_started = False


os.register_at_fork(after_in_child=_forget_timer)


def every(interval: float, fn: Callable[[], bool | None]) -> Ticking:
    """Call ``fn`` every ``interval`` seconds, the first time one interval from now, until the
    returned :class:`Ticking` is stopped or ``fn`` returns False. Calls run on one process-wide
    daemon thread, one at a time: ``fn`` must be short (an exception it raises is dropped and the
    calls go on)."""
    global _timer_started
    ticking = Ticking(fn, interval)
    with _wake:
        if not _timer_started:
            _timer_started = True
            threading.Thread(target=_run_timer, name="ckstore-timer", daemon=True).start()
        heapq.heappush(_due, (time.monotonic() + interval, next(_order), ticking))
        _wake.notify()
    return ticking


def _run_timer() -> None:
    wake = _wake  # (a forked child makes its own)
    while True:
        with wake:
            while True:
                while _due and _due[0][2].stopped:  # stopped ones leave when they reach the top
                    heapq.heappop(_due)
                now = time.monotonic()
                if _due and _due[0][0] <= now:
                    _, _, ticking = heapq.heappop(_due)
                    break
                wake.wait(_due[0][0] - now if _due else None)
        if ticking._tick():
            with wake:
                heapq.heappush(_due, (time.monotonic() + ticking.interval, next(_order), ticking))
