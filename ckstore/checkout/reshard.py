"""Sharding metadata and read planning.

Two pure functions, no I/O:

* :func:`resolve_shards` turns ``Shard`` declarations of every rank into :class:`ShardSpec` s
  (global shape and offsets), deriving even splits from the pieces' shapes.
* :func:`plan_checkout` turns stored manifests and a target world layout into a frozen
  :class:`~ckstore.checkout.readplan.ReadPlan`: which byte ranges of which chunks land where in which
  target tensor.

A target rank's piece of a tensor split over mesh dim ``m`` along tensor dim ``d`` is
``torch.chunk(global, size(m), d)[coord(m)]``, however the tensor was split when it was saved;
a mesh dim the target layout lacks has size 1. Several mesh dims splitting one tensor dim nest
in mesh order, as DTensor does.

Values that are neither sharded nor the same on every rank (a per-rank RNG state, say) go to
the target rank with the same coordinates. A target rank at coordinates the saved layout did
not have (a dim grew) takes them only when every saved rank that could provide them agrees;
otherwise planning fails naming the key, unless ``fallback="modulo"`` picks the saved rank at
the target's coordinates modulo the saved sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import LayoutError
from ..format import tree as tree_format
from ..format.manifest import Manifest, ShardSpec, TensorRecord, check_pieces, overlap
from ..layout import WorldLayout, chunk_range
from .readplan import Box, BoxCopy, Buffer, ChunkCopy, PlanBuilder, ReadPlan, TargetEntry

__all__ = [
    "PieceInfo",
    "resolve_shards",
    "target_box",
    "plan_checkout",
    "FALLBACKS",
    "Buffer",
    "ChunkCopy",
    "BoxCopy",
    "TargetEntry",
    "ReadPlan",
    "StoredPiece",
    "plan_boxes",
]

FALLBACKS = (None, "modulo")


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
    dtype: str | None = None  # (checked to agree across the pieces where given)


def resolve_shards(layout: WorldLayout, pieces: Sequence[PieceInfo]) -> dict[tuple[int, str, str], ShardSpec]:
    """ShardSpecs for every piece, keyed by ``(rank, sub_key, path)``.

    The pieces of one tensor must share its dtype and tile its global shape: distinct pieces
    never overlap (replicas have the same offsets and shape) and together cover every element,
    else :class:`~ckstore.errors.LayoutError` (checkout would refuse the checkpoint)."""
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
        dtypes = {p.dtype for p in group if p.dtype is not None}
        if len(dtypes) > 1:
            raise LayoutError(f"{sub_key}, key {path!r}: ranks hold pieces of it with different dtypes {sorted(dtypes)}")
        explicit = [p for p in group if p.offsets is not None]
        if explicit:
            for p in group:
                if p.offsets is None or p.global_shape is None:
                    raise LayoutError(
                        f"{sub_key}, key {path!r}: some ranks give explicit offsets and others do not"
                    )
                out[(p.rank, sub_key, path)] = ShardSpec(p.global_shape, p.offsets, _mesh_order(layout, p.splits))
            _check_same_global(sub_key, path, group)
        else:
            derived = _derive_even(layout, sub_key, path, group)
            shapes = {spec.global_shape for spec in derived.values()}
            if len(shapes) > 1:
                raise LayoutError(
                    f"{sub_key}, key {path!r}: the pieces of an even split add up to different global shapes "
                    f"{sorted(shapes)} on different ranks; replicas must have the same shape"
                )
            out.update(derived)
        gshape = out[(group[0].rank, sub_key, path)].global_shape
        _check_tiling(sub_key, path, gshape, [(p.rank, out[(p.rank, sub_key, path)].offsets, p.shape) for p in group])
    return out


def _mesh_order(layout: WorldLayout, splits: tuple[tuple[int, str], ...]) -> tuple[tuple[int, str], ...]:
    order = [n for n, _ in layout.dims]
    return tuple(sorted(splits, key=lambda s: order.index(s[1])))


def _check_same_global(sub_key: str, path: str, group: Sequence[PieceInfo]) -> None:
    shapes = {p.global_shape for p in group}
    if len(shapes) > 1:
        raise LayoutError(f"{sub_key}, key {path!r}: ranks disagree on the global shape: {sorted(shapes, key=str)}")


def _check_tiling(
    sub_key: str, path: str, gshape: tuple[int, ...], group: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]]
) -> None:
    """Refuse pieces ``(rank, offsets, shape)`` of a global tensor of shape ``gshape`` that
    overlap, stick out of it or leave a gap.

    Replicas (same offsets and shape) are one piece. A tensor whose pieces are all empty is let
    through: a rank may hold all of it as a plain tensor (DCP's adapter stores a full piece so).
    """
    placed: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for rank, off, shape in group:
        if len(off) != len(gshape) or len(shape) != len(gshape):
            raise LayoutError(f"{sub_key}, key {path!r}: rank {rank}'s piece has {len(shape)} dims, the global tensor {len(gshape)}")
        if any(o < 0 or o + n > g for o, n, g in zip(off, shape, gshape)):
            raise LayoutError(
                f"{sub_key}, key {path!r}: rank {rank}'s piece of shape {list(shape)} at {list(off)} does not fit "
                f"in the global shape {list(gshape)}"
            )
        if math.prod(shape):
            placed.setdefault((off, shape), rank)
    if not placed:
        return
    boxes = list(placed)
    clash = overlap(boxes)
    if clash is not None:
        first, second = sorted((placed[box], *box) for box in clash)
        raise LayoutError(
            f"{sub_key}, key {path!r}: rank {first[0]}'s piece of shape {list(first[2])} at "
            f"{list(first[1])} and rank {second[0]}'s piece of shape {list(second[2])} at "
            f"{list(second[1])} overlap; each element of a sharded tensor belongs to one piece "
            "(replicas have the same offsets and shape)"
        )
    covered, total = sum(math.prod(shape) for _, shape in boxes), math.prod(gshape)
    if covered != total:
        raise LayoutError(
            f"{sub_key}, key {path!r}: the pieces of it that ranks {sorted(set(placed.values()))} hold cover only "
            f"{covered} of its {total} elements (global shape {list(gshape)}); every element of a sharded "
            "tensor must be in a piece of some rank"
        )


def _derive_even(
    layout: WorldLayout, sub_key: str, path: str, group: Sequence[PieceInfo]
) -> dict[tuple[int, str, str], ShardSpec]:
    """Offsets and global shape of pieces split without explicit placement: along each split
    tensor dim, a piece starts where the pieces before it (in nesting order) end."""
    first = group[0]
    for p in group:
        if p.splits != first.splits or len(p.shape) != len(first.shape):
            raise LayoutError(f"{sub_key}, key {path!r}: ranks declare different sharding for it")
    mesh_order = [n for n, _ in layout.dims]
    split_dims: dict[int, list[str]] = {}
    for d, m in first.splits:
        split_dims.setdefault(d, []).append(m)
    coords = {p.rank: layout.coords(p.rank) for p in group}
    offsets = {p.rank: [0] * len(p.shape) for p in group}
    gshape = {p.rank: list(p.shape) for p in group}
    for d, ms in split_dims.items():
        ms.sort(key=mesh_order.index)
        sizes = [layout.size(m) for m in ms]
        # the pieces along one line of the splitting mesh dims, by their index in nesting order
        lines: dict[tuple[int, ...], dict[int, PieceInfo]] = {}
        for p in group:
            c = coords[p.rank]
            line = tuple(c[n] for n in mesh_order if n not in ms)
            index = 0
            for m, size in zip(ms, sizes):
                index = index * size + c[m]
            lines.setdefault(line, {})[index] = p
        for pieces in lines.values():
            if len(pieces) < math.prod(sizes):
                gap = next(i for i in range(math.prod(sizes)) if i not in pieces)
                other = dict(coords[next(iter(pieces.values())).rank])
                for m, size in reversed(list(zip(ms, sizes))):
                    other[m], gap = gap % size, gap // size
                raise LayoutError(
                    f"{sub_key}, key {path!r}: the global shape of an even split cannot be derived "
                    f"because rank {layout.rank(other)} has no piece of it; give Shard(offsets=..., "
                    "global_shape=...) explicitly"
                )
            start = 0
            for i in range(len(pieces)):
                offsets[pieces[i].rank][d] = start
                start += pieces[i].shape[d]
            for p in pieces.values():
                gshape[p.rank][d] = start
    splits = _mesh_order(layout, first.splits)
    return {
        (p.rank, sub_key, path): ShardSpec(tuple(gshape[p.rank]), tuple(offsets[p.rank]), splits) for p in group
    }


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


# -- the planner ---------------------------------------------------------------------------------


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
    b = PlanBuilder(itemsizes)
    for pieces, box in wanted:
        dtypes = {p.record.dtype for p in pieces}
        if len(dtypes) != 1:
            raise LayoutError(f"the stored pieces of one tensor have dtypes {sorted(dtypes)}; expected one")
        b.buffer(dtypes.pop(), tuple(hi - lo for lo, hi in box), staging=False)
    for target, (pieces, box) in enumerate(wanted):
        origin = tuple(lo for lo, _ in box)
        covered = sum(b.piece(p.record, p.offsets, box, target, origin, p.source) for p in pieces)
        need = math.prod(hi - lo for lo, hi in box)
        if covered < need and b.buffers[target].nbytes:
            raise LayoutError(
                f"{pieces[0].source if pieces else 'a tensor'}: the stored pieces cover only {covered} of the "
                f"{need} elements of box {list(box)}; a shard is missing"
            )
    return b.plan()


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where a target rank sits relative to the saved layout."""

    rank: int
    coords: dict[str, int]  # in the target layout
    src: int  # the saved rank at the same coordinates (modulo the saved sizes where they grew)
    inside: tuple[str, ...]  # saved dims along which the target coordinate existed when saving
    candidates: tuple[int, ...]  # saved ranks matching the target along every ``inside`` dim


class _Saved:
    """An index of the saved manifests, built once per plan."""

    def __init__(self, manifests: Mapping[tuple[int, str], Manifest], layout: WorldLayout, where: str) -> None:
        self.manifests = manifests
        self.layout = layout
        self.ranks = sorted({r for r, _ in manifests})
        self.coords = {r: layout.coords(r) for r in self.ranks}
        self.sub_keys = list(dict.fromkeys(k for _, k in manifests))
        self.holders = {k: [r for r in self.ranks if (r, k) in manifests] for k in self.sub_keys}
        # every stored piece of each sharded tensor, grouped by placement (replicas share one)
        self.pieces: dict[tuple[str, str], dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, TensorRecord]]]] = {}
        for (rank, sub_key), man in sorted(manifests.items(), key=lambda kv: kv[0][0]):
            for t in man.tensors:
                if t.shard is not None and t.nbytes:
                    placed = self.pieces.setdefault((sub_key, t.path), {})
                    placed.setdefault((t.shard.offsets, t.shape), []).append((rank, t))
        for (sub_key, path), placed in self.pieces.items():
            check_pieces([rec for group in placed.values() for _, rec in group], f"{where}{sub_key}, key {path!r}")

    def place(self, rank: int, coords: dict[str, int]) -> _Placement:
        folded: dict[str, int] = {}
        inside: list[str] = []
        for name, size in self.layout.dims:
            c = coords.get(name, 0)
            folded[name] = c % size
            if c < size:
                inside.append(name)
        src = self.layout.rank(folded)
        if len(inside) == len(self.layout.dims):
            candidates: tuple[int, ...] = (src,)
        else:
            candidates = tuple(
                r for r in self.ranks if all(self.coords[r][d] == coords.get(d, 0) for d in inside)
            )
        return _Placement(rank, coords, src, tuple(inside), candidates)


