"""Sharding metadata and read planning.

Two pure functions, no I/O:

* :func:`resolve_shards` turns ``Shard`` declarations of every rank into :class:`ShardSpec` s
  (global shape and offsets), deriving even splits from the pieces' shapes.
* :func:`plan_checkout` turns stored manifests and a target world layout into a frozen
  :class:`ReadPlan`: which byte ranges of which chunks land where in which target tensor.

A target rank's piece of a tensor split over mesh dim ``m`` along tensor dim ``d`` is
``torch.chunk(global, size(m), d)[coord(m)]``; a mesh dim the target layout lacks has size 1.
Several mesh dims splitting one tensor dim nest in mesh order, as DTensor does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import LayoutError
from .layout import WorldLayout, chunk_range
from .manifest import Manifest, ShardSpec, TensorRecord

__all__ = [
    "PieceInfo",
    "resolve_shards",
    "Buffer",
    "ChunkCopy",
    "BoxCopy",
    "TargetEntry",
    "ReadPlan",
    "plan_checkout",
    "target_box",
    "StoredPiece",
    "plan_boxes",
]

Box = tuple[tuple[int, int], ...]  # [start, stop) per tensor dim


@dataclass(frozen=True, slots=True)
class PieceInfo:
    """What resolving a shard needs to know of one declared piece."""

    rank: int
    sub_key: str
    path: str
    shape: tuple[int, ...]
    splits: tuple[tuple[int, str], ...]
    offsets: tuple[int, ...] | None
    global_shape: tuple[int, ...] | None


def resolve_shards(layout: WorldLayout, pieces: Sequence[PieceInfo]) -> dict[tuple[int, str, str], ShardSpec]:
    """ShardSpecs for every piece, keyed by ``(rank, sub_key, path)``."""
    mesh = layout.mesh
    groups: dict[tuple[str, str], list[PieceInfo]] = {}
    for p in pieces:
        for _, m in p.splits:
            if m not in mesh:
                raise LayoutError(
                    f"rank {p.rank}, {p.sub_key}, key {p.path!r}: sharded over mesh dim {m!r}, which the "
                    f"world layout {mesh} does not have; pass world_layout= with that dim"
                )
        groups.setdefault((p.sub_key, p.path), []).append(p)
    out: dict[tuple[int, str, str], ShardSpec] = {}
    for (sub_key, path), group in groups.items():
        explicit = [p for p in group if p.offsets is not None]
        if explicit:
            for p in group:
                if p.offsets is None or p.global_shape is None:
                    raise LayoutError(
                        f"{sub_key}, key {path!r}: some ranks give explicit offsets and others do not"
                    )
                out[(p.rank, sub_key, path)] = ShardSpec(p.global_shape, p.offsets, p.splits)
            _check_same_global(sub_key, path, group)
            continue
        out.update(_derive_even(layout, sub_key, path, group))
    return out


def _check_same_global(sub_key: str, path: str, group: Sequence[PieceInfo]) -> None:
    shapes = {p.global_shape for p in group}
    if len(shapes) > 1:
        raise LayoutError(f"{sub_key}, key {path!r}: ranks disagree on the global shape: {sorted(shapes)}")


def _derive_even(
    layout: WorldLayout, sub_key: str, path: str, group: Sequence[PieceInfo]
) -> dict[tuple[int, str, str], ShardSpec]:
    first = group[0]
    for p in group:
        if p.splits != first.splits or len(p.shape) != len(first.shape):
            raise LayoutError(f"{sub_key}, key {path!r}: ranks declare different sharding for it")
    by_coords = {tuple(sorted(layout.coords(p.rank).items())): p for p in group}
    ndim = len(first.shape)
    split_dims: dict[int, list[str]] = {}
    for d, m in first.splits:
        split_dims.setdefault(d, []).append(m)
    mesh_order = [n for n, _ in layout.dims]
    for d in split_dims:
        split_dims[d].sort(key=mesh_order.index)
    out: dict[tuple[int, str, str], ShardSpec] = {}
    for p in group:
        coords = layout.coords(p.rank)
        offsets = [0] * ndim
        gshape = list(p.shape)
        for d, ms in split_dims.items():
            total = 0
            before = 0
            # every combination of the splitting mesh dims' coordinates, in nesting order
            sizes = [layout.size(m) for m in ms]
            for lin in range(math.prod(sizes)):
                idx = []
                rest = lin
                for s in reversed(sizes):
                    idx.append(rest % s)
                    rest //= s
                idx.reverse()
                other = dict(coords)
                other.update(zip(ms, idx))
                q = by_coords.get(tuple(sorted(other.items())))
                if q is None:
                    raise LayoutError(
                        f"{sub_key}, key {path!r}: the global shape of an even split cannot be derived "
                        f"because rank {layout.rank(other)} has no piece of it; give Shard(offsets=..., "
                        "global_shape=...) explicitly"
                    )
                if idx < [coords[m] for m in ms]:
                    before += q.shape[d]
                total += q.shape[d]
            offsets[d] = before
            gshape[d] = total
        out[(p.rank, sub_key, path)] = ShardSpec(tuple(gshape), tuple(offsets), p.splits)
    return out


def target_box(spec: ShardSpec, layout: WorldLayout, coords: Mapping[str, int]) -> Box:
    """The box of the global tensor that a target rank at ``coords`` owns."""
    box = [(0, n) for n in spec.global_shape]
    mesh_order = {n: i for i, (n, _) in enumerate(layout.dims)}
    by_dim: dict[int, list[str]] = {}
    for d, m in spec.splits:
        by_dim.setdefault(d, []).append(m)
    for d, ms in by_dim.items():
        ms = sorted(ms, key=lambda m: mesh_order.get(m, -1))
        lo, hi = box[d]
        for m in ms:
            a, b = chunk_range(hi - lo, layout.size(m), coords.get(m, 0))
            lo, hi = lo + a, lo + b
        box[d] = (lo, hi)
    return tuple(box)


# -- the read plan -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Buffer:
    """A tensor the executor fills: a target tensor handed to the caller, or a staging area."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    staging: bool


