"""Chunk frames: byte-grouping plus zstd, with incompressible bytes stored raw.

A frame is what the blob store holds for one chunk. Its header is 8 bytes, little-endian::

    u8  codec      0 = raw, 1 = zstd, 2 = byte planes, 3 = delta
    u8  itemsize   element size the planes were cut by (codec 2), else 1
    u16 plane_mask bit j set: plane j is zstd-compressed (codec 2)
    u32 raw_len    length of the chunk's raw bytes

Codec 2 follows the header with ``itemsize`` u32 stored plane lengths, then the planes. Plane j
holds byte j of every element (``raw[j::itemsize]``). Only planes whose sample shrinks are
compressed: for float tensors that is the sign/exponent plane, while mantissa planes are
random bytes that zstd cannot shrink, so skipping them keeps the ratio at a fraction of the CPU.
A caller that knows which planes shrank in the same tensor's last chunk names them instead
(``tries``), skipping the samples too.

Codec 3 (a delta) follows the header with the 16-byte digest of its base, another chunk of the
same raw length, then a whole frame of codec 0, 1 or 2 holding the XOR of the two chunks' raw
bytes: successive states of a tensor one training step apart differ in their low mantissa bytes,
so the XOR's high planes are mostly zero and compress. It decodes onto the base's raw bytes
(:func:`apply_delta`).

Encoding never concatenates: a frame is a list of buffers written one after another, and a
chunk that does not shrink is written straight from the tensor's memory.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import zstandard

from ..errors import IntegrityError
from .planes import merge as merge_planes
from .planes import split as split_planes

__all__ = [
    "CODEC_RAW",
    "CODEC_ZSTD",
    "CODEC_PLANES",
    "CODEC_DELTA",
    "DELTA_OVERHEAD",
    "Frame",
    "encode",
    "encode_delta",
    "delta_base",
    "delta_itemsize",
    "apply_delta",
    "encode_many",
    "plane_mask",
    "decode_into",
    "raw_length",
    "max_frame_length",
    "HEADER_SIZE",
]

CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_PLANES = 2
CODEC_DELTA = 3

HEADER_SIZE = 8
#: what a delta frame adds to the frame of its XOR: its own header and its base's digest
DELTA_OVERHEAD = HEADER_SIZE + 16

_HEADER = struct.Struct("<BBHI")
_SAMPLE_BYTES = 16 * 1024
#: chunks shorter than this are stored raw without a compression attempt: a zstd frame's own
#: overhead leaves little to save (measured on a real Adam state: its 256-byte chunks shrank by
#: 0.7%, for 10 µs of work each)
_MIN_COMPRESS = 512
_SHRINK_ENOUGH = 0.92  # a plane is compressed only if its sample shrinks below this ratio

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    key = f"c{level}"
    c = getattr(_local, key, None)
    if c is None:
        c = zstandard.ZstdCompressor(level=level)
        setattr(_local, key, c)
    return c


def _plane_compressor(level: int) -> zstandard.ZstdCompressor:
    """The compressor for byte planes of multi-byte elements.

    Such a plane (the sign/exponent bytes of floats, say) is a stream of few distinct symbols with
    no long repeats: zstd's match finder costs time and even hurts, while its entropy coder does
    the work. At the default level a tiny match table and 7-byte minimum matches leave it mostly
    to the entropy coder: measured on real fp32 and bf16 weights, about 3x faster to compress,
    1.5x faster to decompress, and a slightly better ratio than plain level 1. Higher levels
    use zstd's own parameters.
    """
    if level > 1:
        return _compressor(level)
    c = getattr(_local, "planes", None)
    if c is None:
        params = zstandard.ZstdCompressionParameters.from_level(
            1, hash_log=6, min_match=7, search_log=1, window_log=17, strategy=zstandard.STRATEGY_FAST
        )
        c = _local.planes = zstandard.ZstdCompressor(compression_params=params)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


class Frame(NamedTuple):
    """An encoded chunk: buffers to write in order, and their total length (a tuple: one is
    made per chunk a commit encodes)."""

    codec: int
    parts: tuple[bytes | memoryview, ...]
    length: int


def _shrinks(sample: np.ndarray, c: zstandard.ZstdCompressor) -> bool:
    if sample.nbytes == 0:
        return False
    return len(c.compress(sample.data)) < _SHRINK_ENOUGH * sample.nbytes


def encode(raw: memoryview, itemsize: int, level: int = 1, tries: int | None = None) -> Frame:
    """Encode one chunk's raw bytes; ``raw`` must stay alive until the frame is written.

    ``tries`` (a plane mask): for a chunk cut into byte planes, the planes to compress, each
    whole and kept where it shrinks as a sample must; the others are stored raw untried. A
    commit passes what shrank when the same tensor's chunk was encoded last
    (:class:`ckstore.commit._stage.PlaneHints`), which skips the samples and the planes that
    would not shrink. None: each plane's sample decides."""
    n = raw.nbytes
    if n < _MIN_COMPRESS:  # a zstd frame's own overhead leaves nothing worth saving
        return Frame(CODEC_RAW, (_HEADER.pack(CODEC_RAW, 1, 0, n), raw), HEADER_SIZE + n)
    a = np.frombuffer(raw, dtype=np.uint8)
    if itemsize <= 1 or n % itemsize or n < 2 * itemsize:
        if n <= _SAMPLE_BYTES:  # the sample would be the whole chunk: compress it once
            comp = _compressor(level).compress(a.data)
            if len(comp) < _SHRINK_ENOUGH * n:
                return Frame(CODEC_ZSTD, (_HEADER.pack(CODEC_ZSTD, 1, 0, n), comp), HEADER_SIZE + len(comp))
            return Frame(CODEC_RAW, (_HEADER.pack(CODEC_RAW, 1, 0, n), raw), HEADER_SIZE + n)
        if _shrinks(a[:_SAMPLE_BYTES], _compressor(level)):
            comp = _compressor(level).compress(a.data)
            if len(comp) < n:
                return Frame(CODEC_ZSTD, (_HEADER.pack(CODEC_ZSTD, 1, 0, n), comp), HEADER_SIZE + len(comp))
        return Frame(CODEC_RAW, (_HEADER.pack(CODEC_RAW, 1, 0, n), raw), HEADER_SIZE + n)

    pc = _plane_compressor(level)
    if tries is not None:
        return _tried_planes(raw, a, itemsize, pc, tries)
    if n <= _SAMPLE_BYTES * itemsize:  # each plane's sample would be the whole plane
        return _tried_planes(raw, a, itemsize, pc, (1 << itemsize) - 1)
    mask = 0
    for j, sample in enumerate(split_planes(a[: _SAMPLE_BYTES * itemsize], itemsize)):
        if _shrinks(sample, pc):
            mask |= 1 << j
    if not mask:
        return Frame(CODEC_RAW, (_HEADER.pack(CODEC_RAW, 1, 0, n), raw), HEADER_SIZE + n)

    planes: list[bytes | memoryview] = []
    for j, plane in enumerate(split_planes(a, itemsize)):
        if mask >> j & 1:
            comp = pc.compress(plane.data)
            if len(comp) < plane.nbytes:
                planes.append(comp)
                continue
            mask &= ~(1 << j)
        planes.append(plane.data)
    return _planes_frame(raw, itemsize, mask, planes)


