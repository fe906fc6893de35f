"""Rebuilding a lost catalog from the blob store alone (``ckstore recover``), writing the records
of a store made before records existed (``ckstore db backfill-records``), and comparing records
with the catalog (for ``fsck``).

:func:`recover` runs, in this order:

1. read every pack's index (header and tail only) and record the packs and their chunks — a pack
   whose index is damaged is reported and left out;
2. read every checkpoint record and event (``records/``), each checked like any input — a record
   that does not decode, or sits under a key that is not its own, is reported and left out;
3. replay them in time order: a checkpoint at its commit time (with the tags it was committed
   with), then tags, untags, deletes, forks and policies as they happened. Of two records of one
   step, the later commit wins (a commit with ``replace=True``).

A checkpoint some of whose chunks no pack holds (or are deltas whose chain of bases no pack
completes) is restored and reported as incomplete (``fsck`` names the tensors), never dropped
silently. Every insert is idempotent, so recover may run twice, or over a catalog that still
has part of the store (a pack in that catalog's trash is taken back out of it: the next gc
trashes it again if no chunk row needs it).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime

from ..blobstore import BlobStore
from ..catalog import Catalog, RestoredChunk
from ..config import MAX_DELTA_CHAIN
from ..errors import BlobStoreError, CkstoreError, IntegrityError
from ..format.manifest import Manifest
from ..format.record import (
    CHECKPOINTS_PREFIX,
    EVENTS_PREFIX,
    CheckpointRecord,
    Event,
    Identity,
    checkpoint_key,
    decode,
)
from .gc import list_packs

__all__ = ["RecoverReport", "RecordCheck", "recover", "backfill", "check_records", "read_pack_index"]

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class RecoverReport:
    restored: tuple[str, ...]  # run@step of checkpoints recovered into the catalog
    present: tuple[str, ...]  # already there
    superseded: tuple[str, ...]  # older records of a step committed again (replace=True)
    incomplete: tuple[tuple[str, int], ...]  # (run@step, chunks no pack holds, or deltas no base chain decodes)
    runs: tuple[str, ...]
    tags: tuple[str, ...]  # run@tag as the catalog has them now
    events: int  # events replayed
    packs: int  # packs recorded
    chunks: int  # chunks found in them
    bad_packs: tuple[tuple[str, str], ...]  # (key, problem)
    bad_records: tuple[tuple[str, str], ...]  # (key or event, problem)
    no_records: bool  # packs but no records at all: a store written before records existed

    @property
    def ok(self) -> bool:
        return not (self.incomplete or self.bad_packs or self.bad_records or self.no_records)


@dataclass(frozen=True, slots=True)
class RecordCheck:
    """Disagreement between the catalog and the blob store's records (``fsck``)."""

    unrecorded: tuple[str, ...]  # committed checkpoints without a record
    unknown: tuple[str, ...]  # record keys naming no checkpoint in the catalog
    unreadable: tuple[tuple[str, str], ...]  # (key, problem)
    records: int = 0

    @property
    def ok(self) -> bool:
        return not (self.unrecorded or self.unreadable)


def read_pack_index(blobs: BlobStore, key: str, size: int) -> list[tuple[bytes, int, int, int]]:
    """A pack's index ``[(digest, offset, length, raw_len), …]``, reading only its header and
    tail; every span is checked against the pack's size (:class:`IntegrityError` naming it)."""
    # numpy comes with the format's pack module: not on catalog-only paths (fsck without --deep)
    from ..format.pack import read_index_at

    try:
        return read_index_at(lambda start, end: blobs.read(key, start, end), size)
    except IntegrityError as e:
        raise IntegrityError(f"pack {key}: {e}") from None


