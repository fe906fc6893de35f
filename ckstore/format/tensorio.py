"""Tensors to raw bytes and back, and state trees to manifests' encoded trees.

This is the one core module that imports torch. Tensor bytes are handed out as zero-copy
memoryviews of the tensor's own storage (a non-contiguous tensor or one on an accelerator is
first staged into one contiguous CPU tensor; the few bytes of a tiny tensor are copied, see
:func:`raw_bytes`).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable
from ctypes import string_at as _string_at
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import IntegrityError, UnsupportedValueError
from ..layout import Shard
from . import tree as tree_format
from .tree import MAX_DEPTH

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
    "StagingBuffer",
    "to_device",
    "empty_tensor",
    "byte_view",
    "format_path",
]


_dtype_names: dict[torch.dtype, str] = {}
_itemsizes: dict[torch.dtype, int] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise IntegrityError(f"dtype {name!r} is not known to this torch ({torch.__version__})")
    return dt


def itemsize(dtype: torch.dtype) -> int:
    size = _itemsizes.get(dtype)
    if size is None:
        size = _itemsizes[dtype] = int(torch.empty((), dtype=dtype).element_size())
    return size


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


def _check_storable(t: torch.Tensor, keys: tuple[Any, ...], at: Callable[[tuple[Any, ...]], str]) -> None:
    """Refuse a tensor ckstore cannot store; ``at(keys)`` names it (formatted only on failure)."""
    problem = _unstorable(t)
    if problem is not None:
        raise UnsupportedValueError(f"{at(keys)}: {problem}")


def _unstorable(t: torch.Tensor) -> str | None:
    if t.layout == torch.strided and not t.is_quantized and not t.is_meta and not t.is_nested:
        return None  # the common case, in four attribute reads
    if t.layout != torch.strided:
        return f"tensors of layout {t.layout} cannot be stored; convert with .to_dense() first"
    if t.is_quantized:
        return "quantized tensors cannot be stored; dequantize first"
    if t.device.type == "meta":
        return "a meta tensor has no data to store"
    if getattr(t, "is_nested", False):
        return "nested tensors cannot be stored"
    return None


def raw_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A contiguous CPU tensor with ``t``'s values and a memoryview of its raw bytes.

    No copy is made when ``t`` is already a contiguous CPU tensor, but for one of fewer than
    :data:`COPY_BELOW` bytes, whose bytes are copied: cheaper than viewing them, and lighter
    than the view's objects. Keep the returned tensor alive as long as the memoryview is used;
    read-only use only (a copy does not write through).
    """
    if t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        n = t.nbytes
        if n < COPY_BELOW:
            if t.requires_grad:
                t = t.detach()
            # copied from the tensor's memory while ``t`` holds it (any dtype: 2.7 against 4.1 µs
            # through numpy, which views neither bf16 nor fp8)
            return t, memoryview(_string_at(t.data_ptr(), n) if n else b"")
        if t.dtype in _NUMPY_DTYPES:
            # the common case: numpy views the bytes in place (a third of the calls of the general path)
            if t.requires_grad:
                t = t.detach()
            return t, t.numpy().data.cast("B")
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


#: CPU tensors under this many bytes have their bytes copied rather than viewed (:func:`raw_bytes`):
#: 100,000 tensors of 16 bytes in 195 against 264 ms, their bytes held in 35 against 56 MiB
COPY_BELOW = 512


