"""The worker threads kept across calls (``ckstore/_threads.py``): a call's task group behaves as a
pool of its own would at its end, a forked process gets threads of its own, and the process's
timer calls each function at its interval until it is stopped."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable

import pytest

from ckstore._threads import TaskGroup, every


def test_a_failed_call_cancels_its_unstarted_tasks_and_waits_for_its_running_one() -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def hold() -> None:
        started.set()
        release.wait()
        ran.append(0)

    with pytest.raises(RuntimeError, match="the call failed"), TaskGroup("test-cancel", 1) as group:
        first = group.submit(hold)
        later = [group.submit(ran.append, i) for i in range(1, 4)]
        # the running task may end only once leaving the group has cancelled the others: the
        # group then waits for it
        later[-1].add_done_callback(lambda _: release.set())
        assert started.wait(30)
        raise RuntimeError("the call failed")
    assert first.done() and not first.cancelled() and ran == [0]  # waited for, not abandoned
    assert all(f.cancelled() for f in later)  # never started

    # the pool's thread is still there for the next call
    with TaskGroup("test-cancel", 1) as group:
        assert group.submit(lambda: 7).result() == 7


def test_a_successful_call_keeps_no_result_of_its_finished_tasks() -> None:
    with TaskGroup("test-results", 2) as group:
        futures = [group.submit(bytes, 1024) for _ in range(50)]
        for f in futures:
            f.result()
        assert not group._pending  # done tasks left the group: their results are not held by it


def _in_child(queue: multiprocessing.Queue[int]) -> None:
    with TaskGroup("test-fork", 1) as group:
        queue.put(group.submit(lambda: 41 + 1).result(timeout=30))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_process_starts_threads_of_its_own() -> None:
    with TaskGroup("test-fork", 1) as group:  # the parent's pool has its thread running
        assert group.submit(lambda: 1).result() == 1
    assert _forked(_in_child) == 42


def _forked(target: Callable[[multiprocessing.Queue[int]], None]) -> int:
    """Run ``target`` in a forked child; what it put in the queue."""
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[int] = ctx.Queue()
    child = ctx.Process(target=target, args=(queue,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    return queue.get(timeout=5)


def test_the_timer_calls_until_stopped_or_told_no_more() -> None:
    calls = {"a": 0, "b": 0, "c": 0, "bad": 0}
    ticked = {k: threading.Event() for k in calls}

    def counter(name: str, stop_after: int | None = None) -> Callable[[], bool]:
        def fn() -> bool:
            calls[name] += 1
            if calls[name] >= 3:
                ticked[name].set()
            if name == "bad":
                raise RuntimeError("a failing call does not stop the timer")
            return stop_after is None or calls[name] < stop_after

        return fn

    a = every(0.005, counter("a"))
    b = every(0.005, counter("b", stop_after=3))
    bad = every(0.005, counter("bad"))
    assert ticked["a"].wait(60) and ticked["b"].wait(60) and ticked["bad"].wait(60)
    a.stop()
    seen_a = calls["a"]
    # calls run one at a time on one thread, in order of when they are due: once a function
    # started after the stop has been called three times, a call of the stopped one would have
    # come first
    c = every(0.005, counter("c"))
    assert ticked["c"].wait(60)
    c.stop()
    bad.stop()
    assert calls["a"] == seen_a
    assert calls["b"] == 3 and b.stopped  # it said no more after its third call
    assert calls["bad"] >= 3


def _timer_in_child(queue: multiprocessing.Queue[int]) -> None:
    done = threading.Event()
    every(0.005, lambda: done.set() or False)
    queue.put(1 if done.wait(30) else 0)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_process_starts_a_timer_of_its_own() -> None:
    started = threading.Event()
    parent = every(0.005, lambda: started.set() or False)
    assert started.wait(60) and parent.stopped  # the parent's timer thread is running
    assert _forked(_timer_in_child) == 1
