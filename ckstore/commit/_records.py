"""The commit protocol's hook that writes a checkpoint's blob-store record
(:mod:`ckstore.format.recordio`) before the catalog makes it visible."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from .._crash import crash_point
from ..catalog import Owner, RecordFacts
from ..format.recordio import write_checkpoint_record

__all__ = ["write_record"]


def write_record(
    ctx: Any,
    ckpt_id: int,
    owner: Owner,
    args: Any,
    manifests: Sequence[tuple[int, str, bytes, int]],
    added: int,
    facts: RecordFacts | None = None,
) -> datetime:
    """Write the pending checkpoint ``ckpt_id``'s record (``args``: the commit's checked
    arguments; ``facts``: the catalog's, when read already) before it is made visible; returns
    the commit time it holds, for the catalog."""
    rec = write_checkpoint_record(
        ctx.blobs, ctx.catalog, ckpt_id, metrics=args.metrics, tags=args.tags, entries=manifests,
        stored_bytes_added=added, facts=facts,
    )  # fmt: skip
    crash_point("record.written")
    return rec.committed_at
