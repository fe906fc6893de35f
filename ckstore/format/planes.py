"""Byte planes: a chunk of ``k``-byte elements cut into ``k`` planes, plane ``j`` holding byte
``j`` of every element (``raw[j::k]``), and the planes interleaved back into the chunk.

This is the layout step of the byte-plane codec (:mod:`ckstore.format.codec`): split on every
commit of a changed float chunk, merged on every checkout of one. Two implementations write the
same bytes:

* ckstore's compiled kernels (``ckstore/format/_planes.c``, built with the wheel by
  ``hatch_build.py``): one pass over the chunk with the GIL released, 19–42 GB/s on one thread of
  the development machine for 2- and 4-byte elements and 5–9 GB/s for 8-byte ones;
* numpy, when the kernels were not built (no C compiler at install) or ``CKSTORE_EXTENSION=skip``
  is set: strided copies (one pass per plane, ~3 GB/s) and, for 2- and 4-byte elements of larger
  chunks, shifts of whole words (docs/benchmarks.md, "Byte planes").

``CKSTORE_EXTENSION=require`` makes a missing build an error instead (CI sets it). :data:`KERNEL`
says which one this process uses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["KERNEL", "split", "merge", "split_numpy", "merge_numpy"]


def _load() -> ModuleType | None:
    mode = os.environ.get("CKSTORE_EXTENSION", "auto")
    if mode == "skip":
        return None
    try:
        from . import _planes
    except ImportError as e:
        if mode == "require":
            raise ImportError(
                "CKSTORE_EXTENSION=require, but ckstore's compiled byte-plane kernels are missing: "
                "reinstall ckstore where a C compiler is available (pip install -e . builds them)"
            ) from e
        return None
    return _planes


_native = _load()
#: which implementation splits and merges planes in this process: "compiled" or "numpy"
KERNEL = "numpy" if _native is None else "compiled"


def split(a: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """The ``itemsize`` byte planes of ``a`` (contiguous uint8, whole elements), each contiguous."""
    if _native is None:
        return split_numpy(a, itemsize)
    planes = np.empty((itemsize, a.nbytes // itemsize), dtype=np.uint8)
    _native.split(a, planes)  # (a 2-d array is a sequence of its rows)
    return list(planes)


def merge(planes: Sequence[Any], dst: np.ndarray) -> None:
    """Interleave ``planes`` (buffers of equal length) into ``dst`` (contiguous uint8, as long as
    all of them together): the inverse of :func:`split`."""
    if _native is None:
        merge_numpy(planes, dst)
    else:
        _native.merge(planes, dst)


# -- numpy -------------------------------------------------------------------------------------

_WORDS = {2: "<u2", 4: "<u4"}  # the little-endian words split_numpy shifts for these element sizes
#: chunks this long or longer are split by shifts (measured: shorter ones split faster by strided copies)
_SHIFTS_FROM = 64 << 10
#: chunks shorter than this are merged by strided copies (measured: faster than two casts' set-up)
_MERGE2_SHIFTS_FROM = 8 << 10


def split_numpy(a: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """:func:`split` in numpy.

    Chunks of :data:`_SHIFTS_FROM` bytes or more of two- and four-byte elements (bf16, fp16,
    fp32, int32, ...) are split by shifting 16- or 32-bit words, each shift written straight into
    its plane with a narrowing cast (numpy casts in small buffers: no full-size temporary). On
    one thread, a 4 MiB chunk: 1.7–4.5x as fast as strided byte copies for two-byte elements,
    1.1–1.3x for four-byte ones. A cast costs about a microsecond to set up, so smaller chunks
    take the strided copies."""
    wt = _WORDS.get(itemsize)
    if wt is None or a.nbytes < _SHIFTS_FROM:
        return [np.ascontiguousarray(a[j::itemsize]) for j in range(itemsize)]
    words = a.view(wt)
    planes = []
    for j in range(itemsize):
        plane = np.empty(words.size, dtype=np.uint8)
        np.right_shift(words, 8 * j, out=plane, casting="unsafe")  # the cast keeps the low byte
        planes.append(plane)
    return planes


def merge_numpy(planes: Sequence[Any], dst: np.ndarray) -> None:
    """:func:`merge` in numpy: strided copies, one plane at a time; two planes of chunks of
    :data:`_MERGE2_SHIFTS_FROM` bytes or more as 16-bit words, the high byte shifted up and or'ed
    with the low one, in two passes over ``dst`` whose casts numpy makes in small buffers
    (1.2–1.6x as fast as the casts and shifts before them on a 4 MiB chunk)."""
    itemsize = len(planes)
    if itemsize == 2 and dst.nbytes >= _MERGE2_SHIFTS_FROM:
        low, high = (np.frombuffer(p, dtype=np.uint8) for p in planes)
        words = dst.view("<u2")
        np.left_shift(high, 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, low, out=words, dtype=np.uint16)
        return
    for j, plane in enumerate(planes):
        dst[j::itemsize] = np.frombuffer(plane, dtype=np.uint8)
