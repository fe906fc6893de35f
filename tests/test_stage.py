"""The commit's data path (ckstore/commit/_stage.py): the garbage collector's pause around the
per-tensor work, which must always leave the collector as the caller had it; staging (tiny
tensors' bytes copied, others viewed); encoding ahead; and the packs a commit fills."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckstore
from ckstore import _collector
from ckstore.commit import _stage
from ckstore.errors import UnsupportedValueError


@pytest.fixture
def collector() -> Iterator[None]:
    """Restore the collector's state after the test."""
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_flattening_runs_with_the_collector_paused_and_restores_it(collector: None) -> None:
    seen: list[bool] = []

    def hook(x: Any) -> None:  # asked about the Parameter (not a plain torch.Tensor)
        seen.append(gc.isenabled())

    state = {0: {"m": {"p": torch.nn.Parameter(torch.ones(2))}}}
    gc.enable()
    _stage.prepare_entries(state, allow_pickle=False, tensor_hook=hook)
    assert seen == [False] and gc.isenabled()

    with pytest.raises(UnsupportedValueError):  # a refused state restores it too
        _stage.prepare_entries({0: {"m": {"o": object()}}}, allow_pickle=False, tensor_hook=hook)
    assert gc.isenabled()

    gc.disable()  # a collector the caller turned off stays off
    _stage.prepare_entries(state, allow_pickle=False, tensor_hook=hook)
    assert not gc.isenabled()


def test_overlapping_pauses_enable_the_collector_when_the_last_ends(collector: None) -> None:
    pause = _collector._CollectorPause()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with pause():
            inside.set()
            release.wait(30)

    gc.enable()
    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(30)
        with pause():
            with pause():  # nested
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread's pause still holds
    finally:
        release.set()
        t.join(30)
    assert gc.isenabled()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "staged"])
def test_a_commit_leaves_the_collector_as_it_found_it(store: ckstore.Store, collector: None, blocking: bool) -> None:
    state = {"w": torch.randn(64, 8), "n": {f"t{i}": torch.ones(3) * i for i in range(50)}}
    for step, enabled in enumerate((True, False, True)):
        if enabled:
            gc.enable()
        else:
            gc.disable()
        if blocking:
            store.commit(step, {0: {"m": state}})
        else:
            store.commit(step, {0: {"m": state}}, blocking=False).wait()
        assert gc.isenabled() is enabled
        with pytest.raises(UnsupportedValueError):  # refused at once, asynchronous or not
            store.commit(step + 10, {0: {"m": {"bad": object()}}}, blocking=blocking)  # type: ignore[call-overload]
        assert gc.isenabled() is enabled