def encode_delta(raw: memoryview, base: memoryview, base_digest: bytes, itemsize: int, level: int = 1) -> Frame:
    """The delta frame of ``raw`` against ``base``, the raw bytes of the chunk of digest
    ``base_digest`` (the same length): the XOR of the two, encoded by :func:`encode`, after a
    header naming the base. The frame holds the XOR's buffer alive until it is written."""
    n = raw.nbytes
    if base.nbytes != n or len(base_digest) != 16:
        raise ValueError(f"a delta needs a base of the chunk's {n} bytes and a 16-byte digest")
    xor = np.bitwise_xor(np.frombuffer(raw, dtype=np.uint8), np.frombuffer(base, dtype=np.uint8))
    inner = encode(xor.data, itemsize, level)
    head = _HEADER.pack(CODEC_DELTA, 1, 0, n) + base_digest
    return Frame(CODEC_DELTA, (head, *inner.parts), DELTA_OVERHEAD + inner.length)


def delta_base(frame: memoryview | bytes) -> bytes | None:
    """The digest of the base a delta frame decodes against; None for any other frame."""
    if len(frame) < HEADER_SIZE or frame[0] != CODEC_DELTA:
        return None
    if len(frame) < DELTA_OVERHEAD:
        raise IntegrityError(f"delta chunk frame of {len(frame)} bytes is shorter than its header")
    return bytes(frame[HEADER_SIZE:DELTA_OVERHEAD])


