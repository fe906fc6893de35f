"""Byte planes: splitting a chunk into its planes and interleaving them back, several ways.

The byte-plane codec (``ckstore.format.codec``) stores byte ``j`` of every element together.
This compares, on one thread and a 4 MiB chunk, ckstore's compiled kernels
(``ckstore/format/_planes.c``, what ckstore uses when they are built), numpy's strided copies
(what ckstore's numpy fallback merges 4- and 8-byte elements with, and splits 8-byte ones and
chunks under 64 KiB), casts and shifts on 16- and 32-bit words, either through full-size casts
or with shifts written straight into place (what the fallback splits 2- and 4-byte elements of
larger chunks with, and merges 2-byte ones), numcodecs' ``Shuffle`` when installed (same byte
layout), and ``memcpy`` for scale; then ckstore's own ``encode`` and ``decode_into`` on fp32
and bf16 data, with either kernel. Each figure is the median of ``--calls`` timed calls.

    python benchmarks/bench_planes.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from ckstore.format import codec  # noqa: E402
from ckstore.format import planes as byte_planes

CHUNK = 4 << 20


def timed(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def words(itemsize: int) -> str:
    return {2: "<u2", 4: "<u4"}[itemsize]


def split_words(a: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Planes by narrowing casts of shifted words (2- and 4-byte elements)."""
    w = a.view(words(itemsize))
    out = []
    for j in range(itemsize):
        p = np.empty(w.size, dtype=np.uint8)
        np.copyto(p, w >> (8 * j) if j else w, casting="unsafe")
        out.append(p)
    return out


def merge_words(planes: list[np.ndarray], dst: np.ndarray, itemsize: int) -> None:
    """Interleave by widening casts, shifts and ors on words."""
    w = dst.view(words(itemsize))
    np.copyto(w, planes[-1], casting="unsafe")
    for j in range(itemsize - 2, -1, -1):
        np.left_shift(w, 8, out=w)
        np.bitwise_or(w, planes[j], out=w, casting="unsafe")


def split_shifts(a: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Planes by shifts of words written straight into each plane (the cast in numpy's small
    buffers, no full-size temporary): ckstore's split for 2-byte elements."""
    w = a.view(words(itemsize))
    out = []
    for j in range(itemsize):
        p = np.empty(w.size, dtype=np.uint8)
        np.right_shift(w, 8 * j, out=p, casting="unsafe")
        out.append(p)
    return out


def merge_shifts(planes: list[np.ndarray], dst: np.ndarray, itemsize: int) -> None:
    """Interleave by shifting each plane into place as words and or'ing: ckstore's merge for
    2-byte elements (wider elements need a word-sized temporary per plane)."""
    wt = np.dtype(words(itemsize))
    w = dst.view(wt)
    np.left_shift(planes[-1], 8 * (itemsize - 1), out=w, dtype=wt)
    tmp = np.empty(w.size, dtype=wt) if itemsize > 2 else None
    for j in range(itemsize - 2, -1, -1):
        if tmp is None:
            np.bitwise_or(w, planes[j], out=w, dtype=wt)
        else:
            np.left_shift(planes[j], 8 * j, out=tmp, dtype=wt)
            np.bitwise_or(w, tmp, out=w)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, CHUNK, dtype=np.uint8)
    dst = np.empty_like(a)
    gbs = lambda s: f"{CHUNK / s / 1e9:.2f}"  # noqa: E731
    rows = []
    for k in (2, 4, 8):
        planes = [np.ascontiguousarray(a[j::k]) for j in range(k)]

        def merge_strided(planes: list[np.ndarray] = planes, k: int = k) -> None:
            for j in range(k):
                dst[j::k] = planes[j]

        rows.append(
            [
                f"numpy strided copies, split ({k}-byte elements)",
                gbs(
                    timed(lambda k=k: [np.ascontiguousarray(a[j::k]) for j in range(k)], args.calls)
                ),
            ]
        )
        rows.append(
            [
                f"numpy strided copies, merge ({k}-byte elements)",
                gbs(timed(merge_strided, args.calls)),
            ]
        )
        native = byte_planes._native
        if native is not None:
            out = [np.empty(CHUNK // k, dtype=np.uint8) for _ in range(k)]
            native.split(a, out)
            assert all(np.array_equal(x, y) for x, y in zip(out, planes))
            dst[:] = 0
            native.merge(planes, dst)
            assert np.array_equal(dst, a)
            for op, fn in (("split", lambda o=out: native.split(a, o)), ("merge", lambda p=planes: native.merge(p, dst))):
                rows.append([f"ckstore's compiled kernels, {op} ({k}-byte elements)", gbs(timed(fn, args.calls))])
        else:
            rows.append([f"ckstore's compiled kernels ({k}-byte elements)", "not built"])
        if k in (2, 4):
            for how, split, merge in (
                ("casts", split_words, merge_words),
                ("shifts into place", split_shifts, merge_shifts),
            ):
                assert all(np.array_equal(x, y) for x, y in zip(split(a, k), planes))
                dst[:] = 0
                merge(planes, dst, k)
                assert np.array_equal(dst, a)
                for op, fn in (
                    ("split", lambda split=split, k=k: split(a, k)),
                    ("merge", lambda merge=merge, p=planes, k=k: merge(p, dst, k)),
                ):
                    rows.append(
                        [
                            f"{8 * k}-bit words, {how}, {op} ({k}-byte elements)",
                            gbs(timed(fn, args.calls)),
                        ]
                    )
    try:
        from numcodecs import Shuffle
    except ImportError:
        rows.append(["numcodecs Shuffle", "not installed"])
    else:
        sh = Shuffle(elementsize=4)
        enc = sh.encode(a)
        rows.append(
            [
                "numcodecs Shuffle, encode (4-byte elements)",
                gbs(timed(lambda: sh.encode(a), args.calls)),
            ]
        )
        rows.append(
            [
                "numcodecs Shuffle, decode (4-byte elements)",
                gbs(timed(lambda: sh.decode(enc, out=dst), args.calls)),
            ]
        )
    rows.append(["memcpy, for scale", gbs(timed(lambda: np.copyto(dst, a), args.calls))])
    print("### Splitting and merging the byte planes of a 4 MiB chunk (one thread)\n")
    print(table(["operation", "GB/s"], rows))

    f32 = (rng.standard_normal(CHUNK // 4).astype(np.float32) * 0.02).view(np.uint8)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    bf16 = np.concatenate([bf16, bf16])
    rows = []
    native = byte_planes._native
    kernels = [("compiled", native), ("numpy", None)] if native is not None else [("numpy", None)]
    for name, data, k in (("fp32", f32, 4), ("bf16", bf16, 2)):
        raw = memoryview(data)
        frame = b"".join(bytes(p) for p in codec.encode(raw, k).parts)
        out = memoryview(bytearray(CHUNK))
        for kernel, module in kernels:
            byte_planes._native = module  # (the kernel the codec's split and merge use)
            rows.append([
                name, kernel, f"{len(frame) / CHUNK:.1%}", gbs(timed(lambda r=raw, k=k: codec.encode(r, k), args.calls)),
                gbs(timed(lambda fr=frame: codec.decode_into(fr, out), args.calls)),
            ])  # fmt: skip
    byte_planes._native = native
    print("\n### ckstore's codec on a 4 MiB chunk of normal weights (one thread)\n")
    print(table(["dtype", "byte planes", "stored/raw", "encode GB/s", "decode GB/s"], rows))


if __name__ == "__main__":
    main()
