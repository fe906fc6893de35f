"""The store: a blob store plus a catalog, and the user-facing API over them."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, overload

from ._collector import collector_paused
from ._threads import default_workers
from .blobstore import BlobStore
from .catalog import Catalog, CheckoutRows, ChunkLocation
from .config import StoreConfig
from .errors import (
    CheckpointNotFoundError,
    ChunkNotFoundError,
    CkstoreError,
    LayoutError,
    NotFoundError,
    PolicyError,
    StoreConfigError,
)
from .format.manifest import Manifest
from .layout import WorldLayout
from .records import Checkpoint, RunInfo
from .refs import check_name, parse_ref

__all__ = ["Store", "RankStates"]

if TYPE_CHECKING:
    from .checkout.readplan import Box, ReadPlan
    from .checkout.reshard import StoredPiece
    from .commit.pending import AsyncCommits, PendingCommit
    from .commit.protocol import StagedCommit
    from .diff import DiffResult
    from .diff.lineage import Ancestor

RankStates = Mapping[int, Mapping[str, Any]]

if TYPE_CHECKING:  # retention and garbage collection
    from .maintenance.background import BackgroundGc, PendingGc
    from .maintenance.copy import CopyReport
    from .maintenance.du import DuReport
    from .maintenance.fsck import FsckReport
    from .maintenance.gc import GcReport
    from .maintenance.recover import RecoverReport
    from .maintenance.retention import Policy


def check_layout(world_layout: object) -> None:
    """Refuse a ``world_layout`` that is no :class:`WorldLayout` (None: the saved one)."""
    if world_layout is not None and not isinstance(world_layout, WorldLayout):
        raise LayoutError(
            "world_layout must be a ckstore.WorldLayout (WorldLayout({'dp': 2}), WorldLayout.single()) or "
            f"None, got {type(world_layout).__name__} {world_layout!r}"
        )


def _checkout_subset(ranks: object, sub_keys: object) -> tuple[list[int] | None, list[str] | None]:
    """``ranks`` and ``sub_keys`` of a checkout, checked: lists of ints and of names (a string
    is refused, not split into its characters)."""
    rank_list = key_list = None
    if ranks is not None:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise StoreConfigError(f"ranks must be a list of ranks (ints), got {type(ranks).__name__} {ranks!r}")
        given = list(ranks)
        rank_list = []
        for r in given:
            try:
                rank = -1 if isinstance(r, bool) else operator.index(r)  # numpy's ints too
            except TypeError:
                rank = -1
            if rank < 0:
                raise StoreConfigError(f"ranks must be non-negative ints, got {r!r} in {given!r}")
            rank_list.append(rank)
        rank_list = sorted(set(rank_list))
    if sub_keys is not None:
        if isinstance(sub_keys, (str, bytes)) or not isinstance(sub_keys, Iterable):
            raise StoreConfigError(
                f"sub_keys must be a list of sub-checkpoint names, got {type(sub_keys).__name__} {sub_keys!r}"
                + (f"; for one pass sub_keys=[{sub_keys!r}]" if isinstance(sub_keys, str) else "")
            )
        key_list = list(sub_keys)
        for k in key_list:
            if not isinstance(k, str):
                raise StoreConfigError(f"sub_keys must be sub-checkpoint names (strings), got {k!r} in {key_list!r}")
    return rank_list, key_list


def _device(device: Any) -> Any:
    """``device`` as a ``torch.device`` (None stays None), or an error naming it."""
    import torch

    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise StoreConfigError(f"device must name a torch device ('cpu', 'cuda', 'cuda:1'), got {device!r}: {e}") from None


def _scope(
    ckpt: Checkpoint, world_layout: WorldLayout | None, rank_list: list[int] | None, sub_keys: list[str] | None
) -> tuple[list[int] | None, list[str] | None]:
    """The ranks and sub-checkpoints whose entries a checkout of ``ckpt`` reads (None: all);
    refuses ones the checkpoint does not have."""
    target = None if world_layout is None or world_layout == ckpt.world_layout else world_layout
    if sub_keys is not None:
        unknown = set(sub_keys) - set(ckpt.sub_keys)
        if unknown:
            raise CheckpointNotFoundError(
                f"run {ckpt.run!r}, step {ckpt.step} has no sub-checkpoint {sorted(unknown)}; it has {list(ckpt.sub_keys)}"
            )
    if target is None and rank_list is not None:
        unknown_ranks = set(rank_list) - set(ckpt.ranks)
        if unknown_ranks:
            raise CheckpointNotFoundError(
                f"run {ckpt.run!r}, step {ckpt.step} was saved by ranks {list(ckpt.ranks)}, not {sorted(unknown_ranks)}"
            )
    # a plain checkout reads only the ranks asked for; resharding needs every rank's manifest
    return (rank_list if target is None else None), sub_keys


def _known_locations(
    known: Mapping[bytes, ChunkLocation], lookup: Callable[[list[bytes]], dict[bytes, ChunkLocation]], digests: list[bytes]
) -> dict[bytes, ChunkLocation]:
    """Locations from ``known``; digests it lacks (a damaged reference) are looked up."""
    if len(digests) == len(known) and isinstance(known, dict) and all(d in known for d in digests):
        return known  # (a checkout of the whole checkpoint: not copied)
    out = {d: known[d] for d in digests if d in known}
    missing = [d for d in digests if d not in out]
    if missing:
        out.update(lookup(missing))
    return out


def _assemble(plan: ReadPlan, tensors: list[Any], allow_pickle: bool, where: str) -> dict[int, dict[str, Any]]:
    """Each target entry's state dict, its tensors taken from ``tensors`` (by buffer index)."""
    from .format.tensorio import unflatten

    out: dict[int, dict[str, Any]] = {}
    for entry in plan.entries:
        bufs = entry.buffers

        def tensor_at(i: int, bufs: tuple[int, ...] = bufs) -> Any:
            return tensors[bufs[i]]

        out.setdefault(entry.rank, {})[entry.sub_key] = unflatten(
            entry.tree, tensor_at, allow_pickle=allow_pickle, where=f"{where}, {entry.source}, "
        )
    return out


