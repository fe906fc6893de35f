"""The commit pipeline: flatten → stage tensor bytes → hash chunks → claim → write packs →
manifests. The catalog protocol around it lives in :mod:`ckstore.store` (one process) and
:mod:`ckstore.commit.collective` (a collective commit)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..catalog import Catalog, Owner
from ..checkout.reshard import PieceInfo, resolve_shards
from ..errors import CommitAbandonedError, UnsupportedValueError
from ..format import codec, hashing
from ..format.manifest import Manifest, ShardSpec, TensorRecord
from ..format.pack import PackedChunk, PackWriter
from ..format.tensorio import Leaf, dtype_name, flatten, format_path, itemsize, stage_tensors
from ..layout import WorldLayout

__all__ = [
    "PreparedEntry",
    "StagedTensor",
    "prepare_entries",
    "piece_infos",
    "stage_and_hash",
    "write_missing",
    "build_manifests",
    "Heartbeat",
]


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

    def chunk(self, i: int, chunk_size: int) -> memoryview:
        return self.data[i * chunk_size : (i + 1) * chunk_size]


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
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise UnsupportedValueError(f"rank_states keys must be non-negative int ranks, got {rank!r}")
        if not isinstance(states, Mapping) or not states:
            raise UnsupportedValueError(
                f"rank {rank}: expected a non-empty dict {{sub_key: state_dict}}, got {type(states).__name__}"
            )
        for sub_key, state in states.items():
            if not isinstance(sub_key, str) or not sub_key or len(sub_key) > 255:
                raise UnsupportedValueError(f"rank {rank}: sub-checkpoint keys must be non-empty strings, got {sub_key!r}")
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
                )
            )
    return out


def resolve_entry_shards(entries: Sequence[PreparedEntry], layout: WorldLayout) -> dict[tuple[int, str, str], ShardSpec]:
    return resolve_shards(layout, piece_infos(entries))


def stage_and_hash(
    entries: Sequence[PreparedEntry],
    specs: Mapping[tuple[int, str, str], ShardSpec],
    chunk_size: int,
    pool: ThreadPoolExecutor,
) -> list[StagedTensor]:
    """Stage every tensor's bytes (zero-copy where possible) and hash its chunks in parallel."""
    staged: list[StagedTensor] = []
    order = [(ei, li) for ei, e in enumerate(entries) for li in range(len(e.leaves))]
    host = stage_tensors([entries[ei].leaves[li].tensor for ei, li in order])
    for (ei, li), (t, data) in zip(order, host):
        e = entries[ei]
        path = format_path(e.leaves[li].keys)
        spec = specs.get((e.rank, e.sub_key, path))
        shape = tuple(int(x) for x in t.shape)
        staged.append(StagedTensor(ei, li, path, dtype_name(t.dtype), shape, itemsize(t.dtype), t, data, spec))

    def hash_all(st: StagedTensor) -> list[bytes]:
        n = st.data.nbytes
        return [hashing.digest(st.chunk(i, chunk_size)) for i in range(-(-n // chunk_size))]

    # one task per tensor: xxh3 releases the GIL, so tensors hash in parallel
    futures: list[tuple[StagedTensor, Future[list[bytes]]]] = [(st, pool.submit(hash_all, st)) for st in staged]
    for st, fut in futures:
        st.digests = fut.result()
    return staged


#: Chunks below this size go into packs of their own, ahead of the large ones. Small tensors
#: (RNG states, step counters, norms) often outlive the checkpoint that first stored them; kept
#: apart, such a chunk pins a small pack rather than a pack full of large, short-lived chunks.
SMALL_CHUNK = 256 * 1024


def _unique_missing(
    staged: Sequence[StagedTensor], missing: set[bytes], chunk_size: int
) -> Iterator[tuple[bytes, memoryview, int]]:
    """The missing chunks, each once: every small chunk first, then the large ones in order."""
    seen: set[bytes] = set()
    large: list[tuple[bytes, memoryview, int]] = []
    for st in staged:
        for i, d in enumerate(st.digests):
            if d in missing and d not in seen:
                seen.add(d)
                raw = st.chunk(i, chunk_size)
                if raw.nbytes < SMALL_CHUNK:
                    yield d, raw, st.itemsize
                else:
                    large.append((d, raw, st.itemsize))
    yield from large


def write_missing(
    staged: Sequence[StagedTensor],
    missing: set[bytes],
    writer: PackWriter,
    pool: ThreadPoolExecutor,
    *,
    chunk_size: int,
    level: int,
    window: int,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Encode the chunks in ``missing`` on the pool, in order, and append them to packs."""
    inflight: deque[tuple[bytes, memoryview, Future[codec.Frame]]] = deque()

    def drain_one() -> None:
        d, raw, fut = inflight.popleft()
        writer.add(d, fut.result(), raw.nbytes)
        if progress is not None:
            progress(raw.nbytes)

    try:
        small = True
        for d, raw, item in _unique_missing(staged, missing, chunk_size):
            if small and raw.nbytes >= SMALL_CHUNK:  # close the pack of small chunks
                small = False
                while inflight:
                    drain_one()
                writer.close()
            inflight.append((d, raw, pool.submit(codec.encode, raw, item, level)))
            if len(inflight) >= window:
                drain_one()
        while inflight:
            drain_one()
        writer.close()
    except BaseException:
        for _, _, fut in inflight:
            fut.cancel()
        writer.abort()
        raise


def build_manifests(
    entries: Sequence[PreparedEntry], staged: Sequence[StagedTensor], chunk_size: int
) -> list[tuple[int, str, bytes, int]]:
    records: dict[int, list[TensorRecord]] = {i: [] for i in range(len(entries))}
    for st in staged:
        records[st.entry].append(
            TensorRecord(st.path, st.dtype, st.shape, st.data.nbytes, chunk_size, tuple(st.digests), st.shard)
        )
    out = []
    for i, e in enumerate(entries):
        man = Manifest(e.tree, tuple(records[i]))
        out.append((e.rank, e.sub_key, man.to_bytes(), man.logical_bytes))
    return out


def catalog_pack_callbacks(
    catalog: Catalog, ckpt_id: int, owner: Owner, added: list[int]
) -> tuple[Callable[[], tuple[str, Any]], Callable[[Any, int, list[PackedChunk]], None]]:
    """PackWriter callbacks that record each pack in the catalog before and after writing it."""
    from ..catalog import NewChunk
    from ..format.pack import new_pack_key

    def on_open() -> tuple[str, Any]:
        key = new_pack_key()
        return key, catalog.register_pack(ckpt_id, owner, key)

    def on_close(pack_id: Any, size: int, chunks: list[PackedChunk]) -> None:
        added.append(
            catalog.add_chunks(
                ckpt_id,
                owner,
                pack_id,
                size,
                [NewChunk(c.digest, c.offset, c.length, c.raw_size, c.codec) for c in chunks],
            )
        )

    return on_open, on_close


class Heartbeat:
    """Refreshes a pending checkpoint's lease from a background thread."""

    def __init__(self, catalog: Catalog, ckpt_id: int, owner: Owner, interval: float) -> None:
        self.catalog, self.ckpt_id, self.owner, self.interval = catalog, ckpt_id, owner, interval
        self.lost = False
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckstore-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def check(self) -> None:
        """Raise :class:`CommitAbandonedError` once the pending checkpoint's claim is lost."""
        if self.lost:
            raise CommitAbandonedError(
                "this commit's claim was taken over while it was in flight (garbage collection or "
                "another commit judged it abandoned); nothing of it became visible. Commit again; "
                "if it happens again, raise gc's --grace or the store's lease"
            )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.catalog.heartbeat(self.ckpt_id, self.owner):
                    self.lost = True
                    return
            except Exception as e:  # noqa: BLE001 - reported when the commit finishes
                self.error = e


def all_digests(staged: Iterable[StagedTensor]) -> list[bytes]:
    return list(dict.fromkeys(d for st in staged for d in st.digests))