def delta_itemsize(frame: memoryview | bytes) -> int:
    """The element size a delta frame's XOR was cut into byte planes by (1 when it was not)."""
    inner = memoryview(frame)[DELTA_OVERHEAD:]
    if inner.nbytes >= HEADER_SIZE and inner[0] == CODEC_PLANES:
        return int(inner[1])
    return 1


def encode_many(
    raws: Sequence[memoryview],
    itemsize: int,
    level: int = 1,
    threads: int = 1,
    tries: Sequence[int | None] | None = None,
) -> list[Frame]:
    """:func:`encode` of many chunks of ``itemsize``-byte elements, the same frames byte for byte
    (``tries``: each chunk's, as :func:`encode` takes it).

    Chunks whose planes are no longer than a sample (a real optimizer state is thousands of such
    tensors) are split into byte planes together, in one pass over their concatenation (each
    holds whole elements, so chunk k's plane j is a slice of the concatenation's plane j), and
    their planes compressed in one call on ``threads`` of zstd's own threads, which hold no GIL
    (measured: 1,200 fp32 chunks of 16 KiB, 65 ms one by one, 44 ms on two zstd threads; half of
    them handed to one of ckstore's threads instead lost to the GIL). Other chunks are encoded
    one by one."""
    frames: list[Frame | None] = [None] * len(raws)
    batch = [
        i for i, r in enumerate(raws)
        if itemsize > 1 and _MIN_COMPRESS <= r.nbytes <= _SAMPLE_BYTES * itemsize and r.nbytes % itemsize == 0
        and r.nbytes >= 2 * itemsize
    ]  # fmt: skip
    every = (1 << itemsize) - 1
    masks = [every if tries is None or tries[i] is None else cast(int, tries[i]) & every for i in batch]
    if threads > 1 and len(batch) >= _MANY and _MULTI:
        chunk_planes = _planes_of_many([raws[i] for i in batch], itemsize)
        # the planes to compress: every plane of a chunk without tries (then kept where it
        # shrinks: the frame :func:`encode` makes after sampling), else the planes tried
        segments: list[memoryview] = [
            p.data for planes, mask in zip(chunk_planes, masks) for j, p in enumerate(planes) if mask >> j & 1
        ]
        try:
            packed = _plane_compressor(level).multi_compress_to_buffer(cast(Any, segments), threads=threads)
        except NotImplementedError:  # a backend of python-zstandard without it
            packed = None
        if packed is not None:
            at = 0
            for k, i in enumerate(batch):
                planes = [p.data for p in chunk_planes[k]]
                # segments of zstd's output buffer, which they keep alive; a plane not tried
                # stands for its own compressed form (as long: not kept compressed)
                compressed = []
                for j in range(itemsize):
                    if masks[k] >> j & 1:
                        compressed.append(memoryview(cast(Any, packed[at])))
                        at += 1
                    else:
                        compressed.append(planes[j])
                frames[i] = _small_planes_frame(raws[i], itemsize, planes, compressed)
    return [
        f if f is not None else encode(raws[i], itemsize, level, None if tries is None else tries[i])
        for i, f in enumerate(frames)
    ]


