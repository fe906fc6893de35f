"""Garbage collection: drop the checkpoints retention policies release, then sweep the chunks
and packs no checkpoint references, and delete their objects.

:func:`collect` runs, in this order (``docs/format.md``, "Garbage collection and concurrency",
says why each step is safe while other processes commit and read):

1. list the pack objects, before any catalog read;
2. one write transaction under the *exclusive* gc lock: apply each run's policy (dropping a
   checkpoint drops its chunk references), reap abandoned pending checkpoints, delete chunk rows
   no reference points to, and move pack rows that hold no chunk and have no live owner to the
   ``trash`` table;
3. delete the trashed objects, then their trash rows;
4. delete orphan objects (no pack row, no trash row) and stale temp files older than the grace.

A local folder keeps some of the pack files step 3 releases for later packs to be written over
(``recycle_bytes`` in :func:`ckstore.open`, :mod:`ckstore.blobstore._recycle`); step 4 deletes
those beyond the bound, every one of them where the bound is 0 (``ckstore gc``).

The statements themselves are the catalog's (:class:`~ckstore.catalog.GcTransaction`); this
module decides what to drop and reap, and deletes objects. A dry run does step 2 in a transaction it rolls back, so it reports exactly what
a real run would do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from ..blobstore import BlobStore, NotOwnedError
from ..catalog import Candidate, Catalog, GcTransaction, Owner, Pending, Survey, utcnow
from ..errors import PolicyError, ProtectedCheckpointError, StoreConfigError
from ..format.record import CHECKPOINTS_PREFIX, Identity, checkpoint_key
from ..records import Checkpoint
from ..refs import check_name
from .retention import KeepAll, Policy, policy_from_json, policy_to_json

__all__ = [
    "DEFAULT_GRACE",
    "PACK_PREFIX",
    "Candidate",
    "Decision",
    "GcReport",
    "Progress",
    "Reaped",
    "RunRetention",
    "check_grace",
    "check_policy",
    "collect",
    "delete",
    "set_policy",
    "stored_policy",
]

#: Seconds a commit in flight may go without a heartbeat, and an unknown object or temp file may
#: sit untouched, before gc treats it as abandoned. It must comfortably exceed the heartbeat
#: interval (a quarter of the store's lease).
DEFAULT_GRACE = 3600.0
PACK_PREFIX = "packs/"

#: ``progress(phase, done, total)``; ``total`` is 0 while unknown.
Progress = Callable[[str, int, int], None]


# -- report types -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Decision:
    """A checkpoint a policy kept (with the reasons) or dropped (no reasons)."""

    step: int
    kind: str
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RunRetention:
    """What one run's policy decided."""

    run: str
    policy: str | None  # description; None: the run has no policy and keeps everything
    source: str  # "given" (this call), "stored" (the run's own) or "none"
    kept: tuple[Decision, ...]
    dropped: tuple[Decision, ...]  # reasons empty
    unranked: tuple[tuple[int, tuple[str, ...]], ...]  # (step, metrics it lacks), kept for that


@dataclass(frozen=True, slots=True)
class Reaped:
    """A pending checkpoint (a commit in flight) gc judged abandoned and removed."""

    run: str
    step: int
    owner: str
    why: str


@dataclass(frozen=True, slots=True)
class GcReport:
    dry_run: bool
    runs: tuple[RunRetention, ...]
    reaped: tuple[Reaped, ...]
    chunks_freed: int  # chunk rows no checkpoint referenced any more
    chunk_bytes_freed: int  # their stored (compressed) bytes
    packs_deleted: int  # pack objects deleted (trashed now, or left in the trash by an earlier gc)
    pack_bytes_freed: int
    orphans_deleted: tuple[str, ...]  # objects no catalog row knew, older than the grace
    orphan_bytes_freed: int
    temp_files_deleted: int
    grace: float
    seconds: float
    #: keys that trash rows named outside ckstore's namespaces: refused, left in place and in the
    #: trash table (a damaged or tampered catalog; see ``ckstore fsck``)
    refused: tuple[str, ...] = ()
    records_deleted: int = 0  # records of checkpoints the catalog no longer has
    repack: Any = None  # a ckstore.maintenance.repack.RepackReport when asked to repack
    #: released pack files the blob store keeps after this gc for later commits to write over
    #: (a local folder's recycled files, ``recycle_bytes`` in :func:`ckstore.open`), and their
    #: bytes: counted in ``pack_bytes_freed`` (no longer objects of the store) yet still on disk
    recycled_files: int = 0
    recycled_bytes: int = 0

    @property
    def dropped(self) -> list[str]:
        """``run@step`` of every checkpoint dropped."""
        return [f"{r.run}@{d.step}" for r in self.runs for d in r.dropped]

    @property
    def bytes_freed(self) -> int:
        """Bytes of blob-store objects deleted."""
        return self.pack_bytes_freed + self.orphan_bytes_freed


