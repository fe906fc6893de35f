"""The read plan: frozen data saying which bytes of which chunks land where.

A :class:`ReadPlan` is what :func:`ckstore.checkout.reshard.plan_checkout` returns and what
:func:`ckstore.checkout.executor.execute_plan` runs. It holds no tensors and does no I/O, so tests can
inspect exactly what a checkout would fetch.

* :class:`Buffer` s are the tensors the executor allocates: the tensors handed to the caller, and
  staging areas for stored pieces that are not contiguous in their target.
* :class:`ChunkCopy` s move bytes ``[src_start, src_stop)`` of a decoded chunk into a buffer.
* :class:`BoxCopy` s copy a box of a filled staging buffer into a box of a target buffer.
* :class:`TargetEntry` s say which buffers make up the tensors of each ``(rank, sub_key)`` tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..format.manifest import TensorRecord

__all__ = ["Box", "BoxCopy", "Buffer", "ChunkCopy", "PlanBuilder", "ReadPlan", "TargetEntry"]

Box = tuple[tuple[int, int], ...]  # [start, stop) per tensor dim


# Buffers and chunk copies are tuples: a plan holds one of each per tensor and per chunk, and a
# tuple is made in a third of the time of a frozen dataclass (0.7 against 2.1 µs)


class Buffer(NamedTuple):
    """A tensor the executor fills: a target tensor handed to the caller, or a staging area."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    staging: bool


class ChunkCopy(NamedTuple):
    """Bytes ``[src_start, src_stop)`` of a decoded chunk go to ``buffer`` at ``dst_offset``."""

    digest: bytes
    raw_size: int
    src_start: int
    src_stop: int
    buffer: int
    dst_offset: int
    source: str  # "rank R, SUB_KEY, key PATH" of the stored tensor, for error messages


@dataclass(frozen=True, slots=True)
class BoxCopy:
    """Once staging buffer ``src`` is filled, copy ``src_box`` of it into ``dst_box`` of ``dst``."""

    src: int
    src_box: Box
    dst: int
    dst_box: Box


@dataclass(frozen=True, slots=True)
class TargetEntry:
    rank: int
    sub_key: str
    tree: Any
    buffers: tuple[int, ...]  # tensor i of the tree is buffer buffers[i]
    source: str  # where the tree came from, for error messages


@dataclass(frozen=True, slots=True)
class ReadPlan:
    buffers: tuple[Buffer, ...]
    copies: tuple[ChunkCopy, ...]
    boxes: tuple[BoxCopy, ...]
    entries: tuple[TargetEntry, ...]

    @property
    def bytes_to_fill(self) -> int:
        """Raw bytes the copies move (a chunk needed in two places counts twice)."""
        return sum(c.src_stop - c.src_start for c in self.copies)

    @property
    def chunk_bytes(self) -> int:
        """Raw bytes of the distinct chunks the plan decodes: what a checkout must fetch."""
        return sum({c.digest: c.raw_size for c in self.copies}.values())