def plan_checkout(
    manifests: Mapping[tuple[int, str], Manifest],
    source_layout: WorldLayout,
    target_layout: WorldLayout | None,
    target_ranks: Sequence[int] | None,
    itemsizes: Mapping[str, int],
    *,
    fallback: str | None = None,
    where: str = "",
) -> ReadPlan:
    """Plan a checkout of stored ``manifests`` (keyed by ``(rank, sub_key)``); no I/O.

    ``where`` names the checkpoint in errors. Stored pieces of one sharded tensor that disagree
    or overlap raise :class:`~ckstore.errors.IntegrityError`.

    With ``target_layout`` None each stored rank gets back exactly what it saved. Otherwise
    every sharded tensor is cut for each target rank of ``target_layout`` (all of them, or
    ``target_ranks``), reading only the chunks that overlap the rank's box; replicated values go
    to every rank; per-rank values follow the module's rules, with ``fallback`` (None or
    ``"modulo"``) for target ranks the saved layout had no counterpart of.
    """
    b = PlanBuilder(itemsizes)
    if target_layout is None:
        for (rank, sub_key), man in sorted(manifests.items(), key=lambda kv: kv[0][0]):
            if target_ranks is not None and rank not in target_ranks:
                continue
            bufs = tuple(b.whole(t, _source(rank, sub_key, t.path)) for t in man.tensors)
            b.entries.append(TargetEntry(rank, sub_key, man.tree, bufs, f"rank {rank}, {sub_key}"))
        return b.plan()
    if fallback not in FALLBACKS:
        raise LayoutError(f"unknown fallback {fallback!r}: use None or 'modulo'")
    saved = _Saved(manifests, source_layout, f"{where}, " if where else "")
    ranks = range(target_layout.world_size) if target_ranks is None else target_ranks
    for r in ranks:
        place = saved.place(r, target_layout.coords(r))
        for sub_key in saved.sub_keys:
            _plan_entry(b, saved, target_layout, place, sub_key, fallback)
    return b.plan()