def _numpy_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose CPU tensors this torch hands to numpy (bf16 and fp8 never; unsigned ints since 2.3)."""
    found = set()
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "complex64", "complex128"):  # fmt: skip
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            continue
        try:
            torch.zeros(1, dtype=dt).numpy()
        except (TypeError, RuntimeError):
            continue
        found.add(dt)
    return frozenset(found)


_NUMPY_DTYPES = _numpy_dtypes()
#: those without a conjugate or negative bit that numpy refuses (complex ones may carry one)
_REAL_NUMPY_DTYPES = frozenset(dt for dt in _NUMPY_DTYPES if not dt.is_complex)


def stage_tensors(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, memoryview]]:
    """:func:`raw_bytes` for many tensors, staging accelerator tensors efficiently.

    CPU tensors are viewed in place. Tensors on a CUDA device are made contiguous there, then
    copied into pinned host memory with asynchronous copies that overlap one another; the
    device is synchronized once at the end rather than once per tensor.
    """
    host: list[torch.Tensor | tuple[torch.Tensor, memoryview]] = []
    devices: set[torch.device] = set()
    for t in tensors:
        if t.is_cpu:
            host.append(raw_bytes(t))
            continue
        src = t.detach().resolve_conj().resolve_neg().contiguous()
        pinned = src.device.type == "cuda"
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
        dst.copy_(src, non_blocking=pinned)
        if pinned:
            devices.add(src.device)
        host.append(dst)
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()
    return [h if isinstance(h, tuple) else raw_bytes(h) for h in host]


_ALIGN = 64  # every staged tensor starts on a cache line (and on its own element size)


class StagingBuffer:
    """Reusable host memory that an asynchronous commit copies a state's tensors into.

    :meth:`stage` copies every tensor into one flat byte buffer, each at a 64-byte aligned
    offset, and hands back contiguous views of it with their raw bytes. The buffer is allocated
    on the first call and reused by later ones; it grows (a fresh allocation) only when a state
    no longer fits, so it holds the largest state staged so far: ``nbytes`` is the whole cost.
    With CUDA present it is pinned, accelerator tensors are copied with asynchronous copies, and
    each device is synchronised once at the end. The views stay valid until the next ``stage``:
    the owner must not call it again while a commit still reads them.
    """

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buf: torch.Tensor | None = None
        self._bytes = memoryview(b"")  # the buffer's bytes, sliced for each tensor's raw bytes
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer viewed as each dtype staged
        self._sizes: list[int] = []  # the byte size of each tensor last staged (their layout)
        #: a fingerprint (the chunk digests) of the bytes each tensor's place holds now, where known;
        #: the owner records them once computed, and :meth:`stage` skips copies they prove needless
        self.held: list[Any] = []
        #: how many tensors the last ``stage`` copied, and how many it found already in place
        self.copied = self.kept = 0

    @property
    def nbytes(self) -> int:
        """The host memory this buffer holds now."""
        return 0 if self._buf is None else int(self._buf.numel())

    def stage(
        self, tensors: list[torch.Tensor], fingerprints: list[Any] | None = None
    ) -> list[tuple[torch.Tensor, memoryview]]:
        """Copy ``tensors`` in; with ``fingerprints`` (one per tensor, None for unknown), a tensor
        whose fingerprint equals the one :attr:`held` records for its place is not copied again
        (its bytes are there already, from the previous commit through this buffer)."""
        sizes = [t.nbytes for t in tensors]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        if self._buf is None or self._buf.numel() < total:
            self._buf = None  # release the old one before allocating its successor
            self._bytes, self._typed = memoryview(b""), {}
            self._buf = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=self.pin_memory)
            self._bytes = self._buf.numpy().data
            self.held = []
        if sizes != self._sizes:
            self.held = []
        self._sizes = sizes
        held = self.held if len(self.held) == len(tensors) else [None] * len(tensors)
        self.held = [None] * len(tensors)  # until the owner records what it staged
        buf, raw, typed = self._buf, self._bytes, self._typed
        devices: set[torch.device] = set()
        out: list[tuple[torch.Tensor, memoryview]] = []
        self.copied = self.kept = 0
        with torch.no_grad():  # copying a tensor that requires grad records nothing
            for i, t in enumerate(tensors):
                off, n = offsets[i], sizes[i]
                dtype = t.dtype
                flat = typed.get(dtype)
                if flat is None:
                    flat = typed[dtype] = buf.view(dtype)  # the buffer's size is a multiple of _ALIGN
                if n and t.is_contiguous():
                    # a contiguous tensor's strides lay its elements out densely: one call makes its place
                    dst = flat.as_strided(t.shape, t.stride(), off // itemsize(dtype))
                else:
                    dst = buf[off : off + n].view(dtype).view(t.shape)
                out.append((dst, raw[off : off + n]))
                if fingerprints is not None and fingerprints[i] is not None and fingerprints[i] == held[i]:
                    self.kept += 1
                    continue
                if t.is_cpu:  # copy_ writes the values a conjugate or negative view shows
                    dst.copy_(t)
                else:  # such views resolved on the device first: an asynchronous copy leaves no fix-up to the host
                    asynchronous = self.pin_memory and t.is_cuda
                    dst.copy_(t.resolve_conj().resolve_neg(), non_blocking=asynchronous)
                    if asynchronous:
                        devices.add(t.device)
                self.copied += 1
        for dev in devices:
            torch.cuda.current_stream(dev).synchronize()
        return out


def empty_tensor(dtype: torch.dtype, shape: tuple[int, ...], *, pin_memory: bool = False) -> torch.Tensor:
    # the shape as a keyword: torch parses it faster so (2.9 against 4.3 µs a tensor here; a
    # checkout of 100,000 tiny tensors allocates each)
    return torch.empty(size=shape, dtype=dtype, pin_memory=pin_memory)


def to_device(tensors: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """Copy host tensors to ``device`` (asynchronously from pinned memory), then wait once."""
    out = [None if t is None else t.to(device, non_blocking=t.is_pinned()) for t in tensors]
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return out


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's bytes."""
    if t.dtype in _REAL_NUMPY_DTYPES and not t.requires_grad:
        # numpy views the bytes (4 µs a tensor, where torch's reshape and view took 10: a
        # checkout of 100,000 tiny tensors makes one view of each)
        return t.numpy().reshape(-1).view(np.uint8)
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
    return "/".join(map(str, keys)) if keys else "<root>"