_MULTI = hasattr(zstandard.ZstdCompressor, "multi_compress_to_buffer")
_MANY = 16  # fewer chunks than this are encoded one by one: starting zstd's threads costs more


def _planes_of_many(raws: Sequence[memoryview], itemsize: int) -> list[list[np.ndarray]]:
    """Each chunk's byte planes (views), split from the chunks' concatenation at once."""
    whole = np.concatenate([np.frombuffer(r, dtype=np.uint8) for r in raws])
    planes = split_planes(whole, itemsize)
    out, at = [], 0
    for r in raws:
        n = r.nbytes // itemsize
        out.append([p[at : at + n] for p in planes])
        at += n
    return out


def _tried_planes(raw: memoryview, a: np.ndarray, itemsize: int, pc: zstandard.ZstdCompressor, tries: int) -> Frame:
    """:func:`encode` of a chunk told which planes to try: those compressed whole, each kept
    where it shrinks as a sample must, the others stored raw. Every plane tried is also how a
    chunk whose planes are no longer than a sample is encoded: each compressed once, the same
    frame as sampling first, for half the work."""
    tries &= (1 << itemsize) - 1
    if not tries:  # no plane shrank last time: stored raw, straight from the tensor's memory
        return Frame(CODEC_RAW, (_HEADER.pack(CODEC_RAW, 1, 0, raw.nbytes), raw), HEADER_SIZE + raw.nbytes)
    planes = [p.data for p in split_planes(a, itemsize)]
    compressed = [memoryview(pc.compress(p)) if tries >> j & 1 else p for j, p in enumerate(planes)]
    return _small_planes_frame(raw, itemsize, planes, compressed)


def plane_mask(frame: Frame) -> int | None:
    """The planes a frame :func:`encode` made holds compressed, as a plane mask (0: none, the
    chunk stored raw); None for a frame not cut into planes (single bytes, a short chunk, a
    delta). What a later encode of the same tensor's chunk can take as its ``tries``."""
    codec, itemsize, mask, n = _HEADER.unpack_from(frame.parts[0], 0)
    if codec == CODEC_PLANES:
        return int(mask)
    if codec == CODEC_RAW and n >= _MIN_COMPRESS:
        return 0  # raw: no plane shrank (or a chunk of single bytes that did not: the caller knows)
    return None


def _small_planes_frame(
    raw: memoryview, itemsize: int, planes: Sequence[memoryview], compressed: Sequence[memoryview]
) -> Frame:
    """The frame of a chunk whose planes were each compressed once: a plane is kept compressed if
    it shrank as a sample must (one rule for :func:`encode` and :func:`encode_many`)."""
    mask = 0
    parts: list[bytes | memoryview] = []
    sizes: list[int] = []
    for j, (plane, comp) in enumerate(zip(planes, compressed)):
        size = comp.nbytes
        if size < _SHRINK_ENOUGH * plane.nbytes:
            mask |= 1 << j
            parts.append(comp)
        else:
            size = plane.nbytes
            parts.append(plane)
        sizes.append(size)
    return _planes_frame(raw, itemsize, mask, parts, sizes)


def _planes_frame(
    raw: memoryview, itemsize: int, mask: int, planes: list[bytes | memoryview], sizes: list[int] | None = None
) -> Frame:
    """``sizes``: each plane's length, when the caller knows them (an Adam state's 1,200 chunks of
    16 KiB are framed a few µs faster each, without a memoryview of every plane to ask)."""
    n = raw.nbytes
    if not mask:
        return Frame(CODEC_RAW, (_HEADER.pack(CODEC_RAW, 1, 0, n), raw), HEADER_SIZE + n)
    if sizes is None:
        sizes = [memoryview(p).nbytes for p in planes]
    header = _HEADER.pack(CODEC_PLANES, itemsize, mask, n)
    return Frame(CODEC_PLANES, (header, _LENGTHS[itemsize].pack(*sizes), *planes), HEADER_SIZE + 4 * itemsize + sum(sizes))