class PlanBuilder:
    """Accumulates buffers and copies while a planner walks stored tensors."""

    def __init__(self, itemsizes: Mapping[str, int]) -> None:
        self.itemsizes = itemsizes
        self.buffers: list[Buffer] = []
        self.copies: list[ChunkCopy] = []
        self.boxes: list[BoxCopy] = []
        self.entries: list[TargetEntry] = []

    def plan(self) -> ReadPlan:
        return ReadPlan(tuple(self.buffers), tuple(self.copies), tuple(self.boxes), tuple(self.entries))

    def buffer(self, dtype: str, shape: tuple[int, ...], staging: bool) -> int:
        nbytes = math.prod(shape) * self.itemsizes[dtype]
        self.buffers.append(Buffer(dtype, shape, nbytes, staging))
        return len(self.buffers) - 1

    def copy_bytes(
        self,
        rec: TensorRecord,
        lo: int,
        hi: int,
        buf: int,
        dst: int,
        source: str,
        keep: Callable[[int, int], bool] | None = None,
    ) -> None:
        """Copy bytes ``[lo, hi)`` of stored tensor ``rec`` into ``buf`` starting at ``dst``.

        ``keep(a, b)``, given a chunk's overlap ``[a, b)`` relative to ``lo``, may skip chunks
        holding none of the bytes that are really wanted.
        """
        if hi <= lo:
            return
        cs = rec.chunk_size
        for i in range(lo // cs, -(-hi // cs)):
            c0, c1 = rec.chunk_span(i)
            a, b = max(lo, c0), min(hi, c1)
            if keep is not None and not keep(a - lo, b - lo):
                continue
            self.copies.append(ChunkCopy(rec.chunks[i], c1 - c0, a - c0, b - c0, buf, dst + (a - lo), source))

    def whole(self, rec: TensorRecord, source: str) -> int:
        """A new target buffer holding all of stored tensor ``rec``."""
        n = rec.nbytes  # (a record's nbytes is its dtype's size times its shape's product)
        self.buffers.append(Buffer(rec.dtype, rec.shape, n, False))
        buf = len(self.buffers) - 1
        if 0 < n <= rec.chunk_size:  # one chunk, all of it (most tensors)
            self.copies.append(ChunkCopy(rec.chunks[0], n, 0, n, buf, 0, source))
        else:
            self.copy_bytes(rec, 0, n, buf, 0, source)
        return buf

    def piece(
        self,
        rec: TensorRecord,
        src_offsets: tuple[int, ...],
        want: Box,
        target: int,
        target_origin: tuple[int, ...],
        source: str,
    ) -> int:
        """Fill the part of ``target`` (global box ``want``, starting at ``target_origin``) that
        stored piece ``rec`` (at global ``src_offsets``) overlaps; returns the elements filled.

        Whole rows go straight into the target; otherwise the overlapping rows are staged and a
        box copy moves the wanted part, and chunks holding none of it are not read at all.
        """
        inter = []
        for (w0, w1), o, n in zip(want, src_offsets, rec.shape):
            a, b = max(w0, o), min(w1, o + n)
            if b <= a:
                return 0
            inter.append((a, b))
        ndim = len(rec.shape)
        if ndim == 0:
            self.copy_bytes(rec, 0, rec.nbytes, target, 0, source)
            return 1
        item = self.itemsizes[rec.dtype]
        row = math.prod(rec.shape[1:]) * item
        r0, r1 = inter[0][0] - src_offsets[0], inter[0][1] - src_offsets[0]
        tgt_shape = self.buffers[target].shape
        full_src = all(inter[d] == (src_offsets[d], src_offsets[d] + rec.shape[d]) for d in range(1, ndim))
        full_dst = all(inter[d] == (target_origin[d], target_origin[d] + tgt_shape[d]) for d in range(1, ndim))
        count = math.prod(b - a for a, b in inter)
        if full_src and full_dst:
            dst = (inter[0][0] - target_origin[0]) * row
            self.copy_bytes(rec, r0 * row, r1 * row, target, dst, source)
            return count
        stage_shape = (r1 - r0, *rec.shape[1:])
        src_box: Box = ((0, r1 - r0),) + tuple((a - o, b - o) for (a, b), o in zip(inter[1:], src_offsets[1:]))
        dst_box: Box = tuple((a - t, b - t) for (a, b), t in zip(inter, target_origin))
        stage = self.buffer(rec.dtype, stage_shape, staging=True)
        self.copy_bytes(
            rec, r0 * row, r1 * row, stage, 0, source,
            keep=lambda a, b: touches_box(a, b, stage_shape, src_box, item),
        )  # fmt: skip
        self.boxes.append(BoxCopy(stage, src_box, target, dst_box))
        return count


def touches_box(lo: int, hi: int, shape: tuple[int, ...], box: Box, itemsize: int) -> bool:
    """Whether bytes ``[lo, hi)`` of a C-contiguous tensor of ``shape`` hold any element of
    ``box`` (which must not be empty)."""
    ndim = len(shape)
    if hi <= lo or ndim == 0:
        return hi > lo
    strides = [itemsize] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]

    def walk(a: int, b: int, d: int) -> bool:
        s = strides[d]
        i0, i1 = max(a // s, box[d][0]), min((b - 1) // s, box[d][1] - 1)
        if i0 > i1:
            return False
        if d == ndim - 1 or i1 - i0 >= 2:  # a whole block of the box lies inside [a, b)
            return True
        return any(walk(max(a - i * s, 0), min(b - i * s, s), d + 1) for i in dict.fromkeys((i0, i1)))

    return walk(lo, hi, 0)
