"""Diffs between two checkpoints, of any runs and any world layouts.

Equal chunks have equal digests, so most of a diff is decided from the manifests alone: a
tensor whose stored pieces carry the same chunk digests on both sides is identical, and none of
its bytes are read. A tensor whose chunks differ is changed; for equal shapes its numeric
statistics are computed by streaming windows (a block of rows of the global tensor at a time).
Chunks whose digests differ are read from both sides; chunks the two sides share are read once,
because the norms and the cosine need every element.

Sharded tensors are compared as global tensors: pieces saved by different world layouts are
cut to the same window before comparing, and two checkpoints whose global tensors are equal
diff as identical whatever layouts wrote them. A tensor saved unsharded and the same on every
rank (a replica) counts once; one that differs between ranks, or that some ranks lack, is
compared rank by rank. A dict, list or tuple that changed type is a changed value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFoundError, NotFoundError, StoreConfigError
from ..records import Checkpoint
from ._leaves import Leaf, Reader, Side, TensorLeaf, ValueLeaf, decode, pairs, read_side
from ._stats import Accumulator
from ._view import StoreView

__all__ = [
    "LeafInfo",
    "TensorStats",
    "TensorDiff",
    "ValueDiff",
    "Sharing",
    "DiffResult",
    "diff_checkpoints",
    "module_of",
    "series",
    "StoreView",
]

IDENTICAL = "identical"
CLOSE = "close"
CHANGED = "changed"


def _num(x: float) -> float | str:
    """A float for strict JSON: non-finite values become "nan", "inf" or "-inf"."""
    return x if math.isfinite(x) else str(x)


def module_of(key: str) -> str:
    """The module path a key belongs to: ``model_states/layers.0.attn.weight`` ->
    ``model_states/layers.0.attn``; ``optim_states/state/0/exp_avg`` -> ``optim_states/state/0``."""
    head, _, leaf = key.rpartition("/")
    if "." in leaf:
        mod = leaf.rsplit(".", 1)[0]
        return f"{head}/{mod}" if head else mod
    return head or key


@dataclass(frozen=True, slots=True)
class LeafInfo:
    """A leaf only one of the two checkpoints has."""

    key: str
    rank: int | None  # None: the same on every rank (or a sharded tensor)
    kind: str  # "tensor" | "value"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    nbytes: int = 0
    value: Any = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "rank": self.rank, "kind": self.kind}
        if self.kind == "tensor":
            out.update(dtype=self.dtype, shape=list(self.shape or ()), nbytes=self.nbytes)
        else:
            out["value"] = _jsonable(self.value)
        return out


@dataclass(frozen=True, slots=True)
class TensorStats:
    """How far tensor ``b`` is from tensor ``a`` (compared as float64, or complex128)."""

    numel: int
    changed: int  # elements that differ (NaN equals NaN)
    max_abs_diff: float
    rel_l2: float  # ||b - a|| / ||a||; inf when ||a|| is 0 and b differs
    cosine: float  # nan when either tensor is all zeros
    norm_a: float
    norm_b: float

    @property
    def frac_changed(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "changed": self.changed,
            "frac_changed": self.frac_changed,
            "max_abs_diff": _num(self.max_abs_diff),
            "rel_l2": _num(self.rel_l2),
            "cosine": _num(self.cosine),
            "norm_a": _num(self.norm_a),
            "norm_b": _num(self.norm_b),
        }


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One tensor both checkpoints have.

    ``status`` is ``identical`` (same bytes; ``read_bytes == 0`` when the digests said so),
    ``close`` (different bytes, but no element further apart than the tolerance) or
    ``changed``. A dtype or shape change is always ``changed``.
    """

    key: str
    rank: int | None
    status: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    nbytes_a: int
    nbytes_b: int
    sharded: bool
    stats: TensorStats | None = None
    read_bytes: int = 0

    @property
    def differs(self) -> bool:
        return self.status == CHANGED

    @property
    def dtype_changed(self) -> bool:
        return self.dtype_a != self.dtype_b

    @property
    def shape_changed(self) -> bool:
        return self.shape_a != self.shape_b

    @property
    def module(self) -> str:
        return module_of(self.key)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "rank": self.rank,
            "status": self.status,
            "dtype": [self.dtype_a, self.dtype_b],
            "shape": [list(self.shape_a), list(self.shape_b)],
            "nbytes": [self.nbytes_a, self.nbytes_b],
            "dtype_changed": self.dtype_changed,
            "shape_changed": self.shape_changed,
            "sharded": self.sharded,
            "stats": self.stats.to_json() if self.stats else None,
            "read_bytes": self.read_bytes,
        }


