"""The commit protocol: one path for one process and for a torch.distributed job.

A single-process commit is the collective commit on a group of one (:class:`~ckstore.commit.
collective.Group`); inside a distributed job every rank calls :meth:`ckstore.Store.commit` with
its own states (``{rank: states}``, its rank in the group) and the call is a collective. Who does
what, in order:

1. every rank   checks the commit's arguments, flattens its states, declares its shards
                (DTensors included) and stages its tensors' bytes (``stage``: the only phase that
                runs in the caller's thread; an asynchronous commit copies them into reusable
                host buffers here and runs everything below in a background thread); nothing is
                written before this step has passed everywhere
   all-gather   the declarations (``declare``): every rank derives the same global shapes and offsets (an
                inconsistent declaration raises the same error on every rank)
2. rank 0       opens the pending checkpoint and keeps its lease alive until the end (``hash``;
                a group of one opens it in step 3's transaction instead)
   every rank   hashes its staged chunks
   gather       each rank's chunk digests and sizes, to rank 0
3. rank 0       references the chunks the store already has (``plan_writes``); picks exactly one writer among the
                ranks holding each missing chunk (runs of consecutive chunks, balanced by bytes),
                so data-parallel replicas are written once in total; records the keys of the
                packs every rank may need (its own included), before any is written, in the
                claim's transaction
   scatter      to each rank: the chunks it writes and its pack keys
4. every rank   encodes its chunks and writes its packs (``write``) straight to the blob store, in parallel
   gather       each rank's packs and manifests, to rank 0
5. rank 0       in one transaction (``finish``): records every rank's packs' chunks (and drops
                the rows of packs left unwritten) while its own last pack is still being made
                durable, writes the checkpoint's record once every pack is durable (on the pool
                while the transaction goes on, or first when it names many chunks; durable
                before its COMMIT) and makes the checkpoint visible
   broadcast    the checkpoint, or the error: every rank returns the same record

Only rank 0 talks to the catalog. Rank 0 checks its lease before each of its steps and before
each chunk it writes: once the pending checkpoint was taken over (gc or another commit judged it
abandoned) it stops with :class:`~ckstore.errors.CommitAbandonedError`, which the other ranks learn
at the next collective. On a group of one a failure raises as it is; on a larger group every
collective also carries each rank's success or error, so when one rank fails every rank raises
:class:`~ckstore.errors.DistributedCommitError` naming it, at the same step. Either way rank 0
aborts the pending checkpoint: nothing becomes visible, and whatever was written is garbage that
``gc`` removes. A rank that dies outright makes the others' collectives fail (or time out, after
the process group's timeout), with the same outcome.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._crash import crash_point
from .._threads import TaskGroup, Ticking, every
from ..blobstore import BlobStore
from ..catalog import Catalog, Owner, RecordFacts, utcnow
from ..checkout.reshard import resolve_shards
from ..config import StoreConfig
from ..errors import (
    CkstoreError,
    CommitAbandonedError,
    DistributedCommitError,
    LayoutError,
    UnsupportedValueError,
)
from ..format.codec import DELTA_OVERHEAD, HEADER_SIZE
from ..format.manifest import ShardSpec
from ..format.pack import PACK_HEADER, PackedChunk, PackWriter, new_pack_key
from ..format.tensorio import StagingBuffer
from ..layout import WorldLayout
from ..records import Checkpoint
from . import _stage
from ._arguments import CommitArguments, check_arguments
from ._delta import DeltaCache, DeltaPlan
from ._records import write_record
from .collective import Group, bind
from .dtensor import DTensorLeaves, default_layout

__all__ = ["CommitContext", "start", "StagedCommit", "assign_writers", "Heartbeat", "WRITERS"]

#: Who writes a chunk several ranks hold: "assigned" (one rank, picked by rank 0) or "all"
#: (every holder writes its copy; later copies are dead bytes in their packs until gc).
WRITERS = ("assigned", "all")

#: a record naming at most this many chunks is written alongside the finishing transaction
_RECORD_ALONGSIDE = 256


def _nothing() -> None:
    return None


def _ignore_closed(pack_id: Any, size: int, chunks: list[PackedChunk]) -> None:
    """A commit takes its packs from :attr:`PackWriter.sealed` (durable once it settled)."""


# a frame is its raw bytes plus a header and, for byte planes, one u32 per plane (16 at most);
# a delta frame adds its own header and its base's digest
_MAX_FRAME_OVERHEAD = DELTA_OVERHEAD + HEADER_SIZE + 4 * 16


@dataclass(frozen=True, slots=True)
class CommitContext:
    """What a commit needs of a store: where bytes and records go, and how to write them."""

    blobs: BlobStore
    catalog: Catalog
    config: StoreConfig
    workers: int
    run: str | None = None  # the store's default run, for commits that name none
    delta: DeltaCache | None = None  # the store's chunks to write deltas against, when it writes deltas
    ahead: _stage.AheadHint | None = None  # which large chunks a single process encodes during its claim
    planes: _stage.PlaneHints | None = None  # which byte planes shrank in the store object's last commit


def start(
    ctx: CommitContext,
    step: int,
    rank_states: Any,
    metrics: Mapping[str, Any] | None = None,
    *,
    tags: Sequence[str] = (),
    kind: str = "checkpoint",
    run: str | None = None,
    replace: bool = False,
    world_layout: WorldLayout | None = None,
    allow_pickle: bool = False,
    parent: Callable[[str], int | None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    process_group: Any = None,
    writers: str = "assigned",
    staging: StagingBuffer | None = None,
    changed_only: bool = False,
) -> StagedCommit:
    """The first part of a commit, in the caller's thread: check the arguments, flatten the
    states and stage their tensors (into ``staging``'s reusable buffer when given, so the caller
    may change its tensors as soon as this returns; else zero-copy views; ``changed_only``: see
    :func:`ckstore.commit._stage.stage`). Nothing is collective
    and nothing is written yet; :meth:`StagedCommit.complete` runs the rest, in any one thread.

    On a group of one a bad argument raises here; on a larger group it is reported to every rank
    by the first collective of ``complete`` (every rank's ``complete`` raises).
    """
    if writers not in WRITERS:
        raise CkstoreError(f"writers must be one of {WRITERS}, got {writers!r}")
    name = run or ctx.run
    group = bind(process_group, f"commit of run {name!r}, step {step}")
    job = StagedCommit(ctx, group, writers, progress, replace, parent)
    job.stage(name, step, rank_states, metrics, tags, kind, world_layout, allow_pickle, staging, changed_only)
    return job


class StagedCommit:
    """One rank's side of a commit, one method per phase of the module docstring.

    :meth:`stage` (phase 1's local part) runs in the caller's thread; :meth:`complete` runs every
    later phase, in order, and aborts on any failure. Integrations that must split the last phase
    off (DCP's coordinator finishes in a later call) run :meth:`write_phases` and then
    :meth:`finish` themselves, and :meth:`abort` when they give up.
    """

    def __init__(
        self,
        ctx: CommitContext,
        group: Group,
        writers: str,
        progress: Callable[[int, int], None] | None,
        replace: bool,
        parent: Callable[[str], int | None] | None,
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.config
        self.g = group
        self.writers = writers
        self.progress = progress
        self.replace = replace
        self.parent = parent
        self.owner = Owner.me()
        self.stack = ExitStack()  # the heartbeat and the thread pool, stopped before an abort
        self.declaration: Any = (None, None)  # this rank's outcome of phase 1's local part
        self.args: CommitArguments | None = None
        self.layout: WorldLayout | None = None
        self.ckpt_id: int | None = None  # rank 0: the pending checkpoint
        self.heartbeat: Heartbeat | None = None  # rank 0: keeps the pending checkpoint's lease
        self.pool: Executor | None = None
        self.entries: list[_stage.PreparedEntry] = []
        self.specs: Mapping[tuple[int, str, str], ShardSpec] = {}
        self.staged: list[_stage.StagedTensor] = []
        self.staging: StagingBuffer | None = None  # the reusable buffer the tensors were copied into
        self.held: dict[bytes, int] = {}  # raw size of every distinct chunk this rank holds
        self.holdings: list[list[tuple[bytes, int]]] | None = None  # rank 0: what every rank holds
        self.mine: tuple[list[bytes], list[tuple[str, int]]] = ([], [])  # chunks to write, pack slots
        self.results: list[Any] | None = None  # rank 0: every rank's packs and manifests
        self.registered: list[Any] = []  # rank 0: the ids of every pack recorded for the commit
        self.bases: dict[bytes, bytes] = {}  # this rank's changed chunks' candidate delta bases
        self.usable: dict[bytes, int] = {}  # which of them the catalog has, by chain depth
        self.rank_bases: list[list[bytes]] = []  # rank 0: every rank's candidate bases
        self.claimed_bases: set[bytes] = set()  # rank 0: the candidate bases its claim referenced
        self.depths: dict[bytes, int] = {}  # the chain depth of the deltas this rank wrote
        self.delta_plan: DeltaPlan | None = None  # what this rank may write as deltas
        # rank 0, when the finishing transaction follows at once: waits until its packs are
        # durable (the transaction records their chunks meanwhile, and waits before its COMMIT)
        self.packs_durable: Callable[[], None] = _nothing
        self._durable_at_finish = False
        # a group of one without deltas: its first large chunks' encodes, started before the claim
        self.ahead: dict[bytes, Any] = {}
        # the byte planes this commit compresses in each chunk (encoded ahead or not), from the
        # store object's last commit
        self.plane_tries = ctx.planes.begin() if ctx.planes is not None else None

    @property
    def what(self) -> str:
        """The commit as messages name it: "commit of run 'exp', step 3"."""
        return self.g.what

    def complete(self) -> Checkpoint:
        """Every phase after staging; the checkpoint, the same on every rank."""
        self._durable_at_finish = True
        self.write_phases()
        ckpt = self.finish()
        assert ckpt is not None
        return ckpt

    def write_phases(self, *, settle: bool = False) -> None:
        """Phases 1 (agreement) to 4: after this, every chunk is durable and rank 0 holds every
        rank's manifests. A failure aborts and raises. With ``settle`` (for callers that finish in
        a later call, or never when a rank failed) a failure known after the last gather raises
        now: on the failed rank, and on rank 0 for every rank."""
        try:
            self.declare()
            self.hash()
            self.plan_writes()
            self.write()
            if settle:
                self.g.settle("writing chunks", (None, None))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Stop the heartbeat and the thread pool, then (rank 0) abort the pending checkpoint."""
        self.stack.close()
        if self.ctx.delta is not None:  # what it wrote may never be stored: no delta against it
            self.ctx.delta.clear()
        if self.ckpt_id is None:
            return
        try:
            self.ctx.catalog.abort_checkpoint(self.ckpt_id, self.owner)
        except Exception:  # noqa: BLE001 - the original error matters more; gc cleans up later
            pass
        self.ckpt_id = None

    def check_lease(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.check()

    def stage(
        self,
        run: str | None,
        step: int,
        rank_states: Any,
        metrics: Mapping[str, Any] | None,
        tags: Sequence[str],
        kind: str,
        world_layout: WorldLayout | None,
        allow_pickle: bool,
        staging: StagingBuffer | None,
        changed_only: bool = False,
    ) -> None:
        """Phase 1, this rank's part: check the arguments, flatten, declare the shards, and stage
        the tensors' bytes. No collective: the declaration is exchanged by :meth:`declare`."""
        g = self.g

        def local() -> tuple[Any, ...]:
            self.args = check_arguments(run, step, metrics, tags, kind)
            hook = DTensorLeaves()
            self.entries = _stage.prepare_entries(rank_states, allow_pickle=allow_pickle, tensor_hook=hook)
            ranks = sorted({e.rank for e in self.entries})
            if g.size > 1 and ranks != [g.rank]:
                raise UnsupportedValueError(
                    f"in a collective commit each rank passes only its own states: rank {g.rank} "
                    f"passed ranks {ranks}; call commit(step, {{{g.rank}: states}}) on every rank"
                )
            layout = world_layout or default_layout(hook, g.size if g.size > 1 else ranks[-1] + 1)
            if g.size > 1 and layout.world_size != g.size:
                raise LayoutError(
                    f"world_layout {layout.mesh} has {layout.world_size} ranks but the process group has {g.size}"
                )
            for r in ranks:
                layout.coords(r)  # a rank outside the layout is an error
            self.staged = _stage.stage(
                self.entries, staging, changed_only=changed_only, chunk_size=self.cfg.chunk_size, workers=self.ctx.workers
            )
            self.staging = staging
            return self.args.run, self.args.step, layout.to_json(), _stage.piece_infos(self.entries)

        self.declaration = g.attempt(local)
        crash_point("stage")

    def declare(self) -> None:
        """Phase 1, together: agree on run, step and layout, and derive every shard's placement."""
        g = self.g
        declared = g.all_gather("declaring shards", self.declaration)
        first = declared[0]
        for r, d in enumerate(declared):
            if d[:3] != first[:3]:
                raise DistributedCommitError(
                    f"{g.what}: ranks disagree on what they commit: rank 0 commits run {first[0]!r}, step "
                    f"{first[1]}, layout {WorldLayout.from_json(first[2]).mesh}; rank {r} commits run "
                    f"{d[0]!r}, step {d[1]}, layout {WorldLayout.from_json(d[2]).mesh}"
                )
        # the same inputs on every rank: an inconsistent declaration raises the same error everywhere
        self.layout = WorldLayout.from_json(first[2])
        self.specs = resolve_shards(self.layout, [p for d in declared for p in d[3]])
        self.pool = self.stack.enter_context(TaskGroup("commit", self.ctx.workers))
        crash_point("declare")

    def hash(self) -> None:
        """Phase 2: rank 0 opens the pending checkpoint; every rank hashes its staged chunks;
        rank 0 learns what every rank holds."""
        g, cs = self.g, self.cfg.chunk_size

        def local() -> tuple[bytes | list[bytes], list[int], bytes | list[bytes]]:
            assert self.pool is not None and self.args is not None and self.layout is not None
            if g.rank == 0 and g.size > 1:  # (a group of one opens it with its claim)
                self.ckpt_id = self.ctx.catalog.begin_checkpoint(**self._begin_kwargs())
                self._start_heartbeat()
            _stage.hash_staged(self.entries, self.staged, self.specs, cs, self.pool)
            if self.staging is not None:  # what its places hold now, for the next commit through it
                self.staging.held = [st.digests for st in self.staged]
            held = self.held
            for st in self.staged:
                n = st.data.nbytes
                for i, d in enumerate(st.digests):
                    held.setdefault(d, min(cs, n - i * cs))  # chunk i's length
            if self.ctx.delta is not None:
                self.bases = self.ctx.delta.candidates(self._places())
            elif g.size == 1 and self.ctx.ahead is not None:  # likely missing ones encode during the claim
                self.ahead = _stage.encode_ahead(
                    self.entries, self.staged, cs, self.cfg.compression_level, self.pool, self.ctx.workers, self.ctx.ahead,
                    self.plane_tries,
                )  # fmt: skip
            join = _join if g.size > 1 else list  # (a group of one hands its own lists over)
            return join(list(self.held)), list(self.held.values()), join(list(dict.fromkeys(self.bases.values())))

        hashed = g.attempt(local)
        crash_point("hash")
        gathered = g.gather("hashing chunks", hashed)
        if gathered is not None:
            self.holdings = [list(zip(_split(h[0]), h[1])) if h is not None else [] for h in gathered]
            self.rank_bases = [_split(h[2]) if h is not None else [] for h in gathered]

    def _places(self) -> list[tuple[tuple[int, str, str, int], bytes, int]]:
        """Every staged chunk's place (rank, sub-checkpoint, path, index), digest and length."""
        cs, out = self.cfg.chunk_size, []
        for st in self.staged:
            e, n = self.entries[st.entry], st.data.nbytes
            out += [((e.rank, e.sub_key, st.path, i), d, min(cs, n - i * cs)) for i, d in enumerate(st.digests)]
        return out

    def _begin_kwargs(self) -> dict[str, Any]:
        """The pending checkpoint's :meth:`~ckstore.catalog.Catalog.begin_checkpoint` arguments."""
        a = self.args
        assert a is not None and self.layout is not None
        return {
            "run": a.run, "step": a.step, "kind": a.kind, "replace": self.replace, "owner": self.owner,
            "world_layout": self.layout, "lease_seconds": self.cfg.lease_seconds, "fork_point": self.parent is not None,
            "parent_checkpoint_id": self.parent(a.run) if self.parent is not None else None,
        }  # fmt: skip

    def _start_heartbeat(self) -> None:
        assert self.ckpt_id is not None
        self.heartbeat = self.stack.enter_context(
            Heartbeat(self.ctx.catalog, self.ckpt_id, self.owner, self.cfg.lease_seconds / 4)
        )

    def plan_writes(self) -> None:
        """Step 3: rank 0 claims existing chunks, picks writers and records every rank's pack
        keys, in one catalog transaction."""
        g, cfg = self.g, self.cfg

        def local() -> list[Any]:
            assert self.holdings is not None and (self.ckpt_id is not None or g.size == 1)
            self.check_lease()
            catalog, holdings = self.ctx.catalog, self.holdings
            # the chunks held, then the candidate bases of deltas: a base found is referenced
            # by the claim (gc keeps it) and comes back with its chain depth
            wanted = list(dict.fromkeys([d for items in holdings for d, _ in items] + [b for bs in self.rank_bases for b in bs]))
            # with deltas: the candidate bases, left holding those the catalog has, by depth
            chains: dict[bytes, int] | None = None
            if self.ctx.delta is not None:
                chains = dict.fromkeys((b for bs in self.rank_bases for b in bs), 0)
            sizes = {d: n for items in holdings for d, n in items}
            plan: list[list[bytes]] = []
            needed: list[int] = []

            def keys_for(missing: set[bytes]) -> list[str]:
                # inside the claim's transaction: whom each missing chunk goes to, and an upper
                # bound on the packs each writer fills (the unwritten ones are dropped at finish)
                if self.writers == "all" or g.size == 1:
                    plan[:] = [[d for d, _ in items if d in missing] for items in holdings]
                else:
                    copies: dict[bytes, list[int]] = {}
                    for items in holdings:
                        for d, n in items:
                            if d in missing:
                                copies.setdefault(d, []).append(n)
                    shared = sum(ns[0] for ns in copies.values() if len(ns) > 1)
                    run_bytes = min(cfg.pack_size, max(cfg.chunk_size, shared // (4 * g.size)))
                    plan[:] = assign_writers(holdings, missing, run_bytes)
                needed[:] = [packs_needed(sum(sizes[d] for d in p), len(p), cfg.pack_size) for p in plan]
                return [new_pack_key() for _ in range(sum(needed))]

            if self.ckpt_id is None:  # a group of one: the pending checkpoint opens with its claim
                self.ckpt_id, _, registered = catalog.begin_and_claim(
                    **self._begin_kwargs(), digests=wanted, keys_for=keys_for, chains=chains
                )
                self._start_heartbeat()
            else:
                _, registered = catalog.claim_and_register(self.ckpt_id, self.owner, wanted, keys_for, chains)
            self.registered = [pack_id for _, pack_id in registered]
            ids = iter(registered)
            usable: list[dict[bytes, int]] = [{} for _ in plan]
            if self.ctx.delta is not None and chains:
                longest = self.ctx.delta.chain  # (a depth outside 0..longest-1 in a damaged row: unusable)
                usable = [{b: chains[b] for b in bs if 0 <= chains.get(b, longest) < longest} for bs in self.rank_bases]
                self.claimed_bases = set(chains)
            join = _join if g.size > 1 else list
            return [(join(p), [next(ids) for _ in range(n)], u) for p, n, u in zip(plan, needed, usable)]

        outcome = g.attempt(local) if g.rank == 0 else (None, None)
        crash_point("plan_writes")
        digests, slots, self.usable = g.scatter("assigning chunks to writers", outcome)
        self.mine = (_split(digests), slots)

    def write(self) -> None:
        """Step 4: write this rank's chunks into its packs; rank 0 gathers packs and manifests."""
        cfg, g = self.cfg, self.g

        def local() -> tuple[list[tuple[int, int, list[PackedChunk]]], list[Any]]:
            assert self.pool is not None
            assigned = set(self.mine[0])
            slots = deque(self.mine[1])

            def on_open() -> tuple[str, Any]:
                if not slots:
                    raise CkstoreError(f"rank {g.rank} needs more packs than were recorded for it")
                return slots.popleft()

            total = sum(self.held[d] for d in assigned)
            done = 0

            def tick(n: int) -> None:
                nonlocal done
                self.check_lease()  # stop writing as soon as the claim is lost
                done += n
                if self.progress is not None:
                    self.progress(done, total)

            writer = PackWriter(self.ctx.blobs, cfg.pack_size, on_open, _ignore_closed)
            self.stack.callback(writer.abort)  # on a failure, whatever is still being written ends first
            delta = None
            if self.ctx.delta is not None and self.usable:
                delta = self.delta_plan = DeltaPlan(self.bases, self.usable, self.ctx.delta)
            durable = _stage.write_missing(
                self.staged, assigned, writer, self.pool, chunk_size=cfg.chunk_size,
                level=cfg.compression_level, window=2 * self.ctx.workers, progress=tick, threads=self.ctx.workers,
                delta=delta, ahead=self.ahead, planes=self.plane_tries,
            )  # fmt: skip
            self.ahead = {}
            if self.ctx.planes is not None and self.plane_tries is not None:
                self.ctx.planes.end(self.plane_tries)
            if g.size == 1 and self.ctx.delta is None and self.ctx.ahead is not None:
                self.ctx.ahead.remember(_stage.written_places(self.entries, self.staged, assigned, cfg.chunk_size))
            if self._durable_at_finish and g.rank == 0:
                # the last pack's fdatasync and rename run while the finishing transaction
                # records its chunks; its COMMIT waits for them (4 MiB: ~1.7 ms sooner)
                self.packs_durable = durable
            else:  # what this rank hands over is durable
                durable()
            packs = writer.sealed
            if delta is not None:
                self.depths.update((c.digest, c.chain) for _, _, chunks in packs for c in chunks if c.chain)
            self._remember()
            return packs, _stage.build_manifests(self.entries, self.staged, cfg.chunk_size)

        written = g.attempt(local)
        crash_point("write")
        self.results = g.gather("writing chunks", written)
        # the chunks are written and the manifests built: what finishing needs is in the results,
        # so the staged bytes (tiny tensors' copies, accelerator tensors' host copies), the
        # flattened trees and the chunk lists go now, before the finishing transaction and the
        # record are built beside them (100,000 tiny tensors: ~90 MiB)
        self.staged, self.entries, self.held, self.mine = [], [], {}, ([], [])

    def finish(self, *, collective: bool = True) -> Checkpoint | None:
        """Phase 5: rank 0 records every pack's chunks and makes the checkpoint visible; with
        ``collective`` every rank returns it (else rank 0 alone, the others None). A failure aborts
        and raises."""

        def local() -> Checkpoint:
            assert self.results is not None and self.ckpt_id is not None and self.args is not None
            self.check_lease()
            catalog = self.ctx.catalog
            packs = [(pack_id, size, chunks) for rank_packs, _ in self.results for pack_id, size, chunks in rank_packs]
            written = {pack_id for pack_id, _, _ in packs}
            unused = [pack_id for pack_id in self.registered if pack_id not in written]
            manifests = [m for _, ms in self.results for m in ms]
            # the candidate bases the claim referenced: a checkpoint references only its own
            # chunks (gc keeps the bases of referenced deltas)
            unneeded: list[bytes] = []
            if self.claimed_bases:
                held = {d for items in self.holdings or () for d, _ in items}
                unneeded = [b for b in self.claimed_bases if b not in held]
            when, pool, args, ckpt_id = utcnow(), self.pool, self.args, self.ckpt_id
            assert pool is not None

            def record(added: int, facts: RecordFacts) -> Callable[[], object]:
                # the checkpoint's record in the blob store: its bytes written and made durable
                # while the packs are, in place once every pack is durable (a durable record
                # names only durable chunks), before the finishing transaction's COMMIT. A small
                # record is written on the pool while the transaction's statements run (its time
                # is the disk's); a large one is mostly Python encoding it, which would hold the
                # GIL the statements wait for between their driver calls: it is written here, first
                job = partial(write_record, self.ctx, ckpt_id, args, manifests, added, facts, when, self.packs_durable)
                if len(facts.chunks) > _RECORD_ALONGSIDE:
                    job()
                    return _nothing
                return pool.submit(job).result

            # every pack's chunk rows, the record, and the checkpoint made visible: one transaction
            ckpt = catalog.finish_checkpoint(
                ckpt_id, self.owner, entries=manifests, metrics=args.metrics, tags=args.tags,
                logical_bytes=sum(m[3] for m in manifests), replace=self.replace, committed_at=when,
                packs=packs, unused=unused, record=record, unneeded=unneeded,
            )  # fmt: skip
            self.ckpt_id = None  # visible now: nothing to abort
            return ckpt

        crash_point("finish")
        try:
            ckpt: Checkpoint | None
            outcome = self.g.attempt(local) if self.g.rank == 0 else (None, None)
            if collective:
                try:
                    ckpt = self.g.broadcast("making the checkpoint visible", outcome, final=True)
                except DistributedCommitError:
                    if outcome[1] is None:
                        raise
                    # rank 0 made it visible, complete, with every rank's packs and manifests: a
                    # peer lost after handing them over does not undo the commit
                    ckpt = outcome[1]
            else:  # the caller tells the other ranks (DCP's coordinator does)
                ckpt = self.g.settle("making the checkpoint visible", outcome)
        except BaseException:
            self.abort()
            raise
        self.stack.close()
        return ckpt

    def _remember(self) -> None:
        """Keep this rank's chunks as the next commit's candidate bases (with deltas on), once
        they are written: on every rank, whether or not it learns that the commit went through
        (DCP's other ranks do not), since the next claim uses only the candidates the catalog
        has; a failure forgets them (:meth:`abort`)."""
        if self.ctx.delta is None:
            return
        cs = self.cfg.chunk_size
        self.ctx.delta.remember(
            [(place, d, st.chunk(place[3], cs)) for st, (place, d, _) in zip(self._staged_chunks(), self._places())],
            self.depths,
            self.delta_plan.wholes if self.delta_plan is not None else {},
        )

    def _staged_chunks(self) -> list[_stage.StagedTensor]:
        """The staged tensor of each chunk in :meth:`_places`'s order."""
        return [st for st in self.staged for _ in st.digests]


class Heartbeat:
    """Refreshes a pending checkpoint's lease, from the process's timer thread
    (:func:`ckstore._threads.every`), until the context exits."""

    def __init__(self, catalog: Catalog, ckpt_id: int, owner: Owner, interval: float) -> None:
        self.catalog, self.ckpt_id, self.owner, self.interval = catalog, ckpt_id, owner, interval
        self.lost = False
        self._ticking: Ticking | None = None

    def __enter__(self) -> Heartbeat:
        self._ticking = every(self.interval, self._beat)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._ticking is not None
        self._ticking.stop()  # no beat runs once this returns

    def check(self) -> None:
        """Raise :class:`CommitAbandonedError` once the pending checkpoint's claim is lost."""
        if self.lost:
            raise CommitAbandonedError(
                "this commit's claim was taken over while it was in flight (garbage collection or "
                "another commit judged it abandoned); nothing of it became visible. Commit again; "
                "if it happens again, raise gc's --grace or the store's lease"
            )

    def _beat(self) -> bool:
        """One refresh; False (no more) once the claim is lost. A failed refresh is retried at the
        next beat; a lease that lapses meanwhile is refused by the catalog at the next record."""
        try:
            if not self.catalog.heartbeat(self.ckpt_id, self.owner):
                self.lost = True
                return False
        except Exception:  # noqa: BLE001
            pass
        return True


def packs_needed(raw_bytes: int, chunks: int, pack_size: int) -> int:
    """An upper bound on the packs a :class:`PackWriter` fills with these chunks (a pack is
    closed once it reaches ``pack_size``, so all but the last hold at least that much)."""
    if not chunks:
        return 0
    # + 2: the last, partly filled pack, and the pack of small chunks closed ahead of the others
    return (raw_bytes + chunks * _MAX_FRAME_OVERHEAD) // (pack_size - len(PACK_HEADER)) + 2


def assign_writers(
    holdings: Sequence[Sequence[tuple[bytes, int]]], missing: Collection[bytes], run_bytes: int
) -> list[list[bytes]]:
    """Pick exactly one writer for every missing chunk.

    ``holdings[r]`` lists the ``(digest, raw_size)`` of the chunks rank ``r`` holds, in the order
    it would write them. A chunk only one rank holds is that rank's; a chunk several ranks hold
    (a replicated tensor) goes to one of them, in runs of about ``run_bytes`` consecutive chunks
    (so a tensor's chunks stay together in one pack), each run to the holder with the fewest bytes
    assigned so far. Returns, for each rank, the digests it writes, in its own order.
    """
    holders: dict[bytes, set[int]] = {}
    size: dict[bytes, int] = {}
    for r, items in enumerate(holdings):
        for d, n in items:
            if d in missing:
                holders.setdefault(d, set()).add(r)
                size[d] = n
    owner: dict[bytes, int] = {}
    load = [0] * len(holdings)
    for d, hs in holders.items():
        if len(hs) == 1:
            (owner[d],) = hs
            load[owner[d]] += size[d]
    cur, run = -1, 0
    for items in holdings:
        for d, _ in items:
            if d in owner or d not in holders:
                continue
            hs = holders[d]
            if cur not in hs or run >= run_bytes:
                cur, run = min(hs, key=lambda r: (load[r], r)), 0
            owner[d] = cur
            load[cur] += size[d]
            run += size[d]
    out: list[list[bytes]] = [[] for _ in holdings]
    for r, items in enumerate(holdings):
        for d, _ in items:
            if owner.get(d) == r:
                out[r].append(d)
    return out


def _join(digests: Sequence[bytes]) -> bytes:
    """Digests as one object for a collective (one buffer, not a list of small ones, to pickle)."""
    return b"".join(digests)


def _split(blob: bytes | list[bytes]) -> list[bytes]:
    """The digests :func:`_join` joined; a group of one hands its list over as it is (100,000
    chunks: ~6 MiB of copies each way)."""
    if isinstance(blob, list):
        return blob
    return [blob[i : i + 16] for i in range(0, len(blob), 16)]