_KEY_TYPES = (str, int, float, bool, type(None))



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

    ``tensor_hook`` lets integrations turn foreign leaves (a DTensor, say) into a :class:`Leaf`;
    it is asked about every value whose type is not exactly one of the plain types (dict, list,
    tuple, str, int, float, bool, None) or ``torch.Tensor``.
    Values ckstore cannot store raise :class:`UnsupportedValueError` naming their key path,
    unless ``allow_pickle`` is set, in which case they are pickled. So does a tree that could not
    be read back as it was: nested deeper than :data:`MAX_DEPTH`, a string key or value that has
    no UTF-8 encoding (a lone surrogate), a NUL character in a key, an int too long for the
    manifest, or two values that would have the same key path as users read it
    (:func:`format_path`: ``{"a/b": x}`` beside ``{"a": {"b": y}}``, or keys ``1`` and ``"1"``).
    """
    leaves: list[Leaf] = []
    active: set[int] = set()
    values: list[tuple[Any, ...]] = []  # the key path of every value that is not a container
    slashed = [False]  # a key holds "/": two key paths may read alike

    def at(keys: tuple[Any, ...]) -> str:
        return f"{where}key {format_path(keys)!r}" if where else f"key {format_path(keys)!r}"

    def check_str(x: str, keys: tuple[Any, ...], what: str) -> None:
        if not x.isascii():
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise UnsupportedValueError(
                    f"{at(keys)}: {what} {x[:60]!r} contains a lone surrogate {x[e.start]!r}, which has "
                    "no UTF-8 encoding; store it as bytes"
                ) from None

    def check_int(x: int, keys: tuple[Any, ...], what: str) -> None:
        if x.bit_length() > _MAX_INT_BITS:
            raise UnsupportedValueError(
                f"{at(keys)}: {what} is an int of {x.bit_length()} bits; ints of more than "
                f"{_MAX_INT_BITS} bits cannot be stored (store it as bytes)"
            )

    def walk(x: Any, keys: tuple[Any, ...]) -> Any:
        if len(keys) > MAX_DEPTH:
            raise UnsupportedValueError(
                f"{at(keys)}: the state tree is nested deeper than {MAX_DEPTH} levels of dicts, lists "
                "and tuples; flatten it"
            )
        # values of the plain types first, by exact type: the tensor hook is for foreign values
        kind = type(x)
        if kind is dict or kind is list or kind is tuple:
            return container(x, keys)
        if kind is torch.Tensor:
            return tensor(x, keys, None)
        if kind is str:
            if not x.isascii():
                check_str(x, keys, "the string")
            values.append(keys)
            return ["s", x]
        if kind is float:
            values.append(keys)
            return ["f", repr(x)]
        if kind is int:
            check_int(x, keys, "the value")
            values.append(keys)
            return ["i", x]
        if kind is bool:
            values.append(keys)
            return ["b", x]
        if x is None:
            values.append(keys)
            return ["n"]
        return foreign(x, keys)

    def tensor(t: torch.Tensor, keys: tuple[Any, ...], shard: Shard | None) -> list[Any]:
        _check_storable(t, keys, at)
        leaves.append(Leaf(keys, t, shard))
        values.append(keys)
        return ["T", len(leaves) - 1]

    def foreign(x: Any, keys: tuple[Any, ...]) -> Any:
        if tensor_hook is not None:
            hooked = tensor_hook(x)
            if hooked is not None:
                hooked.keys = keys
                _check_storable(hooked.tensor, keys, at)
                leaves.append(hooked)
                values.append(keys)
                return ["T", len(leaves) - 1]
        if isinstance(x, Shard):
            if not isinstance(x.tensor, torch.Tensor):
                raise UnsupportedValueError(f"{at(keys)}: Shard must wrap a torch.Tensor")
            return tensor(x.tensor, keys, x)
        if isinstance(x, torch.Tensor):
            return tensor(x, keys, None)
        if isinstance(x, str):
            check_str(x, keys, "the string")
        elif isinstance(x, int) and not isinstance(x, bool):
            check_int(x, keys, "the value")
        enc = _encode_scalar(x)
        if enc is not None:
            values.append(keys)
            return enc
        if isinstance(x, (dict, list, tuple)) and _plain_subclass(x):
            return container(x, keys)
        if allow_pickle:
            try:
                values.append(keys)
                return ["P", base64.b64encode(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).decode()]
            except Exception as e:  # noqa: BLE001 - any pickling failure is the user's value
                raise UnsupportedValueError(f"{at(keys)}: value of type {type(x).__name__} cannot be pickled: {e}") from e
        raise UnsupportedValueError(
            f"{at(keys)}: value of type {type(x).__module__}.{type(x).__qualname__} is not a tensor "
            "or plain value (None, bool, int, float, str, bytes, list, tuple, dict). Convert it, or "
            "pass allow_pickle=True to commit to store it pickled (checkout then needs "
            "allow_pickle=True too)"
        )

    def container(x: Any, keys: tuple[Any, ...]) -> list[Any]:
        if id(x) in active:
            raise UnsupportedValueError(f"{at(keys)}: the state tree contains a reference cycle")
        if not x:
            values.append(keys)
        active.add(id(x))
        try:
            if isinstance(x, dict):
                return ["d", walk_dict(x, keys)]
            tag = "l" if isinstance(x, list) else "t"
            return [tag, [walk(v, (*keys, i)) for i, v in enumerate(x)]]
        finally:
            active.discard(id(x))

    def walk_dict(x: dict[Any, Any], keys: tuple[Any, ...]) -> list[Any]:
        named: dict[str, Any] | None = None  # a dict with keys that are not str: keys as read
        for k in x:
            if isinstance(k, str):
                if not k.isascii():
                    check_str(k, keys, "the dict key")
                if "\x00" in k:
                    raise UnsupportedValueError(f"{at(keys)}: dict key {k!r} contains a NUL character")
                if "/" in k:
                    slashed[0] = True
                continue
            if not isinstance(k, _KEY_TYPES):
                raise UnsupportedValueError(
                    f"{at(keys)}: dict key {k!r} of type {type(k).__name__} is not "
                    "supported (use str, int, float, bool or None keys)"
                )
            if isinstance(k, int) and not isinstance(k, bool):
                check_int(k, keys, "a dict key")
            if named is None:
                named = {str(j): j for j in x if isinstance(j, str)}
        if named is not None:  # 1 and "1" (or None and "None") would read as one key
            for k in x:
                if isinstance(k, str):
                    continue
                other = named.setdefault(str(k), k)
                if other is not k:
                    raise _collision(where, (*keys, other), (*keys, k))
        return [[["s", k] if type(k) is str else _encode_scalar(k), walk(v, (*keys, k))] for k, v in x.items()]

    tree = walk(obj, ())
    if slashed[0]:  # only a key holding "/" can make key paths of different depths read alike
        seen: dict[str, tuple[Any, ...]] = {}
        for keys in values:
            other = seen.setdefault(format_path(keys), keys)
            if other is not keys:
                raise _collision(where, other, keys)
    return tree, leaves


#: The longest int a state tree may hold (the manifest's JSON reader takes at most 4300 digits).
_MAX_INT_BITS = 14_000


def _collision(where: str, a: tuple[Any, ...], b: tuple[Any, ...]) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"{where}key paths {list(a)!r} and {list(b)!r} would both read as {format_path(a)!r}; "
        "rename one of them (ckstore names every value by its key path joined with '/')"
    )


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

    return tree_format.rebuild(tree, leaf, where, tensor=tensor_at)


def iter_tensor_paths(tree: Any) -> dict[int, tuple[Any, ...]]:
    """Map each tensor index in an encoded tree to its key path."""
    return tree_format.tensor_paths(tree)