def _read_records(blobs: BlobStore, workers: int) -> tuple[list[CheckpointRecord], list[tuple[str, Event]], list[tuple[str, str]]]:
    keys = [i.key for i in blobs.list(CHECKPOINTS_PREFIX)] + [i.key for i in blobs.list(EVENTS_PREFIX)]
    bad: list[tuple[str, str]] = []

    def load(key: str) -> CheckpointRecord | Event | str:
        try:
            rec = decode(blobs.read(key), key)
        except (IntegrityError, BlobStoreError) as e:
            return str(e)
        if isinstance(rec, CheckpointRecord) and rec.key != key:
            return f"{key}: a record of {rec.ident.ref} stored under another checkpoint's key"
        if isinstance(rec, Event) and not key.startswith(EVENTS_PREFIX):
            return f"{key}: an event stored among checkpoint records"
        return rec

    recs: list[CheckpointRecord] = []
    events: list[tuple[str, Event]] = []
    with ThreadPoolExecutor(workers) as pool:
        for key, got in zip(keys, pool.map(load, keys)):
            if isinstance(got, str):
                bad.append((key, got))
            elif isinstance(got, CheckpointRecord):
                recs.append(got)
            else:
                events.append((key, got))
    return recs, events, bad


def _delta_bases(
    blobs: BlobStore, found: dict[bytes, tuple[str, int, int, int]], codecs: dict[tuple[bytes, str, int], int]
) -> dict[bytes, tuple[bytes, int]]:
    """``{digest: (base, chain depth)}`` of the delta chunks among ``found``, their bases read
    from their frames' headers. A delta whose base is not found, or whose chain is longer than a
    reader follows, is left without a base: checkouts of it fail, as fsck reports."""
    from ..format.codec import CODEC_DELTA, DELTA_OVERHEAD, HEADER_SIZE

    base: dict[bytes, bytes] = {}
    for d, (key, offset, length, _) in found.items():
        if codecs[(d, key, offset)] == CODEC_DELTA and length >= DELTA_OVERHEAD:
            base[d] = bytes(blobs.read(key, offset, offset + DELTA_OVERHEAD)[HEADER_SIZE:])
    out: dict[bytes, tuple[bytes, int]] = {}
    for d, b in base.items():
        depth, at = 1, b
        while at in base and depth <= MAX_DELTA_CHAIN:
            depth, at = depth + 1, base[at]
        if at in found and depth <= MAX_DELTA_CHAIN:
            out[d] = (b, depth)
    return out


