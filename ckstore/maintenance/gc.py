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

Every statement over chunks and references is set-based; Python only sees checkpoints, pending
rows and packs. A dry run does step 2 in a transaction it rolls back, so it reports exactly what
a real run would do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, DateTime, Table, and_, delete, exists, func, literal, or_, select

from ..blobstore import BlobStore
from ..catalog import TABLES, Catalog, Owner, utcnow
from ..catalog._schema import COMMITTED, PENDING
from ..errors import NotFoundError, PolicyError
from .retention import KeepAll, Policy, policy_from_json

__all__ = [
    "DEFAULT_GRACE",
    "PACK_PREFIX",
    "Candidate",
    "Decision",
    "GcReport",
    "Progress",
    "Reaped",
    "RunRetention",
    "collect",
]

#: Seconds a commit in flight may go without a heartbeat, and an unknown object or temp file may
#: sit untouched, before gc treats it as abandoned. It must comfortably exceed the heartbeat
#: interval (a quarter of the store's lease).
DEFAULT_GRACE = 3600.0
PACK_PREFIX = "packs/"
_BATCH = 500

#: ``progress(phase, done, total)``; ``total`` is 0 while unknown.
Progress = Callable[[str, int, int], None]


def _table(name: str) -> Table:
    return TABLES[name]


C, P, K, R, E = (_table(n) for n in ("checkpoints", "packs", "chunks", "chunk_refs", "entries"))
M, T, RUNS, TRASH = (_table(n) for n in ("metrics", "tags", "runs", "trash"))


# -- transactions -------------------------------------------------------------------------------
def catalog_write(catalog: Catalog, lock: str | None = None) -> AbstractContextManager[Connection]:
    """A write transaction (``lock="exclusive"`` for sweeps); a failure rolls it back, and gc
    can simply run again."""
    return catalog.transaction(lock)


def catalog_read(catalog: Catalog) -> AbstractContextManager[Connection]:
    """A read transaction that sees one snapshot (REPEATABLE READ on PostgreSQL)."""
    return catalog.snapshot()