# -- policies ---------------------------------------------------------------------------------
def check_policy(policy: object) -> None:
    if policy is not None and not isinstance(policy, Policy):
        raise PolicyError(f"policy must be a ckstore.maintenance.retention.Policy, got {type(policy).__name__}")


def set_policy(catalog: Catalog, run: str, policy: Policy | None) -> None:
    """Store ``policy`` as ``run``'s retention policy (None clears it)."""
    check_policy(policy)
    catalog.set_run_policy(check_name("run", run), None if policy is None else policy_to_json(policy))


def stored_policy(run: str, text: str | None) -> Policy | None:
    """The policy a run stored (None: it has none); a malformed one is a :class:`PolicyError`
    naming the run and the commands that fix it."""
    if not text:
        return None
    try:
        return policy_from_json(text)
    except PolicyError as e:
        raise PolicyError(
            f"run {run!r} has a malformed stored policy ({e}); replace it with "
            f"`ckstore policy set {run} --keep-last N ...` or clear it with `ckstore policy clear {run}`"
        ) from e


def _policies(txn: GcTransaction, policy: Policy | None, run: str | None) -> dict[str, tuple[Policy | None, str]]:
    out: dict[str, tuple[Policy | None, str]] = {}
    for name, text in txn.stored_policies(run):
        if policy is not None:
            out[name] = (policy, "given")
        else:
            stored = stored_policy(name, text)
            out[name] = (stored, "none") if stored is None else (stored, "stored")
    return out


def apply_policies(txn: GcTransaction, policy: Policy | None, run: str | None, now: datetime) -> list[RunRetention]:
    """Drop the checkpoints each run's policy releases (never a run's latest); returns decisions."""
    if run is not None:
        txn.require_run(run)
    policies = _policies(txn, policy, run)
    candidates = txn.candidates(run)
    out: list[RunRetention] = []
    drop_ids: list[int] = []
    for name, (pol, source) in policies.items():
        ckpts = candidates.get(name, [])
        if not ckpts:
            continue
        sel = (pol or KeepAll()).select(ckpts, now=now)
        latest = max(ckpts, key=lambda c: (c.step, c.id))
        reasons = dict(sel.reasons)
        reasons[latest.id] = ("latest",) + tuple(r for r in reasons.get(latest.id, ()) if r != "latest")
        kept = tuple(Decision(c.step, c.kind, reasons[c.id]) for c in ckpts if c.id in reasons)
        dropped = [c for c in ckpts if c.id not in reasons]
        drop_ids += [c.id for c in dropped]
        unranked = tuple((c.step, sel.unranked[c.id]) for c in ckpts if c.id in sel.unranked)
        out.append(
            RunRetention(
                name, pol.describe() if pol else None, source, kept,
                tuple(Decision(c.step, c.kind, ()) for c in dropped), unranked,
            )
        )  # fmt: skip
    txn.drop_checkpoints(drop_ids)
    return out


# -- abandoned commits ---------------------------------------------------------------------------
def judge_pending(pending: Pending, grace: float, now: datetime) -> tuple[str, bool] | None:
    """Why a pending checkpoint counts as abandoned, and whether only its silent heartbeat says so
    (its owner ran elsewhere); None while it may be live.

    On this host a live owner is never abandoned and a dead one is at once; elsewhere only a
    heartbeat older than ``grace`` makes it abandoned.
    """
    try:
        o = Owner.parse(pending.owner)
        here = o.alive_here()
        who = o.describe()
    except (ValueError, TypeError):
        here, who = None, f"owner {pending.owner!r}"
    if here:
        return None
    if here is False:
        return f"{who} is gone", False
    age = (now - pending.heartbeat_at).total_seconds()
    if age > grace:
        return f"no heartbeat from {who} for {age:.0f}s (grace {grace:g}s)", True
    return None


