"""DTensor leaves: a ``torch.distributed.tensor.DTensor`` is stored as its local tensor plus the
sharding its placements describe.

A ``Shard(d)`` placement on mesh dim ``m`` splits tensor dim ``d`` over ``m`` (several mesh dims
splitting one tensor dim nest in mesh order, as DTensor does); ``Replicate()`` does not split.
The device mesh must have dim names: they are the names the world layout uses. Partial and
strided placements cannot be stored as they are; redistribute first. Checkout hands back plain
local tensors; wrap them with ``DTensor.from_local`` where DTensors are wanted.
"""

from __future__ import annotations

import sys
from typing import Any

from ..checkout.reshard import target_box
from ..errors import UnsupportedValueError
from ..format.manifest import ShardSpec
from ..format.tensorio import Leaf
from ..layout import Shard, WorldLayout

__all__ = ["DTensorLeaves", "default_layout"]


class DTensorLeaves:
    """A ``tensor_hook`` for :func:`ckstore.format.tensorio.flatten` that understands DTensors.

    It remembers each device mesh it met (names and sizes), so a commit without an explicit
    world layout can take the mesh's.
    """

    def __init__(self) -> None:
        self.meshes: list[tuple[tuple[str, ...], tuple[int, ...]]] = []

    def __call__(self, x: Any) -> Leaf | None:
        mod = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless it was imported
        if mod is None or not isinstance(x, mod.DTensor):
            return None
        mesh = x.device_mesh
        names = mesh.mesh_dim_names
        if names is None:
            raise UnsupportedValueError(
                "a DTensor lives on a device mesh without dim names; create the mesh with "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp')) so its dims match the world layout"
            )
        shape = tuple(int(s) for s in mesh.shape)
        self._remember(mesh)
        splits: list[tuple[int, str]] = []
        for name, p in zip(names, x.placements):
            if p.is_shard() and type(p).__name__ == "Shard":  # not _StridedShard (FSDP2 + TP)
                splits.append((int(p.dim) % max(x.dim(), 1), name))
            elif not p.is_replicate():
                raise UnsupportedValueError(
                    f"a DTensor has placement {type(p).__name__} ({p}) on mesh dim {name!r}, which cannot be "
                    "stored as it is; "
                    "redistribute it to Shard or Replicate placements first"
                )
        local = x.to_local()
        if not splits:
            return Leaf((), local, None)
        coords = mesh.get_coordinate()
        if coords is None:
            raise UnsupportedValueError("a DTensor's device mesh does not include this rank")
        gshape = tuple(int(s) for s in x.shape)
        layout = WorldLayout(dict(zip(names, shape)))
        box = target_box(ShardSpec(gshape, (0,) * len(gshape), tuple(splits)), layout, dict(zip(names, coords)))
        if tuple(b - a for a, b in box) != tuple(local.shape):
            raise UnsupportedValueError(
                f"a DTensor's local piece has shape {tuple(local.shape)}, but its placements "
                f"{tuple(x.placements)} give {tuple(b - a for a, b in box)}"
            )
        declared = Shard(
            local,
            tuple(m for _, m in splits),
            tuple(d for d, _ in splits),
            offsets=tuple(a for a, _ in box),
            global_shape=gshape,
        )
        return Leaf((), local, declared)


    def _remember(self, mesh: Any) -> None:
        # a DTensor on a sub-mesh (mesh["tp"]) also tells the whole mesh it was cut from
        root = getattr(mesh, "_get_root_mesh", lambda: mesh)()
        for m in (mesh, root):
            if m.mesh_dim_names is not None:
                found = (tuple(m.mesh_dim_names), tuple(int(s) for s in m.shape))
                if found not in self.meshes:
                    self.meshes.append(found)


def default_layout(hook: DTensorLeaves, world_size: int) -> WorldLayout:
    """The world layout of a commit that did not name one: the device mesh of its DTensors when
    one spans the whole world, else ``world_size`` ranks along ``dp``."""
    for names, shape in hook.meshes:
        layout = WorldLayout(dict(zip(names, shape)))
        if layout.world_size == world_size:
            return layout
    return WorldLayout.flat(world_size)