def recover(catalog: Catalog, blobs: BlobStore, *, workers: int = 8, progress: Progress | None = None) -> RecoverReport:
    """Rebuild ``catalog`` from ``blobs``; see the module docstring."""
    # 1. packs and their chunks
    listing = list_packs(blobs)
    bad_packs: list[tuple[str, str]] = []
    found: dict[bytes, tuple[str, int, int, int]] = {}

    def index(key: str) -> list[tuple[bytes, int, int, int]] | str:
        try:
            return read_pack_index(blobs, key, listing[key][0])
        except (IntegrityError, BlobStoreError) as e:
            return str(e)

    keys = sorted(listing)
    good: list[tuple[str, int]] = []
    with ThreadPoolExecutor(workers) as pool:
        for n, (key, got) in enumerate(zip(keys, pool.map(index, keys)), 1):
            if isinstance(got, str):
                bad_packs.append((key, got))
                continue
            good.append((key, listing[key][0]))
            for digest, offset, length, raw in got:
                found.setdefault(digest, (key, offset, length, raw))
            if progress is not None:
                progress("packs", n, len(keys))
    recs, events, bad_records = _read_records(blobs, workers)
    # a pack this catalog's trash holds (gc swept it, or a repack left it to wait out the grace)
    # is taken back out: recover keeps every chunk the blob store has, and a pack row beside a
    # trash row of the same key would fail every later sweep; the next gc trashes it again
    with catalog.snapshot() as survey:
        unknown = survey.unknown_keys([k for k, _ in good])
        in_use = {p.key for p in survey.packs_in_use()}
    catalog.forget_trash([k for k, _ in good if k not in unknown and k not in in_use])

    # codecs: from the records' hints where they agree with the pack, else the frame header
    hints = {(c.digest, c.pack, c.offset): c.codec for r in recs for c in r.chunks}
    for digest, (key, offset, _, _) in found.items():
        if (digest, key, offset) not in hints:
            hints[(digest, key, offset)] = blobs.read(key, offset, offset + 1)[0]
    from ..format.codec import CODEC_DELTA

    bases = _delta_bases(blobs, found, hints)
    # a delta no chain of found chunks decodes is as good as missing
    unusable = {d for d, (k, o, _, _) in found.items() if hints[(d, k, o)] == CODEC_DELTA and d not in bases}
    catalog.restore_packs(good)
    catalog.restore_chunks(
        [
            RestoredChunk(d, k, o, n, raw, hints[(d, k, o)], *bases.get(d, (None, None)))
            for d, (k, o, n, raw) in found.items()
        ]
    )

    # 2. which record of each step wins
    latest: dict[tuple[str, int], CheckpointRecord] = {}
    superseded = []
    for r in sorted(recs, key=lambda r: r.ident.created_at):
        prev = latest.get((r.ident.run, r.ident.step))
        if prev is not None:
            superseded.append(prev.ident.ref)
        latest[(r.ident.run, r.ident.step)] = r

    # 3. replay in time order; a checkpoint deleted later (`ckstore rm`) is not restored at all
    deleted = {e.target for _, e in events if e.kind == "delete"}
    timeline: list[tuple[datetime, int, str, CheckpointRecord | Event]] = [
        (r.committed_at, 0, r.key, r) for r in latest.values()
    ] + [(e.at, 1, key, e) for key, e in events]
    timeline.sort(key=lambda t: (t[0], t[1], t[2]))
    restored: list[str] = []
    present: list[str] = []
    incomplete: list[tuple[str, int]] = []
    replayed = 0
    for n, (_, _, key, item) in enumerate(timeline, 1):
        if isinstance(item, CheckpointRecord):
            if item.ident in deleted:
                continue
            ident = (item.ident.run, item.ident.step, item.ident.created_at)
            digests = sorted({d for _, _, m, _ in item.entries for d in Manifest.from_bytes(m).digests()})
            missing = sum(1 for d in digests if d not in found or d in unusable)
            catalog.restore_run(item.ident.run, item.run_created_at)
            done = catalog.restore_checkpoint(
                ident, run_created_at=item.run_created_at, kind=item.kind, committed_at=item.committed_at,
                world_layout=_layout_json(item), logical_bytes=item.logical_bytes,
                stored_bytes_added=item.stored_bytes_added, entries=item.entries, metrics=item.metrics,
                digests=[d for d in digests if d in found],
                parent=(item.parent.run, item.parent.step, item.parent.created_at) if item.parent else None,
            )  # fmt: skip
            (restored if done else present).append(item.ident.ref)
            if missing:
                incomplete.append((item.ident.ref, missing))
            for tag in item.tags:
                catalog.restore_tag(item.ident.run, tag, ident)
        else:
            replayed += 1
            try:
                _replay(catalog, item)
            except CkstoreError as e:
                bad_records.append((key, f"{item.kind} of run {item.run!r}: {e}"))
        if progress is not None:
            progress("records", n, len(timeline))
    runs = [r.name for r in catalog.runs()]
    tags = sorted(f"{c.run}@{t}" for c in catalog.checkpoints() for t in c.tags)
    return RecoverReport(
        restored=tuple(restored), present=tuple(present), superseded=tuple(superseded),
        incomplete=tuple(incomplete), runs=tuple(runs), tags=tuple(tags), events=replayed, packs=len(good),
        chunks=len(found), bad_packs=tuple(bad_packs), bad_records=tuple(bad_records),
        no_records=bool(good) and not recs and not events,
    )  # fmt: skip


