"""Garbage collection, deletion, space accounting and fsck, as tests every backend must pass.

What is checked is what the backend holds: pack objects are counted and named through the
store's own blob store (``store.blobs.list``, ``store.blobs.stats``) and catalog rows through its
catalog, so a backend that leaks an object, deletes one too many or disagrees with the catalog
fails here. Stores are tiny: 64 KiB chunks, each checkpoint a few of them.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import catalog_tools
import pytest
import torch
from helpers import assert_same, random_tensor

import ckstore
from ckstore.catalog import Owner, utcnow
from ckstore.format.pack import PACK_HEADER, new_pack_key
from ckstore.layout import WorldLayout
from ckstore.retention import BestN, ByKind, EveryNSteps, KeepAll, LatestN, Tagged, Within

from .store import StoreSpec, assert_consistent

__all__ = ["SMALL", "GcConformance", "chunk_uses", "objects", "open_small", "pack_users", "state"]

#: store settings of these suites: 64 KiB chunks, and packs that close after about one of them
SMALL: dict[str, int] = {"chunk_size": 64 * 1024, "pack_size": 64 * 1024}

#: one chunk (64 KiB of random bits: stored as is), in every checkpoint of :func:`state`
FROZEN = random_tensor(torch.float32, (128, 128), torch.Generator().manual_seed(4321))


def open_small(spec: StoreSpec, run: str | None = "exp") -> ckstore.Store:
    return spec.open(run, **SMALL)


def state(step: int, ranks: int = 1, rows: int = 64) -> dict[int, dict[str, Any]]:
    """Rank states: the shared ``frozen`` chunk, and a ``w`` of each step and rank's own (16 KiB;
    ``rows=256``: a whole chunk, so a pack of its own)."""
    out: dict[int, dict[str, Any]] = {}
    for r in range(ranks):
        own = torch.Generator().manual_seed(1000 * step + r)
        w = random_tensor(torch.float32, (rows, 64), own)
        out[r] = {"model_states": {"frozen": FROZEN, "w": w, "step": step}}
    return out


# -- what the backend holds -----------------------------------------------------------------------
def objects(store: ckstore.Store) -> dict[str, int]:
    """``{key: size}`` of every pack object, as the blob store lists them."""
    return {i.key: i.size for i in store.blobs.list("packs/")}


Use = tuple[str, int, str, str, str, str]  # ref, rank, sub_key, tensor path, chunk hex, pack key


def chunk_uses(store: ckstore.Store) -> set[Use]:
    """Every chunk use of every committed checkpoint, with its pack (from manifests, not fsck)."""
    out: set[Use] = set()
    for ck in store.checkpoints():
        for (rank, sub_key), man in store.manifests(ck).items():
            locs = store.catalog.chunk_locations(man.digests())
            for t in man.tensors:
                for d in t.chunks:
                    out.add((ck.ref, rank, sub_key, t.path, d.hex(), locs[d].pack_key))
    return out


def pack_users(store: ckstore.Store) -> dict[str, set[str]]:
    """``{pack key: refs of the committed checkpoints using a chunk in it}``."""
    users: dict[str, set[str]] = {}
    for ref, *_, key in chunk_uses(store):
        users.setdefault(key, set()).add(ref)
    return users


def only_used_by(store: ckstore.Store, refs: set[str]) -> set[str]:
    """Pack keys whose every chunk only checkpoints in ``refs`` use: what dropping them frees."""
    return {k for k, users in pack_users(store).items() if users <= refs}


def damaged(rep: Any) -> set[tuple[str, int, str, str, str]]:
    """What an fsck report names: ``(ref, rank, sub_key, tensor path, chunk hex)``."""
    return {(d.ref, d.rank, d.sub_key, d.path, d.chunk) for d in rep.damage}


def steps(store: ckstore.Store, run: str = "exp") -> list[int]:
    return [c.step for c in store.checkpoints(run)]


def assert_tidy(store: ckstore.Store) -> None:
    """After a full gc: pack objects and pack rows name the same keys, the trash is empty, every
    chunk row is referenced, and every committed checkpoint's chunks are there."""
    rows = set(catalog_tools.column(store.catalog, "packs", "key"))
    trash = len(store.catalog.trash())
    with store.catalog.snapshot() as survey:
        unreferenced, _ = survey.unreferenced_chunks()
    listed = set(objects(store))
    assert listed == rows, (
        f"objects with no row: {listed - rows}; rows with no object: {rows - listed}"
    )
    assert trash == 0 and unreferenced == 0
    assert_consistent(store)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def pending_commit(store: ckstore.Store, step: int, owner: Owner, heartbeat_age: float = 0) -> str:
    """A commit in flight owned by ``owner`` that wrote one pack object; returns the pack's key."""
    ckpt = store.catalog.begin_checkpoint(
        "exp", step, kind="checkpoint", replace=False, owner=owner,
        world_layout=WorldLayout.flat(1), lease_seconds=60,
    )  # fmt: skip
    key = new_pack_key()
    store.catalog.register_pack(ckpt, owner, key)
    store.blobs.put(key, PACK_HEADER + b"half a pack")
    if heartbeat_age:
        catalog_tools.age_heartbeat(store.catalog, ckpt, heartbeat_age)
    return key