@dataclass(frozen=True, slots=True)
class ValueDiff:
    """A plain value that differs (or a key that is a tensor on one side, a value on the other)."""

    key: str
    rank: int | None
    a: Any
    b: Any

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "rank": self.rank, "a": _jsonable(self.a), "b": _jsonable(self.b)}


@dataclass(frozen=True, slots=True)
class Sharing:
    """Chunks of the compared leaves: held by both checkpoints or by one; bytes as stored."""

    shared_chunks: int
    only_a_chunks: int
    only_b_chunks: int
    shared_bytes: int
    only_a_bytes: int
    only_b_bytes: int

    def to_json(self) -> dict[str, int]:
        return {
            "shared_chunks": self.shared_chunks,
            "only_a_chunks": self.only_a_chunks,
            "only_b_chunks": self.only_b_chunks,
            "shared_bytes": self.shared_bytes,
            "only_a_bytes": self.only_a_bytes,
            "only_b_bytes": self.only_b_bytes,
        }


@dataclass(frozen=True, slots=True)
class DiffResult:
    """What differs between checkpoints ``a`` and ``b``.

    ``tensors`` lists every tensor both have, identical ones included; ``values`` only the plain
    values that differ (``values_equal`` counts the rest). Metrics are shown side by side and do
    not count as a difference.
    """

    a: Checkpoint
    b: Checkpoint
    tensors: tuple[TensorDiff, ...]
    values: tuple[ValueDiff, ...]
    values_equal: int
    only_in_a: tuple[LeafInfo, ...]
    only_in_b: tuple[LeafInfo, ...]
    metrics: dict[str, tuple[float | None, float | None]]
    sharing: Sharing
    stats: bool = True
    tolerance: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def differs(self) -> bool:
        return bool(
            self.only_in_a or self.only_in_b or self.values or any(t.differs for t in self.tensors)
        )

    @property
    def identical(self) -> bool:
        return not self.differs

    @property
    def changed(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if t.differs)

    @property
    def unchanged(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if not t.differs)

    @property
    def read_bytes(self) -> int:
        return sum(t.read_bytes for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (strict JSON: non-finite statistics and values are the strings "nan",
        "inf", "-inf"; a metric with no value, NaN, is None)."""
        return {
            "a": {"ref": self.a.ref, **self.a.to_json()},
            "b": {"ref": self.b.ref, **self.b.to_json()},
            "identical": self.identical,
            "summary": {
                "tensors": len(self.tensors),
                "tensors_identical": sum(t.status == IDENTICAL for t in self.tensors),
                "tensors_close": sum(t.status == CLOSE for t in self.tensors),
                "tensors_changed": len(self.changed),
                "values_changed": len(self.values),
                "values_equal": self.values_equal,
                "only_in_a": len(self.only_in_a),
                "only_in_b": len(self.only_in_b),
                "read_bytes": self.read_bytes,
            },
            "options": {"stats": self.stats, "tolerance": self.tolerance, **self.options},
            "metrics": {
                k: {"a": _metric(va), "b": _metric(vb)} for k, (va, vb) in self.metrics.items()
            },
            "sharing": self.sharing.to_json(),
            "only_in_a": [x.to_json() for x in self.only_in_a],
            "only_in_b": [x.to_json() for x in self.only_in_b],
            "tensors": [t.to_json() for t in self.tensors],
            "values": [v.to_json() for v in self.values],
        }


def _metric(x: float | None) -> float | None:
    """A metric for JSON: NaN records no value, so it is None, as in ``Checkpoint.to_json``."""
    return None if x is None or not math.isfinite(x) else x


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return _num(x)
    if isinstance(x, bytes):
        return {"bytes": len(x), "hex": x[:32].hex()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    return x


def _info(key: str, rank: int | None, leaf: Leaf) -> LeafInfo:
    if isinstance(leaf, ValueLeaf):
        return LeafInfo(key, rank, "value", value=decode(leaf.node))
    return LeafInfo(key, rank, "tensor", leaf.dtype, leaf.shape, leaf.nbytes)


def _items_apart(leaf: Leaf) -> bool:
    return isinstance(leaf, ValueLeaf) and leaf.items_apart


def _describe(leaf: Leaf) -> Any:
    if isinstance(leaf, ValueLeaf):
        return decode(leaf.node)
    return f"<tensor {leaf.dtype} {list(leaf.shape)}>"


# -- comparing one tensor -----------------------------------------------------------------------


def _digests_decide(ta: TensorLeaf, tb: TensorLeaf) -> str | None:
    """IDENTICAL or CHANGED when the chunk digests prove it (same dtype and shape), else None.

    Pieces at the same place cut into chunks the same way hold the same bytes exactly when
    their digests agree; pieces that are runs of whole rows are also lined up by their chunks'
    byte ranges in the global tensor, which catches layouts that split one tensor differently.
    """
    if ta.signature() == tb.signature():
        return IDENTICAL
    placed = {(p.offsets, p.record.shape, p.record.chunk_size): p.record.chunks for p in ta.pieces}
    if any(
        placed.get((p.offsets, p.record.shape, p.record.chunk_size), p.record.chunks)
        != p.record.chunks
        for p in tb.pieces
    ):
        return CHANGED
    ia, ib = ta.intervals(), tb.intervals()
    if ia is None or ib is None:
        return None
    if ia == ib:
        return IDENTICAL
    spans = {(s, e): d for s, e, d in ia}
    return CHANGED if any(spans.get((s, e), d) != d for s, e, d in ib) else None


def _compare_tensor(
    key: str,
    rank: int | None,
    ta: TensorLeaf,
    tb: TensorLeaf,
    reader: Reader,
    stats: bool,
    tolerance: float | None,
) -> TensorDiff:
    def result(status: str, st: TensorStats | None = None, read: int = 0) -> TensorDiff:
        return TensorDiff(
            key, rank, status, ta.dtype, tb.dtype, ta.shape, tb.shape, ta.nbytes, tb.nbytes,
            ta.sharded or tb.sharded, st, read,
        )  # fmt: skip

    if ta.shape != tb.shape:
        return result(CHANGED)
    same_dtype = ta.dtype == tb.dtype
    decided = _digests_decide(ta, tb) if same_dtype else CHANGED
    if decided == IDENTICAL or (decided == CHANGED and not stats):
        return result(decided)
    acc = Accumulator(stats=stats)
    read = reader.scan(ta, tb, acc, stop_on_diff=not stats)
    st = TensorStats(**acc.result()) if stats else None
    if same_dtype and acc.bits_equal:
        status = IDENTICAL
    elif same_dtype and st is not None and tolerance is not None and acc.within(tolerance):
        status = CLOSE
    else:
        status = CHANGED
    return result(status, st, read)


# -- the diff -------------------------------------------------------------------------------------


def _sub_keys(a: Checkpoint, b: Checkpoint, sub_key: str | None) -> list[str] | None:
    if sub_key is None:
        return None
    if sub_key not in a.sub_keys and sub_key not in b.sub_keys:
        raise CheckpointNotFoundError(
            f"neither {a.ref} (sub-checkpoints {list(a.sub_keys)}) nor {b.ref} "
            f"(sub-checkpoints {list(b.sub_keys)}) has a sub-checkpoint {sub_key!r}"
        )
    return [sub_key]


def _check_options(stats: bool, tolerance: float | None) -> None:
    if tolerance is None:
        return
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not tolerance >= 0
        or math.isinf(tolerance)
    ):
        raise StoreConfigError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    if not stats:
        raise StoreConfigError(
            "a tolerance needs the changed tensors' values; leave stats on to use one"
        )


def diff_checkpoints(
    store: StoreView,
    a: Checkpoint,
    b: Checkpoint,
    *,
    sub_key: str | None = None,
    key: str | None = None,
    stats: bool = True,
    tolerance: float | None = None,
) -> DiffResult:
    """Compare checkpoint ``a`` with checkpoint ``b`` (see the module docstring).

    ``sub_key`` restricts the diff to one sub-checkpoint; ``key`` is a glob matched against
    ``SUB_KEY/PATH`` and against ``PATH`` alone. With ``stats=False`` changed tensors are not
    read: digests decide, and only tensors cut differently on the two sides (other world layouts)
    are read, to tell equal from changed. With a ``tolerance``, a tensor whose elements all lie
    within it counts as equal (status ``close``).
    """
    _check_options(stats, tolerance)
    subs = _sub_keys(a, b, sub_key)
    side_a = read_side(store, a, subs, key)
    side_b = read_side(store, b, subs, key)
    if key is not None and not side_a.leaves and not side_b.leaves:
        raise NotFoundError(
            f"no key matches {key!r} in {a.ref} or {b.ref}; keys read SUB_KEY/PATH, as in "
            "'model_states/layers.0.weight' (see `ckstore show`)"
        )
    return _compare(store, side_a, side_b, stats, tolerance, {"sub_key": sub_key, "key": key})


def _compare(
    store: StoreView, sa: Side, sb: Side, stats: bool, tolerance: float | None, options: dict[str, Any]
) -> DiffResult:
    reader = Reader(store, f"diff of {sa.ckpt.ref} and {sb.ckpt.ref}")
    tensors: list[TensorDiff] = []
    values: list[ValueDiff] = []
    only_a: list[LeafInfo] = []
    only_b: list[LeafInfo] = []
    values_equal = 0
    for k in dict.fromkeys([*sa.leaves, *sb.leaves]):
        name = f"{k[0]}/{k[1]}"
        ranks_a, ranks_b = sa.ranks.get(k[0], ()), sb.ranks.get(k[0], ())
        for rank, la, lb in pairs(sa.leaves.get(k, {}), sb.leaves.get(k, {}), ranks_a, ranks_b):
            if lb is None:
                assert la is not None
                if not _items_apart(la):  # a container's items are listed on their own
                    only_a.append(_info(name, rank, la))
            elif la is None:
                if not _items_apart(lb):
                    only_b.append(_info(name, rank, lb))
            elif isinstance(la, TensorLeaf) and isinstance(lb, TensorLeaf):
                tensors.append(_compare_tensor(name, rank, la, lb, reader, stats, tolerance))
            elif (
                isinstance(la, ValueLeaf)
                and isinstance(lb, ValueLeaf)
                and la.container
                and (la.items_apart or lb.items_apart)
            ):
                if la.container != lb.container:  # the type of a container with items changed
                    values.append(ValueDiff(name, rank, _describe(la), _describe(lb)))
            elif isinstance(la, ValueLeaf) and isinstance(lb, ValueLeaf) and la.text == lb.text:
                values_equal += 1
            else:
                values.append(ValueDiff(name, rank, _describe(la), _describe(lb)))
    metrics = {
        m: (sa.ckpt.metrics.get(m), sb.ckpt.metrics.get(m))
        for m in dict.fromkeys([*sa.ckpt.metrics, *sb.ckpt.metrics])
    }
    return DiffResult(
        sa.ckpt, sb.ckpt, tuple(tensors), tuple(values), values_equal, tuple(only_a), tuple(only_b),
        metrics, _sharing(store, sa.chunks, sb.chunks), stats, tolerance, options,
    )  # fmt: skip


def _sharing(store: StoreView, ca: Mapping[bytes, int], cb: Mapping[bytes, int]) -> Sharing:
    locs = store.catalog.chunk_locations([*ca, *(d for d in cb if d not in ca)])

    def size(ds: Sequence[bytes]) -> int:
        return sum(locs[d].length if d in locs else 0 for d in ds)

    shared = [d for d in ca if d in cb]
    only_a = [d for d in ca if d not in cb]
    only_b = [d for d in cb if d not in ca]
    return Sharing(len(shared), len(only_a), len(only_b), size(shared), size(only_a), size(only_b))


def series(
    store: StoreView,
    checkpoints: Sequence[Checkpoint],
    *,
    sub_key: str | None = None,
    key: str | None = None,
) -> list[tuple[Checkpoint, DiffResult | None]]:
    """Each checkpoint diffed (stats off) against the one before it in its run; a run's first
    checkpoint against the checkpoint it descends from, when it has one that still exists."""
    out: list[tuple[Checkpoint, DiffResult | None]] = []
    last: dict[str, tuple[Checkpoint, Side]] = {}
    subs = [sub_key] if sub_key is not None else None
    for ckpt in checkpoints:
        prev = last.get(ckpt.run)
        side = read_side(store, ckpt, subs, key)
        if prev is None and ckpt.parent:
            try:
                parent = store.resolve(ckpt.parent)
                prev = (parent, read_side(store, parent, subs, key))
            except NotFoundError:
                prev = None
        res = None
        if prev is not None:
            res = _compare(store, prev[1], side, False, None, {"sub_key": sub_key, "key": key})
        out.append((ckpt, res))
        last[ckpt.run] = (ckpt, side)
    return out