def reap_abandoned(txn: GcTransaction, grace: float, now: datetime) -> list[Reaped]:
    """Delete abandoned pending checkpoints; their references and pack ownership go with them.

    Each delete re-checks the row (same owner; for a remote owner, a heartbeat still older than
    the grace), so a commit that heartbeats meanwhile is left alone.
    """
    out = []
    for p in txn.pending():
        verdict = judge_pending(p, grace, now)
        if verdict is None:
            continue
        why, by_heartbeat = verdict
        if txn.reap(p, silent_before=now - timedelta(seconds=grace) if by_heartbeat else None):
            out.append(Reaped(p.run, p.step, p.owner, why))
    return out


# -- objects ------------------------------------------------------------------------------------
def list_packs(blobs: BlobStore, progress: Progress | None = None) -> dict[str, tuple[int, float | None]]:
    """``{key: (size, mtime)}`` of every pack object."""
    out: dict[str, tuple[int, float | None]] = {}
    for info in blobs.list(PACK_PREFIX):
        out[info.key] = (info.size, info.mtime)
        if progress is not None and len(out) % 1000 == 0:
            progress("list", len(out), 0)
    return out


def find_orphans(survey: Survey, listing: Mapping[str, tuple[int, float | None]], cutoff: float | None) -> list[str]:
    """Listed objects the catalog does not know, older than ``cutoff`` (seconds since the epoch;
    None: any age). The listing must be older than the survey's snapshot (a commit records a
    pack before writing it). An object whose backend reports no time is kept."""
    cands = sorted(k for k, (_, mtime) in listing.items() if cutoff is None or (mtime is not None and mtime < cutoff))
    return sorted(survey.unknown_keys(cands)) if cands else []


def stale_temp_files(blobs: BlobStore, cutoff: float, catalog: Catalog) -> list[str]:
    """Temp files (local folders) and unfinished multipart uploads (S3) older than ``cutoff``,
    except uploads of packs that a commit still in flight owns: however long a live commit
    takes, gc never breaks it."""
    handles = list(blobs.stale_temp_files(cutoff))
    keys = {h: blobs.temp_file_key(h) for h in handles}
    named = sorted({k for k in keys.values() if k})
    if not named:
        return handles
    with catalog.snapshot() as survey:
        live = survey.live_pack_keys(named)
    return [h for h in handles if keys[h] not in live]


def _delete_objects(blobs: BlobStore, keys: Sequence[str], phase: str, progress: Progress | None,
                    after_batch: Callable[[list[str]], None] | None = None) -> list[str]:  # fmt: skip
    """Delete ``keys`` in batches; returns the keys the blob store refused to delete because they
    lie outside the namespaces ckstore owns (a damaged or tampered row named them). Those stay
    where they are, and so do the rows naming them; everything else is deleted."""
    refused: list[str] = []
    for i in range(0, len(keys), 100):
        batch = list(keys[i : i + 100])
        try:
            blobs.delete(batch)
        except NotOwnedError:  # the batch was refused whole, before any delete: go key by key
            deleted = []
            for key in batch:
                try:
                    blobs.delete([key])
                    deleted.append(key)
                except NotOwnedError:
                    refused.append(key)
            batch = deleted
        if after_batch is not None and batch:
            after_batch(batch)
        if progress is not None:
            progress(phase, min(i + 100, len(keys)), len(keys))
    return refused


def stale_records(
    records: Mapping[str, float | None], gone_ids: Collection[Any], after: Mapping[Any, str], cutoff: float
) -> list[str]:
    """Listed record keys (``{key: mtime}``, listed before the catalog was read) of checkpoints
    the catalog no longer has (``after``: what it has): ``gone_ids`` (dropped or deleted while
    gc ran), or never there and older than ``cutoff`` (a commit that failed after writing its
    record)."""
    kept = {checkpoint_key(Identity(*i)) for i in after}
    gone = {checkpoint_key(Identity(*i)) for i in gone_ids}
    return sorted(
        k for k, mtime in records.items() if k not in kept and (k in gone or (mtime is not None and mtime < cutoff))
    )


def _deletable(blobs: BlobStore, key: str) -> bool:
    """Whether a delete of ``key`` would go ahead (it names an object in a namespace ckstore owns)."""
    try:
        blobs.check_delete([key])
    except NotOwnedError:
        return False
    return True


def remove_temp_files(blobs: BlobStore, handles: Sequence[str]) -> int:
    return blobs.discard_temp_files(handles)


