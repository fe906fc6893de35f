"""Worker threads kept across calls: a commit or a checkout of a small state would otherwise
spend more time starting its threads than using them (a checkout of
5 MB started four threads, ~2.5 ms of its 13 ms under a profiler).

:class:`TaskGroup` is one call's view of a process-wide pool (one per purpose and size, started
on first use): it submits to the pool and, when the call leaves it, cancels the call's tasks that
have not started and waits for those running, as leaving a ``ThreadPoolExecutor`` of its own
would (so no task of a failed call outlives it, writing into buffers it handed back). Tasks must
not wait on other tasks of the same pool. A process forked from one that had started a pool
starts its own (the parent's threads do not exist in the child).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any, TypeVar

__all__ = ["TaskGroup"]

T = TypeVar("T")

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

