from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from helpers import ALL_DTYPES, random_tensor

from ckstore.errors import IntegrityError
from ckstore.format import codec


def _roundtrip(raw: np.ndarray, itemsize: int) -> codec.Frame:
    frame = codec.encode(memoryview(raw), itemsize)
    blob = b"".join(bytes(p) for p in frame.parts)
    assert len(blob) == frame.length
    out = np.empty(raw.nbytes, dtype=np.uint8)
    codec.decode_into(blob, memoryview(out))
    assert out.tobytes() == raw.tobytes()
    return frame


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_roundtrip_random_bits(dtype: torch.dtype) -> None:
    t = random_tensor(dtype, (1000,))
    _roundtrip(t.reshape(-1).view(torch.uint8).numpy(), t.element_size())


def test_float_weights_are_byte_grouped_and_shrink() -> None:
    t = torch.randn(64 * 1024)
    frame = _roundtrip(t.view(torch.uint8).numpy(), 4)
    assert frame.codec == codec.CODEC_PLANES
    assert frame.length < 0.9 * t.numel() * 4


def test_bf16_shrinks_more() -> None:
    t = torch.randn(64 * 1024).to(torch.bfloat16)
    frame = _roundtrip(t.view(torch.uint8).numpy(), 2)
    assert frame.length < 0.75 * t.numel() * 2


def test_incompressible_bytes_are_stored_raw_without_copy() -> None:
    raw = np.frombuffer(np.random.default_rng(0).bytes(100_000), dtype=np.uint8)
    frame = codec.encode(memoryview(raw), 1)
    assert frame.codec == codec.CODEC_RAW
    assert frame.length == codec.HEADER_SIZE + raw.nbytes
    assert np.shares_memory(np.frombuffer(frame.parts[1], dtype=np.uint8), raw)


def test_zeros_compress_to_almost_nothing() -> None:
    raw = np.zeros(1 << 20, dtype=np.uint8)
    frame = _roundtrip(raw, 4)
    assert frame.length < 1000


def test_odd_lengths_and_tiny_chunks() -> None:
    for n in (0, 1, 3, 7, 9):
        _roundtrip(np.arange(n, dtype=np.uint8), 4)


def test_chunks_under_the_minimum_are_stored_raw_without_a_try() -> None:
    zeros = np.zeros(codec._MIN_COMPRESS, dtype=np.uint8)
    assert _roundtrip(zeros[:-1], 4).codec == codec.CODEC_RAW
    assert _roundtrip(zeros, 4).codec == codec.CODEC_PLANES


def test_truncated_and_garbage_frames_raise() -> None:
    t = torch.randn(4096)
    frame = codec.encode(memoryview(t.view(torch.uint8).numpy()), 4)
    blob = b"".join(bytes(p) for p in frame.parts)
    out = memoryview(np.empty(t.numel() * 4, dtype=np.uint8))
    with pytest.raises(IntegrityError):
        codec.decode_into(blob[:-10], out)
    with pytest.raises(IntegrityError):
        codec.decode_into(b"\x09" + blob[1:], out)
    with pytest.raises(IntegrityError):
        codec.decode_into(blob[:4], out)
    with pytest.raises(IntegrityError):
        codec.decode_into(blob, memoryview(np.empty(10, dtype=np.uint8)))


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("floats", [3 * 512, 3 * 1024, 3 * 65536], ids=["6KiB", "12KiB", "768KiB"])
def test_planes_are_the_documented_layout(itemsize: int, offset: int, floats: int) -> None:
    """Plane j of a frame is ``raw[j::itemsize]`` (docs/format.md), however the codec splits and
    merges (small and large chunks take different ways): frames written by any version read the
    same. Checked both ways: the planes of an encoded frame against strided slices, and a frame
    built by hand from strided slices decoded."""
    weights = (np.random.default_rng(itemsize).standard_normal(floats) * 0.02).astype(np.float32)
    raw = np.frombuffer(weights.tobytes(), dtype=np.uint8)
    buf = np.zeros(raw.nbytes + 1, dtype=np.uint8)
    buf[offset : offset + raw.nbytes] = raw
    raw = buf[offset : offset + raw.nbytes]  # an odd address when unaligned
    frame = codec.encode(memoryview(raw), itemsize)
    blob = b"".join(bytes(p) for p in frame.parts)
    kind, size, mask, n = codec._HEADER.unpack_from(blob, 0)
    assert (kind, size, n) == (codec.CODEC_PLANES, itemsize, raw.nbytes) and mask
    lengths = np.frombuffer(blob, dtype="<u4", count=itemsize, offset=codec.HEADER_SIZE)
    pos = codec.HEADER_SIZE + 4 * itemsize
    for j, length in enumerate(lengths):
        part = blob[pos : pos + int(length)]
        pos += int(length)
        plane = zstandard.ZstdDecompressor().decompress(part) if mask >> j & 1 else part
        assert plane == raw[j::itemsize].tobytes(), f"plane {j}"

    by_hand = [raw[j::itemsize].tobytes() for j in range(itemsize)]
    by_hand[-1] = zstandard.ZstdCompressor().compress(by_hand[-1])
    hand = codec._HEADER.pack(codec.CODEC_PLANES, itemsize, 1 << (itemsize - 1), raw.nbytes)
    hand += np.array([len(p) for p in by_hand], dtype="<u4").tobytes() + b"".join(by_hand)
    out = np.zeros(raw.nbytes + 1, dtype=np.uint8)[offset : offset + raw.nbytes]
    codec.decode_into(hand, memoryview(out))
    assert out.tobytes() == raw.tobytes()


