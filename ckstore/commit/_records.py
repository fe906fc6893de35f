"""The commit protocol's hook that writes a checkpoint's blob-store record
(:mod:`ckstore.format.recordio`) while the catalog's transaction that makes it visible runs,
durable before that transaction commits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from .._crash import crash_point
from ..catalog import RecordFacts
from ..format.recordio import write_checkpoint_record

__all__ = ["write_record"]


def write_record(
    ctx: Any,
    ckpt_id: int,
    args: Any,
    manifests: Sequence[tuple[int, str, bytes, int]],
    added: int,
    facts: RecordFacts,
    committed_at: datetime,
    packs_durable: Callable[[], object] | None = None,
) -> None:
    """Write the pending checkpoint ``ckpt_id``'s record (``args``: the commit's checked
    arguments; ``facts``: the catalog's, read in the transaction that makes it visible), durably,
    with ``committed_at`` as its commit time. ``packs_durable`` waits until the packs it names
    are durable: the record's bytes are written (and made durable) meanwhile, and it appears
    only after (a durable record names only durable chunks)."""
    write_checkpoint_record(
        ctx.blobs, ctx.catalog, ckpt_id, metrics=args.metrics, tags=args.tags, entries=manifests,
        stored_bytes_added=added, facts=facts, committed_at=committed_at, before_publish=packs_durable,
    )  # fmt: skip
    crash_point("record.written")
