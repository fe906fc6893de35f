"""The data path of a commit: flatten → stage tensor bytes → hash chunks → encode and write
packs → manifests. No catalog access: the protocol around it (begin, claim, record, finish) is
:mod:`ckstore.commit.protocol`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any

from .._collector import collector_paused
from .._threads import TaskGroup, usable_cores
from ..checkout.reshard import PieceInfo, resolve_shards
from ..errors import CkstoreError, UnsupportedValueError
from ..format import codec, hashing
from ..format.manifest import ShardSpec, manifest_bytes, tensor_json
from ..format.pack import PackWriter
from ..format.tensorio import (
    Leaf,
    StagingBuffer,
    dtype_name,
    flatten,
    format_path,
    itemsize,
    raw_bytes,
    stage_tensors,
)
from ..layout import WorldLayout
from ..refs import MAX_NAME, check_label
from . import _delta
from ._delta import DeltaPlan

__all__ = [
    "PreparedEntry",
    "StagedTensor",
    "prepare_entries",
    "piece_infos",
    "stage",
    "hash_staged",
    "stage_and_hash",
    "write_missing",
    "AheadHint",
    "PlaneHints",
    "PlaneTries",
    "encode_ahead",
    "written_places",
    "build_manifests",
    "MAX_RANK",
]

#: Ranks are stored as signed 32-bit integers.
MAX_RANK = 2**31 - 1




@dataclass(slots=True)
class PreparedEntry:
    rank: int
    sub_key: str
    tree: Any
    leaves: list[Leaf]


@dataclass(slots=True)
class StagedTensor:
    entry: int
    index: int
    path: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    tensor: Any  # the contiguous CPU tensor whose bytes ``data`` views
    data: memoryview
    shard: ShardSpec | None = None
    digests: list[bytes] = field(default_factory=list)
    hashed: bool = False  # digests computed while staging (of the same bytes)

    def chunk(self, i: int, chunk_size: int) -> memoryview:
        return self.data[i * chunk_size : (i + 1) * chunk_size]


@collector_paused()
def prepare_entries(
    rank_states: Mapping[int, Mapping[str, Any]],
    *,
    allow_pickle: bool,
    tensor_hook: Callable[[Any], Leaf | None] | None = None,
) -> list[PreparedEntry]:
    if not isinstance(rank_states, Mapping) or not rank_states:
        raise UnsupportedValueError(
            "rank_states must be a non-empty dict {rank: {sub_key: state_dict}}, e.g. "
            "{0: {'model_states': model.state_dict()}}"
        )
    out = []
    for rank, states in rank_states.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= MAX_RANK:
            shown = f"an int of {rank.bit_length()} bits" if isinstance(rank, int) and rank.bit_length() > 64 else repr(rank)
            raise UnsupportedValueError(f"rank_states keys must be non-negative int ranks below 2**31, got {shown}")
        if not isinstance(states, Mapping) or not states:
            raise UnsupportedValueError(
                f"rank {rank}: expected a non-empty dict {{sub_key: state_dict}}, got {type(states).__name__}"
            )
        for sub_key, state in states.items():
            try:
                check_label("sub-checkpoint key", sub_key, MAX_NAME)
            except CkstoreError as e:
                raise UnsupportedValueError(f"rank {rank}: {e}") from None
            tree, leaves = flatten(
                state, allow_pickle=allow_pickle, tensor_hook=tensor_hook, where=f"rank {rank}, {sub_key}, "
            )
            out.append(PreparedEntry(rank, sub_key, tree, leaves))
    out.sort(key=lambda e: e.rank)
    return out


def piece_infos(entries: Sequence[PreparedEntry]) -> list[PieceInfo]:
    out = []
    for e in entries:
        for leaf in e.leaves:
            s = leaf.shard
            if s is None:
                continue
            out.append(
                PieceInfo(
                    e.rank,
                    e.sub_key,
                    format_path(leaf.keys),
                    tuple(int(x) for x in leaf.tensor.shape),
                    s.splits,
                    s.offsets,
                    s.global_shape,
                    dtype_name(leaf.tensor.dtype),
                )
            )
    return out


def resolve_entry_shards(entries: Sequence[PreparedEntry], layout: WorldLayout) -> dict[tuple[int, str, str], ShardSpec]:
    """Every shard's placement in ``layout`` (entries of one process holding every rank)."""
    return resolve_shards(layout, piece_infos(entries))


