"""The store contract on one catalog and blob store pair, as tests every backend must pass.

A backend's test class provides a ``spec`` fixture: a :class:`StoreSpec` naming a location and
catalog of the test's own (nothing created yet). Tests open the store through it as many times
as they need, from threads and from other processes.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import catalog_tools
import pytest
import torch
from helpers import ALL_DTYPES, assert_same, random_tensor

import ckstore
from ckstore.format.manifest import Manifest

CHUNK = 16 * 1024
PACK = 64 * 1024


@dataclass(frozen=True)
class StoreSpec:
    """Where a test's store lives; picklable, so child processes can open it too."""

    location: str
    catalog: str | None = None
    storage_options: dict[str, Any] | None = None

    def open(self, run: str | None = "exp", **kw: Any) -> ckstore.Store:
        """Open the store; ``kw`` go to :func:`ckstore.open`. ``chunk_size`` and ``pack_size``
        default to :data:`CHUNK` and :data:`PACK` (a suite may pick others, the same on every
        open of its store: they are fixed when the store is created)."""
        settings: dict[str, Any] = {"chunk_size": CHUNK, "pack_size": PACK, **kw}
        return ckstore.open(
            self.location,
            catalog=self.catalog,
            storage_options=self.storage_options,
            run=run,
            **settings,
        )


def sample_states(step: int, ranks: int = 2) -> dict[int, dict[str, Any]]:
    """Small, deterministic rank states: a tensor shared by every step and rank (it dedups),
    tensors of this step's own, and plain values."""
    shared = torch.Generator().manual_seed(1234)
    own = torch.Generator().manual_seed(step + 1)
    frozen = random_tensor(torch.float32, (128, 64), shared)  # 2 chunks, the same everywhere
    out: dict[int, dict[str, Any]] = {}
    for r in range(ranks):
        out[r] = {
            "model_states": {
                "frozen": frozen,
                "w": random_tensor(torch.bfloat16, (96, 80), own),
                "b": random_tensor(torch.float16, (80,), own),
                "step": step,
                "rank": r,
            },
            "optim_states": {"exp_avg": random_tensor(torch.float32, (30, 70), own), "lr": 1e-3 * (step + 1)},
        }
    return out


