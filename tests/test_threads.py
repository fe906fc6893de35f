"""The worker threads kept across calls (``ckstore/_threads.py``): a call's task group behaves as a
pool of its own would at its end, and a forked process gets threads of its own."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from ckstore._threads import TaskGroup


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
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[int] = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == 42
