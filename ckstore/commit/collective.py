"""Collective commit over torch.distributed.

Every rank of the process group calls :meth:`ckstore.Store.commit` with its own states
(``{rank: states}``, its rank in the group); the call is a collective. Who does what, in order:

1. every rank   flattens its states and declares its shards (DTensors included); rank 0 opens
                the pending checkpoint and keeps its lease alive until the end
   all-gather   the shard declarations: every rank derives the same global shapes and offsets
2. every rank   stages its tensors and hashes their chunks
   gather       each rank's chunk digests and sizes, to rank 0
3. rank 0       references the chunks the store already has; picks exactly one writer among the
                ranks holding each missing chunk (runs of consecutive chunks, balanced by bytes),
                so data-parallel replicas are written once in total; records the keys of every
                pack each rank may need, before any is written
   scatter      to each rank: the chunks it writes and its pack keys
4. every rank   encodes its chunks and writes its packs straight to the blob store, in parallel
   gather       each rank's packs and manifests, to rank 0
5. rank 0       records the packs' chunks and makes the checkpoint visible in one transaction
   broadcast    the checkpoint, or the error: every rank returns the same record

Only rank 0 talks to the catalog. Every collective also carries each rank's success or error,
so when one rank fails every rank raises :class:`~ckstore.errors.DistributedCommitError` naming
it, at the same step, and rank 0 aborts the pending checkpoint: nothing becomes visible, and
whatever was written is garbage that ``gc`` removes. A rank that dies outright makes the others'
collectives fail (or time out, after the process group's timeout), with the same outcome.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, TypeVar

from ..catalog import NewChunk, Owner
from ..checkout.reshard import resolve_shards
from ..errors import CkstoreError, DistributedCommitError, LayoutError, UnsupportedValueError
from ..format.codec import HEADER_SIZE
from ..format.manifest import ShardSpec
from ..format.pack import PACK_HEADER, PackedChunk, PackWriter, new_pack_key
from ..layout import WorldLayout
from ..records import Checkpoint
from . import _stage
from .dtensor import DTensorLeaves, default_layout

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "active_group",
    "group_rank",
    "own_ranks",
    "commit_collective",
    "assign_writers",
    "failure_message",
    "WRITERS",
]

#: Who writes a chunk several ranks hold: "assigned" (one rank, picked by rank 0) or "all"
#: (every holder writes its copy; later copies are dead bytes in their packs until gc).
WRITERS = ("assigned", "all")

# a frame is its raw bytes plus a header and, for byte planes, one u32 per plane (16 at most)
_MAX_FRAME_OVERHEAD = HEADER_SIZE + 4 * 16
_MAX_ERROR = 600

T = TypeVar("T")


def active_group(process_group: Any = None) -> Any:
    """The process group a call should be collective over, or None for a single-process call."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise RuntimeError("process_group was given but torch.distributed is not initialized")
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if process_group is None and dist.get_world_size(group) == 1:
        return None
    return group


def group_rank(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_rank(group))