def _plan_entry(
    b: PlanBuilder,
    saved: _Saved,
    target: WorldLayout,
    place: _Placement,
    sub_key: str,
    fallback: str | None,
) -> None:
    manifests = saved.manifests
    eligible = [s for s in place.candidates if (s, sub_key) in manifests]
    if not eligible:  # saved only by ranks elsewhere in the mesh (rank 0 alone, say)
        eligible = saved.holders[sub_key]
    chosen = place.src if (place.src, sub_key) in manifests else eligible[0]
    man = manifests[(chosen, sub_key)]
    strict = fallback is None and len(eligible) > 1
    if strict:
        for other in eligible:
            where = tree_format.tree_difference(man.tree, manifests[(other, sub_key)].tree)
            if where is not None:
                raise _no_source(saved, place, sub_key, where, eligible)
    bufs = []
    for i, t in enumerate(man.tensors):
        if t.shard is None:
            if strict:
                for other in eligible:
                    o = manifests[(other, sub_key)].tensors[i]
                    if (o.dtype, o.shape, o.chunks, o.shard) != (t.dtype, t.shape, t.chunks, None):
                        raise _no_source(saved, place, sub_key, t.path, eligible)
            bufs.append(b.whole(t, _source(chosen, sub_key, t.path)))
        else:
            bufs.append(_cut(b, saved, target, place, sub_key, t, fallback))
    b.entries.append(TargetEntry(place.rank, sub_key, man.tree, tuple(bufs), f"rank {chosen}, {sub_key}"))


