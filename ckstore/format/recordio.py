"""Writing blob-store records (:mod:`ckstore.format.record`) from what the catalog knows: a
commit's checkpoint record, written durably right before the catalog makes the checkpoint
visible, and the events of later changes (tags, deletes, forks, policies), written right after
the catalog applied them.

A record written for a commit that then fails (its claim lost, the catalog unreachable) names
no visible checkpoint; gc deletes it after the grace period, like the commit's packs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..blobstore import BlobStore
from ..catalog import Catalog, RecordFacts, utcnow
from ..errors import CheckpointNotFoundError
from ..layout import WorldLayout
from ..records import Checkpoint
from .record import CheckpointRecord, ChunkHint, Event, Identity

__all__ = ["write_checkpoint_record", "record_from_catalog", "write_event", "checkpoint_event"]


def write_checkpoint_record(
    blobs: BlobStore,
    catalog: Catalog,
    ckpt_id: int,
    *,
    metrics: Mapping[str, float],
    tags: Sequence[str],
    entries: Sequence[tuple[int, str, bytes, int]],
    stored_bytes_added: int,
    facts: RecordFacts | None = None,
    committed_at: Any = None,
    before_publish: Callable[[], object] | None = None,
) -> CheckpointRecord:
    """Write pending checkpoint ``ckpt_id``'s record, durably, with ``committed_at`` (now, when
    None) as its commit time; the caller makes the checkpoint visible with that same time
    (``rec.committed_at``). ``facts``: the catalog's facts of it, when the caller read them
    already (else they are read here). ``before_publish``: what must finish before the record
    appears (a commit's packs being made durable); the record's bytes are written, and made
    durable where the store can, meanwhile (:meth:`~ckstore.blobstore.BlobStore.put`)."""
    when = committed_at if committed_at is not None else utcnow()
    rec = record_from_catalog(
        catalog, ckpt_id, committed_at=when, metrics=metrics, tags=tags, entries=entries,
        stored_bytes_added=stored_bytes_added, facts=facts,
    )  # fmt: skip
    # durable before the catalog's finish transaction
    blobs.put(rec.key, rec.to_bytes(), before_publish=before_publish)
    return rec


def record_from_catalog(
    catalog: Catalog,
    ckpt_id: int,
    *,
    committed_at: Any,
    metrics: Mapping[str, float],
    tags: Sequence[str],
    entries: Sequence[tuple[int, str, bytes, int]],
    stored_bytes_added: int,
    facts: RecordFacts | None = None,
) -> CheckpointRecord:
    f = facts if facts is not None else catalog.record_facts(ckpt_id)
    return CheckpointRecord(
        ident=Identity(f.run, f.step, f.created_at),
        kind=f.kind,
        committed_at=committed_at,
        run_created_at=f.run_created_at,
        world_layout=WorldLayout.from_json(json.loads(f.world_layout)),
        metrics=dict(metrics),
        tags=tuple(dict.fromkeys(tags)),
        parent=Identity(*f.parent) if f.parent else None,
        logical_bytes=sum(e[3] for e in entries),
        stored_bytes_added=stored_bytes_added,
        entries=tuple(entries),
        chunks=tuple(map(ChunkHint._make, f.chunks)),
    )


def write_event(blobs: BlobStore, event: Event) -> None:
    blobs.put(event.new_key(), event.to_bytes())


def checkpoint_event(
    blobs: BlobStore, catalog: Catalog, kind: str, ckpt: Checkpoint, *, name: str | None = None,
    run: str | None = None, parent_ref: str | None = None,
) -> None:  # fmt: skip
    """Record event ``kind`` about checkpoint ``ckpt`` (``run``: the run it applies to, when not
    the checkpoint's own, as for a fork)."""
    found = catalog.identity(ckpt.id)
    if found is None:
        raise CheckpointNotFoundError(f"{ckpt.ref} is gone; its {kind} could not be recorded")
    ident, _ = found
    target_run = run or ckpt.run
    created = catalog.run_created(target_run) or utcnow()
    write_event(
        blobs,
        Event(kind, utcnow(), target_run, created, name=name, target=Identity(*ident), parent_ref=parent_ref),
    )