def own_ranks(group: Any, world_layout: WorldLayout | None) -> list[int]:
    """The ranks a checkout inside a distributed job loads: this rank's own (or rank 0 of a
    one-rank layout: every rank that asks gets the consolidated states)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if world_layout is not None and world_layout.world_size == 1:
        return [0]
    if world_layout is not None and world_layout.world_size != size:
        raise LayoutError(
            f"world_layout {world_layout.mesh} has {world_layout.world_size} ranks but the process group "
            f"has {size}; pass the layout of this job, or ranks=[...] to load other ranks' states"
        )
    return [group_rank(group)]


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 1] + "…"


class _Collective:
    """The collective steps of one call. Each step carries every rank's success or error, and
    raises :class:`DistributedCommitError` on every rank as soon as any rank has failed."""

    def __init__(self, group: Any, what: str) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = int(dist.get_rank(group))
        self.size = int(dist.get_world_size(group))
        self.what = what
        self.error: BaseException | None = None  # this rank's own failure
        self.failures: dict[int, str] = {}  # on rank 0: failures it gathered and not yet reported

    def attempt(self, fn: Callable[[], T]) -> tuple[str | None, T | None]:
        """Run this rank's part of a step; a failure is kept and reported at the next collective.

        Nothing runs once this rank failed, or (on rank 0) once another rank's failure is known."""
        if self.error is not None:
            return _describe(self.error), None
        if self.failures:
            return None, None
        try:
            return None, fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported to every rank
            self.error = e
            return _describe(e), None

    def all_gather(self, step: str, outcome: tuple[str | None, Any]) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._call(step, lambda: self.dist.all_gather_object(out, outcome, group=self.group))
        self._check({r: err for r, (err, _) in enumerate(out) if err})
        return [value for _, value in out]

    def gather(self, step: str, outcome: tuple[str | None, Any]) -> list[Any] | None:
        """Collect every rank's value on rank 0 (None elsewhere); failures are reported at the
        next scatter or broadcast."""
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._call(step, lambda: self.dist.gather_object(outcome, out, group=self.group, group_dst=0))
        if out is None:
            return None
        self.failures.update({r: err for r, (err, _) in enumerate(out) if err})
        return [value for _, value in out]

    def scatter(self, step: str, outcome: tuple[str | None, list[Any] | None]) -> Any:
        """Rank 0 sends each rank its own value (``outcome`` matters only on rank 0)."""
        box: list[Any] = [None]
        send = None
        if self.rank == 0:
            failures = self._pending(outcome[0])
            values = outcome[1] if outcome[1] is not None and not failures else [None] * self.size
            send = [(failures, v) for v in values]
        self._call(step, lambda: self.dist.scatter_object_list(box, send, group=self.group, group_src=0))
        failures, value = box[0]
        self._check(failures)
        return value

    def broadcast(self, step: str, outcome: tuple[str | None, Any]) -> Any:
        """Rank 0 sends one value to every rank (``outcome`` matters only on rank 0)."""
        box: list[Any] = [None]
        if self.rank == 0:
            failures = self._pending(outcome[0])
            box = [(failures, None if failures else outcome[1])]
        self._call(step, lambda: self.dist.broadcast_object_list(box, group=self.group, group_src=0))
        failures, value = box[0]
        self._check(failures)
        return value

    def _pending(self, own: str | None) -> dict[int, str]:
        failures = dict(self.failures)
        if own is not None:
            failures[0] = own
        return failures

    def _call(self, step: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the backend's own errors vary (gloo, NCCL, timeouts)
            raise DistributedCommitError(
                f"{self.what} failed: rank {self.rank} lost contact with the other ranks while "
                f"{step} ({_describe(e)}); nothing was committed. Check the other ranks' logs"
            ) from (self.error or e)

    def _check(self, failures: Mapping[int, str]) -> None:
        if not failures:
            return
        raise DistributedCommitError(failure_message(self.what, failures)) from self.error


def failure_message(what: str, failures: Mapping[int, str]) -> str:
    """``what`` failed on these ranks, with their errors (ranks failing alike are named once)."""
    by_error: dict[str, list[int]] = {}
    for r in sorted(failures):
        by_error.setdefault(failures[r], []).append(r)
    if len(by_error) == 1:
        ((error, ranks),) = by_error.items()
        detail = f"{_ranks(ranks)}: {error}"
    else:
        each = "; ".join(f"{_ranks(rs)}: {e}" for e, rs in by_error.items())
        detail = f"{_ranks(sorted(failures))} ({each})"
    return f"{what} failed on {detail}; nothing was committed"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _packs_needed(raw_bytes: int, chunks: int, pack_size: int) -> int:
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
    return b"".join(digests)


def _split(blob: bytes) -> list[bytes]:
    return [blob[i : i + 16] for i in range(0, len(blob), 16)]


def commit_collective(
    store: Store,
    group: Any,
    step: int,
    rank_states: Any,
    metrics: Mapping[str, float] | None,
    *,
    tags: Sequence[str] = (),
    kind: str = "checkpoint",
    run: str | None = None,
    replace: bool = False,
    world_layout: WorldLayout | None = None,
    allow_pickle: bool = False,
    parent: str | int | None = None,
    progress: Callable[[int, int], None] | None = None,
    writers: str = "assigned",
) -> Checkpoint:
    """Commit this rank's states as part of a collective commit (see the module docstring).

    Called by :meth:`ckstore.Store.commit` inside a distributed job. The checkpoint records rank
    0's metrics and tags. ``progress(done, total)`` counts the bytes this rank writes.
    """
    if writers not in WRITERS:
        raise CkstoreError(f"writers must be one of {WRITERS}, got {writers!r}")
    job = _CommitJob(store, group, step, run, writers, progress)
    with ExitStack() as stack:
        try:
            job.declare(rank_states, stack, metrics, tuple(tags), kind, replace, world_layout, allow_pickle, parent)
            job.hash()
            job.plan_writes()
            job.write()
            return job.finish(tuple(tags), replace)
        except BaseException:
            job.abort()
            raise


class _CommitJob:
    """One rank's side of a collective commit, one method per step of the module docstring."""

    def __init__(
        self,
        store: Store,
        group: Any,
        step: int,
        run: str | None,
        writers: str,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.store = store
        self.cfg = store.config
        self.step = step
        self.run = run
        self.writers = writers
        self.progress = progress
        self.c = _Collective(group, f"commit of run {run or store.run!r}, step {step}")
        self.owner = Owner.me()
        self.ckpt_id: int | None = None  # rank 0: the pending checkpoint
        self.pool: ThreadPoolExecutor | None = None
        self.entries: list[_stage.PreparedEntry] = []
        self.specs: Mapping[tuple[int, str, str], ShardSpec] = {}
        self.staged: list[_stage.StagedTensor] = []
        self.held: dict[bytes, int] = {}  # raw size of every distinct chunk this rank holds
        self.metrics: dict[str, float] = {}
        self.holdings: list[list[tuple[bytes, int]]] | None = None  # rank 0: what every rank holds
        self.mine: tuple[list[bytes], list[tuple[str, int]]] = ([], [])  # chunks to write, pack slots
        self.results: list[Any] | None = None  # rank 0: every rank's packs and manifests

    def abort(self) -> None:
        if self.ckpt_id is None:
            return
        try:
            self.store.catalog.abort_checkpoint(self.ckpt_id, self.owner)
        except Exception:  # noqa: BLE001 - the original error matters more; gc cleans up later
            pass
        self.ckpt_id = None

    def declare(
        self,
        rank_states: Any,
        stack: ExitStack,
        metrics: Mapping[str, float] | None,
        tags: tuple[str, ...],
        kind: str,
        replace: bool,
        world_layout: WorldLayout | None,
        allow_pickle: bool,
        parent: str | int | None,
    ) -> None:
        """Step 1: flatten, agree on run, step and layout, and derive every shard's placement."""
        c, store = self.c, self.store
        self.pool = stack.enter_context(ThreadPoolExecutor(store.workers, thread_name_prefix="ckstore-commit"))

        def local() -> tuple[Any, ...]:
            run_name, self.metrics = store._check_commit(self.step, metrics, tags, kind, self.run)
            hook = DTensorLeaves()
            self.entries = _stage.prepare_entries(rank_states, allow_pickle=allow_pickle, tensor_hook=hook)
            ranks = sorted({e.rank for e in self.entries})
            if ranks != [c.rank]:
                raise UnsupportedValueError(
                    f"in a collective commit each rank passes only its own states: rank {c.rank} "
                    f"passed ranks {ranks}; call commit(step, {{{c.rank}: states}}) on every rank"
                )
            layout = world_layout or default_layout(hook, c.size)
            if layout.world_size != c.size:
                raise LayoutError(
                    f"world_layout {layout.mesh} has {layout.world_size} ranks but the process group has {c.size}"
                )
            if c.rank == 0:
                self.ckpt_id = store.catalog.begin_checkpoint(
                    run_name, self.step, kind=kind, replace=replace, owner=self.owner, world_layout=layout,
                    lease_seconds=self.cfg.lease_seconds, parent_checkpoint_id=store._parent_id(parent, run_name),
                )  # fmt: skip
                stack.enter_context(
                    _stage.Heartbeat(store.catalog, self.ckpt_id, self.owner, self.cfg.lease_seconds / 4)
                )
            return run_name, self.step, layout.to_json(), _stage.piece_infos(self.entries)

        declared = c.all_gather("declaring shards", c.attempt(local))
        first = declared[0]
        for r, d in enumerate(declared):
            if d[:3] != first[:3]:
                raise DistributedCommitError(
                    f"{c.what}: ranks disagree on what they commit: rank 0 commits run {first[0]!r}, step "
                    f"{first[1]}, layout {WorldLayout.from_json(first[2]).mesh}; rank {r} commits run "
                    f"{d[0]!r}, step {d[1]}, layout {WorldLayout.from_json(d[2]).mesh}"
                )
        # the same inputs on every rank: an inconsistent declaration raises the same error everywhere
        self.specs = resolve_shards(WorldLayout.from_json(first[2]), [p for d in declared for p in d[3]])

    def hash(self) -> None:
        """Step 2: stage and hash this rank's chunks; rank 0 learns what every rank holds."""
        cs = self.cfg.chunk_size

        def local() -> tuple[bytes, list[int]]:
            assert self.pool is not None
            self.staged = _stage.stage_and_hash(self.entries, self.specs, cs, self.pool)
            for st in self.staged:
                for i, d in enumerate(st.digests):
                    self.held.setdefault(d, st.chunk(i, cs).nbytes)
            return _join(list(self.held)), list(self.held.values())

        gathered = self.c.gather("hashing chunks", self.c.attempt(local))
        if gathered is not None:
            self.holdings = [list(zip(_split(g[0]), g[1])) if g is not None else [] for g in gathered]

    def plan_writes(self) -> None:
        """Step 3: rank 0 claims existing chunks, picks writers and records pack keys."""
        c, cfg = self.c, self.cfg

        def local() -> list[Any]:
            assert self.holdings is not None and self.ckpt_id is not None
            catalog = self.store.catalog
            wanted = list(dict.fromkeys(d for items in self.holdings for d, _ in items))
            missing = catalog.claim_chunks(self.ckpt_id, self.owner, wanted)
            if self.writers == "all":
                plan = [[d for d, _ in items if d in missing] for items in self.holdings]
            else:
                copies: dict[bytes, list[int]] = {}
                for items in self.holdings:
                    for d, n in items:
                        if d in missing:
                            copies.setdefault(d, []).append(n)
                shared = sum(ns[0] for ns in copies.values() if len(ns) > 1)
                run_bytes = min(cfg.pack_size, max(cfg.chunk_size, shared // (4 * c.size)))
                plan = assign_writers(self.holdings, missing, run_bytes)
            sizes = {d: n for items in self.holdings for d, n in items}
            needed = [_packs_needed(sum(sizes[d] for d in p), len(p), cfg.pack_size) for p in plan]
            keys = [new_pack_key() for _ in range(sum(needed))]
            ids = iter(zip(keys, catalog.register_packs(self.ckpt_id, self.owner, keys)))
            return [(_join(p), [next(ids) for _ in range(n)]) for p, n in zip(plan, needed)]

        outcome = c.attempt(local) if c.rank == 0 else (None, None)
        digests, slots = c.scatter("assigning chunks to writers", outcome)
        self.mine = (_split(digests), slots)

    def write(self) -> None:
        """Step 4: write this rank's chunks into its packs; rank 0 gathers packs and manifests."""
        cfg = self.cfg
        store = self.store

        def local() -> tuple[list[tuple[int, int, list[PackedChunk]]], list[Any]]:
            assert self.pool is not None
            assigned = set(self.mine[0])
            slots = deque(self.mine[1])
            packs: list[tuple[int, int, list[PackedChunk]]] = []

            def on_open() -> tuple[str, Any]:
                if not slots:
                    raise CkstoreError(f"rank {self.c.rank} needs more packs than were recorded for it")
                return slots.popleft()

            def on_close(pack_id: Any, size: int, chunks: list[PackedChunk]) -> None:
                packs.append((pack_id, size, chunks))

            total = sum(self.held[d] for d in assigned)
            done = [0]

            def tick(n: int) -> None:
                done[0] += n
                if self.progress is not None:
                    self.progress(done[0], total)

            writer = PackWriter(store.blobs, cfg.pack_size, on_open, on_close)
            _stage.write_missing(
                self.staged, assigned, writer, self.pool, chunk_size=cfg.chunk_size,
                level=cfg.compression_level, window=2 * store.workers, progress=tick,
            )  # fmt: skip
            return packs, _stage.build_manifests(self.entries, self.staged, cfg.chunk_size)

        self.results = self.c.gather("writing chunks", self.c.attempt(local))

    def finish(self, tags: tuple[str, ...], replace: bool) -> Checkpoint:
        """Step 5: rank 0 records every pack's chunks and makes the checkpoint visible."""

        def local() -> Checkpoint:
            assert self.results is not None and self.ckpt_id is not None
            catalog = self.store.catalog
            packs = [
                (pack_id, size, [NewChunk(k.digest, k.offset, k.length, k.raw_size, k.codec) for k in chunks])
                for rank_packs, _ in self.results
                for pack_id, size, chunks in rank_packs
            ]
            added = catalog.add_packs(self.ckpt_id, self.owner, packs) if packs else 0
            manifests = [m for _, ms in self.results for m in ms]
            ckpt = catalog.finish_checkpoint(
                self.ckpt_id, self.owner, entries=manifests, metrics=self.metrics, tags=tags,
                logical_bytes=sum(m[3] for m in manifests), stored_bytes_added=added, replace=replace,
            )  # fmt: skip
            self.ckpt_id = None  # visible now: nothing to abort
            return ckpt

        outcome = self.c.attempt(local) if self.c.rank == 0 else (None, None)
        ckpt: Checkpoint = self.c.broadcast("making the checkpoint visible", outcome)
        return ckpt
