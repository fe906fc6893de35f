"""World layouts and shard declarations.

A :class:`WorldLayout` is the job's mesh: ordered named dims such as ``{"dp": 4, "tp": 2}``.
Ranks map to coordinates in row-major order (the last dim varies fastest), as
``torch.distributed.device_mesh`` does. A :class:`Shard` wraps a tensor that is one piece of a
larger, global tensor.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import LayoutError

__all__ = ["WorldLayout", "Shard", "chunk_range"]


@dataclass(frozen=True, slots=True)
class WorldLayout:
    """An ordered mesh of named dims; ``WorldLayout({"dp": 2, "tp": 2})`` has 4 ranks."""

    dims: tuple[tuple[str, int], ...]

    def __init__(self, mesh: Mapping[str, int] | tuple[tuple[str, int], ...] | None = None) -> None:
        try:
            items = tuple(mesh.items()) if isinstance(mesh, Mapping) else tuple(mesh or ())
            pairs = [(name, size) for name, size in items]
        except (TypeError, ValueError):
            raise LayoutError(
                f"a world layout is a mesh of named dims, {{'dp': 2, 'tp': 2}}, got {type(mesh).__name__} {mesh!r}"
            ) from None
        seen: set[str] = set()
        for name, size in pairs:
            if not isinstance(name, str) or not name:
                raise LayoutError(f"mesh dim names must be non-empty strings, got {name!r}")
            if name in seen:
                raise LayoutError(f"mesh dim {name!r} appears twice in {dict(items)}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise LayoutError(f"mesh dim {name!r} must have a positive int size, got {size!r}")
            seen.add(name)
        object.__setattr__(self, "dims", tuple((n, int(s)) for n, s in items))

    @classmethod
    def single(cls) -> WorldLayout:
        """One rank: checkout consolidates sharded tensors into full tensors."""
        return cls({})

    @classmethod
    def flat(cls, world_size: int, dim: str = "dp") -> WorldLayout:
        """``world_size`` ranks along one dim (pure data parallelism by default)."""
        return cls({dim: world_size})

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.dims)

    def size(self, dim: str) -> int:
        """Size of ``dim``; a dim the layout does not have counts as size 1."""
        return self.mesh.get(dim, 1)

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size} ({self.mesh})")
        out: dict[str, int] = {}
        for name, size in reversed(self.dims):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name, _ in self.dims}

    def rank(self, coords: Mapping[str, int]) -> int:
        r = 0
        for name, size in self.dims:
            c = coords.get(name, 0)
            if not 0 <= c < size:
                raise LayoutError(f"coordinate {name}={c} is outside {self.mesh}")
            r = r * size + c
        return r

    def to_json(self) -> list[list[Any]]:
        return [[n, s] for n, s in self.dims]

    @classmethod
    def from_json(cls, obj: Any) -> WorldLayout:
        if isinstance(obj, dict):
            return cls(obj)
        return cls(tuple((str(n), int(s)) for n, s in obj))

    def __repr__(self) -> str:
        return f"WorldLayout({self.mesh})"


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The ``[start, stop)`` of piece ``index`` of ``torch.chunk`` over a dim of size ``n``."""
    if parts <= 1:
        return 0, n
    size = -(-n // parts) if n else 0
    start = min(n, index * size)
    return start, min(n, start + size)


class Shard:
    """A tensor that is one piece of a global tensor, split over mesh dims.

    Even split (the global shape is derived from every rank's piece)::

        Shard(local, mesh_dim="tp", dim=0)

    Uneven or flat partitions (ZeRO-style), with explicit placement::

        Shard(part, mesh_dim="dp", offsets=(start,), global_shape=(n,))

    Several mesh dims may split the tensor: ``mesh_dim=("dp", "tp"), dim=(0, 1)``.
    """

    __slots__ = ("tensor", "mesh_dims", "dims", "offsets", "global_shape")

    def __init__(
        self,
        tensor: Any,
        mesh_dim: str | tuple[str, ...],
        dim: int | tuple[int, ...] = 0,
        *,
        offsets: tuple[int, ...] | None = None,
        global_shape: tuple[int, ...] | None = None,
    ) -> None:
        if not callable(getattr(tensor, "dim", None)) or not hasattr(tensor, "shape"):
            raise LayoutError(f"Shard wraps a torch.Tensor, got {type(tensor).__name__}")
        mesh_dims = (mesh_dim,) if isinstance(mesh_dim, str) else _tuple(mesh_dim, "mesh dims")
        if not all(isinstance(m, str) and m for m in mesh_dims):
            raise LayoutError(f"Shard: mesh dims are names of the world layout's dims, got {mesh_dim!r}")
        dims = _ints((dim,) * len(mesh_dims) if isinstance(dim, int) else dim, "tensor dims")
        if len(dims) != len(mesh_dims):
            raise LayoutError(f"Shard: {len(mesh_dims)} mesh dims but {len(dims)} tensor dims")
        if offsets is not None:
            offsets = _ints(offsets, "offsets")
        if global_shape is not None:
            global_shape = _ints(global_shape, "global_shape")
        ndim = tensor.dim()
        if ndim == 0:
            raise LayoutError("Shard: a 0-d tensor cannot be split; store it as a plain tensor")
        for d in dims:
            if not 0 <= d < ndim:
                raise LayoutError(f"Shard: tensor dim {d} is out of range for a {ndim}-d tensor")
        if len(set(mesh_dims)) != len(mesh_dims):
            raise LayoutError(f"Shard: mesh dims {mesh_dims} name one mesh dim twice")
        if (offsets is None) != (global_shape is None):
            raise LayoutError("Shard: give offsets and global_shape together, or neither")
        if offsets is not None and global_shape is not None:
            if len(offsets) != ndim or len(global_shape) != ndim:
                raise LayoutError(
                    f"Shard: offsets {offsets} and global_shape {global_shape} must have one entry "
                    f"per tensor dim ({ndim})"
                )
            for d in range(ndim):
                if offsets[d] < 0 or offsets[d] + tensor.shape[d] > global_shape[d]:
                    raise LayoutError(
                        f"Shard: a piece of shape {tuple(tensor.shape)} at offsets {offsets} does not "
                        f"fit in global shape {global_shape}"
                    )
        self.tensor = tensor
        self.mesh_dims = mesh_dims
        self.dims = dims
        self.offsets = tuple(offsets) if offsets is not None else None
        self.global_shape = tuple(global_shape) if global_shape is not None else None

    @property
    def splits(self) -> tuple[tuple[int, str], ...]:
        return tuple(zip(self.dims, self.mesh_dims))

    def __repr__(self) -> str:
        return (
            f"Shard(shape={tuple(self.tensor.shape)}, mesh_dims={self.mesh_dims}, dims={self.dims}, "
            f"offsets={self.offsets}, global_shape={self.global_shape})"
        )


def _tuple(value: Any, what: str) -> tuple[Any, ...]:
    try:
        return tuple(value)
    except TypeError:
        raise LayoutError(f"Shard: {what} must be a tuple, got {value!r}") from None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints (numpy integers and a torch.Size included; bools, floats
    and strings refused: a manifest records only ints)."""
    items = _tuple(value, what)
    try:
        if any(isinstance(v, bool) for v in items):
            raise TypeError
        return tuple(operator.index(v) for v in items)
    except TypeError:
        raise LayoutError(f"Shard: {what} must be ints, got {value!r}") from None