def test_large_chunks_encode_during_the_claim_guessed_from_the_last_commit(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single process starts encoding the large chunks its last commit wrote first (the first
    large chunks before its first commit) before its claim says which are missing
    (:func:`_stage.encode_ahead`): a missing one takes that frame (not encoded twice), a
    stored one is encoded for nothing (when a thread took it before the commit's writes ended;
    dropped otherwise) and never written, and a state whose large chunks did not change is not
    guessed at."""
    from ckstore.maintenance.gc import list_packs
    from ckstore.maintenance.recover import read_pack_index

    monkeypatch.setattr(_stage, "_CPUS", 2)  # as on the project's machines, whatever this one has
    encoded: list[int] = []
    real = _stage._whole

    def counting(raw: memoryview, itemsize: int, level: int, tries: int | None = None) -> Any:
        encoded.append(raw.nbytes)
        return real(raw, itemsize, level, tries)

    monkeypatch.setattr(_stage, "_whole", counting)
    guessed: list[Any] = []  # the futures of every guess
    real_ahead = _stage.encode_ahead

    def guessing(*args: Any) -> Any:
        got = real_ahead(*args)
        guessed.extend(got.values())
        return got

    monkeypatch.setattr(_stage, "encode_ahead", guessing)
    s = ckstore.open(store_path, run="r", chunk_size=256 * 1024, workers=2)
    ws = [torch.randn(256, 256) for _ in range(4)]  # 256 KiB each: one large chunk apiece

    def commit(step: int, tensors: list[torch.Tensor]) -> tuple[int, int, int]:
        """(chunks guessed, chunks encoded on the pool, guesses dropped unencoded). A guess the
        claim finds stored is dropped once the commit's writes end: encoded if a thread took it
        by then, else never."""
        encoded.clear()
        guessed.clear()
        s.commit(step, {0: {"m": {f"w{i}": w for i, w in enumerate(tensors)}}})
        out = s.checkout(step)[0]["m"]
        assert all(torch.equal(out[f"w{i}"], w) for i, w in enumerate(tensors))
        return len(guessed), len(encoded), sum(f.cancelled() for f in guessed)

    def frames() -> int:
        return sum(len(read_pack_index(s.blobs, key, size)) for key, (size, _) in list_packs(s.blobs).items())

    assert commit(0, ws) == (2, 4, 0) and frames() == 4  # w0 and w1 encoded ahead, and written as they were
    ws[2:] = [w + 1 for w in ws[2:]]
    guesses, n, dropped = commit(1, ws)  # w0 and w1 again (the last commit wrote them first), then w2 and w3
    assert guesses == 2 and n + dropped == 4  # each of w0 and w1 encoded or dropped; w2 and w3 encoded once
    assert frames() == 6  # w0 and w1 stored already: never written
    ws[2:] = [w + 1 for w in ws[2:]]
    assert commit(2, ws) == (2, 2, 0) and frames() == 8  # w2 and w3, encoded ahead, guessed right
    guesses, n, dropped = commit(3, ws)  # nothing changed: w2 and w3 guessed, for nothing
    assert guesses == 2 and n + dropped == 2 and frames() == 8
    assert commit(4, ws) == (0, 0, 0) and frames() == 8  # the last commit wrote nothing: nothing guessed
    ws[3] = ws[3] + 1
    assert commit(5, ws) == (0, 0, 0) and frames() == 9  # nothing guessed; the lone changed chunk encoded inline
    s.close()


@pytest.mark.parametrize("small", [0, 3], ids=["large chunks only", "small chunks first"])
def test_a_commit_writes_one_pack_for_its_small_chunks_and_one_for_its_large_ones(
    store_path: Path, small: int
) -> None:
    """Small chunks go into a pack of their own ahead of the large ones; a commit writes exactly
    the packs it fills, none empty."""
    from ckstore.maintenance.gc import list_packs
    from ckstore.maintenance.recover import read_pack_index

    s = ckstore.open(store_path, run="r", chunk_size=256 * 1024, workers=2)
    state = {f"big{i}": torch.randn(256, 256) for i in range(3)}  # 256 KiB each: a large chunk apiece
    state.update({f"small{i}": torch.randn(64) for i in range(small)})
    s.commit(0, {0: {"m": state}})
    packs = list_packs(s.blobs)
    frames = sorted(len(read_pack_index(s.blobs, key, size)) for key, (size, _) in packs.items())
    assert frames == ([3, small] if small else [3])
    out = s.checkout(0)[0]["m"]
    assert all(torch.equal(out[k], v) for k, v in state.items())
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.float16])
def test_small_tensors_bytes_are_copied_large_ones_viewed(dtype: torch.dtype) -> None:
    """Staging views a CPU tensor's bytes in place, but copies those of a tensor under
    ``COPY_BELOW`` bytes (cheaper, and lighter than the view); either way the bytes are the
    tensor's."""
    from ckstore.format.tensorio import COPY_BELOW, raw_bytes

    for n in (1, COPY_BELOW // 8 - 1, COPY_BELOW, 4 * COPY_BELOW):
        t = (torch.arange(n) % 7).to(dtype)
        kept, data = raw_bytes(t)
        assert bytes(data) == t.numpy().tobytes() and data.format == "B" and data.nbytes == t.nbytes
        if t.nbytes < COPY_BELOW:
            assert kept is t and data.readonly  # a copy: writing into it could not reach the tensor
        else:
            assert not data.readonly and np.frombuffer(data, np.uint8).ctypes.data == t.data_ptr()  # a view
    assert raw_bytes(torch.zeros(0))[1].nbytes == 0


def test_tiny_tensor_bytes_are_the_tensors_whatever_its_dtype_offset_or_flags() -> None:
    """A tiny tensor's bytes are copied from its memory: the bytes of the tensor itself, for
    dtypes numpy cannot view (bf16, fp8), a slice that starts inside its storage, a tensor that
    requires grad, and a conjugated or negated view (resolved first, not copied as stored)."""
    from ckstore.format.tensorio import COPY_BELOW, raw_bytes

    def expected(t: torch.Tensor) -> bytes:
        u = t.detach().resolve_conj().resolve_neg().contiguous()
        return u.reshape(-1).view(torch.uint8).numpy().tobytes()

    base = torch.arange(40, dtype=torch.float32)
    cases = [
        torch.randn(8).to(torch.bfloat16),
        torch.randn(8).to(torch.float8_e4m3fn),
        base[7:19],  # starts 28 bytes into its storage
        base[3],  # 0-d, inside its storage
        torch.randn(5, requires_grad=True),
        torch.tensor([1 + 2j, 3 - 1j]).conj(),
        torch.tensor([1.0, 2.0])._neg_view(),
        base[::2],  # not contiguous
    ]
    for t in cases:
        kept, data = raw_bytes(t)
        assert t.nbytes < COPY_BELOW
        assert bytes(data) == expected(t), t
        assert not kept.requires_grad and expected(kept) == expected(t)  # the tensor kept holds those bytes


class _PlaneCounter:
    """Counts the planes (and samples) given to each thread's own plane compressor."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls, self.lock = real, 0, threading.Lock()

    def __call__(self, level: int) -> Any:
        return _CountingCompressor(self, self.real(level))


class _CountingCompressor:
    def __init__(self, counter: _PlaneCounter, real: Any) -> None:
        self.counter, self.real = counter, real

    def count(self, n: int) -> None:
        with self.counter.lock:
            self.counter.calls += n

    def compress(self, data: Any) -> bytes:
        self.count(1)
        return self.real.compress(data)

    def multi_compress_to_buffer(self, segments: Any, threads: int = 0) -> Any:
        self.count(len(segments))
        return self.real.multi_compress_to_buffer(segments, threads=threads)


def test_a_commit_compresses_the_planes_that_shrank_in_the_last_one(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store object's next commit compresses just the byte planes that shrank when it last
    encoded the same tensor's chunk (:class:`_stage.PlaneHints`): no samples, no mantissa
    planes tried in vain, the same frames. A plane that starts to shrink is found again within
    :attr:`~_stage.PlaneHints.RESAMPLE` commits, and each commit samples its share of chunks."""
    from ckstore.format import codec, hashing

    monkeypatch.setattr(_stage, "_CPUS", 2)  # chunks encoded ahead, as on the project's machines
    counter = _PlaneCounter(codec._plane_compressor)
    monkeypatch.setattr(codec, "_plane_compressor", counter)
    s = ckstore.open(store_path, run="r", chunk_size=256 * 1024, workers=2)
    torch.manual_seed(0)
    # 12 large chunks (256 KiB, encoded one by one) and 24 small ones (16 KiB, encoded together)
    state = {f"w{i}": torch.randn(256, 256) for i in range(12)}
    state.update({f"b{i}": torch.randn(4096) for i in range(24)})

    def commit(step: int) -> int:
        counter.calls = 0
        s.commit(step, {0: {"m": state}})
        return counter.calls

    first = commit(0)  # every large chunk samples its 4 planes, then compresses 1; the small ones try all 4
    assert first == 12 * 5 + 24 * 4
    sizes = {k: s.catalog.chunk_locations([hashing.digest(memoryview(t.numpy()).cast("B"))]) for k, t in state.items()}
    for step in range(1, 1 + _stage.PlaneHints.RESAMPLE):
        state = {k: t * 1.01 for k, t in state.items()}  # every chunk changed, alike
        calls = commit(step)
        # 36 chunks, about one in RESAMPLE sampled again (as the first commit did), the others
        # compress their exponent plane alone
        assert 36 < calls <= 36 + (36 // _stage.PlaneHints.RESAMPLE + 1) * 4, calls
        got = s.checkout(step)[0]["m"]
        assert all(torch.equal(got[k], t) for k, t in state.items())
    after = {k: s.catalog.chunk_locations([hashing.digest(memoryview(t.numpy()).cast("B"))]) for k, t in state.items()}
    for k in state:  # as well compressed as when every plane was sampled
        (a,) = sizes[k].values()
        (b,) = after[k].values()
        assert abs(b.length - a.length) < 0.01 * a.raw_size

    # w0 and w1 turn to (almost) zeros: their low planes now shrink, which the hint does not
    # try; a later sample finds them, and each chunk shrinks to almost nothing within RESAMPLE
    # commits. Two large chunks changed: both are encoded during the claim (encode_ahead), which
    # samples on the same schedule
    lengths: dict[str, list[int]] = {"w0": [], "w1": []}
    for step in range(100, 100 + _stage.PlaneHints.RESAMPLE + 1):
        for k in lengths:
            state[k] = torch.zeros(256, 256)
            state[k][0, 0], state[k][0, 1] = step, int(k[1:])  # a new chunk each commit, each its own
        commit(step)
        got = s.checkout(step)[0]["m"]
        for k, seen in lengths.items():
            (loc,) = s.catalog.chunk_locations([hashing.digest(memoryview(state[k].numpy()).cast("B"))]).values()
            seen.append(loc.length)
            assert torch.equal(got[k], state[k])
    for k, seen in lengths.items():
        assert seen[0] > 0.7 * 256 * 1024, k  # the hint from randn: the exponent plane alone compressed
        assert seen[-1] < 0.01 * 256 * 1024, (k, seen)  # sampled again since: every plane compressed
    s.close()