@dataclass(frozen=True, slots=True)
class ChunkCopy:
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
        return sum(c.src_stop - c.src_start for c in self.copies)


class _Builder:
    def __init__(self, itemsizes: Mapping[str, int]) -> None:
        self.itemsizes = itemsizes
        self.buffers: list[Buffer] = []
        self.copies: list[ChunkCopy] = []
        self.boxes: list[BoxCopy] = []

    def buffer(self, dtype: str, shape: tuple[int, ...], staging: bool) -> int:
        nbytes = math.prod(shape) * self.itemsizes[dtype]
        self.buffers.append(Buffer(dtype, shape, nbytes, staging))
        return len(self.buffers) - 1

    def copy_bytes(self, rec: TensorRecord, lo: int, hi: int, buf: int, dst: int, source: str) -> None:
        """Copy bytes ``[lo, hi)`` of stored tensor ``rec`` into ``buf`` starting at ``dst``."""
        if hi <= lo:
            return
        cs = rec.chunk_size
        for i in range(lo // cs, -(-hi // cs)):
            c0, c1 = rec.chunk_span(i)
            a, b = max(lo, c0), min(hi, c1)
            self.copies.append(ChunkCopy(rec.chunks[i], c1 - c0, a - c0, b - c0, buf, dst + (a - lo), source))

    def whole(self, rec: TensorRecord, source: str) -> int:
        buf = self.buffer(rec.dtype, rec.shape, staging=False)
        self.copy_bytes(rec, 0, rec.nbytes, buf, 0, source)
        return buf

    def piece(self, rec: TensorRecord, spec: ShardSpec, src_offsets: tuple[int, ...], want: Box, target: int, target_origin: tuple[int, ...], source: str) -> None:
        """Fill the part of target buffer ``target`` (whose global origin is ``target_origin``)
        that stored piece ``rec`` (at ``src_offsets``) overlaps within box ``want``."""
        inter = []
        for (w0, w1), o, n in zip(want, src_offsets, rec.shape):
            a, b = max(w0, o), min(w1, o + n)
            if b <= a:
                return
            inter.append((a, b))
        item = self.itemsizes[rec.dtype]
        ndim = len(rec.shape)
        if ndim == 0:
            self.copy_bytes(rec, 0, rec.nbytes, target, 0, source)
            return
        row = math.prod(rec.shape[1:]) * item
        r0, r1 = inter[0][0] - src_offsets[0], inter[0][1] - src_offsets[0]
        tgt_shape = self.buffers[target].shape
        full_rows_src = all(inter[d] == (src_offsets[d], src_offsets[d] + rec.shape[d]) for d in range(1, ndim))
        full_rows_dst = all(
            inter[d] == (target_origin[d], target_origin[d] + tgt_shape[d]) for d in range(1, ndim)
        )
        if full_rows_src and full_rows_dst:
            dst = (inter[0][0] - target_origin[0]) * row
            self.copy_bytes(rec, r0 * row, r1 * row, target, dst, source)
            return
        stage = self.buffer(rec.dtype, (r1 - r0, *rec.shape[1:]), staging=True)
        self.copy_bytes(rec, r0 * row, r1 * row, stage, 0, source)
        src_box = ((0, r1 - r0),) + tuple((a - o, b - o) for (a, b), o in zip(inter[1:], src_offsets[1:]))
        dst_box = tuple((a - t, b - t) for (a, b), t in zip(inter, target_origin))
        self.boxes.append(BoxCopy(stage, src_box, target, dst_box))


def _source(rank: int, sub_key: str, path: str) -> str:
    return f"rank {rank}, {sub_key}, key {path!r}"


@dataclass(frozen=True, slots=True)
class StoredPiece:
    """A stored tensor that holds the part of a global tensor starting at ``offsets``."""

    offsets: tuple[int, ...]
    record: TensorRecord
    source: str  # where it is stored, for error messages


def plan_boxes(wanted: Sequence[tuple[Sequence[StoredPiece], Box]], itemsizes: Mapping[str, int]) -> ReadPlan:
    """Plan reading box ``box`` of each global tensor, given by its non-overlapping stored pieces.

    Request ``i`` fills target buffer ``i``; staging buffers, if any, come after the targets.
    A chunk that several requests need is listed once per place it goes, so the executor
    fetches it once.
    """
    b = _Builder(itemsizes)
    for pieces, box in wanted:
        dtypes = {p.record.dtype for p in pieces}
        if len(dtypes) != 1:
            raise LayoutError(f"the stored pieces of one tensor have dtypes {sorted(dtypes)}; expected one")
        b.buffer(dtypes.pop(), tuple(hi - lo for lo, hi in box), staging=False)
    for target, (pieces, box) in enumerate(wanted):
        origin = tuple(lo for lo, _ in box)
        covered = 0
        for p in pieces:
            before = len(b.copies) + len(b.boxes)
            b.piece(p.record, p.record.shard, p.offsets, box, target, origin, p.source)  # type: ignore[arg-type]
            if len(b.copies) + len(b.boxes) > before:
                covered += math.prod(
                    max(0, min(hi, o + n) - max(lo, o)) for (lo, hi), o, n in zip(box, p.offsets, p.record.shape)
                )
        need = math.prod(hi - lo for lo, hi in box)
        if covered < need and need and b.buffers[target].nbytes:
            raise LayoutError(
                f"{pieces[0].source if pieces else 'a tensor'}: the stored pieces cover only {covered} of the "
                f"{need} elements of box {list(box)}; a shard is missing"
            )
    return ReadPlan(tuple(b.buffers), tuple(b.copies), tuple(b.boxes), ())


def plan_checkout(
    manifests: Mapping[tuple[int, str], Manifest],
    source_layout: WorldLayout,
    target_layout: WorldLayout | None,
    target_ranks: Sequence[int] | None,
    itemsizes: Mapping[str, int],
    *,
    fallback: str | None = None,
) -> ReadPlan:
    """Plan a checkout of stored ``manifests`` (keyed by ``(rank, sub_key)``).

    With ``target_layout`` None each stored rank gets back exactly what it saved. Otherwise every
    sharded tensor is cut for the target layout, replicated tensors are handed to every rank, and
    per-rank values (neither sharded nor the same on every rank) go to the target rank with the
    same coordinates. ``fallback="modulo"`` lets target ranks whose coordinates did not exist in
    the source take per-rank values from the source rank at their coordinates modulo its sizes.
    """
    b = _Builder(itemsizes)
    entries: list[TargetEntry] = []
    if target_layout is None:
        for (rank, sub_key), man in sorted(manifests.items()):
            if target_ranks is not None and rank not in target_ranks:
                continue
            bufs = tuple(b.whole(t, _source(rank, sub_key, t.path)) for t in man.tensors)
            entries.append(TargetEntry(rank, sub_key, man.tree, bufs, f"rank {rank}, {sub_key}"))
        return ReadPlan(tuple(b.buffers), tuple(b.copies), tuple(b.boxes), tuple(entries))

    if fallback not in (None, "modulo"):
        raise LayoutError(f"unknown fallback {fallback!r}: use None or 'modulo'")
    src_ranks = sorted({r for r, _ in manifests})
    sub_keys = list(dict.fromkeys(k for _, k in sorted(manifests)))
    ranks = list(range(target_layout.world_size)) if target_ranks is None else list(target_ranks)
    # all stored pieces of each sharded tensor, deduplicated by offsets (replicas are equal)
    pieces: dict[tuple[str, str], dict[tuple[int, ...], tuple[int, TensorRecord]]] = {}
    replicas: dict[tuple[str, str], set[tuple[bytes, ...]]] = {}
    trees: dict[str, set[str]] = {}
    for (rank, sub_key), man in manifests.items():
        trees.setdefault(sub_key, set()).add(json.dumps(man.tree))
        for t in man.tensors:
            if t.shard is not None:
                pieces.setdefault((sub_key, t.path), {}).setdefault(t.shard.offsets, (rank, t))
            else:
                replicas.setdefault((sub_key, t.path), set()).add((t.dtype.encode(), *t.chunks, str(t.shape).encode()))

    for r in ranks:
        coords = target_layout.coords(r)
        exact: dict[str, int] = {}
        folded: dict[str, int] = {}
        inside = True
        for name, size in source_layout.dims:
            c = coords.get(name, 0)
            exact[name] = c
            folded[name] = c % size
            if c >= size:
                inside = False
        src = source_layout.rank(folded)
        for sub_key in sub_keys:
            man = manifests.get((src, sub_key))
            if man is None:
                src_any = next((s for s in src_ranks if (s, sub_key) in manifests), None)
                if src_any is None:
                    continue
                man = manifests[(src_any, sub_key)]
                src_here = src_any
            else:
                src_here = src
            if not inside and fallback is None and len(trees[sub_key]) > 1:
                raise LayoutError(
                    f"target rank {r} ({coords}) has no counterpart in the saved layout "
                    f"{source_layout.mesh}, and the ranks saved different {sub_key} structures or values; "
                    "pass fallback='modulo' to take them from the rank at the same coordinates modulo the "
                    "saved sizes"
                )
            bufs = []
            for t in man.tensors:
                source = _source(src_here, sub_key, t.path)
                if t.shard is None:
                    if not inside and fallback is None and len(replicas.get((sub_key, t.path), ())) > 1:
                        raise LayoutError(
                            f"target rank {r} ({coords}): key {t.path!r} of {sub_key} differs between saved "
                            f"ranks and is not sharded, and no saved rank has coordinates {coords}; pass "
                            "fallback='modulo' to take it from the saved rank at coordinates modulo the "
                            "saved sizes"
                        )
                    bufs.append(b.whole(t, source))
                    continue
                spec = t.shard
                box = target_box(spec, target_layout, coords)
                shape = tuple(hi - lo for lo, hi in box)
                buf = b.buffer(t.dtype, shape, staging=False)
                origin = tuple(lo for lo, _ in box)
                covered = 0
                for offsets, (prank, prec) in sorted(pieces[(sub_key, t.path)].items()):
                    before = len(b.copies) + len(b.boxes)
                    b.piece(prec, spec, offsets, box, buf, origin, _source(prank, sub_key, t.path))
                    if len(b.copies) + len(b.boxes) > before:
                        covered += math.prod(
                            max(0, min(hi, o + n) - max(lo, o)) for (lo, hi), o, n in zip(box, offsets, prec.shape)
                        )
                if covered < math.prod(shape):
                    raise LayoutError(
                        f"{sub_key}, key {t.path!r}: the saved pieces cover only {covered} of the "
                        f"{math.prod(shape)} elements that target rank {r} needs; a shard is missing"
                    )
                bufs.append(buf)
            entries.append(TargetEntry(r, sub_key, man.tree, tuple(bufs), f"rank {src_here}, {sub_key}"))
    return ReadPlan(tuple(b.buffers), tuple(b.copies), tuple(b.boxes), tuple(entries))