def mp_context() -> Any:
    """Processes forked from a clean server that has the heavy modules imported already."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "ckstore", "ckstore.store", "alembic.command", "sqlalchemy.dialects.postgresql", "psycopg", "s3fs"]
    )
    return ctx


def assert_consistent(store: ckstore.Store) -> None:
    """No pending checkpoint; every chunk a committed manifest names is recorded once, and lies
    inside an existing pack object."""
    cat = store.catalog
    assert cat.pending() == []
    digests: set[bytes] = set()
    for ck in store.checkpoints():
        for _r, _k, raw in cat.entries(ck.id):
            for t in Manifest.from_bytes(raw).tensors:
                digests.update(t.chunks)
    locs = cat.chunk_locations(digests)
    assert set(locs) == digests, f"{len(digests - set(locs))} chunks are missing from the catalog"
    sizes = {i.key: i.size for i in store.blobs.list("packs/")}
    for d, loc in locs.items():
        assert loc.pack_key in sizes, f"pack {loc.pack_key} of chunk {d.hex()} is missing"
        assert loc.offset + loc.length <= sizes[loc.pack_key]
    digests_recorded = catalog_tools.column(cat, "chunks", "digest")
    assert len(digests_recorded) == len({bytes(d) for d in digests_recorded})


# -- child processes ----------------------------------------------------------------------------
def _commit_then_die(spec: StoreSpec, step: int) -> None:
    store = spec.open()

    def die(_done: int, _total: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    store.commit(step, sample_states(step), progress=die)


class StoreConformance:
    @pytest.fixture
    def store(self, spec: StoreSpec) -> Any:
        s = spec.open()
        yield s
        s.close()

    # -- commit and checkout --------------------------------------------------------------------
    def test_roundtrip_every_dtype_and_shape(self, store: ckstore.Store) -> None:
        gen = torch.Generator().manual_seed(7)
        model = {f"{str(dt).split('.')[-1]}": random_tensor(dt, (33, 17), gen) for dt in ALL_DTYPES}
        model["scalar"] = torch.tensor(3.5, dtype=torch.float64)
        model["empty"] = torch.empty((0, 4), dtype=torch.float16)
        model["big"] = random_tensor(torch.float32, (100, 100), gen)  # several chunks
        model["strided"] = random_tensor(torch.int32, (40, 30), gen).t()
        meta = {"name": "x", "n": 3, "f": 1.5, "none": None, "b": b"\x00\xff"}
        ck = store.commit(1, {0: {"meta": meta, "model_states": model}}, {"loss": 0.5})
        assert (ck.run, ck.step, ck.status, ck.ranks) == ("exp", 1, "committed", (0,))
        got = store.checkout(1)
        expected = {0: {"meta": meta, "model_states": {k: v.contiguous() for k, v in model.items()}}}
        assert_same(got, expected)
        assert_consistent(store)

    def test_another_handle_sees_commits(self, spec: StoreSpec, store: ckstore.Store) -> None:
        store.commit(5, sample_states(5))
        with spec.open(run=None) as other:
            assert other.resolve("exp@latest").step == 5
            assert_same(other.checkout("exp@5"), sample_states(5))

    def test_resharded_checkout(self, store: ckstore.Store) -> None:
        full = random_tensor(torch.float32, (64, 40), torch.Generator().manual_seed(3))
        layout = ckstore.WorldLayout({"tp": 2})
        states = {r: {"model_states": {"w": ckstore.Shard(full[r * 32 : (r + 1) * 32], mesh_dim="tp", dim=0)}} for r in range(2)}
        store.commit(1, states, world_layout=layout)
        got = store.checkout(1, ckstore.WorldLayout.single())
        assert_same(got[0]["model_states"]["w"], full)

    def test_unchanged_state_adds_nothing(self, store: ckstore.Store) -> None:
        first = store.commit(1, sample_states(1))
        store.blobs.stats.reset()
        again = store.commit(2, sample_states(1))
        assert first.stored_bytes_added > 0
        assert again.stored_bytes_added == 0
        # no pack: the one object written is the checkpoint's record (manifests, a few KiB)
        packs = {i.key for i in store.blobs.list("packs/")}
        assert store.blobs.stats.writes == 1 and store.blobs.stats.bytes_written < 16 * 1024
        store.commit(3, sample_states(1))
        assert {i.key for i in store.blobs.list("packs/")} == packs
        assert again.logical_bytes == first.logical_bytes

    def test_partial_checkout(self, store: ckstore.Store) -> None:
        store.commit(1, sample_states(1))
        got = store.checkout(1, ranks=[1], sub_keys=["optim_states"])
        assert_same(got, {1: {"optim_states": sample_states(1)[1]["optim_states"]}})
        with pytest.raises(ckstore.CheckpointNotFoundError, match="ranks"):
            store.checkout(1, ranks=[5])

    # -- refs, tags, metrics, runs --------------------------------------------------------------
    def test_refs(self, store: ckstore.Store) -> None:
        for step, loss in ((10, 0.9), (20, 0.3), (30, 0.5)):
            store.commit(step, sample_states(step, ranks=1), {"loss": loss, "acc": 1 - loss}, tags=[f"t{step}"])
        assert store.resolve("latest").step == 30
        assert store.resolve(20).step == 20
        assert store.resolve("t10").step == 10
        assert store.resolve("min:loss").step == 20
        assert store.resolve("max:loss").step == 10
        assert store.resolve("exp@max:acc").step == 20
        assert store.resolve("exp@20").metrics == {"loss": 0.3, "acc": 0.7}
        with pytest.raises(ckstore.CheckpointNotFoundError, match="step 40"):
            store.resolve(40)
        with pytest.raises(ckstore.CheckpointNotFoundError, match="nosuch"):
            store.resolve("nosuch")
        with pytest.raises(ckstore.NotFoundError, match="other"):
            store.resolve("other@latest")

    def test_tags(self, store: ckstore.Store) -> None:
        store.commit(1, sample_states(1, ranks=1), tags=["best"])
        store.commit(2, sample_states(2, ranks=1))
        with pytest.raises(ckstore.AlreadyExistsError, match="best"):
            store.tag(2, "best")
        assert store.tag(2, "best", move=True).tags == ("best",)
        assert store.resolve("best").step == 2
        assert store.resolve(1).tags == ()
        store.untag("best")
        with pytest.raises(ckstore.NotFoundError, match="best"):
            store.untag("best", run="exp")
        with pytest.raises(ckstore.InvalidRefError):
            store.tag(1, "latest")

    def test_metrics_listing_and_runs(self, spec: StoreSpec, store: ckstore.Store) -> None:
        store.commit(3, sample_states(3, ranks=1), {"loss": float("nan"), "big": 1e300})
        store.commit(1, sample_states(1, ranks=1), kind="epoch")
        with spec.open(run="other") as other:
            other.commit(7, sample_states(7, ranks=1))
        listed = store.checkpoints("exp")
        assert [c.step for c in listed] == [1, 3]
        assert listed[0].kind == "epoch"
        assert math.isnan(listed[1].metrics["loss"]) and listed[1].metrics["big"] == 1e300
        assert {(r.name, r.checkpoints, r.latest_step) for r in store.runs()} == {("exp", 2, 3), ("other", 1, 7)}
        assert all(c.committed_at is not None and c.committed_at.tzinfo is not None for c in store.checkpoints())

    def test_commit_returns_the_record_the_catalog_reads_back(self, spec: StoreSpec, store: ckstore.Store) -> None:
        """The record a commit returns is built from what it wrote, not read back: it must equal
        the one every later read gets (metric and tag names in code point order on every catalog,
        NaN metrics, ranks and sub-keys, the parent, the times)."""
        first = store.commit(1, sample_states(1, ranks=1))
        states = {r: {"b_optim": {"x": torch.ones(3)}, "a_model": {"w": torch.full((5,), float(r))}} for r in (2, 0)}
        metrics = {"val_loss": 0.25, "Loss": float("nan"), "acc": 1e300, "Zeta": -0.0}
        made = store.commit(2, states, metrics, tags=["best", "Best", "_x", "z"], parent=1)
        assert first.parent is None and made.parent == "exp@1"
        assert made.tags == ("Best", "_x", "best", "z") and list(made.metrics) == ["Loss", "Zeta", "acc", "val_loss"]
        assert made.ranks == (0, 2) and set(made.sub_keys) == {"b_optim", "a_model"}
        with spec.open() as other:
            for read in (store.resolve(2), other.resolve(2), next(c for c in other.checkpoints() if c.step == 2)):
                assert math.isnan(read.metrics["Loss"]) and math.isnan(made.metrics["Loss"])
                nan_free = {"metrics": {k: v for k, v in made.metrics.items() if k != "Loss"}}
                assert dataclasses.replace(read, **nan_free) == dataclasses.replace(made, **nan_free)
                assert list(read.metrics) == list(made.metrics)

    # -- replace, failures, pending commits -----------------------------------------------------
    def test_replace(self, store: ckstore.Store) -> None:
        store.commit(1, sample_states(1), tags=["keep"])
        with pytest.raises(ckstore.AlreadyExistsError, match="replace=True"):
            store.commit(1, sample_states(2))
        assert_same(store.checkout(1), sample_states(1))
        store.commit(1, sample_states(2), replace=True)
        assert_same(store.checkout(1), sample_states(2))
        assert len(store.checkpoints()) == 1
        assert_consistent(store)

    def test_failed_commit_leaves_nothing_visible(self, store: ckstore.Store) -> None:
        store.commit(1, sample_states(1))

        def fail(done: int, total: int) -> None:
            if done > total // 2:
                raise RuntimeError("disk on fire")

        with pytest.raises(RuntimeError, match="disk on fire"):
            store.commit(2, sample_states(2), progress=fail)
        assert [c.step for c in store.checkpoints()] == [1]
        assert store.catalog.pending() == []
        store.commit(2, sample_states(2))
        assert_same(store.checkout(2), sample_states(2))
        assert_consistent(store)

    def test_live_commit_holds_its_step(self, spec: StoreSpec, store: ckstore.Store) -> None:
        seen: list[BaseException] = []

        def meanwhile(done: int, total: int) -> None:
            if seen:
                return
            with spec.open() as other:
                try:
                    other.commit(4, sample_states(9))
                except BaseException as e:  # noqa: BLE001 - checked below
                    seen.append(e)
                other.commit(5, sample_states(5))  # another step goes through meanwhile

        store.commit(4, sample_states(4), progress=meanwhile)
        assert isinstance(seen[0], ckstore.CommitInProgressError), seen
        assert "step 4" in str(seen[0]) and f"process {os.getpid()}" in str(seen[0])
        assert_same(store.checkout(4), sample_states(4))
        assert [c.step for c in store.checkpoints()] == [4, 5]

    def test_killed_committer_is_taken_over(self, spec: StoreSpec, store: ckstore.Store) -> None:
        ctx = mp_context()
        p = ctx.Process(target=_commit_then_die, args=(spec, 3))
        p.start()
        p.join(120)
        assert p.exitcode == -signal.SIGKILL
        pending = store.catalog.pending()
        assert [(run, step) for _, run, step, _, _ in pending] == [("exp", 3)]
        assert f":{p.pid}:" in pending[0][3]
        with pytest.raises(ckstore.CheckpointNotFoundError):
            store.resolve(3)
        store.commit(3, sample_states(3))  # the dead process's claim is taken over
        assert_same(store.checkout(3), sample_states(3))
        assert_consistent(store)

    # -- concurrency ----------------------------------------------------------------------------
    def test_concurrent_commits(self, spec: StoreSpec, store: ckstore.Store) -> None:
        n = 4
        barrier = threading.Barrier(n)

        def commit(step: int) -> ckstore.Checkpoint:
            with spec.open() as mine:
                barrier.wait()
                return mine.commit(step, sample_states(step), {"loss": step / 10}, tags=["newest"])

        with ThreadPoolExecutor(n) as pool:
            done = list(pool.map(commit, range(n)))
        assert sorted(c.step for c in store.checkpoints()) == list(range(n))
        for step in range(n):
            assert_same(store.checkout(step), sample_states(step))
        # every chunk (the shared ones too) is recorded once, and paid for by one commit
        assert sum(c.stored_bytes_added for c in done) == store.catalog.stored_bytes()
        assert store.resolve("newest").step in range(n)
        assert sum("newest" in c.tags for c in store.checkpoints()) == 1
        assert_consistent(store)

    def test_concurrent_commits_of_one_step(self, spec: StoreSpec, store: ckstore.Store) -> None:
        n = 3
        barrier = threading.Barrier(n)

        def commit(seed: int) -> int | BaseException:
            with spec.open() as mine:
                barrier.wait()
                try:
                    mine.commit(8, sample_states(seed))
                    return seed
                except (ckstore.CommitInProgressError, ckstore.AlreadyExistsError) as e:
                    return e

        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(commit, range(n)))
        winners = [r for r in results if isinstance(r, int)]
        assert len(winners) == 1, results
        assert_same(store.checkout(8), sample_states(winners[0]))
        assert_consistent(store)

    # -- the catalog's schema -------------------------------------------------------------------
    def test_schema_is_checked_on_open(self, spec: StoreSpec, store: ckstore.Store) -> None:
        store.commit(1, sample_states(1, ranks=1))
        before, after = store.catalog.upgrade()
        assert before == after
        catalog_tools.set_schema_revision(store.catalog, "ffffffff")
        with pytest.raises(ckstore.SchemaVersionError, match="newer"):
            spec.open()
        catalog_tools.set_schema_revision(store.catalog, after)
        with spec.open() as again:
            assert_same(again.checkout(1), sample_states(1, ranks=1))
