"""Tensors to raw bytes and back, and state trees to manifests' encoded trees.

This is the one core module that imports torch. Tensor bytes are handed out as zero-copy
memoryviews of the tensor's own storage (a non-contiguous tensor or one on an accelerator is
first staged into one contiguous CPU tensor).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import IntegrityError, UnsupportedValueError
from ..layout import Shard
from . import tree as tree_format

__all__ = [
    "Leaf",
    "flatten",
    "unflatten",
    "dtype_name",
    "dtype_from_name",
    "itemsize",
    "stored_itemsize",
    "raw_bytes",
    "stage_tensors",
    "to_device",
    "empty_tensor",
    "byte_view",
    "format_path",
]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise IntegrityError(f"dtype {name!r} is not known to this torch ({torch.__version__})")
    return dt


def itemsize(dtype: torch.dtype) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})
_stored_itemsizes: dict[str, int] = {}


def stored_itemsize(name: str) -> int:
    """The element size of dtype ``name`` as a manifest records it.

    Raises :class:`IntegrityError` unless ``name`` is the canonical name (``dtype_name``) of a
    dtype this torch has and ckstore stores (quantized dtypes are refused at commit).
    """
    size = _stored_itemsizes.get(name)
    if size is None:
        dt = getattr(torch, name, None) if name.isidentifier() and not name.startswith("_") else None
        if not isinstance(dt, torch.dtype) or dtype_name(dt) != name or name in _QUANTIZED:
            raise IntegrityError(f"dtype {name[:40]!r} is not a dtype this torch ({torch.__version__}) stores")
        size = _stored_itemsizes[name] = int(dt.itemsize)
    return size


def _check_storable(t: torch.Tensor, where: str) -> None:
    if t.layout != torch.strided:
        raise UnsupportedValueError(
            f"{where}: tensors of layout {t.layout} cannot be stored; convert with .to_dense() first"
        )
    if t.is_quantized:
        raise UnsupportedValueError(f"{where}: quantized tensors cannot be stored; dequantize first")
    if t.device.type == "meta":
        raise UnsupportedValueError(f"{where}: a meta tensor has no data to store")
    if getattr(t, "is_nested", False):
        raise UnsupportedValueError(f"{where}: nested tensors cannot be stored")


def raw_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A contiguous CPU tensor with ``t``'s values and a memoryview of its raw bytes.

    No copy is made when ``t`` is already a contiguous CPU tensor. Keep the returned tensor
    alive as long as the memoryview is used.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return t, memoryview(b"")
    u8 = t.reshape(-1).view(torch.uint8)
    return t, u8.numpy().data.cast("B")


def stage_tensors(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, memoryview]]:
    """:func:`raw_bytes` for many tensors, staging accelerator tensors efficiently.

    CPU tensors are viewed in place. Tensors on a CUDA device are made contiguous there, then
    copied into pinned host memory with asynchronous copies that overlap one another; the
    device is synchronized once at the end rather than once per tensor.
    """
    host: list[torch.Tensor | tuple[torch.Tensor, memoryview]] = []
    devices: set[torch.device] = set()
    for t in tensors:
        t = t.detach()
        if t.device.type == "cpu":
            host.append(raw_bytes(t))
            continue
        src = t.resolve_conj().resolve_neg().contiguous()
        pinned = src.device.type == "cuda"
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
        dst.copy_(src, non_blocking=pinned)
        if pinned:
            devices.add(src.device)
        host.append(dst)
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()
    return [h if isinstance(h, tuple) else raw_bytes(h) for h in host]


def empty_tensor(dtype: torch.dtype, shape: tuple[int, ...], *, pin_memory: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)


def to_device(tensors: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """Copy host tensors to ``device`` (asynchronously from pinned memory), then wait once."""
    out = [None if t is None else t.to(device, non_blocking=t.is_pinned()) for t in tensors]
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return out


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's bytes."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass(slots=True)
class Leaf:
    """A tensor found while flattening: its key path and, for a shard, its declaration."""

    keys: tuple[Any, ...]
    tensor: torch.Tensor
    shard: Shard | None


def format_path(keys: tuple[Any, ...]) -> str:
    """A key path as users read it: ``state/0/exp_avg``."""
    return "/".join(str(k) for k in keys) if keys else "<root>"


_KEY_TYPES = (str, int, float, bool, type(None))

#: The deepest nesting of dicts, lists and tuples a state tree may have (the root is depth 0).
#: Commits refuse deeper trees before writing anything; decoding refuses deeper manifests.
MAX_DEPTH = 100


def _encode_scalar(x: Any) -> list[Any] | None:
    if x is None:
        return ["n"]
    if isinstance(x, bool):
        return ["b", x]
    if isinstance(x, int):
        return ["i", int(x)]
    if isinstance(x, float):
        return ["f", repr(float(x))]
    if isinstance(x, str):
        return ["s", str(x)]
    if isinstance(x, (bytes, bytearray, memoryview)):
        return ["y", base64.b64encode(bytes(x)).decode()]
    return None


def flatten(
    obj: Any,
    *,
    allow_pickle: bool = False,
    tensor_hook: Callable[[Any], Leaf | None] | None = None,
    where: str = "",
) -> tuple[Any, list[Leaf]]:
    """Encode a state tree; returns the tree and its tensors in depth-first order.

    ``tensor_hook`` lets integrations turn foreign leaves (a DTensor, say) into a :class:`Leaf`.
    Values ckstore cannot store raise :class:`UnsupportedValueError` naming their key path,
    unless ``allow_pickle`` is set, in which case they are pickled.
    """
    leaves: list[Leaf] = []
    active: set[int] = set()

    def at(keys: tuple[Any, ...]) -> str:
        return f"{where}key {format_path(keys)!r}" if where else f"key {format_path(keys)!r}"

    def walk(x: Any, keys: tuple[Any, ...]) -> Any:
        if tensor_hook is not None:
            hooked = tensor_hook(x)
            if hooked is not None:
                hooked.keys = keys
                _check_storable(hooked.tensor, at(keys))
                leaves.append(hooked)
                return ["T", len(leaves) - 1]
        if isinstance(x, Shard):
            if not isinstance(x.tensor, torch.Tensor):
                raise UnsupportedValueError(f"{at(keys)}: Shard must wrap a torch.Tensor")
            _check_storable(x.tensor, at(keys))
            leaves.append(Leaf(keys, x.tensor, x))
            return ["T", len(leaves) - 1]
        if isinstance(x, torch.Tensor):
            _check_storable(x, at(keys))
            leaves.append(Leaf(keys, x, None))
            return ["T", len(leaves) - 1]
        enc = _encode_scalar(x)
        if enc is not None:
            return enc
        if isinstance(x, (dict, list, tuple)) and (type(x) in (dict, list, tuple) or _plain_subclass(x)):
            if id(x) in active:
                raise UnsupportedValueError(f"{at(keys)}: the state tree contains a reference cycle")
            active.add(id(x))
            try:
                if isinstance(x, dict):
                    items = []
                    for k, v in x.items():
                        if not isinstance(k, _KEY_TYPES):
                            raise UnsupportedValueError(
                                f"{at(keys)}: dict key {k!r} of type {type(k).__name__} is not "
                                "supported (use str, int, float, bool or None keys)"
                            )
                        items.append([_encode_scalar(k), walk(v, (*keys, k))])
                    return ["d", items]
                tag = "l" if isinstance(x, list) else "t"
                return [tag, [walk(v, (*keys, i)) for i, v in enumerate(x)]]
            finally:
                active.discard(id(x))
        if allow_pickle:
            try:
                return ["P", base64.b64encode(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).decode()]
            except Exception as e:  # noqa: BLE001 - any pickling failure is the user's value
                raise UnsupportedValueError(f"{at(keys)}: value of type {type(x).__name__} cannot be pickled: {e}") from e
        raise UnsupportedValueError(
            f"{at(keys)}: value of type {type(x).__module__}.{type(x).__qualname__} is not a tensor "
            "or plain value (None, bool, int, float, str, bytes, list, tuple, dict). Convert it, or "
            "pass allow_pickle=True to commit to store it pickled (checkout then needs "
            "allow_pickle=True too)"
        )

    return walk(obj, ()), leaves


def _plain_subclass(x: Any) -> bool:
    # OrderedDict, defaultdict, torch.Size and named tuples are stored as plain dict/tuple.
    import collections

    return isinstance(x, (collections.OrderedDict, collections.defaultdict, torch.Size)) or (
        isinstance(x, tuple) and hasattr(x, "_fields")
    )


def unflatten(
    tree: Any,
    tensor_at: Callable[[int], Any],
    *,
    allow_pickle: bool = False,
    where: str = "",
) -> Any:
    """Rebuild a state tree, fetching tensor ``i`` from ``tensor_at(i)``.

    The tree is read by :func:`ckstore.format.tree.rebuild`; a malformed node raises
    :class:`IntegrityError`, a pickled value without ``allow_pickle`` :class:`UnsupportedValueError`.
    """

    def leaf(keys: tuple[Any, ...], tag: str, node: Any) -> Any:
        if tag == "T":
            return tensor_at(int(node[1]))
        if tag == "P":
            if not allow_pickle:
                raise UnsupportedValueError(
                    f"{where}key {format_path(keys)!r} holds a pickled object; pickles can run code, "
                    "so checkout refuses them unless you pass allow_pickle=True"
                )
            try:
                data = base64.b64decode(node[1], validate=True)
            except ValueError as e:
                raise IntegrityError(f"{where}key {format_path(keys)!r}: the pickled value is not base64") from e
            return pickle.loads(data)  # noqa: S301 - explicit opt-in
        return tree_format.decode_scalar(node, where, keys)

    return tree_format.rebuild(tree, leaf, where)


def iter_tensor_paths(tree: Any) -> dict[int, tuple[Any, ...]]:
    """Map each tensor index in an encoded tree to its key path."""
    return tree_format.tensor_paths(tree)