def raw_length(frame: memoryview | bytes) -> int:
    """The raw length a frame decodes to, read from its header."""
    if len(frame) < HEADER_SIZE:
        raise IntegrityError(f"chunk frame of {len(frame)} bytes is shorter than its header")
    return int(_HEADER.unpack_from(frame, 0)[3])


def max_frame_length(raw_len: int) -> int:
    """The longest frame :func:`encode` writes for ``raw_len`` raw bytes.

    A frame is stored raw unless it shrinks, so it is never longer than the header, the
    byte-plane length table and the raw bytes (a delta frame: that, after its own header and
    its base's digest).
    """
    return DELTA_OVERHEAD + HEADER_SIZE + 4 * _MAX_ITEMSIZE + raw_len


_MAX_ITEMSIZE = 16  # plane_mask has 16 bits
#: each element size's table of plane lengths (little-endian u32s)
_LENGTHS = [struct.Struct(f"<{k}I") for k in range(_MAX_ITEMSIZE + 1)]


def _unzstd(src: memoryview, dest: memoryview, what: str) -> None:
    """Decompress one zstd frame ``src`` into ``dest``, which it must fill exactly.

    python-zstandard's one-shot ``decompress`` trusts a frame's declared content size (and
    ignores ``max_output_size`` when there is one), so the declared size is checked against the
    expected length first and the frame is then streamed straight into ``dest``: decoding never
    allocates more than the expected length, whatever the frame says.
    """
    n = dest.nbytes
    try:
        params = zstandard.get_frame_parameters(src)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{what} has no valid zstd frame header: {e}") from e
    declared = params.content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared != n:
        raise IntegrityError(f"{what} declares {declared} bytes, expected {n}")
    if declared == zstandard.CONTENTSIZE_UNKNOWN and params.window_size > max(2 * n, 1 << 17):
        # zstd would allocate a window this large to stream a frame of unknown size
        raise IntegrityError(f"{what} asks for a {params.window_size}-byte window to produce {n} bytes")
    reader = _decompressor().stream_reader(src)
    got = 0
    while got < n:
        k = reader.readinto(dest[got:])
        if not k:
            raise IntegrityError(f"{what} decoded to {got} bytes, expected {n}")
        got += k
    if reader.read(1):
        raise IntegrityError(f"{what} decodes to more than the expected {n} bytes")


def decode_into(frame: memoryview | bytes, dest: memoryview) -> None:
    """Decode ``frame`` into ``dest``, which must be exactly the chunk's raw length.

    Never allocates more than ``dest``'s length, whatever the frame declares. Raises
    :class:`IntegrityError` naming what is wrong when the frame is malformed; the caller
    verifies the digest. A delta frame (:func:`delta_base` names its base) is refused: it
    decodes onto its base's raw bytes, with :func:`apply_delta`.
    """
    fv = memoryview(frame).cast("B") if memoryview(frame).format != "B" else memoryview(frame)
    if fv.nbytes < HEADER_SIZE:
        raise IntegrityError(f"chunk frame of {fv.nbytes} bytes is shorter than its header")
    codec, itemsize, mask, n = _HEADER.unpack_from(fv, 0)
    out = memoryview(dest).cast("B") if memoryview(dest).format != "B" else memoryview(dest)
    if out.nbytes != n:
        raise IntegrityError(f"chunk frame holds {n} raw bytes, expected {out.nbytes}")
    if codec == CODEC_DELTA:
        raise IntegrityError("delta chunk frame decoded without its base")
    body = fv[HEADER_SIZE:]
    if codec in (CODEC_RAW, CODEC_ZSTD) and (itemsize, mask) != (1, 0):
        raise IntegrityError(f"chunk frame of codec {codec} has itemsize {itemsize} and plane mask {mask:#x}")
    try:
        if codec == CODEC_RAW:
            if body.nbytes != n:
                raise IntegrityError(f"raw chunk frame holds {body.nbytes} bytes, header says {n}")
            out[:] = body
        elif codec == CODEC_ZSTD:
            _unzstd(body, out, "zstd chunk frame")
        elif codec == CODEC_PLANES:
            _planes_into(body, out, itemsize, mask)
        else:
            raise IntegrityError(f"unknown chunk codec {codec}")
    except zstandard.ZstdError as e:
        raise IntegrityError(f"chunk frame does not decompress: {e}") from e