# -- report types -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Candidate:
    """A committed checkpoint as policies see it."""

    id: int
    run: str
    step: int
    kind: str
    committed_at: datetime | None
    metrics: Mapping[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ()


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

    @property
    def dropped(self) -> list[str]:
        """``run@step`` of every checkpoint dropped."""
        return [f"{r.run}@{d.step}" for r in self.runs for d in r.dropped]

    @property
    def bytes_freed(self) -> int:
        """Bytes of blob-store objects deleted."""
        return self.pack_bytes_freed + self.orphan_bytes_freed


class _Rollback(Exception):
    pass


# -- policies ---------------------------------------------------------------------------------
def load_candidates(conn: Connection, run: str | None) -> dict[str, list[Candidate]]:
    """Committed checkpoints by run (every run, or one), with metrics and tags; on PostgreSQL
    their rows stay locked until the transaction ends, so a tag added meanwhile waits."""
    cond = [C.c.status == COMMITTED]
    if run is not None:
        cond.append(RUNS.c.name == run)
    ckpts = C.join(RUNS, RUNS.c.id == C.c.run_id)
    rows = conn.execute(
        select(C.c.id, RUNS.c.name, C.c.step, C.c.kind, C.c.committed_at)
        .select_from(ckpts)
        .where(*cond)
        .order_by(RUNS.c.id, C.c.step)
        .with_for_update(of=C)
    ).all()
    metrics: dict[int, dict[str, float]] = {}
    q = select(M.c.checkpoint_id, M.c.name, M.c.value).select_from(
        ckpts.join(M, M.c.checkpoint_id == C.c.id)
    )
    for m in conn.execute(q.where(*cond)):
        metrics.setdefault(m.checkpoint_id, {})[m.name] = (
            math.nan if m.value is None else float(m.value)
        )
    tags: dict[int, list[str]] = {}
    q = select(T.c.checkpoint_id, T.c.name).select_from(ckpts.join(T, T.c.checkpoint_id == C.c.id))
    for t in conn.execute(q.where(*cond).order_by(T.c.name)):
        tags.setdefault(t.checkpoint_id, []).append(t.name)
    out: dict[str, list[Candidate]] = {}
    for r in rows:
        at = r.committed_at
        if at is not None and at.tzinfo is None:
            at = at.replace(tzinfo=utcnow().tzinfo)
        out.setdefault(r.name, []).append(
            Candidate(
                r.id,
                r.name,
                int(r.step),
                r.kind,
                at,
                metrics.get(r.id, {}),
                tuple(tags.get(r.id, ())),
            )
        )
    return out


def _policies(
    conn: Connection, policy: Policy | None, run: str | None
) -> dict[str, tuple[Policy | None, str]]:
    # in creation order: without ORDER BY, PostgreSQL returns rows in heap order, which an
    # UPDATE (set_policy) changes, so reports would list runs in another order than on SQLite
    q = select(RUNS.c.name, RUNS.c.policy).order_by(RUNS.c.id)
    if run is not None:
        q = q.where(RUNS.c.name == run)
    out: dict[str, tuple[Policy | None, str]] = {}
    for name, stored in conn.execute(q):
        if policy is not None:
            out[name] = (policy, "given")
        elif stored:
            try:
                out[name] = (policy_from_json(stored), "stored")
            except PolicyError as e:
                raise PolicyError(
                    f"run {name!r} has a malformed stored policy ({e}); replace it with "
                    f"`ckstore policy set {name} --keep-last N ...` or clear it with `ckstore policy clear {name}`"
                ) from e
        else:
            out[name] = (None, "none")
    return out


def apply_policies(
    conn: Connection, policy: Policy | None, run: str | None, now: datetime
) -> list[RunRetention]:
    """Drop the checkpoints each run's policy releases (never a run's latest); returns decisions."""
    if (
        run is not None
        and conn.execute(select(RUNS.c.id).where(RUNS.c.name == run)).first() is None
    ):
        raise NotFoundError(f"no run named {run!r} in this store (see `ckstore runs`)")
    policies = _policies(conn, policy, run)
    candidates = load_candidates(conn, run)
    out: list[RunRetention] = []
    drop_ids: list[int] = []
    for name, (pol, source) in policies.items():
        ckpts = candidates.get(name, [])
        if not ckpts:
            continue
        sel = (pol or KeepAll()).select(ckpts, now=now)
        latest = max(ckpts, key=lambda c: (c.step, c.id))
        reasons = {k: v for k, v in sel.reasons.items()}
        reasons[latest.id] = ("latest",) + tuple(
            r for r in reasons.get(latest.id, ()) if r != "latest"
        )
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
    for i in range(0, len(drop_ids), _BATCH):
        conn.execute(delete(C).where(C.c.id.in_(drop_ids[i : i + _BATCH]), C.c.status == COMMITTED))
    return out


# -- abandoned commits ---------------------------------------------------------------------------
def judge_pending(
    owner: str, heartbeat_at: datetime, grace: float, now: datetime
) -> tuple[str, bool] | None:
    """Why a pending checkpoint counts as abandoned, and whether only its silent heartbeat says so
    (its owner ran elsewhere); None while it may be live.

    On this host a live owner is never abandoned and a dead one is at once; elsewhere only a
    heartbeat older than ``grace`` makes it abandoned.
    """
    try:
        o = Owner.parse(owner)
        here = o.alive_here()
        who = o.describe()
    except (ValueError, TypeError):
        here, who = None, f"owner {owner!r}"
    if here:
        return None
    if here is False:
        return f"{who} is gone", False
    hb = heartbeat_at if heartbeat_at.tzinfo else heartbeat_at.replace(tzinfo=now.tzinfo)
    age = (now - hb).total_seconds()
    if age > grace:
        return f"no heartbeat from {who} for {age:.0f}s (grace {grace:g}s)", True
    return None


def pending_rows(conn: Connection) -> list[Any]:
    return list(
        conn.execute(
            select(C.c.id, RUNS.c.name, C.c.step, C.c.owner, C.c.heartbeat_at)
            .select_from(C.join(RUNS, RUNS.c.id == C.c.run_id))
            .where(C.c.status == PENDING)
            .order_by(C.c.id)
        )
    )


def reap_abandoned(conn: Connection, grace: float, now: datetime) -> list[Reaped]:
    """Delete abandoned pending checkpoints; their references and pack ownership go with them.

    Each delete re-checks the row (same owner; for a remote owner, a heartbeat still older than
    the grace), so a commit that heartbeats meanwhile is left alone.
    """
    out = []
    for r in pending_rows(conn):
        verdict = judge_pending(r.owner, r.heartbeat_at, grace, now)
        if verdict is None:
            continue
        why, by_heartbeat = verdict
        cond = [C.c.id == r.id, C.c.status == PENDING, C.c.owner == r.owner]
        if by_heartbeat:
            cond.append(C.c.heartbeat_at < now - timedelta(seconds=grace))
        if conn.execute(delete(C).where(*cond)).rowcount:
            out.append(Reaped(r.name, int(r.step), r.owner, why))
    return out


# -- the sweep ----------------------------------------------------------------------------------
def _unreferenced() -> Any:
    return ~exists().where(R.c.chunk_id == K.c.id)


def _dead_packs() -> Any:
    live_owner = P.c.owner_checkpoint_id.in_(select(C.c.id).where(C.c.status == PENDING))
    return and_(
        ~exists().where(K.c.pack_id == P.c.id), or_(P.c.owner_checkpoint_id.is_(None), ~live_owner)
    )


def sweep(conn: Connection, now: datetime) -> tuple[int, int, dict[str, int]]:
    """Delete unreferenced chunk rows, then move dead pack rows to the trash.

    Must run under the exclusive gc lock: commits reference existing chunks, and insert chunk
    rows, only under the shared lock. Returns ``(chunks, chunk bytes, {trashed key: size})``.
    """
    n, nbytes = conn.execute(
        select(func.count(), func.coalesce(func.sum(K.c.length), 0)).where(_unreferenced())
    ).one()
    if n:
        conn.execute(delete(K).where(_unreferenced()))
    trashed = {k: int(s) for k, s in conn.execute(select(P.c.key, P.c.size).where(_dead_packs()))}
    if not trashed:
        return int(n), int(nbytes), trashed
    conn.execute(
        TRASH.insert().from_select(
            ["key", "created_at"],
            select(P.c.key, literal(now, DateTime(timezone=True))).where(_dead_packs()),
        )
    )
    conn.execute(delete(P).where(_dead_packs()))
    return int(n), int(nbytes), trashed


# -- objects ------------------------------------------------------------------------------------
def list_packs(
    blobs: BlobStore, progress: Progress | None = None
) -> dict[str, tuple[int, float | None]]:
    """``{key: (size, mtime)}`` of every pack object."""
    out: dict[str, tuple[int, float | None]] = {}
    for info in blobs.list(PACK_PREFIX):
        out[info.key] = (info.size, info.mtime)
        if progress is not None and len(out) % 1000 == 0:
            progress("list", len(out), 0)
    return out


def unknown_keys(conn: Connection, keys: Sequence[str]) -> set[str]:
    """The keys in ``keys`` that neither a pack row nor a trash row knows."""
    unknown = set(keys)
    for i in range(0, len(keys), _BATCH):
        batch = list(keys[i : i + _BATCH])
        unknown -= {k for (k,) in conn.execute(select(P.c.key).where(P.c.key.in_(batch)))}
        unknown -= {k for (k,) in conn.execute(select(TRASH.c.key).where(TRASH.c.key.in_(batch)))}
    return unknown


def find_orphans(
    catalog: Catalog, listing: Mapping[str, tuple[int, float | None]], cutoff: float | None
) -> list[str]:
    """Listed objects the catalog does not know (read after the listing), older than ``cutoff``
    (seconds since the epoch; None: any age). An object whose backend reports no time is kept."""
    cands = sorted(
        k
        for k, (_, mtime) in listing.items()
        if cutoff is None or (mtime is not None and mtime < cutoff)
    )
    if not cands:
        return []
    with catalog_read(catalog) as conn:
        return sorted(unknown_keys(conn, cands))


def stale_temp_files(blobs: BlobStore, cutoff: float, catalog: Catalog) -> list[str]:
    """Temp files (local folders) and unfinished multipart uploads (S3) older than ``cutoff``,
    except uploads of packs that a commit still in flight owns: however long a live commit
    takes, gc never breaks it."""
    handles = list(blobs.stale_temp_files(cutoff))
    keys = {h: blobs.temp_file_key(h) for h in handles}
    named = sorted({k for k in keys.values() if k})
    if not named:
        return handles
    live_owner = P.c.owner_checkpoint_id.in_(select(C.c.id).where(C.c.status == PENDING))
    with catalog_read(catalog) as conn:
        live = {k for (k,) in conn.execute(select(P.c.key).where(P.c.key.in_(named), live_owner))}
    return [h for h in handles if keys[h] not in live]


def _delete_objects(blobs: BlobStore, keys: Sequence[str], phase: str, progress: Progress | None,
                    after_batch: Callable[[list[str]], None] | None = None) -> None:  # fmt: skip
    for i in range(0, len(keys), 100):
        batch = list(keys[i : i + 100])
        blobs.delete(batch)
        if after_batch is not None:
            after_batch(batch)
        if progress is not None:
            progress(phase, min(i + 100, len(keys)), len(keys))


def remove_temp_files(blobs: BlobStore, handles: Sequence[str]) -> int:
    return blobs.discard_temp_files(handles)


# -- gc -----------------------------------------------------------------------------------------
def collect(
    catalog: Catalog,
    blobs: BlobStore,
    *,
    policy: Policy | None = None,
    run: str | None = None,
    dry_run: bool = False,
    grace: float = DEFAULT_GRACE,
    progress: Progress | None = None,
) -> GcReport:
    """Apply retention policies and sweep; see the module docstring for the order.

    ``policy`` replaces the stored policy of ``run`` (or of every run, when ``run`` is None) for
    this call; without it each run's stored policy applies, and a run with none keeps everything.
    """
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise PolicyError(f"grace must be a number of seconds >= 0, got {grace!r}")
    if policy is not None and not isinstance(policy, Policy):
        raise PolicyError(f"policy must be a ckstore.maintenance.retention.Policy, got {type(policy).__name__}")
    t0 = time.perf_counter()
    now = utcnow()
    cutoff = time.time() - grace
    listing = list_packs(blobs, progress)  # before any catalog read: see find_orphans

    try:
        with catalog_write(catalog, lock="exclusive") as conn:
            runs = apply_policies(conn, policy, run, now)
            reaped = reap_abandoned(conn, grace, now)
            chunks, chunk_bytes, trashed = sweep(conn, now)
            trash_keys = sorted(k for (k,) in conn.execute(select(TRASH.c.key)))
            if dry_run:
                raise _Rollback
    except _Rollback:
        pass
    trash_bytes = sum(listing[k][0] if k in listing else trashed.get(k, 0) for k in trash_keys)
    in_trash = set(trash_keys)
    orphans = [k for k in find_orphans(catalog, listing, cutoff) if k not in in_trash]
    orphan_bytes = sum(listing[k][0] for k in orphans)
    temps = stale_temp_files(blobs, cutoff, catalog)

    if not dry_run:

        def forget(batch: list[str]) -> None:
            with catalog_write(catalog) as conn:
                conn.execute(delete(TRASH).where(TRASH.c.key.in_(batch)))

        _delete_objects(blobs, trash_keys, "delete", progress, forget)
        _delete_objects(blobs, orphans, "orphans", progress)
        remove_temp_files(blobs, temps)

    return GcReport(
        dry_run=dry_run,
        runs=tuple(runs),
        reaped=tuple(reaped),
        chunks_freed=chunks,
        chunk_bytes_freed=chunk_bytes,
        packs_deleted=len(trash_keys),
        pack_bytes_freed=trash_bytes,
        orphans_deleted=tuple(orphans),
        orphan_bytes_freed=orphan_bytes,
        temp_files_deleted=len(temps),
        grace=float(grace),
        seconds=time.perf_counter() - t0,
    )