class Store:
    """A checkpoint store. Open one with :func:`ckstore.open`.

    ``run`` is the default run for commits and refs that do not name one. A store may be used
    from several threads for reads; commits from one process run one at a time per store object.
    ``max_inflight`` bounds the asynchronous commits in flight (see :meth:`commit`); set
    ``store.max_inflight`` before the first asynchronous commit to change it (after, a change is
    refused).
    """

    def __init__(
        self,
        location: str,
        blobs: BlobStore,
        catalog: Catalog,
        config: StoreConfig,
        *,
        run: str | None = None,
        workers: int | None = None,
        max_inflight: int = 1,
    ) -> None:
        self.location = location
        self.blobs = blobs
        self.catalog = catalog
        self.config = config
        self.run = check_name("run", run) if run is not None else None
        self.workers = workers or default_workers()
        self._async: AsyncCommits | None = None
        self.max_inflight = max_inflight
        self._gcs: BackgroundGc | None = None
        self._delta: Any = None  # a DeltaCache once write_deltas turned deltas on
        self._ahead: Any = None  # the commit._stage.AheadHint of this object's commits, from the first
        self._planes: Any = None  # and their commit._stage.PlaneHints

    @property
    def max_inflight(self) -> int:
        """The most asynchronous commits in flight at once (see :meth:`commit`)."""
        return self._max_inflight

    @max_inflight.setter
    def max_inflight(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise StoreConfigError(f"max_inflight must be an int of at least 1, got {value!r}")
        started = self._async
        if started is not None and value != started.max_inflight:
            raise StoreConfigError(
                f"max_inflight is {started.max_inflight}: it is set before the first asynchronous commit "
                f"of a store object; open the store again to commit with max_inflight={value}"
            )
        self._max_inflight = value

    def write_deltas(self, chain: int, memory: int | None = None) -> None:
        """Write each changed chunk of later commits as a delta against the same chunk of the
        previous commit through this store object, where that is smaller, through chains of at
        most ``chain`` deltas (0: whole chunks only, the default); ``memory``: the most bytes of
        the previous commit kept for it (1 GiB by default). See :func:`ckstore.open`."""
        from .commit._delta import DEFAULT_DELTA_MEMORY, DeltaCache
        from .config import MAX_DELTA_CHAIN

        if not isinstance(chain, int) or isinstance(chain, bool) or not 0 <= chain <= MAX_DELTA_CHAIN:
            raise CkstoreError(f"delta_chain must be an int from 0 (off) to {MAX_DELTA_CHAIN}, got {chain!r}")
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory < 0):
            raise CkstoreError(f"delta_memory must be a number of bytes (an int >= 0), got {memory!r}")
        if memory is not None and not chain:
            raise CkstoreError(
                f"delta_memory={memory!r} bounds what deltas are written against: pass delta_chain=N (1 to "
                f"{MAX_DELTA_CHAIN}) with it, or leave it out"
            )
        self._delta = DeltaCache(chain, DEFAULT_DELTA_MEMORY if memory is None else memory) if chain else None

    def __repr__(self) -> str:
        return f"Store({self.location!r}, run={self.run!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for asynchronous commits and background gcs in flight (raising a failure not yet
        raised), then close."""
        try:
            if self._async is not None:
                self._async.close()
        finally:
            try:
                if self._gcs is not None:
                    self._gcs.wait()
            finally:
                self.catalog.close()

    def wait(self) -> None:
        """Wait for every asynchronous commit and background gc in flight from this store; raise
        the first failure not yet raised (by its ``wait()`` or an earlier call)."""
        try:
            if self._async is not None:
                self._async.wait()
        finally:
            if self._gcs is not None:
                self._gcs.wait()

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging buffers of asynchronous commits (see :meth:`commit`)."""
        return 0 if self._async is None else self._async.staging_bytes

    # -- commit ---------------------------------------------------------------------------------
    @overload
    def commit(
        self, step: int, rank_states: RankStates, metrics: Mapping[str, float] | None = None, *,
        tags: Sequence[str] = (), kind: str = "checkpoint", run: str | None = None, replace: bool = False,
        world_layout: WorldLayout | None = None, allow_pickle: bool = False, parent: str | int | None = None,
        process_group: Any = None, progress: Callable[[int, int], None] | None = None,
        blocking: Literal[True] = True, stage: str = "all",
    ) -> Checkpoint: ...  # fmt: skip

    @overload
    def commit(
        self, step: int, rank_states: RankStates, metrics: Mapping[str, float] | None = None, *,
        tags: Sequence[str] = (), kind: str = "checkpoint", run: str | None = None, replace: bool = False,
        world_layout: WorldLayout | None = None, allow_pickle: bool = False, parent: str | int | None = None,
        process_group: Any = None, progress: Callable[[int, int], None] | None = None,
        blocking: Literal[False], stage: str = "all",
    ) -> PendingCommit: ...  # fmt: skip

    def commit(
        self,
        step: int,
        rank_states: RankStates,
        metrics: Mapping[str, float] | None = None,
        *,
        tags: Sequence[str] = (),
        kind: str = "checkpoint",
        run: str | None = None,
        replace: bool = False,
        world_layout: WorldLayout | None = None,
        allow_pickle: bool = False,
        parent: str | int | None = None,
        process_group: Any = None,
        progress: Callable[[int, int], None] | None = None,
        blocking: bool = True,
        stage: str = "all",
    ) -> Checkpoint | PendingCommit:
        """Store ``rank_states`` (``{rank: {sub_key: state_dict}}``) as checkpoint ``step`` of a run.

        The checkpoint becomes visible atomically once every chunk is durable. Inside an
        initialized ``torch.distributed`` job (or with ``process_group``) this is a collective:
        each rank passes ``{its rank: states}``, writes its own chunks, and every rank returns
        the same record (or raises :class:`~ckstore.DistributedCommitError`); rank 0's metrics
        and tags are recorded. A tensor may be one piece of a global tensor, declared with
        :class:`~ckstore.Shard` or read from a DTensor's placements; ``world_layout`` names the
        job's mesh (by default the DTensors' device mesh, else every rank along ``dp``).
        ``progress(done_bytes, total_bytes)`` is called as chunks are written.

        With ``blocking=False`` the call returns a :class:`~ckstore.commit.pending.PendingCommit`
        once the tensors are copied into reusable host buffers; hashing, encoding, writes and
        the catalog run in a background thread (see :mod:`ckstore.commit.pending` for memory and
        errors). At most ``max_inflight`` commits are in flight; another waits for a slot. A
        blocking commit first waits for the asynchronous ones (and raises a failure of theirs).
        ``stage="changed"`` hashes each CPU tensor while staging and copies only those whose
        bytes differ from what the staging buffer holds from the previous commit through it: it
        pays when most of the state is unchanged (frozen layers, a model being evaluated) and on
        machines where memory bandwidth, not hashing, is short.
        """
        if stage not in ("all", "changed"):
            raise StoreConfigError(f"stage must be 'all' or 'changed', got {stage!r}")
        if blocking:
            if self._async is not None:  # the asynchronous commits first (a gc in flight goes on)
                self._async.wait()
            with collector_paused():  # see ckstore._collector
                return self.start_commit(
                    step, rank_states, metrics, tags=tags, kind=kind, run=run, replace=replace,
                    world_layout=world_layout, allow_pickle=allow_pickle, parent=parent, process_group=process_group,
                    progress=progress,
                ).complete()  # fmt: skip
        if self._async is None:
            from .commit.pending import AsyncCommits

            self._async = AsyncCommits(self.max_inflight)
        group = self._async.background_group(process_group)
        return self._async.submit(
            lambda staging: self.start_commit(
                step, rank_states, metrics, tags=tags, kind=kind, run=run, replace=replace, world_layout=world_layout,
                allow_pickle=allow_pickle, parent=parent, process_group=group, progress=progress, staging=staging,
                changed_only=stage == "changed",
            )
        )  # fmt: skip

    def start_commit(
        self,
        step: int,
        rank_states: RankStates,
        metrics: Mapping[str, float] | None = None,
        *,
        tags: Sequence[str] = (),
        kind: str = "checkpoint",
        run: str | None = None,
        replace: bool = False,
        world_layout: WorldLayout | None = None,
        allow_pickle: bool = False,
        parent: str | int | None = None,
        process_group: Any = None,
        progress: Callable[[int, int], None] | None = None,
        staging: Any = None,
        changed_only: bool = False,
    ) -> StagedCommit:
        """The first phase of :meth:`commit` in this thread (checked, flattened, staged); the
        returned :class:`~ckstore.commit.protocol.StagedCommit` runs the rest. For integrations
        that drive the phases themselves (DCP's storage writer)."""
        from .commit import _stage, protocol
        from .diff.lineage import commit_parent

        check_layout(world_layout)
        if self._ahead is None:
            self._ahead = _stage.AheadHint()
            self._planes = _stage.PlaneHints()
        return protocol.start(
            protocol.CommitContext(
                self.blobs, self.catalog, self.config, self.workers, self.run, self._delta, self._ahead, self._planes
            ),
            step, rank_states, metrics, tags=tags, kind=kind, run=run, replace=replace,
            world_layout=world_layout, allow_pickle=allow_pickle, parent=partial(commit_parent, self, parent),
            progress=progress, process_group=process_group, staging=staging, changed_only=changed_only,
        )  # fmt: skip

    # -- checkout -------------------------------------------------------------------------------
    def checkout(
        self,
        ref: str | int = "latest",
        world_layout: WorldLayout | None = None,
        *,
        ranks: Iterable[int] | None = None,
        sub_keys: Iterable[str] | None = None,
        allow_pickle: bool = False,
        fallback: str | None = None,
        run: str | None = None,
        process_group: Any = None,
        device: Any = None,
    ) -> dict[int, dict[str, Any]]:
        """Load a checkpoint as ``{rank: {sub_key: state_dict}}``, bit-exact.

        With no ``world_layout`` every saved rank gets back what it saved. With one, sharded
        tensors are cut for that layout (``WorldLayout.single()`` consolidates full tensors).
        Inside an initialized ``torch.distributed`` job each rank gets only its own states.
        Tensors come back on the CPU unless ``device`` names another (``"cuda"``, ``"cuda:1"``).
        """
        from .commit import collective as _dist

        check_layout(world_layout)
        device = _device(device)
        group = _dist.active_group(process_group)
        if group is not None and ranks is None:
            ranks = _dist.own_ranks(group, world_layout)
        rank_list, keys = _checkout_subset(ranks, sub_keys)
        with collector_paused():  # see ckstore._collector
            # the checkpoint, its entries and (for all of it) its chunks' locations: one snapshot
            try:
                rows = self.catalog.checkout_rows(
                    parse_ref(ref), run or self.run, lambda ckpt: _scope(ckpt, world_layout, rank_list, keys),
                    locations=rank_list is None and keys is None,
                )  # fmt: skip
            except NotFoundError as e:
                self._raise_if_in_flight(e)
                raise
            return self._load(
                rows.checkpoint, world_layout, rank_list, keys, allow_pickle=allow_pickle, fallback=fallback,
                device=device, rows=rows,
            )  # fmt: skip

    def manifests(self, ckpt: Checkpoint, *, ranks: Iterable[int] | None = None, sub_keys: Iterable[str] | None = None) -> dict[tuple[int, str], Manifest]:
        return self._manifests(ckpt, self.catalog.entries(ckpt.id, ranks=ranks, sub_keys=sub_keys))

    @staticmethod
    def _manifests(ckpt: Checkpoint, entries: Iterable[tuple[int, str, bytes]]) -> dict[tuple[int, str], Manifest]:
        return {
            (r, k): Manifest.from_bytes(m, f"run {ckpt.run!r}, step {ckpt.step}, rank {r}, {k}") for r, k, m in entries
        }

    def load(
        self,
        ckpt: Checkpoint,
        world_layout: WorldLayout | None = None,
        *,
        ranks: Iterable[int] | None = None,
        sub_keys: Iterable[str] | None = None,
        allow_pickle: bool = False,
        fallback: str | None = None,
        progress: Callable[[int, int], None] | None = None,
        device: Any = None,
    ) -> dict[int, dict[str, Any]]:
        """Check out an already resolved checkpoint (see :meth:`checkout`)."""
        check_layout(world_layout)
        rank_list, keys = _checkout_subset(ranks, sub_keys)
        return self._load(
            ckpt, world_layout, rank_list, keys, allow_pickle=allow_pickle, fallback=fallback, progress=progress,
            device=device,
        )  # fmt: skip

    @collector_paused()  # see ckstore._collector
    def _load(
        self,
        ckpt: Checkpoint,
        world_layout: WorldLayout | None,
        rank_list: list[int] | None,
        sub_keys: list[str] | None,
        *,
        allow_pickle: bool = False,
        fallback: str | None = None,
        progress: Callable[[int, int], None] | None = None,
        device: Any = None,
        rows: CheckoutRows | None = None,
    ) -> dict[int, dict[str, Any]]:
        """:meth:`load`; ``rows``: what :meth:`checkout` read of the catalog already."""
        import dataclasses

        from .checkout.executor import allocate_targets, execute_plan, locate_plan
        from .checkout.reshard import plan_checkout
        from .format.tensorio import dtype_from_name, itemsize, to_device

        dev = _device(device)
        target = None if world_layout is None or world_layout == ckpt.world_layout else world_layout
        if rows is not None:
            mans = self._manifests(ckpt, rows.entries)
        else:
            entry_ranks, entry_keys = _scope(ckpt, world_layout, rank_list, sub_keys)
            mans = self._manifests(ckpt, self.catalog.entries(ckpt.id, ranks=entry_ranks, sub_keys=entry_keys))
        if not mans and ckpt.ranks:
            raise CheckpointNotFoundError(
                f"run {ckpt.run!r}, step {ckpt.step} was deleted (by gc or `ckstore rm`) while it was being checked out"
            )
        sizes = {d: itemsize(dtype_from_name(d)) for d in {t.dtype for m in mans.values() for t in m.tensors}}
        where = f"run {ckpt.run!r}, step {ckpt.step}"
        plan = plan_checkout(mans, ckpt.world_layout, target, rank_list, sizes, fallback=fallback, where=where)
        del mans  # the plan holds what the reads need: the tensor records go before them (100,000: 13 MiB)
        total = plan.bytes_to_fill
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        accel = dev if dev is not None and dev.type != "cpu" else None
        locate = self.catalog.chunk_locations
        if rows is not None and rows.locations is not None:  # every chunk's, read with the entries
            locate = partial(_known_locations, rows.locations, self.catalog.chunk_locations)
        elif rank_list is None and sub_keys is None:  # every chunk of the checkpoint: one query
            locate = partial(self.catalog.chunk_locations, checkpoint_id=ckpt.id)
        out: dict[int, dict[str, Any]] | None = None
        try:
            # the chunks' locations, checked against the manifests, before anything is allocated
            locs = locate_plan(plan, locate, where)
            tensors = allocate_targets(plan, pin_memory=accel is not None and accel.type == "cuda", where=where)
            if accel is None:
                # the state dicts around the tensors the reads then fill: the manifests' trees go
                # before the reads (100,000 tensors: ~35 MiB of lists at the checkout's peak), and a
                # tree refused (a pickle without allow_pickle) is refused before anything is read
                out = _assemble(plan, tensors, allow_pickle, where)
                plan = dataclasses.replace(plan, entries=())
            tensors = execute_plan(
                plan, self.blobs, locate, where=where, workers=self.workers, progress=tick, tensors=tensors,
                locs=locs,
            )  # fmt: skip
        except ChunkNotFoundError as e:
            try:
                self.catalog.get(ckpt.id)
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(
                    f"{where} was deleted (by gc or rm) while it was being checked out"
                ) from e
            raise
        if out is None:
            assert accel is not None
            out = _assemble(plan, to_device(tensors, accel), allow_pickle, where)
        return out

    def read_boxes(self, ckpt: Checkpoint, wanted: Sequence[tuple[Sequence[StoredPiece], Box]]) -> list[Any]:
        """Read box ``box`` of each global tensor given by its stored pieces (records of
        :meth:`manifests` of ``ckpt``), fetching only the chunks that overlap it; one tensor each."""
        from .checkout.executor import execute_plan
        from .checkout.reshard import plan_boxes
        from .format.tensorio import dtype_from_name, itemsize

        sizes = {d: itemsize(dtype_from_name(d)) for d in {p.record.dtype for pieces, _ in wanted for p in pieces}}
        plan = plan_boxes(wanted, sizes)
        where = f"run {ckpt.run!r}, step {ckpt.step}"
        tensors = execute_plan(plan, self.blobs, self.catalog.chunk_locations, where=where, workers=self.workers)
        return list(tensors[: len(wanted)])

    # -- catalog views ----------------------------------------------------------------------------
    def resolve(self, ref: str | int = "latest", *, run: str | None = None) -> Checkpoint:
        """The committed checkpoint a ref names (see :mod:`ckstore.refs`)."""
        try:
            return self.catalog.resolve(parse_ref(ref), default_run=run or self.run)
        except NotFoundError as e:
            self._raise_if_in_flight(e)
            raise

    def _raise_if_in_flight(self, e: NotFoundError) -> None:
        """Raise ``e`` again saying which of this store object's asynchronous commits are still in
        flight (not visible until they finish), where any are."""
        flying = [] if self._async is None else self._async.in_flight()
        if flying:
            names = "; ".join(p.what for p in flying)
            raise type(e)(
                f"{e}; this store object has {len(flying)} asynchronous commit(s) in flight, visible once "
                f"they finish ({names}): wait for them first (pending.wait() or store.wait())"
            ) from e

    def checkpoints(self, run: str | None = None) -> list[Checkpoint]:
        return self.catalog.checkpoints(run)

    def runs(self) -> list[RunInfo]:
        return self.catalog.runs()

    def tag(self, ref: str | int, name: str, *, move: bool = False) -> Checkpoint:
        ckpt = self.resolve(ref)
        self.catalog.tag(ckpt, name, move=move)
        self._record("tag", ckpt, name=name)
        return self.catalog.get(ckpt.id)

    def untag(self, name: str, *, run: str | None = None) -> None:
        run_name = run or self.run
        if run_name is None:
            ckpt = self.resolve(name)
            run_name = ckpt.run
        self.catalog.untag(run_name, name)
        self._record_run("untag", run_name, name=name)

    # -- diff and lineage --
    def diff(
        self,
        a: str | int | Checkpoint,
        b: str | int | Checkpoint,
        *,
        sub_key: str | None = None,
        key: str | None = None,
        stats: bool = True,
        tolerance: float | None = None,
    ) -> DiffResult:
        """What changed from checkpoint ``a`` to checkpoint ``b`` (refs of any runs, or bare run
        names for their latest checkpoints); see :func:`ckstore.diff.diff_checkpoints`."""
        from .diff import diff_checkpoints
        from .diff.lineage import resolve_ref_or_run

        ca, cb = resolve_ref_or_run(self, a), resolve_ref_or_run(self, b)
        return diff_checkpoints(self, ca, cb, sub_key=sub_key, key=key, stats=stats, tolerance=tolerance)

    def fork(self, ref: str | int | Checkpoint, new_run: str) -> Checkpoint:
        """Start run ``new_run`` from checkpoint ``ref``; its first commit descends from it."""
        from .diff.lineage import fork

        ckpt = fork(self, ref, new_run)
        self._record("fork", ckpt, run=new_run, parent_ref=ckpt.ref)
        return ckpt

    def lineage(self, run: str | None = None) -> list[Ancestor]:
        """The checkpoints ``run`` (default: the store's run) descends from, nearest first."""
        from .diff.lineage import lineage

        name = run or self.run
        if name is None:
            raise StoreConfigError("lineage needs a run: pass run='NAME'")
        return lineage(self, name)

    # -- retention and garbage collection --
    def set_policy(self, run: str, policy: Policy | None) -> None:
        """Store ``policy`` as ``run``'s retention policy (None clears it); ``gc()`` applies it."""
        from .maintenance import gc as _gc

        _gc.set_policy(self.catalog, run, policy)
        self._record_run("policy", run, policy=self.catalog.run_policy(run))

    def policy(self, run: str) -> Policy | None:
        """``run``'s stored retention policy, or None."""
        from .maintenance import gc as _gc

        return _gc.stored_policy(run, self.catalog.run_policy(run))

    @overload
    def gc(
        self, policy: Policy | None = None, *, run: str | None = None, dry_run: bool = False,
        grace: float | None = None, progress: Callable[[str, int, int], None] | None = None,
        repack: bool = False, min_dead: float | None = None, blocking: Literal[True] = True,
    ) -> GcReport: ...
    @overload
    def gc(
        self, policy: Policy | None = None, *, run: str | None = None, dry_run: bool = False,
        grace: float | None = None, progress: Callable[[str, int, int], None] | None = None,
        repack: bool = False, min_dead: float | None = None, blocking: Literal[False],
    ) -> PendingGc: ...
    def gc(
        self,
        policy: Policy | None = None,
        *,
        run: str | None = None,
        dry_run: bool = False,
        grace: float | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        repack: bool = False,
        min_dead: float | None = None,
        blocking: bool = True,
    ) -> GcReport | PendingGc:
        """Drop the checkpoints retention policies release, then free unreferenced chunks.

        ``policy`` replaces the stored policy of ``run`` (every run when ``run`` is None) for this
        call; without it each run's stored policy applies, and a run with none keeps everything.
        A run's latest checkpoint is never dropped. Safe while other processes commit and read;
        see :mod:`ckstore.maintenance.gc`. ``progress(phase, done, total)`` is called on long sweeps.
        ``repack`` then rewrites packs whose dead fraction exceeds ``min_dead`` (see
        :mod:`ckstore.maintenance.repack`); the old packs go after the grace period.

        With ``blocking=False`` the call returns a :class:`~ckstore.maintenance.background.PendingGc`
        at once and a thread of this store runs the collection while training and commits go on
        (see :mod:`ckstore.maintenance.background`); its failure raises from its ``wait()`` or
        from this store's next ``gc``, ``wait`` or ``close``.
        """
        from .maintenance import gc as _gc

        _gc.check_grace(grace)
        if policy is not None:
            _gc.check_policy(policy)
        if run is not None:
            check_name("run", run)
        if min_dead is not None:
            from .maintenance.repack import check_min_dead

            check_min_dead(min_dead)
            if not repack:
                raise PolicyError(f"min_dead={min_dead!r} applies to repacking: pass repack=True (--repack) with it")
        kwargs: dict[str, Any] = dict(
            policy=policy, run=run, dry_run=dry_run, grace=grace, progress=progress, repack=repack, min_dead=min_dead
        )
        if not blocking:
            if self._gcs is None:
                from .maintenance.background import BackgroundGc

                self._gcs = BackgroundGc(self._gc, self.location)
            return self._gcs.submit("gc of every run" if run is None else f"gc of run {run!r}", **kwargs)
        if self._gcs is not None:
            self._gcs.raise_failed()
        return self._gc(**kwargs)

    def _gc(
        self, *, policy: Policy | None, run: str | None, dry_run: bool, grace: float | None,
        progress: Callable[[str, int, int], None] | None, repack: bool, min_dead: float | None,
    ) -> GcReport:  # fmt: skip
        from .maintenance import gc as _gc

        report = _gc.collect(self.catalog, self.blobs, policy=policy, run=run, dry_run=dry_run, grace=grace, progress=progress)
        if not repack:
            return report
        import dataclasses

        from .maintenance import repack as _repack

        packed = _repack.repack(
            self.catalog, self.blobs, min_dead=_repack.DEFAULT_MIN_DEAD if min_dead is None else min_dead,
            grace=report.grace, pack_size=self.config.pack_size, dry_run=dry_run, progress=progress,
        )  # fmt: skip
        return dataclasses.replace(report, repack=packed)

    def delete(self, ref: str | int, *, force: bool = False, run: str | None = None) -> Checkpoint:
        """Remove one checkpoint from the catalog (a tagged one only with ``force``).

        Its bytes are freed by the next :meth:`gc` (chunks other checkpoints share stay).
        """
        from .maintenance import gc as _gc

        ckpt = self.resolve(ref, run=run)
        found = self.catalog.identity(ckpt.id)
        _gc.delete(self.catalog, ckpt, force=force)
        if found is not None:
            self._record_run("delete", ckpt.run, target=found[0])
        return ckpt

    def fsck(
        self,
        *,
        deep: bool = False,
        repair: bool = False,
        grace: float | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> FsckReport:
        """Check that every chunk a checkpoint references is stored (``deep``: and decodes to its
        digest); find orphan objects. ``repair`` removes only orphans and abandoned commits."""
        from .maintenance import fsck as _fsck

        return _fsck.check(self.catalog, self.blobs, deep=deep, repair=repair, grace=grace, workers=self.workers, progress=progress)

    # -- records: what a lost catalog is rebuilt from --
    def _record(self, kind: str, ckpt: Checkpoint, **kw: Any) -> None:
        """Record a change to ``ckpt`` (already applied to the catalog) in the blob store."""
        from .format.recordio import checkpoint_event

        checkpoint_event(self.blobs, self.catalog, kind, ckpt, **kw)

    def _record_run(self, kind: str, run: str, *, name: str | None = None, target: Any = None, policy: str | None = None) -> None:
        from .catalog import utcnow
        from .format.record import Event, Identity
        from .format.recordio import write_event

        created = self.catalog.run_created(run) or utcnow()
        ident = Identity(*target) if target is not None else None
        write_event(self.blobs, Event(kind, utcnow(), run, created, name=name, target=ident, policy=policy))

    def recover(self, *, progress: Callable[[str, int, int], None] | None = None) -> RecoverReport:
        """Rebuild this store's catalog from the records and packs in its blob store (a missing,
        empty or damaged catalog); safe to run twice. See :mod:`ckstore.maintenance.recover`."""
        from .maintenance import recover as _recover

        return _recover.recover(self.catalog, self.blobs, progress=progress)

    def backfill_records(self) -> int:
        """Write the blob-store records of every checkpoint, fork and policy the catalog has and
        the blob store lacks (stores written before records existed); returns how many."""
        from .maintenance import recover as _recover

        return _recover.backfill(self.catalog, self.blobs)

    def copy(
        self,
        refs: Iterable[str | int],
        dest: Store,
        *,
        run: str | None = None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> CopyReport:
        """Copy the checkpoints ``refs`` name (and every checkpoint of ``run``) into store
        ``dest``, with their runs, metrics, tags, kinds and lineage; only chunks ``dest`` lacks
        are sent, as stored, each verified against its digest. Resumable: copying again skips
        what arrived. ``progress(bytes_sent, bytes_to_send, bytes_skipped)``; see
        :mod:`ckstore.maintenance.copy`."""
        from .commit.frames import commit_frames
        from .commit.protocol import CommitContext
        from .maintenance.copy import copy_checkpoints

        if not isinstance(dest, Store):
            raise StoreConfigError(
                f"copy's dest must be a ckstore.Store (ckstore.open(location)), got {type(dest).__name__} {dest!r}"
            )
        ckpts = {c.id: c for c in (self.resolve(r) for r in refs)}
        if run is not None:
            self.catalog.require_run(run)
            ckpts.update({c.id: c for c in self.checkpoints(run)})
        ctx = CommitContext(dest.blobs, dest.catalog, dest.config, dest.workers, dest.run)
        return copy_checkpoints(self, dest, list(ckpts.values()), commit=partial(commit_frames, ctx), progress=progress)

    def du(self, run: str | None = None) -> DuReport:
        """Logical and stored bytes, dedup and compression ratios, and bytes each run and
        checkpoint alone holds, per run (and per checkpoint of ``run``, or of every run)."""
        from .maintenance import du as _du

        return _du.usage(self.catalog, run, self.blobs)

