"""The commit protocol for chunks that are already encoded: a checkpoint copied from another
store (``ckstore copy``) arrives as manifests plus stored frames, written as they are.

The catalog steps are the protocol's own (:mod:`ckstore.commit.protocol`, call order in
:mod:`ckstore.catalog`): ``begin_checkpoint`` → ``claim_chunks`` (chunks the store already has are
referenced, not sent) → per pack ``register_pack`` → write → ``add_chunks`` → the checkpoint's
record → ``finish_checkpoint``, under the same heartbeat. A copy killed part-way leaves a pending
checkpoint whose packs are recorded as they were written; the next copy of the step takes the
dead claim over and finds those chunks already stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from ..catalog import Owner
from ..format.codec import Frame
from ..format.pack import PackWriter, new_pack_key
from ..format.recordio import write_checkpoint_record
from ..layout import WorldLayout
from ..records import Checkpoint
from ._arguments import check_arguments
from .protocol import CommitContext, Heartbeat

__all__ = ["commit_frames"]

#: ``fetch(digests)`` yields ``(digest, frame bytes, raw size, codec)`` for each digest asked for,
#: each frame already verified against its digest
FetchFrames = Callable[[Sequence[bytes]], Iterable[tuple[bytes, bytes, int, int]]]


def commit_frames(
    ctx: CommitContext,
    *,
    run: str,
    step: int,
    kind: str,
    metrics: Mapping[str, float],
    tags: Sequence[str],
    world_layout: WorldLayout,
    parent_checkpoint_id: int | None,
    entries: Sequence[tuple[int, str, bytes, int]],
    digests: Sequence[bytes],
    fetch: FetchFrames,
    on_claimed: Callable[[set[bytes]], None] | None = None,
) -> Checkpoint:
    """Commit checkpoint ``step`` of ``run`` from manifests ``entries`` (``(rank, sub_key,
    manifest bytes, logical bytes)``) whose chunks are ``digests``; only the chunks this store
    lacks are fetched (``on_claimed(missing)`` hears which, before any is)."""
    # a checkpoint committed before empty kinds were refused copies as the default kind
    args = check_arguments(run, step, dict(metrics), list(tags), kind or "checkpoint")
    cfg, catalog, owner = ctx.config, ctx.catalog, Owner.me()
    ckpt_id = catalog.begin_checkpoint(
        args.run, args.step, kind=args.kind, replace=False, owner=owner, world_layout=world_layout,
        lease_seconds=cfg.lease_seconds, parent_checkpoint_id=parent_checkpoint_id,
    )  # fmt: skip
    try:
        with Heartbeat(catalog, ckpt_id, owner, cfg.lease_seconds / 4) as beat:
            missing = catalog.claim_chunks(ckpt_id, owner, digests)
            if on_claimed is not None:
                on_claimed(missing)
            added: list[int] = []

            def on_open() -> tuple[str, int]:
                key = new_pack_key()
                return key, catalog.register_pack(ckpt_id, owner, key)

            def on_close(pack_id: int, size: int, chunks: list) -> None:  # type: ignore[type-arg]
                added.append(catalog.add_chunks(ckpt_id, owner, pack_id, size, chunks))

            writer = PackWriter(ctx.blobs, cfg.pack_size, on_open, on_close)
            try:
                for digest, frame, raw_size, codec in fetch([d for d in dict.fromkeys(digests) if d in missing]):
                    beat.check()
                    writer.add(digest, Frame(codec, (frame,), len(frame)), raw_size)
                writer.close()
            except BaseException:
                writer.abort()
                raise
            beat.check()
            rec = write_checkpoint_record(
                ctx.blobs, catalog, ckpt_id, metrics=args.metrics, tags=args.tags, entries=entries,
                stored_bytes_added=sum(added),
            )  # fmt: skip
            ckpt = catalog.finish_checkpoint(
                ckpt_id, owner, entries=entries, metrics=args.metrics, tags=args.tags,
                logical_bytes=sum(e[3] for e in entries), stored_bytes_added=sum(added), replace=False,
                committed_at=rec.committed_at,
            )  # fmt: skip
    except BaseException:
        try:
            catalog.abort_checkpoint(ckpt_id, owner)
        except Exception:  # noqa: BLE001, S110 - the original error matters more; gc cleans up later
            pass
        raise
    return ckpt
