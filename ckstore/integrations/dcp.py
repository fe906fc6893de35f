"""PyTorch Distributed Checkpoint (DCP) on ckstore: a ``StorageWriter`` and a ``StorageReader``.

::

    from ckstore.integrations import dcp as ckdcp
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict, storage_writer=ckdcp.Writer(store, step=step, metrics={"loss": loss}))
    future = dcp.async_save(state_dict, storage_writer=ckdcp.Writer(store, step=step + 1))
    dcp.load(state_dict, storage_reader=ckdcp.Reader(store, "latest"))

The writer is a thin adapter over the one commit protocol (:mod:`ckstore.commit.protocol`), run
over the same ranks as the save (the default process group, or ``process_group``):

* ``prepare_local_plan`` (every rank) keeps this rank's whole local plan. DCP's global plan then
  keeps each replicated item on one rank only; ckstore undoes that: every rank records every item
  of its own state, so every rank's entries have the same keys, and the protocol's writer
  assignment stores each replicated chunk once anyway.
* ``write_data`` (every rank) maps the items back to ``{sub_key: state}`` (the state dict's
  top-level keys are the sub-checkpoints; DCP's flattening is undone with its own mapping) and
  runs the protocol's phases up to the last one: every rank's chunks are durable and rank 0
  holds every rank's manifests. DTensors keep their placements (the mesh becomes the world
  layout when its dims are named and it spans the job); other sharded pieces (a ShardedTensor's,
  a DTensor on an unnamed mesh) are stored at their offsets in the global tensor.
* ``finish`` (the coordinator, which must be rank 0 of the group) runs the protocol's last phase:
  the checkpoint becomes visible in one catalog transaction. The written checkpoint is then
  ``writer.checkpoint`` on the coordinator.

A failure on any rank fails the save on every rank (DCP raises ``CheckpointException``) and
leaves nothing visible. The DCP metadata DCP hands to ``finish`` is not stored: a ckstore
checkpoint's manifests say everything it needs.

The reader builds DCP's ``Metadata`` from the checkpoint's manifests (never unpickling anything
from the store): each tensor's fully qualified name is DCP's flattening of ``{sub_key: state}``,
its chunks the stored pieces (of the lowest rank, for an unsharded tensor stored per rank), and
``read_data`` reads only the chunks that overlap each requested box. So it loads DCP-written
checkpoints into any number of ranks (DCP reshards), and checkpoints committed with
``Store.commit`` whose keys match the state dict. Values a commit stored pickled are refused
unless the reader is given ``allow_pickle=True``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..checkout.reshard import StoredPiece
from ..commit._arguments import check_arguments
from ..commit.collective import active_group, group_rank
from ..commit.dtensor import DTensorLeaves, default_layout
from ..commit.protocol import StagedCommit
from ..errors import CkstoreError, UnsupportedValueError
from ..format import tree as tree_format
from ..format.tensorio import dtype_from_name
from ..layout import Shard, WorldLayout
from ..records import Checkpoint

__all__ = ["Writer", "Reader"]

#: how many bytes of tensors ``Reader.read_data`` reads in one go
_READ_BATCH = 512 * 2**20


class Writer(StorageWriter):
    """Save through DCP into ``store`` as checkpoint ``step`` (of ``run``, else the store's run)."""

    def __init__(
        self,
        store: Any,
        *,
        step: int,
        metrics: Mapping[str, float] | None = None,
        tags: Sequence[str] = (),
        kind: str = "checkpoint",
        run: str | None = None,
        replace: bool = False,
        allow_pickle: bool = False,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        from ..store import Store

        if not isinstance(store, Store):
            raise CkstoreError(f"Writer needs a ckstore.Store (ckstore.open(location)), got {type(store).__name__}")
        # checked here, in every rank's own call, rather than inside DCP's save (a str of tags
        # would have been split into one tag per character)
        check_arguments(run or store.run, step, metrics, tags, kind)
        self.store = store
        self.step, self.metrics, self.tags, self.kind = step, metrics, tuple(tags), kind
        self.run, self.replace, self.allow_pickle = run, replace, allow_pickle
        self.process_group = process_group
        #: the checkpoint, on the coordinator once ``finish`` has made it visible
        self.checkpoint: Checkpoint | None = None
        self._local: list[WriteItem] | None = None
        self._job: StagedCommit | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            raise CkstoreError(
                "ckstore's DCP Writer names its checkpoint by step: pass Writer(store, step=...) "
                f"and no checkpoint_id (got {checkpoint_id!r})"
            )
        self._drop()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._drop()
        group = active_group(self.process_group)
        rank = 0 if group is None else group_rank(group)
        if is_coordinator != (rank == 0):
            raise CkstoreError(
                f"DCP's coordinator must be rank 0 of the group for ckstore's Writer (rank {rank} "
                f"{'is' if is_coordinator else 'is not'} the coordinator); save with coordinator_rank=0"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local = list(plan.items)  # before DCP's global plan drops replicas: see the module
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        try:
            future.set_result(self._write(plan, planner))
        except BaseException as e:  # noqa: BLE001 - DCP reports it from the future, on every rank
            future.set_exception(e)  # type: ignore[arg-type]
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        job, self._job = self._job, None
        if job is None:
            raise CkstoreError("DCP called finish on a Writer that wrote nothing (or on a rank other than 0)")
        self.checkpoint = job.finish(collective=False)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def storage_meta(self) -> StorageMeta | None:
        return None

    def _drop(self) -> None:
        """Abort a commit left over from a save that never reached ``finish``."""
        job, self._job = self._job, None
        if job is not None:
            job.abort()

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        group = active_group(self.process_group)
        world = 1 if group is None else int(torch.distributed.get_world_size(group))
        rank = 0 if group is None else group_rank(group)
        items = self._local if self._local is not None else list(plan.items)
        states, layout = _states(items, planner, world)
        job = self.store.start_commit(
            self.step, {rank: states}, self.metrics, tags=self.tags, kind=self.kind, run=self.run,
            replace=self.replace, world_layout=layout, allow_pickle=self.allow_pickle,
            process_group=self.process_group,
        )  # fmt: skip
        job.write_phases(settle=True)  # a failed rank raises now: DCP then never calls finish
        if job.g.rank == 0:
            self._job = job  # finished by the coordinator's finish()
        else:
            job.finish(collective=False)  # releases this rank's threads; rank 0 tells DCP the rest
        return [WriteResult(index=i.index, size_in_bytes=_nbytes(i), storage_data=None) for i in plan.items]


def _nbytes(item: WriteItem) -> int:
    size = item.tensor_storage_size()
    return int(size) if size is not None else 0


def _object(planner: SavePlanner, item: WriteItem) -> Any:
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):  # the default planner: the value itself
        return lookup(item.index)
    data = planner.resolve_data(item)  # another planner: its bytes, read without unpickling code
    assert isinstance(data, io.BytesIO)
    data.seek(0)
    return torch.load(data, weights_only=True)


def _states(items: Sequence[WriteItem], planner: SavePlanner, world: int) -> tuple[dict[str, Any], WorldLayout]:
    """This rank's ``{sub_key: state}`` from its write items, and the world layout to commit."""
    from torch.distributed.checkpoint._traverse import set_element

    mappings: Mapping[str, tuple[Any, ...]] = getattr(planner, "mappings", None) or {}
    originals = getattr(planner, "state_dict", None)
    originals = originals if isinstance(originals, Mapping) else {}
    values: dict[str, Any] = {}
    pieces: dict[str, tuple[torch.Tensor, WriteItem]] = {}
    hook = DTensorLeaves()
    dtensors: dict[str, Any] = {}
    for item in items:
        fqn = item.index.fqn
        if fqn in values or fqn in pieces:
            raise UnsupportedValueError(
                f"{fqn!r}: this rank holds several pieces of it (a ShardedTensor with more than one "
                "local shard); ckstore stores one piece per rank"
            )
        if item.type == WriteItemType.BYTE_IO:
            values[fqn] = _object(planner, item)
            continue
        data = planner.resolve_data(item)
        assert isinstance(data, torch.Tensor)
        if item.type != WriteItemType.SHARD:
            values[fqn] = data
            continue
        original = originals.get(fqn)
        if type(original).__name__ == "DTensor":
            try:
                hook(original)
                dtensors[fqn] = original
            except UnsupportedValueError:
                pass  # an unnamed mesh or a placement the hook refuses: stored at its offsets
        pieces[fqn] = (data, item)
    layout = default_layout(hook, world)
    for fqn, (data, item) in pieces.items():
        dt = dtensors.get(fqn)
        if dt is not None and set(dt.device_mesh.mesh_dim_names) <= set(layout.mesh):
            values[fqn] = dt  # the protocol reads its placements
        else:
            values[fqn] = _piece(data, item, layout)
    root: dict[str, Any] = {}
    for fqn in [i.index.fqn for i in items]:
        path = tuple(mappings.get(fqn, (fqn,)))
        if not isinstance(path[0], str):
            raise UnsupportedValueError(f"{fqn!r}: the state dict's top-level keys must be strings (sub-checkpoint names)")
        if len(path) == 1:
            root[path[0]] = values[fqn]
        else:
            set_element(root, path, values[fqn])
    return root, layout


def _piece(data: torch.Tensor, item: WriteItem, layout: WorldLayout) -> Any:
    """A sharded piece at explicit offsets (a full-size piece is a plain tensor)."""
    assert item.tensor_data is not None
    chunk = item.tensor_data.chunk
    offsets = tuple(int(o) for o in chunk.offsets)
    gshape = tuple(int(s) for s in item.tensor_data.size)
    split = [d for d, (n, g) in enumerate(zip(chunk.sizes, gshape)) if int(n) != g]
    if not split:
        return data
    # the offsets place the piece; the split dim only shapes resharded checkouts by ckstore
    return Shard(data, layout.dims[0][0], split[0], offsets=offsets, global_shape=gshape)


@dataclass(slots=True)
class _Tensor:
    dtype: str
    size: tuple[int, ...]
    pieces: dict[tuple[tuple[int, ...], tuple[int, ...]], StoredPiece] = field(default_factory=dict)


class _Refused:
    """A value stored pickled, read by a reader without ``allow_pickle``."""

    def __init__(self, where: str) -> None:
        self.where = where


class Reader(StorageReader):
    """Load checkpoint ``ref`` of ``store`` through DCP (``dcp.load``), on any number of ranks."""

    def __init__(self, store: Any, ref: str | int = "latest", *, run: str | None = None, allow_pickle: bool = False) -> None:
        super().__init__()
        self.store = store
        self.run = run
        self.allow_pickle = allow_pickle
        self.checkpoint: Checkpoint = store.resolve(ref, run=run)
        self._tensors: dict[str, _Tensor] | None = None
        self._objects: dict[str, Any] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:  # dcp.load(..., checkpoint_id=REF): a ref of the store
            self.checkpoint = self.store.resolve(checkpoint_id, run=self.run)
        self._tensors = None
        self._objects = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._index()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._tensors is None:
            self._index()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # the coordinator's checkpoint goes to every rank with its plan: ranks whose Readers named
        # a ref such as "latest" on either side of a commit would otherwise load different steps
        mine = (self.checkpoint.id, self.checkpoint.ref)
        return [replace(p, storage_data=mine) for p in plans]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._tensors is None:
            self._index()
        assert self._tensors is not None
        theirs = plan.storage_data
        if isinstance(theirs, tuple) and len(theirs) == 2 and theirs[0] != self.checkpoint.id:
            raise CkstoreError(
                f"this rank's Reader loads {self.checkpoint.ref}, the coordinator's {theirs[1]}: the ranks' "
                "Readers resolved their ref to different checkpoints (a commit landed between them); give "
                "every rank the same step (resolve the ref on one rank and broadcast its step)"
            )
        where = f"run {self.checkpoint.run!r}, step {self.checkpoint.step}"
        batch: list[tuple[Any, list[StoredPiece], tuple[tuple[int, int], ...]]] = []
        held = 0
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn not in self._objects:
                    raise CkstoreError(f"{where} has no value {fqn!r}")
                value = self._objects[fqn]
                if isinstance(value, _Refused):
                    raise UnsupportedValueError(
                        f"{where}: {value.where} holds a pickled object; pickles can run code, so the "
                        "reader refuses them unless it is given allow_pickle=True"
                    )
                buf = io.BytesIO()
                torch.save(value, buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            entry = self._tensors.get(fqn)
            if entry is None:
                raise CkstoreError(f"{where} has no tensor {fqn!r}")
            origin = item.storage_index.offset or (0,) * len(entry.size)
            box = tuple(
                (int(o) + int(s), int(o) + int(s) + int(n)) for o, s, n in zip(origin, item.storage_offsets, item.lengths)
            )
            batch.append((item, list(entry.pieces.values()), box))
            held += _box_bytes(box, entry.dtype)
            if held >= _READ_BATCH:
                self._read(batch, planner)
                batch, held = [], 0
        self._read(batch, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read(self, batch: list[tuple[Any, list[StoredPiece], tuple[tuple[int, int], ...]]], planner: LoadPlanner) -> None:
        if not batch:
            return
        tensors = self.store.read_boxes(self.checkpoint, [(pieces, box) for _, pieces, box in batch])
        for (item, _, _), got in zip(batch, tensors):
            target = planner.resolve_tensor(item).detach()
            target.copy_(got.view(target.shape))
            planner.commit_tensor(item, target)

    def _index(self) -> Metadata:
        """DCP's metadata of the checkpoint, built from its manifests."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        ckpt = self.checkpoint
        where = f"run {ckpt.run!r}, step {ckpt.step}, "
        tensors: dict[str, _Tensor] = {}
        objects: dict[str, Any] = {}
        mappings: dict[str, Any] = {}
        manifests = self.store.manifests(ckpt)
        for (rank, sub_key), man in sorted(manifests.items(), key=lambda kv: kv[0][0]):
            obj, placeholders, _alive = _rebuild(man, f"{where}rank {rank}, {sub_key}, ", self.allow_pickle)
            flat, mapping = flatten_state_dict({sub_key: obj})
            for fqn, value in flat.items():
                mappings.setdefault(fqn, mapping[fqn])
                index = placeholders.get(id(value)) if isinstance(value, torch.Tensor) else None
                if index is None:
                    objects.setdefault(fqn, value)
                    continue
                rec = man.tensors[index]
                entry = tensors.setdefault(fqn, _Tensor(rec.dtype, tuple(value.shape)))
                source = f"rank {rank}, {sub_key}, key {rec.path!r}"
                if rec.shard is None:
                    if not entry.pieces:  # a per-rank tensor: the lowest rank's
                        entry.pieces[((0,) * len(rec.shape), rec.shape)] = StoredPiece((0,) * len(rec.shape), rec, source)
                elif rec.nbytes or not entry.pieces:
                    entry.pieces.setdefault((rec.shard.offsets, rec.shape), StoredPiece(rec.shard.offsets, rec, source))
        self._tensors, self._objects = tensors, objects
        sd_meta: dict[str, Any] = {fqn: BytesStorageMetadata() for fqn in objects}
        for fqn, t in tensors.items():
            sd_meta[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(t.dtype)),
                size=torch.Size(t.size),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in t.pieces],
            )
        return Metadata(state_dict_metadata=sd_meta, planner_data=mappings)


def _rebuild(man: Any, where: str, allow_pickle: bool) -> tuple[Any, dict[int, int], list[torch.Tensor]]:
    """A manifest's state with a meta tensor (of the global shape) for each tensor: the state,
    which tensor each placeholder stands for (by id), and the placeholders (keep them alive)."""
    placeholders: dict[int, int] = {}
    alive: list[torch.Tensor] = []

    def leaf(keys: tuple[Any, ...], tag: str, node: Any) -> Any:
        if tag == "T":
            rec = man.tensors[int(node[1])]
            shape = rec.shard.global_shape if rec.shard is not None else rec.shape
            t = torch.empty(shape, dtype=dtype_from_name(rec.dtype), device="meta")
            placeholders[id(t)] = int(node[1])
            alive.append(t)
            return t
        if tag == "P":
            if not allow_pickle:
                return _Refused(f"{where}key {'/'.join(map(str, keys))!r}")
            import base64
            import pickle

            return pickle.loads(base64.b64decode(node[1], validate=True))  # noqa: S301 - explicit opt-in
        return tree_format.decode_scalar(node, where, keys)

    return tree_format.rebuild(man.tree, leaf, where), placeholders, alive


def _box_bytes(box: tuple[tuple[int, int], ...], dtype: str) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n * dtype_from_name(dtype).itemsize