def _dead_owner() -> Owner:
    return Owner(socket.gethostname(), _dead_pid(), "1", os.urandom(4).hex())


class _Died(Exception):
    pass


def killed_commit(store: ckstore.Store, step: int, states: dict[int, dict[str, Any]]) -> None:
    """A commit whose process dies half-way: its pending row is left to a gone owner, with the
    packs it had written (rows and objects) and the references it had claimed; its chunk rows
    would have been recorded once every pack was written."""
    dead = _dead_owner()

    def die(done: int, total: int) -> None:
        if done > total // 2:
            assert catalog_tools.pending_pack_chunks(store.catalog, step) == 0
            catalog_tools.hand_over_pending(store.catalog, step, dead)  # from now on the row is the dead process's
            raise _Died(f"process {dead.pid}")

    with pytest.raises(_Died):
        store.commit(step, states, progress=die)
    assert [(p[2], p[3]) for p in store.catalog.pending()] == [(step, str(dead))]


class GcConformance:
    @pytest.fixture
    def gc_store(self, spec: StoreSpec) -> Iterator[ckstore.Store]:
        s = open_small(spec)
        yield s
        s.close()

    # -- retention policies -----------------------------------------------------------------------
    def test_policies_drop_what_they_release(self, gc_store: ckstore.Store) -> None:
        store = gc_store
        nan = math.nan
        plan: list[tuple[int, dict[str, float], str, tuple[str, ...]]] = [
            (1, {"loss": 0.5}, "epoch", ()),
            (2, {"loss": 0.3}, "checkpoint", ("golden",)),
            (3, {"loss": nan}, "recovery", ()),
            (4, {}, "recovery", ()),
            (5, {"loss": 0.3}, "epoch", ()),  # ties step 2
            (6, {"loss": 0.9}, "recovery", ()),
        ]
        for step, metrics, kind, tags in plan:
            store.commit(step, state(step), metrics, kind=kind, tags=tags)
        store.commit(1, state(101), run="other")
        store.commit(2, state(102), run="other")

        def dropped(policy: Any) -> list[str]:
            return store.gc(policy, run="exp", dry_run=True).dropped

        assert dropped(LatestN(2)) == ["exp@1", "exp@2", "exp@3", "exp@4"]
        best = store.gc(BestN(1, "loss"), run="exp", dry_run=True)
        assert best.dropped == ["exp@1", "exp@2"]  # the tie goes to the newer step
        assert best.runs[0].unranked == ((3, ("loss",)), (4, ("loss",)))
        assert {d.step: d.reasons for d in best.runs[0].kept} == {
            3: ("no loss: best 1 by loss (min) cannot rank it",),
            4: ("no loss: best 1 by loss (min) cannot rank it",),
            5: ("best 1 by loss (min)",),
            6: ("latest",),
        }
        assert dropped(BestN(2, "loss")) == ["exp@1"]  # both of the tied steps
        assert dropped(BestN(2, "loss", "max")) == ["exp@2", "exp@5"]
        assert dropped(Tagged()) == ["exp@1", "exp@3", "exp@4", "exp@5"]
        assert dropped(Tagged(("other-tag",))) == ["exp@1", "exp@2", "exp@3", "exp@4", "exp@5"]
        by_kind = ByKind("recovery", LatestN(1)) | ByKind("epoch", KeepAll())
        assert dropped(by_kind) == ["exp@2", "exp@3", "exp@4"]
        assert dropped(EveryNSteps(2)) == ["exp@1", "exp@3", "exp@5"]
        assert dropped(Within(3600)) == []
        assert dropped(Within(0)) == ["exp@1", "exp@2", "exp@3", "exp@4", "exp@5"]
        assert steps(store) == [1, 2, 3, 4, 5, 6]  # dry runs all

        # each run's stored policy; a run without one keeps everything
        policy = Tagged() | ByKind("recovery", LatestN(1)) | ByKind("epoch", LatestN(1))
        store.set_policy("exp", policy)
        assert store.policy("exp") == policy and store.policy("other") is None
        frees = only_used_by(store, {"exp@1", "exp@3", "exp@4"})
        before = objects(store)
        report = store.gc()
        assert [r.run for r in report.runs] == ["exp", "other"]  # in the order the runs were made
        assert {r.run: (r.source, r.policy) for r in report.runs} == {
            "exp": ("stored", policy.describe()),
            "other": ("none", None),
        }
        assert report.dropped == ["exp@1", "exp@3", "exp@4"]
        assert {d.step: d.reasons for d in report.runs[0].kept} == {
            2: ("tagged golden",),
            5: ("kind epoch: last 1",),
            6: ("latest", "kind recovery: last 1"),
        }
        assert steps(store) == [2, 5, 6] and steps(store, "other") == [1, 2]
        assert frees and set(before) - set(objects(store)) == frees
        kept = {"exp@2": 2, "exp@5": 5, "exp@6": 6, "other@1": 101, "other@2": 102}
        for ref, seed in kept.items():
            assert_same(store.checkout(ref), state(seed))
        assert_tidy(store)
        again = store.gc()
        assert (again.dropped, again.chunks_freed, again.packs_deleted) == ([], 0, 0)

    # -- dry runs -----------------------------------------------------------------------------------
    def test_dry_run_changes_nothing_and_reports_what_gc_then_does(
        self, gc_store: ckstore.Store
    ) -> None:
        store = gc_store
        for step in range(1, 6):
            store.commit(step, state(step), {"loss": 1.0 / step})
        dead_key = pending_commit(store, 9, _dead_owner())
        orphan = "packs/zz/" + os.urandom(16).hex()
        store.blobs.put(orphan, b"o" * 100)
        frees = only_used_by(store, {"exp@1", "exp@2", "exp@3"})
        before, du_before = objects(store), store.du()

        store.blobs.stats.reset()
        dry = store.gc(LatestN(2), grace=0, dry_run=True)
        assert store.blobs.stats.deletes == 0 and store.blobs.stats.writes == 0
        assert objects(store) == before and steps(store) == [1, 2, 3, 4, 5]
        assert [p[2] for p in store.catalog.pending()] == [9] and store.du() == du_before
        assert dry.dry_run and dry.dropped == ["exp@1", "exp@2", "exp@3"]
        assert [r.step for r in dry.reaped] == [9] and dry.orphans_deleted == (orphan,)
        assert dry.chunks_freed == 3 and dry.packs_deleted == len(frees) + 1  # + the dead commit's

        store.blobs.stats.reset()
        real = store.gc(LatestN(2), grace=0)
        assert not real.dry_run and real.runs == dry.runs and real.reaped == dry.reaped
        fields = ("chunks_freed", "chunk_bytes_freed", "packs_deleted", "pack_bytes_freed",
                  "orphans_deleted", "orphan_bytes_freed", "temp_files_deleted", "records_deleted")  # fmt: skip
        assert {f: getattr(real, f) for f in fields} == {f: getattr(dry, f) for f in fields}
        after = objects(store)
        gone = set(before) - set(after)
        assert gone == frees | {dead_key, orphan} and set(after) < set(before)
        assert sum(before[k] for k in gone) == real.bytes_freed
        assert real.orphan_bytes_freed == 100
        # and the records of the three dropped checkpoints
        assert real.records_deleted == 3
        assert store.blobs.stats.deletes == real.packs_deleted + len(real.orphans_deleted) + real.records_deleted
        assert steps(store) == [4, 5] and store.catalog.pending() == []
        for step in (4, 5):
            assert_same(store.checkout(step), state(step))
        assert_tidy(store)

    # -- dedup, deletion, really deleted objects ----------------------------------------------------
    def test_shared_chunks_survive_while_referenced_and_delete(
        self, gc_store: ckstore.Store
    ) -> None:
        store = gc_store
        store.commit(1, state(1), tags=["golden"])
        store.commit(2, state(2))
        store.commit(3, state(3))
        store.commit(1, state(101), run="other")  # shares only the frozen chunk
        everyone = {"exp@1", "exp@2", "exp@3", "other@1"}
        (frozen,) = {k for k, users in pack_users(store).items() if users == everyone}
        assert len(objects(store)) == 5  # the frozen chunk once, and each checkpoint's own

        with pytest.raises(ckstore.ProtectedCheckpointError, match="golden"):
            store.delete(1)
        frees = only_used_by(store, {"exp@2"})
        stored = store.catalog.stored_bytes()
        assert store.delete(2).ref == "exp@2"
        assert steps(store) == [1, 3]
        assert store.catalog.stored_bytes() == stored  # rows go now, bytes at the next gc
        assert set(objects(store)) >= frees and store.du().garbage_bytes > 0
        with pytest.raises(ckstore.CheckpointNotFoundError):
            store.checkout(2)

        store.blobs.stats.reset()
        report = store.gc(grace=0)
        assert (report.dropped, report.chunks_freed, report.packs_deleted) == ([], 1, 1)
        assert len(frees) == 1
        assert report.records_deleted == 1  # exp@2's record
        assert store.blobs.stats.deletes == 1 + 1 and not set(objects(store)) & frees
        assert frozen in objects(store)
        assert_tidy(store)

        assert store.delete("golden", force=True).ref == "exp@1"
        assert store.delete(3).ref == "exp@3"  # a run's latest goes too, when deleted by hand
        store.gc(grace=0)
        assert steps(store) == [] and set(objects(store)) == {frozen} | set(pack_users(store))
        assert frozen in objects(store)  # other@1 still uses it
        assert_same(store.checkout("other@1"), state(101))
        assert_tidy(store)

        store.delete("other@1")
        report = store.gc(grace=0)
        assert report.chunks_freed == 2 and objects(store) == {}  # nothing left in the blob store
        assert store.catalog.stored_bytes() == 0
        assert_tidy(store)

    # -- abandoned commits and orphans ----------------------------------------------------------------
    def test_orphans_and_abandoned_commits_are_cleaned(self, gc_store: ckstore.Store) -> None:
        store = gc_store
        store.commit(1, state(1))
        committed = set(objects(store))
        killed_commit(store, 5, state(5, ranks=4, rows=256))
        assert len(objects(store)) > len(committed)  # what it wrote before it died
        dead_key = pending_commit(store, 2, _dead_owner())
        remote = Owner("elsewhere.invalid", 7, "1", "remote")
        remote_key = pending_commit(store, 3, remote, heartbeat_age=5)
        live = Owner.me()
        live_key = pending_commit(store, 4, live)
        orphan = "packs/zz/" + os.urandom(16).hex()
        store.blobs.put(orphan, os.urandom(300))

        # the default grace: the remote commit may still be alive, and the orphan is new
        kept = store.gc()
        assert sorted(r.step for r in kept.reaped) == [2, 5]
        assert all("is gone" in r.why for r in kept.reaped)
        assert kept.orphans_deleted == () and kept.packs_deleted >= 2  # the dead commits' packs
        assert dead_key not in objects(store)
        assert set(objects(store)) == committed | {remote_key, live_key, orphan}

        report = store.gc(grace=0)
        assert [(r.step, r.owner) for r in report.reaped] == [(3, str(remote))]
        assert "no heartbeat" in report.reaped[0].why
        assert report.orphans_deleted == (orphan,) and report.orphan_bytes_freed == 300
        assert set(objects(store)) == committed | {live_key}  # a live commit's pack is no garbage
        assert [p[2] for p in store.catalog.pending()] == [4]

        store.catalog.abort_checkpoint(store.catalog.pending()[0][0], live)
        assert store.gc(grace=0).packs_deleted == 1
        assert set(objects(store)) == committed
        assert_same(store.checkout(1), state(1))
        assert_tidy(store)

    # -- a gc killed half-way -----------------------------------------------------------------------
    def test_next_gc_finishes_what_an_interrupted_one_left(self, gc_store: ckstore.Store) -> None:
        store = gc_store
        for step in (1, 2, 3):
            store.commit(step, state(step))
        frees = only_used_by(store, {"exp@2"})
        sizes = objects(store)
        store.delete(2)
        with store.catalog.gc_transaction() as txn:  # killed after its sweep
            swept = txn.sweep(utcnow())
        assert swept.chunks == 1 and set(swept.trashed) == frees and set(objects(store)) == set(sizes)
        rep = store.fsck()
        assert rep.ok and rep.trash == len(frees) and rep.unreferenced_chunks == 0
        assert rep.orphans == ()

        # and killed again after deleting the first object, before forgetting its trash row
        first = min(frees)
        store.blobs.delete([first])
        store.blobs.stats.reset()
        report = store.gc(grace=0)
        assert report.chunks_freed == 0 and report.packs_deleted == len(frees)
        assert report.pack_bytes_freed == sum(sizes[k] for k in frees - {first})
        assert report.records_deleted == 1  # exp@2's record
        assert report.orphans_deleted == () and store.blobs.stats.deletes == len(frees) + 1
        assert set(objects(store)) == set(sizes) - frees
        for step in (1, 3):
            assert_same(store.checkout(step), state(step))
        assert_tidy(store)

    def test_a_background_gc_runs_while_commits_go_on(self, gc_store: ckstore.Store) -> None:
        """``gc(blocking=False)``: the collection, held at its first delete, runs on the store's
        gc thread while a blocking and an asynchronous commit land; every object it was to delete
        goes, and nothing else."""
        import threading

        store = gc_store
        for step in (1, 2, 3, 4):
            store.commit(step, state(step))
        frees = only_used_by(store, {"exp@1", "exp@2", "exp@3"})
        entered, opened, threads = threading.Event(), threading.Event(), set()

        def gate(phase: str, done: int, total: int) -> None:
            threads.add(threading.current_thread().name)
            if phase == "delete":
                entered.set()
                assert opened.wait(60)

        pending = store.gc(LatestN(1), grace=0, blocking=False, progress=gate)
        assert entered.wait(60) and not pending.done()
        store.commit(5, state(5))
        store.commit(6, state(6), blocking=False).wait()
        opened.set()
        report = pending.wait(60)
        assert report.dropped == ["exp@1", "exp@2", "exp@3"] and report.packs_deleted == len(frees)
        assert threads and all(t.startswith("ckstore-gc") for t in threads)
        assert not set(objects(store)) & frees
        for step in (4, 5, 6):
            assert_same(store.checkout(step), state(step))
        assert_tidy(store)

    # -- du ---------------------------------------------------------------------------------------
    def test_du_agrees_with_the_catalog_blobs_and_gc(self, gc_store: ckstore.Store) -> None:
        store = gc_store
        store.commit(1, state(1, ranks=2), run="a")
        store.commit(2, state(2, ranks=2), run="a")
        store.commit(1, state(1, ranks=2), run="b")  # the same bytes as a@1
        store.commit(2, state(3, ranks=2), run="b")
        rep = store.du()

        length = {i: int(n) for i, n in catalog_tools.rows(store.catalog, "SELECT id, length FROM chunks")}
        raw = {i: int(n) for i, n in catalog_tools.rows(store.catalog, "SELECT id, raw_size FROM chunks")}
        refs = [
            (int(c), int(k))
            for c, k in catalog_tools.rows(store.catalog, "SELECT checkpoint_id, chunk_id FROM chunk_refs")
        ]
        ids = {ck.ref: ck.id for ck in store.checkpoints()}
        users: dict[int, set[int]] = {}
        for ck, ch in refs:
            users.setdefault(ch, set()).add(ck)
        by_ckpt = {u.name: u for u in rep.checkpoints}
        assert list(by_ckpt) == ["a@1", "a@2", "b@1", "b@2"]
        for ref, i in ids.items():
            mine = {ch for ck, ch in refs if ck == i}
            u = by_ckpt[ref]
            assert u.logical_bytes == store.resolve(ref).logical_bytes == 2 * (64 + 16) * 1024
            assert u.unique_bytes == sum(raw[c] for c in mine)
            assert u.stored_bytes == sum(length[c] for c in mine)
            assert u.exclusive_bytes == sum(length[c] for c in mine if users[c] == {i})
            assert u.dedup_ratio == pytest.approx(160 / 96)  # the frozen chunk twice, stored once
        by_run = {u.name: u for u in rep.runs}
        for run in ("a", "b"):
            mine_ids = {i for ref, i in ids.items() if ref.startswith(f"{run}@")}
            chunks = {ch for ck, ch in refs if ck in mine_ids}
            u = by_run[run]
            assert u.checkpoints == 2
            assert u.logical_bytes == sum(by_ckpt[f"{run}@{s}"].logical_bytes for s in (1, 2))
            assert u.stored_bytes == sum(length[c] for c in chunks)
            assert u.exclusive_bytes == sum(length[c] for c in chunks if users[c] <= mine_ids)
        assert by_run["a"].exclusive_bytes == by_ckpt["a@2"].exclusive_bytes > 0  # a@1 is b@1
        assert rep.total.stored_bytes == sum(length.values()) and rep.garbage_bytes == 0
        assert rep.total.logical_bytes == sum(u.logical_bytes for u in rep.checkpoints)
        assert rep.pack_bytes == sum(objects(store).values())  # the catalog's sizes: the objects'
        assert [u.name for u in store.du("b").checkpoints] == ["b@1", "b@2"]
        with pytest.raises(ckstore.NotFoundError, match="zzz"):
            store.du("zzz")

        # what du says a checkpoint alone holds is what gc frees once it is gone
        expect = by_ckpt["b@2"].exclusive_bytes
        frees = only_used_by(store, {"b@2"})
        before = objects(store)
        store.delete("b@2")
        assert store.du().garbage_bytes == expect
        report = store.gc(grace=0)
        assert report.chunk_bytes_freed == expect
        assert report.pack_bytes_freed == sum(before[k] for k in frees)
        after = store.du()
        assert after.garbage_bytes == 0 and after.pack_bytes == sum(objects(store).values())
        assert_tidy(store)

    # -- fsck ---------------------------------------------------------------------------------------
    def test_fsck_names_what_a_deleted_pack_breaks_and_repair_removes_only_orphans(
        self, gc_store: ckstore.Store
    ) -> None:
        store = gc_store
        store.commit(1, state(1, ranks=2))
        store.commit(2, state(2, ranks=2))
        clean, deep = store.fsck(), store.fsck(deep=True)
        assert clean.ok and deep.ok and clean.orphans == () and clean.pending == ()
        assert (clean.checkpoints, clean.packs) == (2, len(objects(store)))
        assert deep.bytes_read == sum(objects(store).values())

        uses = chunk_uses(store)
        victim = next(u[5] for u in uses if u[:4] == ("exp@2", 1, "model_states", "w"))
        broken = {u[:5] for u in uses if u[5] == victim}
        store.blobs.delete([victim])
        for deep_check in (False, True):
            rep = store.fsck(deep=deep_check)
            assert not rep.ok and rep.damaged_checkpoints == ["exp@2"]
            assert damaged(rep) == broken
            assert all(d.pack == victim and "missing" in d.problem for d in rep.damage)
            assert rep.orphans == ()
        with pytest.raises(ckstore.ChunkNotFoundError, match=victim):
            store.checkout(2)

        orphan = "packs/zz/" + os.urandom(16).hex()
        store.blobs.put(orphan, b"x" * 10)
        dead_key = pending_commit(store, 3, _dead_owner())
        live = Owner.me()
        live_key = pending_commit(store, 4, live)
        before = objects(store)
        rows = catalog_tools.count(store.catalog, "chunks")
        packs = set(catalog_tools.column(store.catalog, "packs", "key"))
        rep = store.fsck()
        assert rep.orphans == ((orphan, 10),)
        assert [(p.step, p.abandoned is not None) for p in rep.pending] == [(3, True), (4, False)]
        rep = store.fsck(repair=True, grace=0)
        assert rep.repaired_orphans == (orphan,) and [r.step for r in rep.repaired_pending] == [3]
        assert damaged(rep) == broken  # not repaired
        assert set(objects(store)) == set(before) - {orphan} and {dead_key, live_key} < set(before)
        # not a chunk or pack row touched: gc frees them
        assert catalog_tools.count(store.catalog, "chunks") == rows
        assert set(catalog_tools.column(store.catalog, "packs", "key")) == packs and victim in packs
        assert [p[2] for p in store.catalog.pending()] == [4]
        store.catalog.abort_checkpoint(store.catalog.pending()[0][0], live)
        assert_same(store.checkout(1), state(1, ranks=2))

    def test_fsck_deep_finds_corrupt_bytes(self, gc_store: ckstore.Store) -> None:
        store = gc_store
        store.commit(1, state(1, ranks=2))
        store.commit(2, state(2, ranks=2))
        uses = chunk_uses(store)
        digest = next(u[4] for u in uses if u[:4] == ("exp@1", 0, "model_states", "w"))
        (loc,) = store.catalog.chunk_locations([bytes.fromhex(digest)]).values()
        data = bytearray(store.blobs.read(loc.pack_key))
        data[loc.offset + loc.length // 2] ^= 0xFF
        store.blobs.put(loc.pack_key, bytes(data))  # overwritten in place, through the backend

        assert store.fsck().ok  # sizes are right: only reading finds it
        rep = store.fsck(deep=True)
        assert damaged(rep) == {("exp@1", 0, "model_states", "w", digest)}
        assert rep.damage[0].pack == loc.pack_key and "corrupt" in rep.damage[0].problem
        assert rep.damaged_checkpoints == ["exp@1"]
        with pytest.raises(ckstore.IntegrityError, match="rank 0"):
            store.checkout(1)
        assert_same(store.checkout(2), state(2, ranks=2))

        # a pack cut short: the listing's size tells, without reading
        cut = next(u for u in uses if u[:4] == ("exp@2", 1, "model_states", "w"))[5]
        store.blobs.put(cut, store.blobs.read(cut, 0, 100))
        shortened = {u[:5] for u in uses if u[5] == cut}
        rep = store.fsck()
        assert damaged(rep) == shortened
        assert all(d.pack == cut and "shorter" in d.problem for d in rep.damage)
        rep = store.fsck(deep=True)
        assert {d.ref for d in rep.damage} == {"exp@1", "exp@2"}
        assert len(rep.damage) == 1 + len(shortened)