def _layout_json(rec: CheckpointRecord) -> str:
    import json

    return json.dumps(rec.world_layout.to_json())


def _replay(catalog: Catalog, ev: Event) -> None:
    t = (ev.target.run, ev.target.step, ev.target.created_at) if ev.target else None
    if ev.kind == "tag":
        assert ev.name is not None
        catalog.restore_tag(ev.run, ev.name, t)  # a target gone meanwhile (deleted) leaves no tag
    elif ev.kind == "untag":
        assert ev.name is not None
        catalog.restore_tag(ev.run, ev.name, None)
    elif ev.kind == "delete":
        assert t is not None
        catalog.forget_checkpoint(t)
    elif ev.kind == "fork":
        catalog.restore_run(ev.run, ev.run_created_at, parent=t, parent_ref=ev.parent_ref)
    elif ev.kind == "policy":
        catalog.restore_run(ev.run, ev.run_created_at, policy=ev.policy, set_policy=True)


def backfill(catalog: Catalog, blobs: BlobStore) -> int:
    """Write records for every committed checkpoint that has none, and a fork and policy event
    for every run that has them (a store made before records existed); returns objects written."""
    from ..catalog import utcnow
    from ..format.recordio import record_from_catalog, write_event

    have = {i.key for i in blobs.list(CHECKPOINTS_PREFIX)}
    written = 0
    ckpts = sorted(catalog.checkpoints(), key=lambda c: c.created_at)
    for c in ckpts:
        found = catalog.identity(c.id)
        if found is None or checkpoint_key(Identity(*found[0])) in have:
            continue
        entries = [(r, k, m, Manifest.from_bytes(m).logical_bytes) for r, k, m in catalog.entries(c.id)]
        rec = record_from_catalog(
            catalog, c.id, committed_at=c.committed_at or c.created_at, metrics=c.metrics, tags=c.tags,
            entries=entries, stored_bytes_added=c.stored_bytes_added,
        )  # fmt: skip
        blobs.put(rec.key, rec.to_bytes())
        written += 1
    for run in catalog.runs():
        created = catalog.run_created(run.name) or utcnow()
        ancestry = catalog.ancestry(run.name)
        if ancestry:
            parent_id, parent_ref = ancestry[0]
            parent = catalog.identity(parent_id) if parent_id is not None else None
            if parent is not None:
                write_event(blobs, Event("fork", utcnow(), run.name, created, target=Identity(*parent[0]), parent_ref=parent_ref))
                written += 1
        policy = catalog.run_policy(run.name)
        if policy:
            write_event(blobs, Event("policy", utcnow(), run.name, created, policy=policy))
            written += 1
    return written


def check_records(catalog: Catalog, blobs: BlobStore, *, cutoff: float | None = None, deep: bool = False) -> RecordCheck:
    """Committed checkpoints without a record, and records (older than ``cutoff``, seconds since
    the epoch) naming no checkpoint the catalog has; ``deep`` also decodes every record."""
    listing = {i.key: i.mtime for i in blobs.list(CHECKPOINTS_PREFIX)}
    ids = catalog.identities()
    expected = {checkpoint_key(Identity(*i)): (i, status) for i, status in ids.items()}
    unrecorded = sorted(f"{i[0]}@{i[1]}" for k, (i, status) in expected.items() if status == "committed" and k not in listing)
    unknown = sorted(
        k for k, mtime in listing.items() if k not in expected and (cutoff is None or (mtime is not None and mtime < cutoff))
    )
    unreadable = []
    if deep:
        for key in sorted(listing):
            try:
                rec = decode(blobs.read(key), key)
                if not isinstance(rec, CheckpointRecord) or rec.key != key:
                    unreadable.append((key, "not the record its key names"))
            except (IntegrityError, BlobStoreError) as e:
                unreadable.append((key, str(e)))
    return RecordCheck(tuple(unrecorded), tuple(unknown), tuple(unreadable), len(listing))
