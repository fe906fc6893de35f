"""The store's API: refs, tags, errors, dedup accounting and integrity checks."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, small_model_state

import ckstore
from ckstore.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    ChunkNotFoundError,
    IntegrityError,
    InvalidRefError,
    StoreConfigError,
    UnsupportedValueError,
)


def test_commit_returns_record_and_checkout_latest(store: ckstore.Store) -> None:
    state = small_model_state()
    ck = store.commit(100, {0: state, 1: state}, {"val_loss": 0.31, "top1": 0.78}, tags=["epoch-3"], kind="epoch")
    assert (ck.run, ck.step, ck.kind, ck.tags) == ("exp", 100, "epoch", ("epoch-3",))
    assert ck.metrics == {"val_loss": 0.31, "top1": 0.78}
    assert ck.ranks == (0, 1) and ck.sub_keys == ("model_states", "optim_states")
    tensors = [t for sd in state.values() for t in _tensors(sd)]
    assert ck.logical_bytes == 2 * sum(t.numel() * t.element_size() for t in tensors)
    assert 0 < ck.stored_bytes_added < ck.logical_bytes / 2  # rank 1 is a replica: stored once
    assert ck.created_at <= ck.committed_at
    out = store.checkout("latest")
    assert sorted(out) == [0, 1]
    assert_same(out[1], state)


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def test_refs(store_path: Path) -> None:
    s = ckstore.open(store_path, run="exp0")
    for step, loss in [(10, 0.5), (20, 0.2), (30, 0.2), (40, 0.9)]:
        s.commit(step, {0: {"m": {"w": torch.full((4,), float(step))}}}, {"val_loss": loss, "acc": 1 - loss})
    s.commit(50, {0: {"m": {"w": torch.zeros(1)}}})  # no metrics
    other = ckstore.open(store_path, run="exp1")
    other.commit(10, {0: {"m": {"w": torch.ones(1)}}}, {"val_loss": 0.1}, tags=["best"])

    assert s.resolve("latest").step == 50
    assert s.resolve(20).step == 20 and s.resolve("20").step == 20
    assert s.resolve("min:val_loss").step == 30  # tie: the later step wins
    assert s.resolve("max:acc").step == 30
    assert s.resolve("max:val_loss").step == 40
    assert s.resolve("exp1@latest").run == "exp1"
    assert s.resolve("exp1@min:val_loss").step == 10
    with pytest.raises(CheckpointNotFoundError, match="tagged 'best' in run 'exp0'"):
        s.resolve("best")  # the store's default run applies
    assert s.resolve("exp0@10").metrics["val_loss"] == 0.5
    out = s.checkout("exp0@min:val_loss")
    assert torch.equal(out[0]["m"]["w"], torch.full((4,), 30.0))

    with pytest.raises(CheckpointNotFoundError, match="step 999"):
        s.resolve(999)
    with pytest.raises(CheckpointNotFoundError, match="metric 'nope'"):
        s.resolve("min:nope")
    with pytest.raises(CheckpointNotFoundError, match="tagged 'nosuch'"):
        s.resolve("nosuch")
    with pytest.raises(ckstore.NotFoundError, match="no run named 'ghost'"):
        s.resolve("ghost@latest")
    for bad in ("exp0@", "a:b", "", "min:", "x@y@z"):
        with pytest.raises(InvalidRefError):
            s.resolve(bad)
    anywhere = ckstore.open(store_path)
    assert anywhere.resolve("best").run == "exp1"  # a tag unique across runs
    assert anywhere.resolve("latest").run == "exp1"  # the most recently committed
    with pytest.raises(InvalidRefError, match="several runs"):
        anywhere.resolve(10)


def test_tags(store: ckstore.Store) -> None:
    store.commit(1, {0: {"m": {"w": torch.ones(2)}}})
    store.commit(2, {0: {"m": {"w": torch.zeros(2)}}})
    store.tag(1, "good")
    assert store.resolve("good").step == 1
    with pytest.raises(AlreadyExistsError, match="already names step 1"):
        store.tag(2, "good")
    store.tag(2, "good", move=True)
    assert store.resolve("good").step == 2
    store.untag("good")
    with pytest.raises(CheckpointNotFoundError):
        store.resolve("good")
    with pytest.raises(InvalidRefError):
        store.tag(1, "latest")
    with pytest.raises(InvalidRefError):
        store.tag(1, "123")


def test_existing_step_is_refused_unless_replaced(store: ckstore.Store) -> None:
    store.commit(7, {0: {"m": {"w": torch.ones(3)}}}, {"loss": 1.0})
    with pytest.raises(AlreadyExistsError, match="step 7"):
        store.commit(7, {0: {"m": {"w": torch.zeros(3)}}})
    assert torch.equal(store.checkout(7)[0]["m"]["w"], torch.ones(3))
    ck = store.commit(7, {0: {"m": {"w": torch.zeros(3)}}}, {"loss": 0.5}, replace=True)
    assert ck.metrics == {"loss": 0.5}
    assert len(store.checkpoints()) == 1
    assert torch.equal(store.checkout(7)[0]["m"]["w"], torch.zeros(3))


def test_bad_input_is_refused_and_loses_nothing(store: ckstore.Store) -> None:
    store.commit(1, {0: {"m": {"w": torch.ones(3)}}})

    class Custom:
        pass

    with pytest.raises(UnsupportedValueError, match=r"rank 0, m, key 'layer/obj'.*Custom"):
        store.commit(2, {0: {"m": {"layer": {"obj": Custom()}}}})
    with pytest.raises(UnsupportedValueError, match="non-empty dict"):
        store.commit(2, {})
    with pytest.raises(UnsupportedValueError, match="non-negative int ranks"):
        store.commit(2, {"0": {"m": {}}})  # type: ignore[dict-item]
    with pytest.raises(UnsupportedValueError, match="dict key"):
        store.commit(2, {0: {"m": {(1, 2): 3}}})
    with pytest.raises(StoreConfigError, match="metric 'loss' must be a number"):
        store.commit(2, {0: {"m": {"w": torch.ones(1)}}}, {"loss": "low"})  # type: ignore[dict-item]
    with pytest.raises(StoreConfigError, match="step"):
        store.commit(-1, {0: {"m": {"w": torch.ones(1)}}})
    with pytest.raises(UnsupportedValueError, match="sparse|layout"):
        store.commit(2, {0: {"m": {"w": torch.eye(3).to_sparse()}}})
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(UnsupportedValueError, match="cycle"):
        store.commit(2, {0: {"m": {"c": cyclic}}})
    assert [c.step for c in store.checkpoints()] == [1]
    assert store.catalog.pending() == []
    assert torch.equal(store.checkout(1)[0]["m"]["w"], torch.ones(3))


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.v == self.v


def test_pickles_need_opt_in_on_both_sides(store: ckstore.Store) -> None:
    store.commit(1, {0: {"m": {"obj": Opaque(3), "w": torch.ones(1)}}}, allow_pickle=True)
    with pytest.raises(UnsupportedValueError, match="pickled object.*allow_pickle=True"):
        store.checkout(1)
    out = store.checkout(1, allow_pickle=True)
    assert out[0]["m"]["obj"] == Opaque(3)


def test_checkout_never_unpickles_a_planted_pickle(store: ckstore.Store, tmp_path: Path) -> None:
    # a manifest naming a pickle is refused without opt-in, whatever the pickle would do
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Boom(str(marker)))
    pickle.loads(payload)  # the planted pickle does run when unpickled: the marker proves it
    assert marker.exists()
    marker.unlink()
    store.commit(1, {0: {"m": {"x": _Boom(str(marker))}}}, allow_pickle=True)
    assert not marker.exists()
    with pytest.raises(UnsupportedValueError):
        store.checkout(1)
    assert not marker.exists()


class _Boom:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_touch, (self.path,))


def _touch(path: str) -> None:
    Path(path).write_text("x")


def test_dedup_replicas_and_changed_tensor(store_path: Path) -> None:
    s = ckstore.open(store_path, run="dp", chunk_size=64 * 1024)
    torch.manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(256, 256) for i in range(8)}  # 8 x 256 KiB
    one = s.commit(1, {0: {"model_states": model}})
    four = s.commit(2, {r: {"model_states": model} for r in range(4)})
    assert four.logical_bytes == 4 * one.logical_bytes
    assert four.stored_bytes_added == 0  # every chunk already stored
    changed = dict(model)
    changed["layer3.weight"] = torch.randn(256, 256)
    c3 = s.commit(3, {0: {"model_states": changed}})
    tensor_bytes = 256 * 256 * 4
    assert 0.75 * tensor_bytes < c3.stored_bytes_added < 1.0 * tensor_bytes
    assert s.catalog.stored_bytes() < 0.95 * 9 * tensor_bytes


def test_many_tiny_tensors_write_few_objects(store_path: Path) -> None:
    s = ckstore.open(store_path, run="tiny")
    state = {f"t{i}": torch.tensor([float(i), 1.0, 2.0]) for i in range(10_000)}
    s.commit(1, {0: {"m": state}})
    packs = [b for b in s.blobs.list("packs/")]
    assert 1 <= len(packs) <= 4
    out = s.checkout(1)[0]["m"]
    assert len(out) == 10_000 and torch.equal(out["t9999"], state["t9999"])


def test_a_checkout_reads_each_range_to_an_address_that_matches_its_file_offset_within_a_page(
    store_path: Path,
) -> None:
    # the kernel's copy from the page cache slows down ~10x on some CPUs when the buffer sits a
    # few bytes past the file offset within a page (ckstore/checkout/executor.py, _PAGE): every
    # read, whatever its offset (a pack's first chunk starts 8 bytes in), lands page-matched
    import ctypes

    s = ckstore.open(store_path, run="r", chunk_size=64 * 1024, pack_size=256 * 1024, workers=2)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(40_000 + 1_000 * i, generator=g) for i in range(6)}  # chunks of odd lengths
    s.commit(1, {0: {"m": state}})
    reads: list[tuple[str, int, int, int]] = []
    read_into = s.blobs._read_into

    def recorded(key: str, start: int, out: memoryview) -> None:
        reads.append((key, start, out.nbytes, ctypes.addressof(ctypes.c_char.from_buffer(out))))
        read_into(key, start, out)

    s.blobs._read_into = recorded  # type: ignore[method-assign]
    out = s.checkout(1)[0]["m"]
    for k, v in state.items():
        assert torch.equal(out[k], v)
    assert len({key for key, *_ in reads}) >= 3  # several packs, so several reads start 8 bytes in
    assert any(start == 8 for _, start, _, _ in reads)
    assert sum(n for _, _, n, _ in reads) >= 0.8 * sum(v.nbytes for v in state.values())
    assert [(key, start) for key, start, _, addr in reads if (addr - start) % 4096] == []


def test_a_checkout_with_no_more_reads_than_threads_runs_one_on_the_calling_thread(store_path: Path) -> None:
    # a small checkout's read runs on the caller instead of waiting for a thread to wake for it;
    # with more reads than threads every read goes to the threads (the caller's Python would
    # compete with theirs for the GIL)
    import threading

    s = ckstore.open(store_path, run="r", chunk_size=64 * 1024, pack_size=256 * 1024, workers=2)
    g = torch.Generator().manual_seed(0)
    small = {"w": torch.randn(1000, generator=g)}
    large = {f"w{i}": torch.randn(40_000, generator=g) for i in range(8)}  # 1.25 MiB in 5 packs
    s.commit(1, {0: {"m": small}})
    s.commit(2, {0: {"m": large}})
    threads: list[int] = []
    read_into = s.blobs._read_into

    def recorded(key: str, start: int, out: memoryview) -> None:
        threads.append(threading.get_ident())
        read_into(key, start, out)

    s.blobs._read_into = recorded  # type: ignore[method-assign]
    assert torch.equal(s.checkout(1)[0]["m"]["w"], small["w"])
    assert threads == [threading.get_ident()]
    threads.clear()
    out = s.checkout(2)[0]["m"]
    assert all(torch.equal(out[k], v) for k, v in large.items())
    assert len(threads) > 2  # more reads than the two threads
    assert threading.get_ident() not in threads


def _pack_files(path: Path) -> list[Path]:
    return sorted(p for p in (path / "packs").rglob("*") if p.is_file())


def test_flipped_byte_is_detected_with_names(store: ckstore.Store, store_path: Path) -> None:
    store.commit(3, {0: {"model_states": {"w": torch.randn(50_000)}}})
    (pack,) = _pack_files(store_path)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x40
    os.chmod(pack, 0o644)
    pack.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"run 'exp', step 3, rank 0, model_states, key 'w'"):
        store.checkout(3)


def test_missing_pack_is_reported_with_names(store: ckstore.Store, store_path: Path) -> None:
    store.commit(4, {0: {"optim_states": {"state": {0: {"exp_avg": torch.randn(1000)}}}}})
    for p in _pack_files(store_path):
        p.unlink()
    with pytest.raises(ChunkNotFoundError, match=r"step 4, rank 0, optim_states, key 'state/0/exp_avg'") as e:
        store.checkout(4)
    assert isinstance(e.value, FileNotFoundError)


def test_store_remembers_its_settings(store_path: Path) -> None:
    s = ckstore.open(store_path, run="a", chunk_size=128 * 1024)
    s.commit(1, {0: {"m": {"w": torch.randn(100_000)}}})
    s.close()
    again = ckstore.open(store_path)
    assert again.config.chunk_size == 128 * 1024
    with pytest.raises(StoreConfigError, match="fixed when a store is created"):
        ckstore.open(store_path, chunk_size=4096)
    with pytest.raises(StoreConfigError, match="no ckstore store"):
        ckstore.open(store_path.parent / "nothing", create=False)
    with pytest.raises(StoreConfigError, match="needs a run"):
        again.commit(2, {0: {"m": {}}})


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"chunk_sze": 4096}, "unknown store setting 'chunk_sze'; a new store takes chunk_size, pack_size"),
        ({"created_at": "2020", "format_version": 1}, "unknown store settings 'created_at', 'format_version'"),
        ({"chunk_size": "4MiB"}, "chunk_size must be an int, got '4MiB'"),
        ({"pack_size": True}, "pack_size must be an int, got True"),
        ({"compression_level": 3.5}, "compression_level must be an int, got 3.5"),
        ({"lease_seconds": float("nan")}, "lease_seconds must be a number of seconds, got nan"),
        ({"lease_seconds": "60"}, "lease_seconds must be a number of seconds, got '60'"),
    ],
)
def test_settings_that_are_not_ones_are_refused_naming_them(
    tmp_path: Path, settings: dict[str, Any], match: str
) -> None:
    """A misspelt or mistyped setting is refused by name, both where ``open`` would create the
    store (nothing is written) and where the store exists (a misspelt one was ignored there)."""
    new = tmp_path / "new"
    for call in (ckstore.init, ckstore.open):
        with pytest.raises(StoreConfigError, match=re.escape(match)):
            call(new, **settings)
        assert not (new / "ckstore.json").exists()
    ckstore.init(tmp_path / "old").close()
    before = (tmp_path / "old" / "ckstore.json").read_bytes()
    with pytest.raises(StoreConfigError, match=re.escape(match)):
        ckstore.open(tmp_path / "old", **settings)
    assert (tmp_path / "old" / "ckstore.json").read_bytes() == before


def test_a_config_of_the_wrong_types_is_refused(tmp_path: Path) -> None:
    """``ckstore.json`` is read from the store, so a number of the wrong type in it is refused as
    a broken config, not used (a float chunk size would reach the chunker)."""
    ckstore.init(tmp_path / "s").close()
    path = tmp_path / "s" / "ckstore.json"
    doc = json.loads(path.read_text())
    for field, value in (("chunk_size", 4194304.5), ("compression_level", True), ("lease_seconds", "60")):
        path.write_text(json.dumps({**doc, field: value}))
        with pytest.raises(StoreConfigError, match=f"not a valid ckstore config: {field} must be"):
            ckstore.open(tmp_path / "s")


def test_checkout_subsets(store: ckstore.Store) -> None:
    state = small_model_state()
    store.commit(1, {0: state, 1: small_model_state(seed=1)})
    only = store.checkout(1, ranks=[1], sub_keys=["model_states"])
    assert list(only) == [1] and list(only[1]) == ["model_states"]
    with pytest.raises(CheckpointNotFoundError, match="no sub-checkpoint"):
        store.checkout(1, sub_keys=["nope"])
    with pytest.raises(CheckpointNotFoundError, match="saved by ranks"):
        store.checkout(1, ranks=[5])


def test_secrets_are_not_recorded(tmp_path: Path) -> None:
    with pytest.raises(StoreConfigError, match="literal password"):
        ckstore.open(tmp_path / "s", catalog="postgresql+psycopg://user:hunter2@db/ck")
    assert not (tmp_path / "s" / "ckstore.json").exists()


def test_commit_stops_when_its_claim_is_taken_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc reaping a pending checkpoint (here by hand) makes the commit fail fast, invisibly."""
    import threading

    import catalog_tools

    from ckstore.commit import protocol

    lost = threading.Event()
    real_beat = protocol.Heartbeat._beat

    def beat(self: protocol.Heartbeat) -> bool:
        again = real_beat(self)
        if not again:  # the beat found the claim gone, and recorded it
            lost.set()
        return again

    monkeypatch.setattr(protocol.Heartbeat, "_beat", beat)
    s = ckstore.open(tmp_path / "s", run="r", chunk_size=64 * 1024, lease_seconds=0.4)
    calls = []

    def progress(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 1:
            assert catalog_tools.drop_pending(s.catalog) == 1
            # the heartbeat (every 0.1 s, on the process's timer thread) finds the claim gone
            assert lost.wait(60)

    state = {f"w{i}": torch.randn(64 * 1024) for i in range(8)}
    with pytest.raises(ckstore.CommitAbandonedError, match="taken over"):
        s.commit(1, {0: {"m": state}}, progress=progress)
    assert len(calls) == 1  # it stopped writing at the next chunk instead of finishing
    assert s.checkpoints() == [] and s.catalog.pending() == []


def test_checkout_of_a_checkpoint_deleted_meanwhile_says_so(store_path: Path) -> None:
    from ckstore.retention import LatestN

    s = ckstore.open(store_path, run="r", chunk_size=64 * 1024, pack_size=256 * 1024, workers=1)
    s.commit(1, {0: {"m": {"w": torch.randn(400_000)}}})
    s.commit(2, {0: {"m": {"w": torch.randn(10)}}})
    ckpt = s.resolve(1)
    with pytest.raises(CheckpointNotFoundError, match="deleted .* while it was being checked out") as e:
        gone = []

        def progress(done: int, total: int) -> None:
            if not gone:  # after the first read, gc drops step 1 and deletes its packs
                gone.append(s.gc(LatestN(1), grace=0))

        s.load(ckpt, progress=progress)
    assert gone and gone[0].dropped == ["r@1"]
    assert isinstance(e.value.__cause__, ChunkNotFoundError)  # found out while reading chunks


def _resident_pages(region: memoryview) -> list[bool]:
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    n = region.nbytes // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.addressof(ctypes.c_char.from_buffer(region)), region.nbytes, vec) == 0
    return [bool(b & 1) for b in vec]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")
def test_a_fresh_target_range_is_faulted_in_at_once_and_a_recycled_one_is_left_alone() -> None:
    import mmap

    from ckstore.checkout import executor

    fresh = mmap.mmap(-1, 64 * mmap.PAGESIZE + executor.PREFAULT_MIN)  # untouched anonymous memory
    view = memoryview(fresh)
    assert not any(_resident_pages(view))
    populated = executor._prefault(view)
    if executor._libc is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert populated and all(_resident_pages(view))
    assert fresh[:] == bytes(len(fresh))  # faulted in, not written
    assert not executor._prefault(view)  # its pages are in now: nothing to do
    # a short range is left to the decode
    short = mmap.mmap(-1, executor.PREFAULT_MIN // 2)
    assert not executor._prefault(memoryview(short)) and not any(_resident_pages(memoryview(short)))
    view.release()
    fresh.close()
    short.close()


def test_a_checkout_into_fresh_memory_is_bit_exact(store_path: Path, tmp_path: Path) -> None:
    # every target of a first checkout is fresh: chunks decode into ranges faulted in ahead
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(300_000 + 4099 * i, generator=g) for i in range(3)}
    state["h"] = state["w0"].to(torch.bfloat16)
    ckstore.open(store_path, run="r", chunk_size=1 << 20).commit(1, {0: {"m": state}})
    proc = subprocess.run(
        [sys.executable, "-c", (
            "import sys, torch, ckstore\n"
            "out = ckstore.open(sys.argv[1], run='r').checkout(1)[0]['m']\n"
            "torch.save(out, sys.argv[2])\n"
        ), str(store_path), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = torch.load(tmp_path / "out.pt")
    assert out.keys() == state.keys()
    for k, v in state.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)