# -- gc -----------------------------------------------------------------------------------------
def check_grace(grace: float | None) -> float:
    """``grace`` as seconds (None: :data:`DEFAULT_GRACE`), or a :class:`PolicyError`."""
    if grace is None:
        return DEFAULT_GRACE
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise PolicyError(f"grace must be a number of seconds >= 0, got {grace!r}")
    return float(grace)


def delete(catalog: Catalog, ckpt: Checkpoint, *, force: bool = False) -> Checkpoint:
    """Remove one checkpoint's rows (a tagged one only with ``force``); the next gc frees its
    bytes (chunks other checkpoints share stay)."""
    if ckpt.tags and not force:
        raise ProtectedCheckpointError(
            f"{ckpt.ref} is tagged {', '.join(ckpt.tags)}; untag it first or pass force=True (--force)"
        )
    catalog.delete_checkpoint(ckpt.id)
    return ckpt


def collect(
    catalog: Catalog,
    blobs: BlobStore,
    *,
    policy: Policy | None = None,
    run: str | None = None,
    dry_run: bool = False,
    grace: float | None = None,
    progress: Progress | None = None,
) -> GcReport:
    """Apply retention policies and sweep; see the module docstring for the order.

    ``policy`` replaces the stored policy of ``run`` (or of every run, when ``run`` is None) for
    this call; without it each run's stored policy applies, and a run with none keeps everything.
    """
    grace = check_grace(grace)
    check_policy(policy)
    t0 = time.perf_counter()
    now = utcnow()
    cutoff = time.time() - grace
    listing = list_packs(blobs, progress)  # before any catalog read: see find_orphans
    records = {i.key: i.mtime for i in blobs.list(CHECKPOINTS_PREFIX)}  # likewise
    before = catalog.identities()
    if records and not before and catalog.is_empty():
        raise StoreConfigError(
            f"the catalog is empty but the blob store holds {len(records)} checkpoint records: the catalog "
            "was lost or replaced. Rebuild it first with `ckstore recover`; gc would delete everything"
        )

    with catalog.gc_transaction(dry_run=dry_run) as txn:
        runs = apply_policies(txn, policy, run, now)
        reaped = reap_abandoned(txn, grace, now)
        swept = txn.sweep(now)
        trash_keys = txn.trash_keys()
    def stored_bytes(keys: Sequence[str]) -> int:
        return sum(listing[k][0] if k in listing else swept.trashed.get(k, 0) for k in keys)

    in_trash = set(trash_keys)
    with catalog.snapshot() as survey:  # read after the listing: see find_orphans
        orphans = [k for k in find_orphans(survey, listing, cutoff) if k not in in_trash]
    orphan_bytes = sum(listing[k][0] for k in orphans)
    temps = stale_temp_files(blobs, cutoff, catalog)
    # the checkpoints gone: those this gc dropped or reaped (a dry run only says so), and any other
    # that went meanwhile (`ckstore rm`)
    dropped = {(r.run, d.step) for r in runs for d in r.dropped}
    reaped_steps = {(p.run, p.step) for p in reaped}
    after = catalog.identities()
    gone = {
        i for i, status in before.items()
        if i not in after or (i[0], i[1]) in (dropped if status == "committed" else reaped_steps)
    }  # fmt: skip
    stale = stale_records(records, gone, {i: s for i, s in after.items() if i not in gone}, cutoff)

    refused: list[str] = []
    if not dry_run:
        refused = _delete_objects(blobs, trash_keys, "delete", progress, catalog.forget_trash)
        _delete_objects(blobs, orphans, "orphans", progress)
        _delete_objects(blobs, stale, "records", None)  # after their checkpoints' rows
        remove_temp_files(blobs, temps)
    else:  # what those deletes would refuse
        refused = [k for k in trash_keys if not _deletable(blobs, k)]
    trash_keys = [k for k in trash_keys if k not in set(refused)]
    recycled = blobs.recycled() if not dry_run else (0, 0)

    return GcReport(
        dry_run=dry_run,
        runs=tuple(runs),
        reaped=tuple(reaped),
        chunks_freed=swept.chunks,
        chunk_bytes_freed=swept.chunk_bytes,
        packs_deleted=len(trash_keys),
        pack_bytes_freed=stored_bytes(trash_keys),
        orphans_deleted=tuple(orphans),
        orphan_bytes_freed=orphan_bytes,
        temp_files_deleted=len(temps),
        grace=grace,
        seconds=time.perf_counter() - t0,
        refused=tuple(refused),
        records_deleted=len(stale),
        recycled_files=recycled[0],
        recycled_bytes=recycled[1],
    )
