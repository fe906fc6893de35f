"""Asynchronous commits: the commit protocol with staging split from the rest.

``Store.commit(..., blocking=False)`` runs the protocol's first phase (:meth:`~ckstore.commit.
protocol.StagedCommit.stage`: check, flatten, copy every tensor into a reusable host buffer) in
the caller's thread and returns a :class:`PendingCommit`; one background thread per store then
runs the remaining phases (hash, plan, write, finish) of each staged commit, in the order they
were made. The caller may change its tensors as soon as ``commit`` returns.

Memory: each in-flight commit owns one :class:`~ckstore.format.tensorio.StagingBuffer`, as large
as the largest state it staged (its tensors' bytes, each rounded up to 64 bytes). At most
``max_inflight`` commits are in flight (staged and not yet finished), so staging holds at most
``max_inflight`` times the state's size; a further ``commit`` waits for a slot. Buffers are
made as commits first need them and reused across commits, never allocated per checkpoint;
:meth:`AsyncCommits.close` (``Store.close``) lets them go. A failed commit keeps neither the
caller's tensors nor its buffer alive through its error.

Errors never vanish: a failed commit raises from its :meth:`PendingCommit.wait`, and, until it was
raised once, from the store's next ``commit``, :meth:`AsyncCommits.wait` (``Store.wait``) and
``close``; at interpreter exit an ``atexit`` handler waits for commits still in flight, saying
which, and prints any failure. A failed commit is aborted by the protocol: nothing of it becomes
visible.

In a torch.distributed job every rank commits asynchronously alike; the background phases run
their collectives on a gloo process group of their own (created once per store and group, as
DCP's ``async_save`` does), so they never interleave with the training's collectives.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._threads import Outcome, Outcomes
from ..errors import CkstoreError
from ..format.tensorio import StagingBuffer
from ..records import Checkpoint
from .protocol import StagedCommit

__all__ = ["PendingCommit", "AsyncCommits"]


class PendingCommit(Outcome[Checkpoint]):
    """A commit running in the background. ``wait()`` returns its checkpoint or raises its error;
    ``seconds`` runs from the call to the checkpoint becoming visible."""

    def __init__(self, what: str, blocked_seconds: float) -> None:
        super().__init__(what, started=time.perf_counter() - blocked_seconds)
        #: how long ``commit`` blocked the caller (staging included)
        self.blocked_seconds = blocked_seconds


class AsyncCommits:
    """A store's asynchronous commits: staging slots, the background thread, error reporting."""

    def __init__(self, max_inflight: int = 1) -> None:
        if not isinstance(max_inflight, int) or isinstance(max_inflight, bool) or max_inflight < 1:
            raise CkstoreError(f"max_inflight must be an int of at least 1, got {max_inflight!r}")
        self.max_inflight = max_inflight
        self._slots = threading.Semaphore(max_inflight)  # one per commit in flight
        self._buffers: list[StagingBuffer] = []  # every buffer made, each at most max_inflight
        self._free: list[StagingBuffer] = []  # those no commit in flight holds
        self._jobs: queue.SimpleQueue[tuple[StagedCommit, StagingBuffer, PendingCommit] | None] = queue.SimpleQueue()
        self._pending: Outcomes[Checkpoint] = Outcomes(
            "(raised by a later call: this asynchronous {what} failed; nothing of it became visible)"
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._groups: dict[Any, Any] = {}  # the checkpoint's own gloo group, per training group
        self._exit_hook: Callable[[], None] | None = None

    @property
    def staging_bytes(self) -> int:
        """Host memory the staging buffers hold now."""
        return sum(b.nbytes for b in self._buffers)

    def in_flight(self) -> list[Outcome[Checkpoint]]:
        return self._pending.in_flight()

    def raise_failed(self) -> None:
        """Raise the first failure of an earlier commit not yet raised anywhere."""
        self._pending.raise_failed()

    def wait(self) -> None:
        """Wait for every commit in flight; raise the first failure not yet raised."""
        self._pending.wait()

    def background_group(self, process_group: Any) -> Any:
        """The gloo group the background phases of a collective commit over ``process_group``
        use (None outside a distributed job); created once, on every rank alike."""
        from .collective import active_group

        group = active_group(process_group)
        if group is None:
            return None
        own = self._groups.get(group)
        if own is None:
            import torch.distributed as dist

            if group is dist.group.WORLD:
                own = dist.new_group(backend="gloo")
            else:
                own = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
            self._groups[group] = own
        return own

    def submit(self, start: Callable[[StagingBuffer], StagedCommit]) -> PendingCommit:
        """Take a staging slot (waiting for one), stage with ``start`` in this thread, and hand the
        staged commit to the background thread."""
        self.raise_failed()
        t0 = time.perf_counter()
        self._slots.acquire()
        buf = None
        try:
            self.raise_failed()  # a commit that failed while this one waited for its slot
            with self._lock:  # the buffer last handed back (it holds the latest state: see stage="changed")
                buf = self._free.pop() if self._free else None
                if buf is None:  # made when first needed: max_inflight bounds them, it allocates none
                    buf = StagingBuffer()
                    self._buffers.append(buf)
            job = start(buf)
        except BaseException:
            self._release(buf)
            raise
        pending = PendingCommit(job.what, time.perf_counter() - t0)
        self._pending.add(pending)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckstore-async-commit", daemon=True)
                self._thread.start()
                self._exit_hook = _exit_hook(weakref.ref(self))
                _register_exit(self._exit_hook)
        self._jobs.put((job, buf, pending))
        return pending

    def close(self) -> None:
        """Wait for every commit in flight, stop the background thread, raise a failure not yet
        raised."""
        try:
            self.wait()
        finally:
            with self._lock:
                thread, self._thread = self._thread, None
                hook, self._exit_hook = self._exit_hook, None
            if thread is not None:
                self._jobs.put(None)
                thread.join()
            if hook is not None:
                atexit.unregister(hook)  # (a hook run by threading is a no-op once closed)
            with self._lock:  # the staging memory goes with the store (pinned memory, where CUDA is)
                self._buffers = [b for b in self._buffers if b not in self._free]
                self._free.clear()

    def _release(self, buf: StagingBuffer | None) -> None:
        """Hand a commit's slot back, and its buffer to the next commit."""
        if buf is not None:
            with self._lock:
                self._free.append(buf)
        self._slots.release()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            self._complete(*item)
            del item  # (it would hold the commit, and through it the caller's state, until the next)

    def _complete(self, job: StagedCommit, buf: StagingBuffer, pending: PendingCommit) -> None:
        try:
            ckpt = job.complete()
        except BaseException as e:  # noqa: BLE001 - kept for wait(), the next commit, close()
            # the error's traceback holds the commit: not the caller's tensors nor the staging buffer
            job.entries.clear()
            job.staged.clear()
            pending.finish(None, e)
        else:
            pending.finish(ckpt, None)
        finally:
            self._release(buf)


def _register_exit(hook: Callable[[], None]) -> None:
    # threading's exit hooks run before concurrent.futures stops taking work (and before atexit
    # hooks): the commits still in flight need their thread pools
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(hook)
            return
    except RuntimeError:  # the interpreter is already shutting down
        pass
    atexit.register(hook)


def _exit_hook(ref: weakref.ReferenceType[AsyncCommits]) -> Callable[[], None]:
    def at_exit() -> None:
        commits = ref()
        if commits is None or commits._exit_hook is None:  # gone, or closed
            return
        flying = commits.in_flight()
        if flying:
            names = "; ".join(p.what for p in flying)
            print(f"ckstore: waiting for {len(flying)} checkpoint commit(s) still in flight: {names}", file=sys.stderr)
        for p in flying:
            p.join()
        for p, e in commits._pending.failed():
            print(f"ckstore: the asynchronous {p.what} failed; nothing of it became visible: {e}", file=sys.stderr)

    return at_exit
