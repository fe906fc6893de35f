"""Copying checkpoints between stores (``ckstore copy``, ``Store.copy``): runs, metrics, tags,
kinds, layouts and lineage, with only the chunks the destination lacks sent.

Each checkpoint is committed into the destination through the commit protocol's entry point for
already-encoded frames (:func:`ckstore.commit.frames.commit_frames`, handed in by the store):
frames travel as stored, no re-encoding, each verified against its digest (decoded and hashed)
before it is written. A delta (codec 3) is the exception: its base may not be copied, so it is
sent as a whole chunk, encoded again from the bytes it decodes to, at the destination's
compression level. Checkpoints go oldest first, so a parent arrives before its children.

A copy killed part-way leaves the destination consistent: what finished is committed, the
checkpoint in flight is a pending one whose written packs are recorded. Copying again skips
the checkpoints already there (same run and step, same manifests) and the chunks already
stored; a step the destination holds with other content is an error, never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkout.bases import Bases
from ..errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    ChunkNotFoundError,
    IntegrityError,
    NotFoundError,
)
from ..format import codec, hashing
from ..format.manifest import Manifest
from ..records import Checkpoint
from .retention import policy_from_json

__all__ = ["CopyReport", "copy_checkpoints"]

#: ``progress(bytes_done, bytes_to_send, bytes_skipped)``, in the source's stored bytes (a delta
#: is sent as a larger whole chunk: it counts its stored length, so the figure ends at the total)
CopyProgress = Callable[[int, int, int], None]
_WINDOW = 64


@dataclass(frozen=True, slots=True)
class CopyReport:
    copied: tuple[str, ...]  # run@step committed into the destination
    present: tuple[str, ...]  # already there with the same content
    chunks_sent: int
    bytes_sent: int  # stored (compressed) bytes of the frames sent
    chunks_skipped: int  # chunks the destination already had
    bytes_skipped: int
    runs: tuple[str, ...]  # runs made in the destination
    lineage_lost: tuple[str, ...]  # runs whose fork parent is in neither store's copy


def copy_checkpoints(
    src: Any,
    dest: Any,
    ckpts: Sequence[Checkpoint],
    *,
    commit: Callable[..., Checkpoint],
    progress: CopyProgress | None = None,
) -> CopyReport:
    """Copy ``ckpts`` of store ``src`` into store ``dest`` (both :class:`ckstore.Store`);
    ``commit(**kw)`` is the destination's :func:`~ckstore.commit.frames.commit_frames`."""
    ordered = sorted(ckpts, key=lambda c: (c.created_at, c.id))
    plans = []
    for c in ordered:
        entries = [(r, k, m, Manifest.from_bytes(m, f"{c.ref}, rank {r}, {k}: ").logical_bytes) for r, k, m in src.catalog.entries(c.id)]
        digests = list(dict.fromkeys(d for _, _, m, _ in entries for t in Manifest.from_bytes(m).tensors for d in t.chunks))
        plans.append((c, entries, digests))
    every = list(dict.fromkeys(d for _, _, ds in plans for d in ds))
    where = src.catalog.chunk_locations(every)
    lacking = [d for d in every if d not in where]
    if lacking:
        raise CheckpointNotFoundError(
            f"the source store lacks {len(lacking)} chunks these checkpoints need (first {lacking[0].hex()}); "
            "run `ckstore fsck` on it"
        )
    have = set(dest.catalog.chunk_locations(every))
    to_send = sum(where[d].length for d in every if d not in have)
    skipped_bytes = sum(where[d].length for d in every if d in have)
    sent = [0, 0, 0]  # bytes sent, chunks sent, the source's stored bytes of those chunks
    if progress is not None:
        progress(0, to_send, skipped_bytes)

    bases = Bases(src.blobs, src.catalog.chunk_locations, where)

    def fetch(digests: Sequence[bytes]) -> Iterator[tuple[bytes, bytes, int, int]]:
        def one(d: bytes) -> tuple[bytes, bytes, int, int]:
            loc = where[d]
            frame = src.blobs.read(loc.pack_key, loc.offset, loc.offset + loc.length)
            out = np.empty(loc.raw_size, dtype=np.uint8)
            try:
                bases.decode(frame, loc, out.data)
            except (IntegrityError, ChunkNotFoundError) as e:
                raise IntegrityError(f"chunk {d.hex()} in {loc.pack_key} of the source is corrupt: {e}") from e
            if hashing.digest(out.data) != d:
                raise IntegrityError(
                    f"chunk {d.hex()} in {loc.pack_key} of the source does not match its digest; nothing of it "
                    "was copied (run `ckstore fsck --deep` on the source)"
                )
            if loc.base is not None:  # a whole chunk: the destination may not have the base
                full = codec.encode(out.data, codec.delta_itemsize(frame), dest.config.compression_level)
                return d, b"".join(full.parts), loc.raw_size, full.codec
            return d, frame, loc.raw_size, loc.codec

        with ThreadPoolExecutor(src.workers) as pool:
            for i in range(0, len(digests), _WINDOW):
                for item in pool.map(one, digests[i : i + _WINDOW]):
                    sent[0] += len(item[1])
                    sent[1] += 1
                    sent[2] += where[item[0]].length
                    if progress is not None:
                        progress(sent[2], to_send, skipped_bytes)
                    yield item

    copied, present, made, lost = [], [], [], []
    for c, entries, digests in plans:
        existing = _existing(dest, c)
        if existing is not None:
            theirs = sorted(dest.catalog.entries(existing.id))
            if theirs != sorted((r, k, m) for r, k, m, _ in entries):
                raise AlreadyExistsError(
                    f"the destination already has {c.ref} with other content; copy into another run or "
                    f"delete it there first (ckstore rm {c.ref})"
                )
            present.append(c.ref)
            continue
        if dest.catalog.run_origin(c.run) is None:
            made.append(c.run)
            if not _bring_lineage(src, dest, c.run):
                lost.append(c.run)
        parent_id = None
        if c.parent:
            try:
                parent_id = dest.resolve(c.parent).id
            except NotFoundError:
                parent_id = None
        commit(
            run=c.run, step=c.step, kind=c.kind, metrics=c.metrics, tags=c.tags, world_layout=c.world_layout,
            parent_checkpoint_id=parent_id, entries=entries, digests=digests, fetch=fetch,
        )  # fmt: skip
        copied.append(c.ref)
    return CopyReport(
        tuple(copied), tuple(present), sent[1], sent[0], sum(1 for d in every if d in have),
        skipped_bytes, tuple(made), tuple(lost),
    )  # fmt: skip


def _existing(dest: Any, c: Checkpoint) -> Checkpoint | None:
    try:
        return dest.resolve(c.step, run=c.run)  # type: ignore[no-any-return]
    except NotFoundError:
        return None


def _bring_lineage(src: Any, dest: Any, run: str) -> bool:
    """Give a run new to the destination its origin and policy; False when its fork parent is
    not in the destination (the run is copied without lineage)."""
    origin = src.catalog.run_origin(run)
    ok = True
    if origin is not None and origin[1]:
        try:
            dest.fork(origin[1], run)
        except NotFoundError:
            ok = False
    policy = src.catalog.run_policy(run)
    if policy:
        dest.set_policy(run, policy_from_json(policy))
    return ok
