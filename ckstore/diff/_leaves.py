"""The leaves of one side of a diff, and reading the same window of two global tensors.

A side maps each ``(sub_key, path)`` to its leaf per rank: ``{None: leaf}`` when the leaf is a
sharded tensor (its deduplicated pieces make one global tensor) or is the same on every rank that
holds the sub-checkpoint, else ``{rank: leaf}`` (so a key some ranks lack is kept rank by rank).

Every dict, list and tuple is a leaf too: an empty one as its value, a non-empty one as its type
alone (its items are leaves of their own), so a list that became a tuple, or a dict that became a
list, is a change even when every item is the same.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checkout.reshard import StoredPiece, plan_boxes
from ..format import tree as tree_format
from ..format.dtypes import stored_itemsize
from ..format.manifest import check_pieces
from ..records import Checkpoint
from ._stats import Accumulator
from ._view import StoreView

__all__ = ["TensorLeaf", "ValueLeaf", "Leaf", "Side", "read_side", "pairs", "decode", "Reader"]

_WINDOW_ELEMS = 1 << 21  # elements per window and side (16 MiB as float64)


@dataclass(frozen=True, slots=True)
class TensorLeaf:
    """A global tensor: one stored piece when unsharded, every distinct piece when sharded."""

    dtype: str
    shape: tuple[int, ...]  # of the global tensor
    pieces: tuple[StoredPiece, ...]  # sorted by offsets, replicas dropped
    sharded: bool
    item: int  # bytes per element

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.item

    def signature(self) -> frozenset[tuple[Any, ...]]:
        return frozenset(
            (p.offsets, p.record.shape, p.record.chunk_size, p.record.chunks) for p in self.pieces
        )

    def intervals(self) -> list[tuple[int, int, bytes]] | None:
        """``(start, stop, digest)`` of every chunk in the global tensor's row-major bytes, when
        every piece is a contiguous run of whole rows; else None."""
        row = math.prod(self.shape[1:]) * self.item
        out = []
        for p in self.pieces:
            if p.record.shape[1:] != self.shape[1:]:
                return None
            base = p.offsets[0] * row if self.shape else 0
            for i, d in enumerate(p.record.chunks):
                s, e = p.record.chunk_span(i)
                out.append((base + s, base + e, d))
        return out


@dataclass(frozen=True, slots=True)
class ValueLeaf:
    """A plain value (or an empty container), as its encoded manifest node; or the type of a
    non-empty container, as its tag alone (``["d"]``, ``["l"]``, ``["t"]``)."""

    node: Any
    text: str  # the node as canonical JSON, for comparing by value and type

    @property
    def container(self) -> str | None:
        """The tag of a dict, list or tuple (empty or not); None for any other value."""
        tag = self.node[0]
        return tag if tag in tree_format.CONTAINER_TAGS else None

    @property
    def items_apart(self) -> bool:
        """Whether this is a non-empty container, whose items are leaves of their own."""
        return len(self.node) == 1 and self.container is not None


Leaf = TensorLeaf | ValueLeaf


@dataclass(slots=True)
class Side:
    """The leaves of one checkpoint that a diff compares."""

    ckpt: Checkpoint
    leaves: dict[tuple[str, str], dict[int | None, Leaf]]
    chunks: dict[bytes, int]  # digest -> raw size, of every compared tensor
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # sub_key -> ranks holding it


def _walk(tree: Any, where: str) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(keys, node)`` for every leaf of an encoded tree: tensor refs, values, empty containers,
    and the type of every non-empty container (as ``[tag]``)."""
    for keys, tag, node in tree_format.nodes(tree, where):
        if tag in tree_format.CONTAINER_TAGS and node[1]:
            yield keys, [tag]
        else:
            yield keys, node


def decode(node: Any) -> Any:
    """A plain value for display: scalars as Python values, containers summarized."""
    tag = node[0]
    if tag in ("n", "b", "i", "s"):
        return None if tag == "n" else node[1]
    if tag == "f":
        return float(node[1])
    if tag == "y":
        return base64.b64decode(node[1])
    if tag == "P":
        return "<pickled object>"
    if len(node) == 1 and tag in tree_format.CONTAINER_TAGS:
        return {"d": "<dict>", "l": "<list>", "t": "<tuple>"}[tag]
    return {"d": {}, "l": [], "t": []}.get(tag, f"<{tag}>")


def _matches(pattern: str | None, sub_key: str, path: str) -> bool:
    return (
        pattern is None
        or fnmatch.fnmatchcase(f"{sub_key}/{path}", pattern)
        or fnmatch.fnmatchcase(path, pattern)
    )