def apply_delta(frame: memoryview | bytes, dest: memoryview, scratch: memoryview) -> None:
    """Turn ``dest``, which holds the raw bytes of a delta frame's base (verified against its
    digest by the caller), into the delta's chunk: the frame's XOR is decoded into ``scratch``
    (as long as ``dest``) and XORed into ``dest``. A chain of deltas decodes in place this way,
    from its whole chunk up, with one scratch buffer; the caller verifies each level's digest.
    Never allocates, whatever the frame declares."""
    fv = memoryview(frame).cast("B") if memoryview(frame).format != "B" else memoryview(frame)
    if fv.nbytes < HEADER_SIZE:
        raise IntegrityError(f"chunk frame of {fv.nbytes} bytes is shorter than its header")
    codec, itemsize, mask, n = _HEADER.unpack_from(fv, 0)
    out = memoryview(dest).cast("B") if memoryview(dest).format != "B" else memoryview(dest)
    if codec != CODEC_DELTA:
        raise IntegrityError(f"chunk frame of codec {codec} is not a delta")
    if out.nbytes != n or memoryview(scratch).nbytes != n:
        raise IntegrityError(f"delta chunk frame holds {n} raw bytes, expected {out.nbytes}")
    if (itemsize, mask) != (1, 0):
        raise IntegrityError(f"delta chunk frame has itemsize {itemsize} and plane mask {mask:#x}")
    inner = fv[DELTA_OVERHEAD:]
    if inner.nbytes >= 1 and inner[0] == CODEC_DELTA:
        raise IntegrityError("delta chunk frame holds another delta frame")
    decode_into(inner, scratch)
    dst = np.frombuffer(out, dtype=np.uint8)
    np.bitwise_xor(dst, np.frombuffer(scratch, dtype=np.uint8), out=dst)


def _planes_into(body: memoryview, out: memoryview, itemsize: int, mask: int) -> None:
    n = out.nbytes
    if not 2 <= itemsize <= _MAX_ITEMSIZE or n % itemsize:
        raise IntegrityError(f"byte-plane frame with itemsize {itemsize} and length {n}")
    if mask >> itemsize:
        raise IntegrityError(f"byte-plane frame of {itemsize} planes marks plane {mask.bit_length() - 1} compressed")
    table = 4 * itemsize
    if body.nbytes < table:
        raise IntegrityError(f"byte-plane frame of {body.nbytes} bytes is shorter than its length table")
    lengths = struct.unpack_from(f"<{itemsize}I", body, 0)
    if table + sum(lengths) != body.nbytes:
        raise IntegrityError(
            f"byte-plane frame holds {body.nbytes - table} bytes of planes, its table says {sum(lengths)}"
        )
    per_plane = n // itemsize
    sources: list[np.ndarray] = []
    pos = table
    for j, ln in enumerate(lengths):
        part = body[pos : pos + ln]
        pos += ln
        if mask >> j & 1:
            plane = np.empty(per_plane, dtype=np.uint8)
            _unzstd(part, plane.data, f"byte plane {j}")
        else:
            if part.nbytes != per_plane:
                raise IntegrityError(f"byte plane {j} holds {part.nbytes} bytes, expected {per_plane}")
            plane = np.frombuffer(part, dtype=np.uint8)
        sources.append(plane)
    merge_planes(sources, np.frombuffer(out, dtype=np.uint8))