@collector_paused()
def stage(
    entries: Sequence[PreparedEntry],
    staging: StagingBuffer | None = None,
    *,
    changed_only: bool = False,
    chunk_size: int = 0,
    workers: int = 1,
) -> list[StagedTensor]:
    """Every tensor's bytes: zero-copy views of CPU tensors (tiny ones' bytes copied, accelerator
    tensors copied to the host), or, with ``staging``, copies in its reusable buffer that outlive
    later changes to the tensors. Shard placements are filled in by :func:`hash_staged`.

    ``changed_only`` (with ``staging``): hash each CPU tensor's chunks here, in parallel, and copy
    only the tensors whose digests differ from those of the bytes the buffer already holds in
    their place (from the previous commit through it); the digests are kept, not computed again.
    """
    order = [(ei, li, leaf) for ei, e in enumerate(entries) for li, leaf in enumerate(e.leaves)]
    tensors = [leaf.tensor for _, _, leaf in order]
    digests: list[Any] | None = None
    if staging is not None and changed_only:
        with TaskGroup("stage", workers) as pool:
            digests = list(pool.map(lambda t: _live_digests(t, chunk_size), tensors))
    host = staging.stage(tensors, digests) if staging is not None else stage_tensors(tensors)
    kinds: dict[Any, tuple[str, int]] = {}  # name and element size of each dtype, looked up once
    staged = []
    for (ei, li, leaf), (t, data) in zip(order, host):
        dt = t.dtype
        kind = kinds.get(dt)
        if kind is None:
            kind = kinds[dt] = (dtype_name(dt), itemsize(dt))
        staged.append(StagedTensor(ei, li, format_path(leaf.keys), kind[0], tuple(t.shape), kind[1], t, data))
    if digests is not None:
        for st, d in zip(staged, digests):
            if d is not None:
                st.digests, st.hashed = d, True
    return staged


def _live_digests(t: Any, chunk_size: int) -> list[bytes] | None:
    """The chunk digests of a contiguous CPU tensor as it is now (None for any other tensor)."""
    if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    _, data = raw_bytes(t)
    return _digests(data, chunk_size)