def read_side(
    store: StoreView, ckpt: Checkpoint, sub_keys: list[str] | None, pattern: str | None
) -> Side:
    """The leaves of ``ckpt`` in ``sub_keys`` (all when None) whose key matches glob ``pattern``."""
    from ..format.tensorio import format_path

    mans = store.manifests(ckpt, sub_keys=sub_keys)
    where = f"run {ckpt.run!r}, step {ckpt.step}"
    pieces: dict[tuple[str, str], dict[tuple[tuple[int, ...], tuple[int, ...]], StoredPiece]] = {}
    gshape: dict[tuple[str, str], tuple[int, ...]] = {}
    plain: dict[tuple[str, str], dict[int | None, Leaf]] = {}
    chunks: dict[bytes, int] = {}
    sizes: dict[str, int] = {}
    order: dict[tuple[str, str], None] = {}
    ranks: dict[str, set[int]] = {}  # sub_key -> the ranks that hold it
    for (rank, sub_key), man in sorted(mans.items()):
        ranks.setdefault(sub_key, set()).add(rank)
        for keys, node in _walk(man.tree, f"{where}, rank {rank}, {sub_key}: "):
            path = format_path(keys)
            if not _matches(pattern, sub_key, path):
                continue
            k = (sub_key, path)
            order[k] = None
            if node[0] != "T":
                plain.setdefault(k, {})[rank] = ValueLeaf(
                    node, json.dumps(node, separators=(",", ":"))
                )
                continue
            rec = man.tensors[int(node[1])]
            for i, d in enumerate(rec.chunks):
                s, e = rec.chunk_span(i)
                chunks[d] = e - s
            source = f"{where}, rank {rank}, {sub_key}, key {rec.path!r}"
            item = sizes.setdefault(rec.dtype, stored_itemsize(rec.dtype))
            if rec.shard is not None:
                pieces.setdefault(k, {}).setdefault(
                    (rec.shard.offsets, rec.shape), StoredPiece(rec.shard.offsets, rec, source)
                )
                gshape[k] = rec.shard.global_shape
                continue
            piece = StoredPiece((0,) * len(rec.shape), rec, source)
            plain.setdefault(k, {})[rank] = TensorLeaf(rec.dtype, rec.shape, (piece,), False, item)
    leaves: dict[tuple[str, str], dict[int | None, Leaf]] = {}
    for k in order:
        if k in pieces:
            check_pieces([p.record for p in pieces[k].values()], f"{where}, {k[0]}, key {k[1]!r}")
            ps = tuple(v for _, v in sorted(pieces[k].items()))
            dtype = ps[0].record.dtype
            leaves[k] = {None: TensorLeaf(dtype, gshape[k], ps, True, sizes[dtype])}
            continue
        by_rank = plain[k]
        first = next(iter(by_rank.values()))
        if set(by_rank) == ranks[k[0]] and all(_same_leaf(first, v) for v in by_rank.values()):
            leaves[k] = {None: first}
        else:
            leaves[k] = dict(by_rank)
    return Side(ckpt, leaves, chunks, {sk: tuple(sorted(rs)) for sk, rs in ranks.items()})


def _same_leaf(x: Leaf, y: Leaf) -> bool:
    if isinstance(x, ValueLeaf) or isinstance(y, ValueLeaf):
        return isinstance(x, ValueLeaf) and isinstance(y, ValueLeaf) and x.text == y.text
    return x.dtype == y.dtype and x.shape == y.shape and x.signature() == y.signature()


def pairs(
    am: Mapping[int | None, Leaf],
    bm: Mapping[int | None, Leaf],
    ranks_a: Iterable[int] = (),
    ranks_b: Iterable[int] = (),
) -> Iterator[tuple[int | None, Leaf | None, Leaf | None]]:
    """``(rank, leaf of a, leaf of b)`` to compare for one key; a missing leaf is None.

    A leaf that is the same on every rank is compared with each rank's leaf of the other side,
    and with its absence on each rank that holds the key's sub-checkpoint on both sides
    (``ranks_a``, ``ranks_b``): a rank that gained or lost the key has a leaf one side lacks."""
    both = set(ranks_a) & set(ranks_b)
    if not am or not bm:
        for r, v in (am or bm).items():
            yield (r, v, None) if am else (r, None, v)
    elif None in am and None in bm:
        yield None, am[None], bm[None]
    elif None in am:
        for r in sorted({*bm, *both}, key=_rank_order):
            yield r, am[None], bm.get(r)
    elif None in bm:
        for r in sorted({*am, *both}, key=_rank_order):
            yield r, am.get(r), bm[None]
    else:
        for r in sorted(set(am) | set(bm), key=_rank_order):
            yield r, am.get(r), bm.get(r)


def _rank_order(r: int | None) -> int:
    return -1 if r is None else r


def _windows(shape: tuple[int, ...], elems: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """Blocks of whole rows (along dim 0) of about ``elems`` elements covering the tensor."""
    if not shape:
        yield ()
        return
    row = math.prod(shape[1:])
    if row == 0 or shape[0] == 0:
        return
    rows = max(1, elems // row)
    rest = tuple((0, n) for n in shape[1:])
    for r0 in range(0, shape[0], rows):
        yield ((r0, min(shape[0], r0 + rows)), *rest)


class Reader:
    """Reads the same window of both sides' global tensors through one read plan."""

    def __init__(self, store: StoreView, where: str) -> None:
        self.store = store
        self.where = where
        self.sizes: dict[str, int] = {}

    def scan(self, ta: TensorLeaf, tb: TensorLeaf, acc: Accumulator, *, stop_on_diff: bool) -> int:
        """Feed every window of ``ta`` and ``tb`` to ``acc``; returns the raw bytes decoded."""
        from ..checkout.executor import execute_plan  # torch: only once tensors are read

        self.sizes.update({ta.dtype: ta.item, tb.dtype: tb.item})
        chunk_elems = max(p.record.chunk_size // t.item for t in (ta, tb) for p in t.pieces)
        read = 0
        for box in _windows(ta.shape, max(_WINDOW_ELEMS, chunk_elems)):
            plan = plan_boxes([(ta.pieces, box), (tb.pieces, box)], self.sizes)
            got = execute_plan(
                plan,
                self.store.blobs,
                self.store.catalog.chunk_locations,
                where=self.where,
                workers=self.store.workers,
            )
            read += sum({c.digest: c.raw_size for c in plan.copies}.values())
            a, b = got[0], got[1]
            assert a is not None and b is not None
            acc.add(a, b)
            if stop_on_diff and not acc.bits_equal:
                break
        return read
