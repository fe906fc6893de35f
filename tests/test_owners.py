"""Who owns a commit in flight, with real processes: a reused pid, a lease that runs out, and
stores created by several processes at once.

docs/backends.md ("PostgreSQL catalogs") and docs/format.md ("A live commit is never abandoned"):
a pending checkpoint belongs to ``host:pid:start:nonce``; on the same host it is live while that
pid runs *with the same start time*; a lease not renewed in time gives the step up to the next
commit; ``init`` writes the store's settings with a conditional put, so racing creators agree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance import StoreSpec
from conformance.store import mp_context
from helpers import assert_same
from services import S3Server

import ckstore
from ckstore.catalog import Owner, utcnow
from ckstore.errors import AlreadyExistsError, CommitInProgressError, StoreConfigError

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _start_time(pid: int) -> str:
    """A process's start time, as the kernel reports it (field 22 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[19].decode()


def _w(x: float) -> dict[int, dict[str, Any]]:
    return {0: {"m": {"w": torch.full((1000,), x)}}}


def _pending(store: ckstore.Store) -> list[tuple[str, int]]:
    return sorted((run, step) for _, run, step, _, _ in store.catalog.pending())


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="process start times come from /proc (Linux)")
def test_a_pending_row_whose_pid_now_belongs_to_another_process_is_abandoned(tmp_path: Path) -> None:
    s = ckstore.open(tmp_path / "s", run="r")
    # a process records its real identity and exits
    out = subprocess.run(
        [sys.executable, "-c", "from ckstore.catalog import Owner; print(Owner.me())"],
        env=_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    dead = Owner.parse(out.stdout.strip())
    # another process runs now; give it the dead one's pid, as the kernel may on reuse
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        live_start = _start_time(live.pid)
        assert dead.start != live_start and dead.pid != live.pid
        layout = ckstore.WorldLayout.flat(1)

        def claim(step: int, owner: Owner) -> None:
            s.catalog.begin_checkpoint(
                "r", step, kind="checkpoint", replace=False, owner=owner, world_layout=layout, lease_seconds=60
            )

        # step 5: the live process as it is (its pid and its start time): a commit in flight
        claim(5, Owner(dead.host, live.pid, live_start, dead.nonce))
        # step 6: the dead process's start time under the pid the live one holds: pid reuse
        claim(6, Owner(dead.host, live.pid, dead.start, dead.nonce))
        assert _pending(s) == [("r", 5), ("r", 6)]

        with pytest.raises(CommitInProgressError, match=rf"process {live.pid} on "):
            s.commit(5, _w(5.0))
        assert s.commit(6, _w(6.0)).step == 6  # taken over: the owner is gone
        assert _pending(s) == [("r", 5)]
        assert s.gc(grace=0).reaped == ()  # gc agrees: step 5's owner is alive
    finally:
        live.kill()
        live.wait()
    (reaped,) = s.gc(grace=0).reaped  # and once it is gone, gc reaps its row
    assert (reaped.step, "is gone" in reaped.why) == (5, True)
    assert [c.step for c in s.checkpoints()] == [6]
    assert_same(s.checkout(6), _w(6.0))
    assert s.fsck(deep=True).ok


def test_a_forked_child_owns_its_commits_as_itself_not_as_its_parent() -> None:
    """The owner's start time is read once per process: a forked child (a DataLoader worker that
    commits, say) reads its own, or its pending rows would look like its parent's."""
    from ckstore.catalog._owner import _proc_start

    parent = Owner.me()
    assert Owner.me().start == parent.start == _proc_start(os.getpid())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its owner, as Owner.me() builds it, and its start time from /proc
        try:
            os.write(write, f"{Owner.me()} {_proc_start(os.getpid())}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        got = f.read().decode()
    os.waitpid(pid, 0)
    owner, start = got.split()
    child = Owner.parse(owner)
    assert child.pid == pid != parent.pid
    assert child.start == start  # its own start time, not the cached parent's


def test_a_lease_not_renewed_in_time_is_taken_over_by_the_next_commit(tmp_path: Path) -> None:
    """A committer frozen with SIGSTOP mid-write stops heartbeating; once its 2 s lease has run
    out the next commit of the step takes it over; thawed, the frozen one finds its claim gone."""
    path = tmp_path / "s"
    s = ckstore.open(path, run="r", chunk_size=64 * 1024, lease_seconds=2.0)
    s.commit(1, _w(1.0))
    script = f"""
import sys, torch, ckstore
s = ckstore.open({str(path)!r}, run="r")
def progress(done, total, first=[True]):
    if first[0]:
        first[0] = False
        print("writing", flush=True)
        sys.stdin.readline()
try:
    s.commit(2, {{0: {{"m": {{"w": torch.full((200_000,), 7.0)}}}}}}, progress=progress)
    print("committed", flush=True)
except ckstore.CkstoreError as e:
    print(type(e).__name__, flush=True)
"""
    child = subprocess.Popen([sys.executable, "-c", script], env=_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "writing", child.stderr.read() if child.stderr else ""
        assert _pending(s) == [("r", 2)]
        # alive and heartbeating (every 0.5 s): its step is not to be had
        with pytest.raises(CommitInProgressError, match="being committed right now"):
            s.commit(2, _w(2.0))
        os.kill(child.pid, signal.SIGSTOP)
        try:
            # wait for the lease to run out: the row's last heartbeat, read from the catalog
            deadline = time.monotonic() + 120  # a guard only
            while True:
                ((_, _, _, _, beat),) = s.catalog.pending()
                if (utcnow() - beat).total_seconds() > 2.5:
                    break
                assert time.monotonic() < deadline, "the frozen committer's heartbeat kept advancing"
                time.sleep(0.1)
            ck = s.commit(2, _w(2.0))  # the lease ran out: taken over
            assert ck.step == 2
        finally:
            os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert out.strip() == "CommitAbandonedError"  # it stopped, and nothing of it became visible
    assert [c.step for c in s.checkpoints()] == [1, 2]
    assert_same(s.checkout(2), _w(2.0))
    assert _pending(s) == []
    s.gc(grace=0)
    rep = s.fsck(deep=True)
    assert rep.ok and not rep.orphans and not rep.pending and rep.unreferenced_chunks == 0


# -- racing creators ------------------------------------------------------------------------------
_barrier: Any = None


def _init_racer(barrier: Any) -> None:
    global _barrier
    _barrier = barrier


def _create(spec: StoreSpec, chunk_size: int, exclusive: bool) -> tuple[str, str]:
    _barrier.wait(120)
    try:
        if exclusive:
            store = ckstore.init(spec.location, catalog=spec.catalog, storage_options=spec.storage_options,
                                 chunk_size=chunk_size)  # fmt: skip
        else:
            store = ckstore.open(spec.location, catalog=spec.catalog, storage_options=spec.storage_options,
                                 chunk_size=chunk_size)  # fmt: skip
    except ckstore.CkstoreError as e:
        return type(e).__name__, str(e)
    store.close()
    return "ok", str(store.config.chunk_size)


def _race(spec: StoreSpec, sizes: list[int], exclusive: bool) -> list[tuple[str, str]]:
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp_context()
    barrier = ctx.Barrier(len(sizes))
    with ProcessPoolExecutor(len(sizes), mp_context=ctx, initializer=_init_racer, initargs=(barrier,)) as pool:
        return list(pool.map(_create, [spec] * len(sizes), sizes, [exclusive] * len(sizes)))


def _racing_inits(spec: StoreSpec) -> None:
    sizes = [64 * 1024, 128 * 1024, 256 * 1024]
    # open(create=True) with different settings: one creates the store, the others find it and
    # refuse their own settings (they are fixed at creation) with an error naming the winner's
    got = _race(spec, sizes, exclusive=False)
    won = [i for i, (what, _) in enumerate(got) if what == "ok"]
    assert len(won) == 1, got
    winner = sizes[won[0]]
    for i, (what, msg) in enumerate(got):
        if i != won[0]:
            assert what == StoreConfigError.__name__, got
            assert f"was created with chunk_size={winner}" in msg, msg
    with spec.open(chunk_size=None, pack_size=None) as store:
        assert store.config.chunk_size == winner
        store.commit(1, _w(1.0))
        assert_same(store.checkout(1), _w(1.0))
    # init (exclusive) of an existing store: every racer is told it exists, none changes it
    got = _race(spec, sizes, exclusive=True)
    assert [what for what, _ in got] == [AlreadyExistsError.__name__] * len(sizes), got
    with spec.open(chunk_size=None, pack_size=None) as store:
        assert store.config.chunk_size == winner and [c.step for c in store.checkpoints()] == [1]


def _racing_exclusive_inits(spec: StoreSpec) -> None:
    sizes = [64 * 1024] * 3
    got = _race(spec, sizes, exclusive=True)
    assert sorted(what for what, _ in got) == [AlreadyExistsError.__name__] * 2 + ["ok"], got
    assert all("already exists" in msg for what, msg in got if what != "ok")


def test_racing_creators_of_a_local_store(tmp_path: Path) -> None:
    _racing_inits(StoreSpec(str(tmp_path / "a")))
    _racing_exclusive_inits(StoreSpec(str(tmp_path / "b")))


@pytest.mark.postgres
@pytest.mark.s3
def test_racing_creators_of_an_s3_store_with_a_postgres_catalog(
    s3_server: S3Server, pg_catalog_url: str
) -> None:
    bucket = s3_server.make_bucket()
    _racing_inits(StoreSpec(f"s3://{bucket}/a", pg_catalog_url, s3_server.storage_options()))