def _frame_bytes(f: codec.Frame) -> tuple[int, int, bytes]:
    return f.codec, f.length, b"".join(bytes(p) for p in f.parts)


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_encode_many_writes_the_frames_encode_writes(itemsize: int) -> None:
    """Chunks encoded together (their planes split in one pass, compressed on zstd's threads) are
    byte for byte the frames of encoding each alone: of every kind, in any order, kept readable
    after the batch's buffers are gone."""
    rng = np.random.default_rng(itemsize)
    dt = {2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
    arrays = [
        (rng.standard_normal(n) * 1e-3).astype(dt)
        for n in (4096 // itemsize, 16384 // itemsize, 64 * 1024 // itemsize, 3 * 1024 // itemsize + 1)
    ]
    arrays += [np.zeros(2048 // itemsize, dt), np.arange(600 // itemsize, dtype=dt), np.ones(40, dt)]
    arrays += [rng.integers(0, 255, 8192, dtype=np.uint8).view(dt)]  # incompressible: stored raw
    arrays += [(rng.standard_normal(200_000) * 1e-3).astype(dt)]  # past a sample: sampled, one by one
    raws = [memoryview(a).cast("B") for a in arrays * 3]  # 27 chunks: more than one batch's minimum
    raws.append(memoryview(b"\x01\x02\x03"))  # not whole elements: encoded alone
    want = [_frame_bytes(codec.encode(r, itemsize)) for r in raws]
    frames = codec.encode_many(raws, itemsize, threads=2)
    del arrays
    assert [_frame_bytes(f) for f in frames] == want
    if codec._MULTI:  # the planes really were compressed together, by zstd's multi-chunk call
        assert any(isinstance(p, memoryview) and type(p.obj).__name__ == "BufferSegment" for f in frames for p in f.parts)
    kinds = {f.codec for f in frames}
    assert {codec.CODEC_PLANES, codec.CODEC_RAW} <= kinds
    for r, f in zip(raws, frames):  # and they decode
        out = bytearray(r.nbytes)
        codec.decode_into(_frame_bytes(f)[2], memoryview(out))
        assert bytes(out) == bytes(r)
    # one thread: the chunks are encoded one by one, the same frames
    assert [_frame_bytes(f) for f in codec.encode_many(raws, itemsize, threads=1)] == want


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_tries_compress_just_the_planes_named(itemsize: int) -> None:
    """Told which planes to try, encode compresses those whole and keeps each that shrinks,
    stores the others raw without a sample, and says which it kept (:func:`codec.plane_mask`):
    given what a sampled encode kept, it makes the same frame. Every frame decodes."""
    rng = np.random.default_rng(itemsize)
    dt = {2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
    for n in (4096, 16384, 256 * 1024):
        raw = memoryview((rng.standard_normal(n // itemsize) * 1e-3).astype(dt)).cast("B")
        sampled = codec.encode(raw, itemsize)
        mask = codec.plane_mask(sampled)
        assert mask and mask != (1 << itemsize) - 1  # the high plane(s) shrink, the low ones do not
        assert _frame_bytes(codec.encode(raw, itemsize, tries=mask)) == _frame_bytes(sampled)
        everything = codec.encode(raw, itemsize, tries=(1 << itemsize) - 1)  # the low planes tried in vain
        assert codec.plane_mask(everything) == mask and everything.length == sampled.length
        none = codec.encode(raw, itemsize, tries=0)  # stored raw, straight from the chunk's memory
        assert none.codec == codec.CODEC_RAW and none.parts[1] is raw and codec.plane_mask(none) == 0
        low = codec.encode(raw, itemsize, tries=1)  # a low plane alone: it does not shrink, so raw
        assert codec.plane_mask(low) == 0
        for f in (sampled, everything, none, low):
            out = bytearray(raw.nbytes)
            codec.decode_into(_frame_bytes(f)[2], memoryview(out))
            assert bytes(out) == bytes(raw)
    assert codec.plane_mask(codec.encode(memoryview(b"x" * 100), 1)) is None  # too short for planes
    assert codec.plane_mask(codec.encode(memoryview(b"x" * 4096), 1)) is None  # single bytes: zstd whole


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_encode_many_with_tries_writes_the_frames_encode_writes(itemsize: int) -> None:
    """Each chunk's tries, in a batch compressed together, make the frames encode makes alone."""
    rng = np.random.default_rng(itemsize + 10)
    dt = {2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
    arrays = [(rng.standard_normal(4096 // itemsize) * 1e-3).astype(dt) for _ in range(20)]
    arrays += [np.zeros(2048 // itemsize, dt), (rng.standard_normal(200_000) * 1e-3).astype(dt)]
    raws = [memoryview(a).cast("B") for a in arrays]
    every = (1 << itemsize) - 1
    tries: list[int | None] = [[None, 0, 1 << (itemsize - 1), every, 1][i % 5] for i in range(len(raws))]
    want = [_frame_bytes(codec.encode(r, itemsize, tries=t)) for r, t in zip(raws, tries)]
    assert [_frame_bytes(f) for f in codec.encode_many(raws, itemsize, threads=2, tries=tries)] == want
    assert [_frame_bytes(f) for f in codec.encode_many(raws, itemsize, threads=1, tries=tries)] == want
    assert len({w[2] for w in want[:5]}) > 1  # the tries did make different frames
