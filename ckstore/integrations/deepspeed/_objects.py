"""DeepSpeed's Python objects as plain values, and back, without pickle.

DeepSpeed's checkpoint files hold a few objects besides tensors and plain values: loss scalers
(``LossScaler``, ``DynamicLossScaler``), ZeRO's ``fragment_address`` records, enums, and torch
dtypes. :func:`to_plain` replaces each known one by a small dict marked with :data:`MARK`::

    {"__ckstore_deepspeed__": "object", "class": "deepspeed.runtime.fp16.loss_scaler.LossScaler",
     "state": {"cur_scale": 1.0, "dynamic": False}}
    {"__ckstore_deepspeed__": "enum", "class": "deepspeed.….ZeroStageEnum", "value": 2}
    {"__ckstore_deepspeed__": "dtype", "name": "bfloat16"}
    {"__ckstore_deepspeed__": "size", "dims": [24, 16]}


and :func:`from_plain` rebuilds them. Known means: a class defined in a ``deepspeed.`` module
that is an enum, a dataclass or a ``DeepSpeedConfigObject`` (plain records of attributes), plus
torch dtypes, devices and sizes (``torch.Size``: DeepSpeed's ``param_shapes`` and
``frozen_param_shapes`` call ``numel()`` on them, which a plain tuple lacks). Rebuilding imports nothing outside ``deepspeed.``, checks the class
against the same rule, and sets the recorded attributes on an instance made with ``__new__``
(no constructor, no ``__setstate__``): stored data can name only such record classes and give
them only plain values and tensors.

Anything else is left in place when the caller opted in to pickling (the commit then stores it
pickled), and refused with an error naming its key otherwise. A state that itself holds a dict
with the :data:`MARK` key is refused: it could not be told apart from a converted object.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from collections.abc import Callable
from typing import Any

import torch

from ...errors import IntegrityError, UnsupportedValueError
from ...format.tensorio import format_path

__all__ = ["MARK", "to_plain", "from_plain"]

MARK = "__ckstore_deepspeed__"

_PLAIN = (str, int, float, bool, bytes, type(None))
_KINDS = ("object", "enum", "dtype", "device", "size")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_record_class(cls: Any) -> bool:
    """A class whose instances are plain records of attributes: one we may rebuild."""
    if not isinstance(cls, type) or not cls.__module__.startswith("deepspeed."):
        return False
    if issubclass(cls, enum.Enum):
        return False
    if dataclasses.is_dataclass(cls):
        return True
    try:
        from deepspeed.runtime.config_utils import DeepSpeedConfigObject
    except ImportError:  # pragma: no cover - DeepSpeed without its config module
        return False
    return issubclass(cls, DeepSpeedConfigObject)


def _is_enum_class(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__.startswith("deepspeed.")


def _attributes(obj: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return dict(vars(obj))


def to_plain(state: Any, *, allow_pickle: bool = False, where: str = "") -> Any:
    """``state`` with every known DeepSpeed object replaced by its plain description.

    Containers are copied (dicts stay dicts, in order); tensors and plain values are kept as they
    are. An unknown object raises :class:`UnsupportedValueError` naming its key, unless
    ``allow_pickle`` is set, in which case it is kept for the commit to pickle.
    """

    def at(keys: tuple[Any, ...]) -> str:
        return f"{where}key {format_path(keys)!r}"

    def walk(x: Any, keys: tuple[Any, ...]) -> Any:
        if isinstance(x, torch.Tensor) or isinstance(x, _PLAIN) and not isinstance(x, enum.Enum):
            return x
        if isinstance(x, dict):
            if MARK in x:
                raise UnsupportedValueError(
                    f"{at(keys)}: a dict with the key {MARK!r} is reserved for DeepSpeed objects ckstore "
                    "converts to plain values; rename that key"
                )
            return {k: walk(v, (*keys, k)) for k, v in x.items()}
        if isinstance(x, torch.Size):
            return {MARK: "size", "dims": [int(d) for d in x]}
        if type(x) in (list, tuple) or isinstance(x, tuple) and hasattr(x, "_fields"):  # named tuples: tuples
            items = [walk(v, (*keys, i)) for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        if isinstance(x, torch.dtype):
            return {MARK: "dtype", "name": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {MARK: "device", "name": str(x)}
        cls = type(x)
        if _is_enum_class(cls):
            return {MARK: "enum", "class": _qualname(cls), "value": walk(x.value, (*keys, "value"))}
        if _is_record_class(cls):
            attrs = _attributes(x)
            return {MARK: "object", "class": _qualname(cls), "state": walk(attrs, keys)}
        if allow_pickle:
            return x
        raise UnsupportedValueError(
            f"{at(keys)}: a {_qualname(cls)} object is not a tensor, a plain value or a DeepSpeed "
            "record ckstore can store without pickle. Pass allow_pickle=True to store it pickled "
            "(loading it then needs allow_pickle=True too)"
        )

    return walk(state, ())


def _resolve_class(path: Any, check: Callable[[Any], bool], what: str, where: str) -> Any:
    if not isinstance(path, str) or not path.startswith("deepspeed.") or "." not in path:
        raise IntegrityError(f"{where}: a stored DeepSpeed {what} names {path!r}, not a class of DeepSpeed")
    module_name, _, name = path.rpartition(".")
    cls: Any = None
    # a nested class's qualified name has dots too: find the longest importable module prefix
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        cls = module
        for attr in parts[cut:]:
            cls = getattr(cls, attr, None)
        break
    if cls is None:
        raise UnsupportedValueError(
            f"{where}: the checkpoint holds a {path} {what}, which this DeepSpeed "
            f"(module {module_name}, name {name}) does not have"
        )
    if not check(cls):
        raise IntegrityError(f"{where}: {path} is not a DeepSpeed {what} class ckstore rebuilds")
    return cls


def from_plain(state: Any, *, where: str = "") -> Any:
    """Rebuild the DeepSpeed objects :func:`to_plain` described; everything else is kept."""

    def walk(x: Any, keys: tuple[Any, ...]) -> Any:
        if isinstance(x, dict):
            if MARK in x:
                return rebuild(x, keys)
            return {k: walk(v, (*keys, k)) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v, (*keys, i)) for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return tuple(walk(v, (*keys, i)) for i, v in enumerate(x))
        return x

    def rebuild(node: dict[Any, Any], keys: tuple[Any, ...]) -> Any:
        at = f"{where}key {format_path(keys)!r}"
        kind = node[MARK]
        if kind not in _KINDS:
            raise IntegrityError(f"{at}: unknown DeepSpeed value kind {kind!r}")
        if kind == "dtype":
            name = node.get("name")
            dt = getattr(torch, name, None) if isinstance(name, str) else None
            if not isinstance(dt, torch.dtype):
                raise IntegrityError(f"{at}: {name!r} is not a torch dtype")
            return dt
        if kind == "size":
            dims = node.get("dims")
            if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
                raise IntegrityError(f"{at}: {dims!r} is not a list of tensor dims")
            return torch.Size(dims)
        if kind == "device":
            try:
                return torch.device(str(node.get("name")))
            except (RuntimeError, TypeError) as e:
                raise IntegrityError(f"{at}: {node.get('name')!r} is not a torch device") from e
        if kind == "enum":
            cls = _resolve_class(node.get("class"), _is_enum_class, "enum", at)
            try:
                return cls(walk(node.get("value"), (*keys, "value")))
            except ValueError as e:
                raise IntegrityError(f"{at}: {node.get('value')!r} is not a value of {node['class']}") from e
        cls = _resolve_class(node.get("class"), _is_record_class, "record", at)
        attrs = node.get("state")
        if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
            raise IntegrityError(f"{at}: the attributes of a stored {node['class']} are not a dict of names")
        obj = cls.__new__(cls)
        for name, value in walk(attrs, keys).items():
            object.__setattr__(obj, name, value)
        return obj

    return walk(state, ())
