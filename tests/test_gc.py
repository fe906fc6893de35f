"""Garbage collection on real stores: policies, sweeps, dry runs, abandoned commits, orphans."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import catalog_tools
import pytest
import torch
from helpers import assert_same

import ckstore
from ckstore.catalog import Owner, utcnow
from ckstore.layout import WorldLayout
from ckstore.retention import BestN, KeepAll, LatestN, Tagged

SHARED = torch.arange(200_000, dtype=torch.float32)  # in every checkpoint: its chunks dedup


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model_states": {"shared": SHARED, "w": torch.randn(128, 256, generator=g)},
        "step": {"n": step},
    }


def commit(s: ckstore.Store, step: int, run: str | None = None, **kw: Any) -> ckstore.Checkpoint:
    return s.commit(step, {0: state(step)}, run=run, **kw)


def objects(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in (root / "packs").rglob("*")
        if p.is_file()
    }


def steps(s: ckstore.Store, run: str | None = None) -> list[int]:
    return [c.step for c in s.checkpoints(run)]


def check_all(s: ckstore.Store) -> None:
    for ck in s.checkpoints():
        assert_same(s.checkout(ck.ref)[0], state(ck.step))


def test_dry_run_reports_exactly_what_gc_then_does(store: ckstore.Store, store_path: Path) -> None:
    for step in range(1, 9):
        commit(
            store,
            step,
            metrics={"val_loss": abs(step - 3) + 0.5},
            tags=["keep-me"] if step == 5 else [],
        )
    before_objects = objects(store_path)
    before = steps(store)
    policy = LatestN(2) | BestN(1, "val_loss") | Tagged()

    dry = store.gc(policy, dry_run=True)
    assert steps(store) == before and objects(store_path) == before_objects  # nothing changed
    assert dry.dropped == ["exp@1", "exp@2", "exp@4", "exp@6"]
    assert dry.chunks_freed > 0 and dry.pack_bytes_freed > 0

    real = store.gc(policy)
    assert (real.dropped, real.chunks_freed, real.chunk_bytes_freed, real.packs_deleted, real.pack_bytes_freed) == (
        dry.dropped, dry.chunks_freed, dry.chunk_bytes_freed, dry.packs_deleted, dry.pack_bytes_freed,
    )  # fmt: skip
    assert steps(store) == [3, 5, 7, 8]
    after = objects(store_path)
    assert sum(before_objects.values()) - sum(after.values()) == real.pack_bytes_freed
    assert set(after) < set(before_objects)
    kept = {k.step: k.reasons for k in real.runs[0].kept}
    assert kept == {
        3: ("best 1 by val_loss (min)",),
        5: ("tagged keep-me",),
        7: ("last 2",),
        8: ("latest", "last 2"),
    }
    check_all(store)  # the shared tensor's chunks stayed
    assert store.fsck(deep=True).ok
    again = store.gc(policy)
    assert again.dropped == [] and again.chunks_freed == 0 and again.packs_deleted == 0


def test_latest_is_never_dropped_and_no_policy_keeps_everything(store: ckstore.Store) -> None:
    for step in (10, 20, 30):
        commit(store, step)
    report = store.gc()
    assert report.dropped == [] and report.runs[0].policy is None
    assert store.gc(LatestN(0)).dropped == ["exp@10", "exp@20"]
    assert steps(store) == [30]
    assert store.gc(LatestN(0)).runs[0].kept[0].reasons == ("latest",)
    check_all(store)


def test_each_run_keeps_its_stored_policy(store: ckstore.Store) -> None:
    for step in range(1, 5):
        commit(store, step, run="a", kind="recovery" if step % 2 else "epoch")
        commit(store, step, run="b")
    store.set_policy("a", by_kind_policy())
    assert store.policy("a") == by_kind_policy() and store.policy("b") is None
    report = store.gc()
    assert {r.run: r.source for r in report.runs} == {"a": "stored", "b": "none"}
    assert steps(store, "a") == [2, 3, 4] and steps(store, "b") == [1, 2, 3, 4]
    # a policy given for one call replaces the stored one, for that run only
    assert store.gc(LatestN(1), run="b").dropped == ["b@1", "b@2", "b@3"]
    assert steps(store, "a") == [2, 3, 4]
    store.set_policy("a", None)
    assert store.policy("a") is None
    with pytest.raises(ckstore.NotFoundError, match="no run named 'zzz'"):
        store.gc(LatestN(1), run="zzz")
    check_all(store)


def by_kind_policy() -> Any:
    from ckstore.retention import ByKind

    return ByKind("recovery", LatestN(1)) | ByKind("epoch", KeepAll())


def test_missing_metric_is_kept_and_reported(store: ckstore.Store) -> None:
    commit(store, 1, metrics={"val_loss": 0.2})
    commit(store, 2)  # no metric
    commit(store, 3, metrics={"val_loss": float("nan")})
    commit(store, 4, metrics={"val_loss": 0.9})
    commit(store, 5, metrics={"val_loss": 0.5})
    report = store.gc(BestN(1, "val_loss"))
    assert report.dropped == ["exp@4"]
    assert report.runs[0].unranked == ((2, ("val_loss",)), (3, ("val_loss",)))


def test_delete_needs_force_for_tags_and_gc_frees_it(
    store: ckstore.Store, store_path: Path
) -> None:
    commit(store, 1, tags=["golden"])
    commit(store, 2)
    commit(store, 3)
    with pytest.raises(ckstore.ProtectedCheckpointError, match="tagged golden"):
        store.delete(1)
    stored = store.catalog.stored_bytes()
    assert store.delete(2).step == 2
    assert (
        steps(store) == [1, 3] and store.catalog.stored_bytes() == stored
    )  # rows only, bytes later
    report = store.gc()
    assert report.dropped == [] and report.chunks_freed > 0 and report.packs_deleted > 0
    assert store.delete("golden", force=True).step == 1
    assert store.gc().chunks_freed > 0
    check_all(store)
    assert store.fsck().ok


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _pending(
    s: ckstore.Store, step: int, owner: Owner, heartbeat_age: float = 0.0
) -> tuple[int, str]:
    """A pending checkpoint owned by ``owner`` that wrote one pack object."""
    ckpt = s.catalog.begin_checkpoint(
        "exp",
        step,
        kind="checkpoint",
        replace=False,
        owner=owner,
        world_layout=WorldLayout.flat(1),
        lease_seconds=60,
    )
    key = f"packs/ab/{os.urandom(16).hex()}"
    s.catalog.register_pack(ckpt, owner, key)
    s.blobs.put(key, b"CKPK\x01\x00\x00\x00 half a pack")
    catalog_tools.age_heartbeat(s.catalog, ckpt, heartbeat_age)
    return ckpt, key


def test_abandoned_commits_are_reaped_and_live_ones_never(store: ckstore.Store) -> None:
    commit(store, 1)
    host = socket.gethostname()
    _, dead_key = _pending(store, 2, Owner(host, _dead_pid(), "1", "dead"))
    _, live_key = _pending(
        store, 3, Owner.me(), heartbeat_age=86400
    )  # live here: never, however old
    _, remote_fresh = _pending(store, 4, Owner("elsewhere", 7, "1", "fresh"), heartbeat_age=5)
    _, remote_stale = _pending(store, 5, Owner("elsewhere", 8, "1", "stale"), heartbeat_age=600)

    report = store.gc(grace=60)
    reaped = {r.step: r.why for r in report.reaped}
    assert set(reaped) == {2, 5}
    assert "is gone" in reaped[2] and "no heartbeat" in reaped[5]
    assert not store.blobs.exists(dead_key) and not store.blobs.exists(remote_stale)
    assert store.blobs.exists(live_key) and store.blobs.exists(remote_fresh)
    assert sorted(p[2] for p in store.catalog.pending()) == [3, 4]
    # a live commit's pack with no chunk rows yet is not garbage, even with grace 0 ...
    assert {r.step for r in store.gc(grace=0).reaped} == {4}
    assert store.blobs.exists(live_key)
    # ... and once its process is gone it is
    catalog_tools.hand_over_pending(store.catalog, 3, Owner(host, _dead_pid(), "1", "x"))
    assert {r.step for r in store.gc().reaped} == {3}
    assert not store.blobs.exists(live_key)
    check_all(store)


def test_orphans_and_stale_temp_files_go_after_the_grace(
    store: ckstore.Store, store_path: Path
) -> None:
    commit(store, 1)
    old = time.time() - 7200
    store.blobs.put("packs/zz/old-orphan", b"x" * 100)
    os.utime(store_path / "packs/zz/old-orphan", (old, old))
    store.blobs.put("packs/zz/new-orphan", b"y" * 10)
    tmp_old, tmp_new = store_path / "tmp" / "a.part", store_path / "tmp" / "b.part"
    tmp_old.write_bytes(b"partial")
    tmp_new.write_bytes(b"partial")
    os.utime(tmp_old, (old, old))

    dry = store.gc(dry_run=True)
    assert dry.orphans_deleted == ("packs/zz/old-orphan",) and dry.temp_files_deleted == 1
    assert store.blobs.exists("packs/zz/old-orphan") and tmp_old.exists()
    report = store.gc()
    assert report.orphans_deleted == ("packs/zz/old-orphan",) and report.orphan_bytes_freed == 100
    assert report.temp_files_deleted == 1 and not tmp_old.exists() and tmp_new.exists()
    assert store.blobs.exists("packs/zz/new-orphan")
    assert store.gc(grace=0).orphans_deleted == ("packs/zz/new-orphan",)
    assert not tmp_new.exists()
    check_all(store)


def test_next_gc_finishes_what_a_killed_one_left(store: ckstore.Store, store_path: Path) -> None:
    for step in (1, 2, 3):
        commit(store, step)
    store.delete(2)  # (step 1's pack also holds the shared tensor)
    with store.catalog.gc_transaction() as txn:  # gc killed right after its sweep
        swept = txn.sweep(utcnow())
    chunks, trashed = swept.chunks, swept.trashed
    assert chunks > 0 and trashed and all(store.blobs.exists(k) for k in trashed)
    rep = store.fsck()
    assert rep.ok and rep.trash == len(trashed) and not rep.orphans
    report = store.gc()
    assert report.packs_deleted == len(trashed) and report.chunks_freed == 0
    assert not any(store.blobs.exists(k) for k in trashed)
    assert store.catalog.trash() == []
    check_all(store)


def test_du_agrees_with_what_gc_frees(store: ckstore.Store) -> None:
    for step in (1, 2):
        commit(store, step, run="a")
    commit(store, 1, run="b")
    commit(store, 2, run="b")
    rep = store.du()
    by_run = {u.name: u for u in rep.runs}
    by_ckpt = {u.name: u for u in rep.checkpoints}
    # hand computation from the catalog's rows
    length = dict(catalog_tools.rows(store.catalog, "SELECT id, length FROM chunks"))
    refs = catalog_tools.rows(store.catalog, "SELECT checkpoint_id, chunk_id FROM chunk_refs")
    ids = {ck.ref: ck.id for ck in store.checkpoints()}
    users: dict[int, set[int]] = {}
    for ck, ch in refs:
        users.setdefault(ch, set()).add(ck)
    for ref, i in ids.items():
        mine = {ch for ck, ch in refs if ck == i}
        assert by_ckpt[ref].stored_bytes == sum(length[ch] for ch in mine)
        assert by_ckpt[ref].exclusive_bytes == sum(length[ch] for ch in mine if users[ch] == {i})
    # a@1 and b@1 hold the same bytes: nothing is exclusive to either run but 'w' differs per step
    assert (
        by_run["a"].checkpoints == 2
        and by_run["a"].logical_bytes == by_ckpt["a@1"].logical_bytes * 2
    )
    assert by_run["a"].dedup_ratio > 1.0 and by_run["a"].compression_ratio > 1.0
    assert by_run["a"].exclusive_bytes == 0  # run b has the same states, step for step
    assert rep.total.stored_bytes == sum(length.values()) and rep.garbage_bytes == 0
    # what du says dropping a checkpoint would free is what gc frees once it is dropped
    assert by_ckpt["b@2"].exclusive_bytes == 0  # a@2 holds the same bytes
    store.delete("a@2")
    expect = {u.name: u for u in store.du().checkpoints}["b@2"].exclusive_bytes
    store.delete("b@2")
    assert store.gc().chunk_bytes_freed == expect > 0
    assert store.du().garbage_bytes == 0


def test_progress_callback_sees_the_deletes(store: ckstore.Store) -> None:
    for step in range(1, 6):
        commit(store, step)
    seen: list[tuple[str, int, int]] = []
    report = store.gc(
        LatestN(1), progress=lambda phase, done, total: seen.append((phase, done, total))
    )
    assert report.packs_deleted > 0
    assert seen and seen[-1] == ("delete", report.packs_deleted, report.packs_deleted)


def test_bad_arguments(store: ckstore.Store) -> None:
    commit(store, 1)
    with pytest.raises(ckstore.PolicyError, match="grace"):
        store.gc(grace=-1)
    with pytest.raises(ckstore.PolicyError, match="Policy"):
        store.gc("keep-last-2")  # type: ignore[arg-type]
    with pytest.raises(ckstore.PolicyError, match="Policy"):
        store.set_policy("exp", {"rule": "latest"})  # type: ignore[arg-type]
    store.catalog.set_run_policy("exp", "{nonsense")
    with pytest.raises(ckstore.PolicyError, match="run 'exp' has a malformed stored policy"):
        store.gc()
    assert steps(store) == [1]


def test_long_lived_small_chunk_does_not_pin_large_chunks(tmp_path: Path) -> None:
    """Small chunks go to their own pack, so an unchanging RNG state frees the big pack."""
    from ckstore.retention import LatestN

    s = ckstore.open(tmp_path / "s", run="r", chunk_size=1024 * 1024, pack_size=64 * 1024 * 1024)
    rng = torch.randint(0, 255, (5056,), dtype=torch.uint8)  # like torch.get_rng_state(), never changes
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        s.commit(step, {0: {"model_states": {"w": torch.randn(1024, 1024, generator=g)}, "rng": {"cpu": rng}}})
    report = s.gc(LatestN(1))
    assert report.dropped == ["r@0", "r@1"]
    remaining = sum(b.size for b in s.blobs.list("packs/"))
    assert remaining < 1.1 * 4 * 1024 * 1024  # one checkpoint's weights plus the small pack
    assert torch.equal(s.checkout(2)[0]["rng"]["cpu"], rng)


def test_trash_rows_naming_foreign_or_invalid_keys_are_refused_alike_in_dry_and_real_runs(
    store: ckstore.Store, store_path: Path
) -> None:
    """A damaged trash row naming ``ckstore.json``, or ``packs/../ckstore.json`` (no valid key
    at all), is refused and reported, in the dry run as in the real one; the invalid key made
    every gc fail with 'invalid blob key' before, and the dry run reported both as deleted."""
    commit(store, 1)
    commit(store, 2)
    store.delete("exp@1")
    with sqlite3.connect(store_path / "catalog.db") as db:
        for key in ("ckstore.json", "packs/../ckstore.json"):
            db.execute("INSERT INTO trash (key, created_at) VALUES (?, '2020-01-01 00:00:00.000000')", (key,))
    dry = store.gc(grace=0, dry_run=True)
    real = store.gc(grace=0)
    assert set(dry.refused) == set(real.refused) == {"ckstore.json", "packs/../ckstore.json"}
    assert dry.packs_deleted == real.packs_deleted and dry.pack_bytes_freed == real.pack_bytes_freed
    assert (store_path / "ckstore.json").exists() and steps(store) == [2]
    check_all(store)


def test_trash_rows_naming_folders_are_refused_and_no_folder_is_deleted(
    store: ckstore.Store, store_path: Path
) -> None:
    """A trash row naming a folder of the store (``packs/ab``, ``packs/.``, ``packs/ab/``) made
    every gc crash with IsADirectoryError; such keys are refused and reported, in the dry run as
    in the real one, and every folder stays with what it holds."""
    commit(store, 1)
    commit(store, 2)
    store.delete("exp@1")
    folder = next(p for p in (store_path / "packs").iterdir() if any(p.iterdir()))
    keys = {f"packs/{folder.name}", "packs/.", f"packs/{folder.name}/", "packs"}
    with sqlite3.connect(store_path / "catalog.db") as db:
        for key in keys:
            db.execute("INSERT INTO trash (key, created_at) VALUES (?, '2020-01-01 00:00:00.000000')", (key,))
    dry = store.gc(grace=0, dry_run=True)
    real = store.gc(grace=0)
    assert set(dry.refused) == set(real.refused) == keys
    assert dry.packs_deleted == real.packs_deleted and dry.pack_bytes_freed == real.pack_bytes_freed
    assert folder.is_dir() and (store_path / "packs").is_dir()
    assert set(store.gc(grace=0).refused) == keys  # and every later gc runs through, refusing them again
    assert steps(store) == [2]
    check_all(store)