def _cut(
    b: PlanBuilder,
    saved: _Saved,
    target: WorldLayout,
    place: _Placement,
    sub_key: str,
    t: TensorRecord,
    fallback: str | None,
) -> int:
    """A target buffer with the target rank's box of sharded tensor ``t``, filled from every
    stored piece that overlaps it."""
    assert t.shard is not None
    box = target_box(t.shard, target, place.coords)
    shape = tuple(hi - lo for lo, hi in box)
    buf = b.buffer(t.dtype, shape, staging=False)
    origin = tuple(lo for lo, _ in box)
    split = {m for _, m in t.shard.splits}
    free = [d for d, _ in saved.layout.dims if d not in split]
    need = math.prod(shape)
    covered = 0
    for (offsets, pshape), group in saved.pieces.get((sub_key, t.path), {}).items() if need else ():
        if any(min(hi, o + n) <= max(lo, o) for (lo, hi), o, n in zip(box, offsets, pshape)):
            continue
        rank, rec = _pick_replica(saved, place, sub_key, t.path, group, free, fallback)
        covered += b.piece(rec, offsets, box, buf, origin, _source(rank, sub_key, t.path))
    if covered < need:
        raise LayoutError(
            f"{sub_key}, key {t.path!r}: the saved pieces cover only {covered} of the {need} "
            f"elements that target rank {place.rank} ({place.coords}) needs; a shard is missing from the "
            "checkpoint"
        )
    return buf


def _pick_replica(
    saved: _Saved,
    place: _Placement,
    sub_key: str,
    path: str,
    group: list[tuple[int, TensorRecord]],
    free: list[str],
    fallback: str | None,
) -> tuple[int, TensorRecord]:
    """The stored piece to read among those saved at the same offsets by different ranks.

    Replicas are normally equal (and then any will do). When they differ (say each tensor-parallel
    rank partitions its own flat buffer over ``dp``), take the one saved at the target's
    coordinates along the dims that do not split the tensor."""
    if len(group) == 1 or len({rec.chunks for _, rec in group}) == 1:
        return group[0]
    src = saved.coords[place.src] if place.src in saved.coords else saved.layout.coords(place.src)

    def at(rank: int, dims: Sequence[str], want: Mapping[str, int]) -> bool:
        return all(saved.coords[rank][d] == want.get(d, 0) for d in dims)

    exact = [g for g in group if at(g[0], [d for d in free if d in place.inside], place.coords)]
    if fallback is None and len({rec.chunks for _, rec in exact}) != 1:
        raise _no_source(saved, place, sub_key, path, [g[0] for g in exact] or [g[0] for g in group])
    preferred = [g for g in group if at(g[0], free, src)]
    return (preferred or exact or group)[0]


def _no_source(saved: _Saved, place: _Placement, sub_key: str, path: str, ranks: Sequence[int]) -> LayoutError:
    return LayoutError(
        f"target rank {place.rank} ({place.coords}): {sub_key} key {path!r} is neither sharded nor the "
        f"same on the saved ranks {list(ranks)} that could provide it, and the saved layout "
        f"{saved.layout.mesh} has no rank at these coordinates; pass fallback='modulo' to take it from "
        "the saved rank at the same coordinates modulo the saved sizes"
    )