def _digests(data: memoryview, chunk_size: int) -> list[bytes]:
    """The digests of the chunks of ``data`` (none for no bytes)."""
    n = data.nbytes
    if n <= chunk_size:  # one chunk (most tensors): the bytes as they are
        return [hashing.digest(data)] if n else []
    return [hashing.digest(data[i * chunk_size : (i + 1) * chunk_size]) for i in range(-(-n // chunk_size))]


#: Chunks below this size go into packs of their own, ahead of the large ones. Small tensors
#: (RNG states, step counters, norms) often outlive the checkpoint that first stored them; kept
#: apart, such a chunk pins a small pack rather than a pack full of large, short-lived chunks.
SMALL_CHUNK = 256 * 1024
#: Small tensors are hashed in batches of about this many bytes, or this many tensors, a pool task each.
SMALL_BATCH = 1 << 20
SMALL_BATCH_CHUNKS = 1024
#: States up to this size are hashed in the calling thread (xxh3 runs at ~10 GB/s: a few ms)
INLINE_HASH = 16 << 20
#: Chunks encoded in the calling thread go to the codec in batches of about this many bytes, or
#: this many chunks (the batch's planes are copied once: a bounded copy, not the checkpoint's)
BATCH_BYTES = 4 << 20
BATCH_CHUNKS = 2048
_CPUS = usable_cores()

def hash_staged(
    entries: Sequence[PreparedEntry],
    staged: Sequence[StagedTensor],
    specs: Mapping[tuple[int, str, str], ShardSpec],
    chunk_size: int,
    pool: Executor,
) -> None:
    """Record each staged tensor's shard placement and hash its chunks, in parallel."""
    if specs:  # else no tensor is a shard
        for st in staged:
            e = entries[st.entry]
            st.shard = specs.get((e.rank, e.sub_key, st.path))

    def hash_all(group: list[StagedTensor]) -> None:
        for st in group:
            st.digests = _digests(st.data, chunk_size)

    todo = [st for st in staged if not st.hashed]
    if sum(st.data.nbytes for st in todo) <= INLINE_HASH:  # faster than handing it to threads
        hash_all(todo)
        return
    # xxh3 releases the GIL, so tensors hash in parallel: a task per large tensor, one per batch
    # of small ones
    groups: list[list[StagedTensor]] = []
    small: list[StagedTensor] = []
    small_bytes = 0
    for st in todo:
        if st.data.nbytes >= SMALL_CHUNK:
            groups.append([st])
            continue
        small.append(st)
        small_bytes += st.data.nbytes
        if small_bytes >= SMALL_BATCH or len(small) >= SMALL_BATCH_CHUNKS:
            groups.append(small)
            small, small_bytes = [], 0
    if small:
        groups.append(small)
    for fut in [pool.submit(hash_all, group) for group in groups]:
        fut.result()


def stage_and_hash(
    entries: Sequence[PreparedEntry],
    specs: Mapping[tuple[int, str, str], ShardSpec],
    chunk_size: int,
    pool: Executor,
) -> list[StagedTensor]:
    """:func:`stage` (zero-copy) then :func:`hash_staged`: the data path of a blocking commit."""
    staged = stage(entries)
    hash_staged(entries, staged, specs, chunk_size, pool)
    return staged


def _unique_missing(
    staged: Sequence[StagedTensor], missing: set[bytes], chunk_size: int
) -> tuple[list[tuple[int, int]], int]:
    """The missing chunks, each once, as ``(tensor, chunk)`` indexes into ``staged``: every small
    chunk first, then the large ones in order; and how many are large. (Indexes, not views: a
    commit of 100,000 tensors then holds no object per chunk for the garbage collector to scan.)"""
    seen: set[bytes] = set()
    small: list[tuple[int, int]] = []
    large: list[tuple[int, int]] = []
    for si, st in enumerate(staged):
        n = st.data.nbytes
        for ci, d in enumerate(st.digests):
            if d in missing and d not in seen:
                seen.add(d)
                (small if min(chunk_size, n - ci * chunk_size) < SMALL_CHUNK else large).append((si, ci))
    return small + large, len(large)


class AheadHint:
    """Which large chunks a store object's next commit encodes ahead (:func:`encode_ahead`):
    the places (rank, sub-checkpoint, path, chunk index) of the first large chunks its last
    commit wrote, in order. Training changes the same tensors from one commit to the next, and
    a frozen embedding that leads the state is stored already: guessing from the last commit
    spends no encode on it. Before a first commit, the first large chunks are taken."""

    def __init__(self) -> None:
        self.places: list[tuple[int, str, str, int]] | None = None  # None: no commit yet

    def remember(self, places: list[tuple[int, str, str, int]]) -> None:
        self.places = places[:AHEAD]


#: the most large chunks a commit encodes ahead of its claim (two cores' worth)
AHEAD = 2


class PlaneHints:
    """Which byte planes shrank when a store object last encoded each chunk place (a tensor's
    path, its chunk index and element size), so that its next commit compresses just those:
    a float tensor's sign/exponent plane shrinks from one training step to the next and its
    mantissa planes do not, so sampling every plane again, and compressing the small chunks'
    planes that then prove incompressible, is work thrown away (the demo's state: ~1 ms of a
    commit's CPU; an Adam state of 1,200 chunks of 16 KiB: 43% of its compression time).

    Hints only steer work: a frame says which of its planes are compressed, so a stale hint
    costs bytes or time, never correctness. A plane tried that no longer shrinks is stored raw
    and dropped from the hint; one that starts to shrink (a tensor zeroed, say) is noticed when
    its chunk is sampled again: each commit samples one chunk in :data:`RESAMPLE` in turn, so
    every place is sampled at least every :data:`RESAMPLE` commits that encode it. Only the last
    commit's places are kept (at most :data:`MAX_PLACES`).

    A commit takes one :class:`PlaneTries` (:meth:`begin`) for every chunk it encodes, ahead of
    its claim or not, and hands it back (:meth:`end`) once its chunks are written."""

    RESAMPLE = 8
    MAX_PLACES = 1 << 16

    def __init__(self) -> None:
        self.last: dict[tuple[str, int, int], int] = {}
        self._turn = 0

    def begin(self) -> PlaneTries:
        self._turn += 1
        return PlaneTries(self.last, self._turn)

    def end(self, tries: PlaneTries) -> None:
        if tries.learned:
            self.last = tries.learned


class PlaneTries:
    """One commit's use of :class:`PlaneHints`: the planes to try for each chunk it encodes,
    and what its frames showed."""

    __slots__ = ("last", "learned", "_n")

    def __init__(self, last: dict[tuple[str, int, int], int], turn: int) -> None:
        self.last = last
        self.learned: dict[tuple[str, int, int], int] = {}
        self._n = turn % PlaneHints.RESAMPLE  # which chunks this commit samples again

    def tries(self, key: tuple[str, int, int]) -> int | None:
        """The planes to compress for the chunk at ``key``; None: sample each (no hint, or
        this chunk's turn to be sampled again)."""
        self._n += 1
        if self._n % PlaneHints.RESAMPLE == 0:
            return None
        return self.last.get(key)

    def learn(self, key: tuple[str, int, int], frame: codec.Frame) -> None:
        if key[2] > 1 and len(self.learned) < PlaneHints.MAX_PLACES:
            mask = codec.plane_mask(frame)
            if mask is not None:
                self.learned[key] = mask


def encode_ahead(
    entries: Sequence[PreparedEntry],
    staged: Sequence[StagedTensor],
    chunk_size: int,
    level: int,
    pool: Executor,
    threads: int,
    hint: AheadHint,
    planes: PlaneTries | None = None,
) -> dict[bytes, Future[tuple[codec.Frame, int | None]]]:
    """Start encoding, on the pool, the large chunks this commit will most likely write
    (``hint``: the places the last commit wrote first), before the claim has said which chunks
    are missing: a small commit's first frames are then ready, and their writeback started,
    about when its claim's transaction ends instead of an encode later. At most :data:`AHEAD`
    (and ``threads``, and the CPUs); none on one core. A guess the claim finds stored already
    was encoded for nothing: that many chunks' work at most. Pass the result to
    :func:`write_missing` as ``ahead``."""
    if min(threads, _CPUS) < 2:
        return {}
    wanted = None if hint.places is None else set(hint.places)
    picked: dict[bytes, tuple[memoryview, int, tuple[str, int, int]]] = {}
    for place, d, st, ci in _large_places(entries, staged, chunk_size):
        if d not in picked and (wanted is None or place in wanted):
            raw = st.data if st.data.nbytes <= chunk_size else st.chunk(ci, chunk_size)
            picked[d] = (raw, st.itemsize, (st.path, ci, st.itemsize))
            if len(picked) == min(threads, AHEAD):
                tries = {d: None if planes is None else planes.tries(key) for d, (_, _, key) in picked.items()}
                return {d: pool.submit(_whole, raw, k, level, tries[d]) for d, (raw, k, _) in picked.items()}
    # fewer: write_missing may well encode them in its own thread (a lone large chunk)
    return {}


def written_places(
    entries: Sequence[PreparedEntry], staged: Sequence[StagedTensor], written: set[bytes], chunk_size: int
) -> list[tuple[int, str, str, int]]:
    """The places of the first :data:`AHEAD` large chunks in ``written``, in order (for
    :meth:`AheadHint.remember`)."""
    out: list[tuple[int, str, str, int]] = []
    for place, d, _, _ in _large_places(entries, staged, chunk_size):
        if d in written:
            out.append(place)
            if len(out) == AHEAD:
                break
    return out


def _large_places(
    entries: Sequence[PreparedEntry], staged: Sequence[StagedTensor], chunk_size: int
) -> Iterator[tuple[tuple[int, str, str, int], bytes, StagedTensor, int]]:
    """Every large chunk (at least :data:`SMALL_CHUNK`) in order: its place (rank,
    sub-checkpoint, path, chunk index), digest, staged tensor and index."""
    for st in staged:
        n = st.data.nbytes
        if n < SMALL_CHUNK:  # (an optimizer state's thousands of small tensors: one test each)
            continue
        e = entries[st.entry]
        for ci, d in enumerate(st.digests):
            if min(chunk_size, n - ci * chunk_size) >= SMALL_CHUNK:
                yield (e.rank, e.sub_key, st.path, ci), d, st, ci


def write_missing(
    staged: Sequence[StagedTensor],
    missing: set[bytes],
    writer: PackWriter,
    pool: Executor,
    *,
    chunk_size: int,
    level: int,
    window: int,
    progress: Callable[[int], None] | None = None,
    threads: int = 1,
    delta: DeltaPlan | None = None,
    ahead: Mapping[bytes, Future[tuple[codec.Frame, int | None]]] | None = None,
    planes: PlaneTries | None = None,
) -> Callable[[], None]:
    """Encode the chunks in ``missing`` on the pool, in order, and append them to packs; returns
    once the last pack is finished, with the function that waits until every pack is durable
    (:meth:`~ckstore.format.pack.PackWriter.close_later`; the writer is aborted on a failure
    before that).

    With ``delta``, a chunk with a usable base is encoded as a delta when that is smaller
    (:func:`ckstore.commit._delta.encode`), one chunk at a time.

    Small chunks (under :data:`SMALL_CHUNK`) are encoded in the calling thread: encoding a chunk
    takes and releases the GIL a dozen times, and for small chunks threads contending for it cost
    more than they share (an Adam state of 7,200 tensors of 16 KiB: 0.76 s on the pool, 0.66 s
    inline). They are encoded a batch at a time (:data:`BATCH_BYTES`, :data:`BATCH_CHUNKS`),
    their byte planes compressed together on up to ``threads`` of zstd's threads
    (:func:`ckstore.format.codec.encode_many`). Large chunks are encoded on the pool, a window of
    them in flight, even in a small commit (four fp32 chunks of 1 MiB: 6.2 ms one after another,
    3.3 ms on two threads; the commit 1.8 ms faster); a lone large chunk, or any on a single
    core, is encoded in the calling thread, which has nothing else to do meanwhile.

    ``ahead``: encodes :func:`encode_ahead` started; the chunks among them that are missing take
    their frames from there, the others are dropped once they end.

    ``planes``: the commit's :class:`PlaneTries`, which planes to compress in each chunk, and
    where what its frames show is kept (chunks encoded as deltas go without)."""
    inflight: deque[tuple[bytes, memoryview, Future[tuple[codec.Frame, int | None]]]] = deque()
    early = dict(ahead or {})
    chunks, large = _unique_missing(staged, missing, chunk_size)
    threads = min(threads, _CPUS)
    inline = large < 2 or threads < 2
    # small chunks to encode in this thread, in order: digest, bytes, element size, place
    batch: list[tuple[bytes, memoryview, int, tuple[str, int, int]]] = []
    batch_bytes = 0
    places: dict[bytes, tuple[str, int, int]] = {}  # of the large chunks in flight, to learn from

    def add(
        d: bytes, frame: codec.Frame, chain: int | None = None, *, raw: memoryview, place: tuple[str, int, int] | None = None
    ) -> None:
        writer.add(d, frame, raw.nbytes, chain)
        if planes is not None and place is not None and chain is None:
            planes.learn(place, frame)
        if progress is not None:
            progress(raw.nbytes)

    def encode_batch() -> None:
        nonlocal batch, batch_bytes
        todo, batch, batch_bytes = batch, [], 0
        frames: list[Any] = [None] * len(todo)
        by_item: dict[int, list[int]] = {}
        for i, (_, _, item, _) in enumerate(todo):
            by_item.setdefault(item, []).append(i)
        for item, at in by_item.items():
            tries = None if planes is None else [planes.tries(todo[i][3]) for i in at]
            for i, frame in zip(at, codec.encode_many([todo[i][1] for i in at], item, level, threads, tries)):
                frames[i] = frame
        for (d, raw, _, place), frame in zip(todo, frames):
            add(d, frame, raw=raw, place=place)

    def pop_inflight() -> None:
        d0, raw0, fut = inflight.popleft()
        add(d0, *fut.result(), raw=raw0, place=places.pop(d0, None))

    try:
        small = True
        for si, ci in chunks:
            st = staged[si]
            d, raw = st.digests[ci], st.data if st.data.nbytes <= chunk_size else st.chunk(ci, chunk_size)
            if small and raw.nbytes >= SMALL_CHUNK:
                encode_batch()
                small = False
                writer.seal()  # the pack of small chunks: written while the large ones are encoded
            base = delta.bases.get(d) if delta is not None else None
            place = (st.path, ci, st.itemsize)
            if d in early:  # encoding since before the claim
                inflight.append((d, raw, early.pop(d)))
                places[d] = place
            elif base is not None and delta is not None and base in delta.usable:
                if small or inline:
                    frame, chain = _delta.encode(raw, st.itemsize, level, d, base, delta)
                    add(d, frame, chain, raw=raw)
                    continue
                inflight.append((d, raw, pool.submit(_delta.encode, raw, st.itemsize, level, d, base, delta)))
            elif small:
                batch.append((d, raw, st.itemsize, place))
                batch_bytes += raw.nbytes
                if batch_bytes >= BATCH_BYTES or len(batch) >= BATCH_CHUNKS:
                    encode_batch()
                continue
            elif inline:  # encoded and written at once, one frame held
                tries = None if planes is None else planes.tries(place)
                add(d, codec.encode(raw, st.itemsize, level, tries), raw=raw, place=place)
                continue
            else:
                tries = None if planes is None else planes.tries(place)
                inflight.append((d, raw, pool.submit(_whole, raw, st.itemsize, level, tries)))
                places[d] = place
            if len(inflight) >= window:
                pop_inflight()
        encode_batch()
        while inflight:
            pop_inflight()
        return writer.close_later()
    except BaseException:
        for _, _, fut in inflight:
            fut.cancel()
        writer.abort()
        raise
    finally:  # the chunks encoded ahead that were stored already: dropped once they end
        for fut in early.values():
            fut.cancel()
        wait(early.values())


def _whole(raw: memoryview, itemsize: int, level: int, tries: int | None = None) -> tuple[codec.Frame, None]:
    return codec.encode(raw, itemsize, level, tries), None


@collector_paused()
def build_manifests(
    entries: Sequence[PreparedEntry], staged: Sequence[StagedTensor], chunk_size: int
) -> list[tuple[int, str, bytes, int]]:
    # the records' JSON straight from the staged tensors (no record object per tensor: 7,200
    # tensors' records cost 18 ms as objects, 5 ms as dicts), a batch of dicts at a time
    # (manifest_bytes); Manifest.to_bytes writes the same
    by_entry: list[list[StagedTensor]] = [[] for _ in entries]
    for st in staged:
        by_entry[st.entry].append(st)

    def records(group: list[StagedTensor]) -> Iterator[dict[str, Any]]:
        for st in group:
            yield tensor_json(st.path, st.dtype, st.shape, st.data.nbytes, chunk_size, st.digests, st.shard)

    return [
        (e.rank, e.sub_key, manifest_bytes(e.tree, records(group)), sum(st.data.nbytes for st in group))
        for e, group in zip(entries, by_entry)
    ]
