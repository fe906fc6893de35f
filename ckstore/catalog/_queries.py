"""Read queries that build records: checkpoint records, ref resolution, listings, manifests and
chunk locations.

Catalog rows are untrusted: a row damaged outside ckstore (a world layout that is not JSON, a
metric that is not a number) makes that one checkpoint unreadable, never a listing. Listings
skip it with a :class:`CorruptRowWarning`; resolving it raises :class:`IntegrityError` naming
its run and step.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, bindparam, delete, exists, func, select

from ..errors import CheckpointNotFoundError, CkstoreError, IntegrityError, InvalidRefError
from ..layout import WorldLayout
from ..records import Checkpoint
from ..refs import Ref
from ._access import CatalogBase, execute
from ._rows import (
    CHECKPOINTS,
    CHUNK_REFS,
    CHUNKS,
    ENTRIES,
    METRICS,
    PACKS,
    RUNS,
    TAGS,
    ChunkLocation,
    Pending,
    aware,
    batches,
    pending_row,
    run_id,
)
from ._schema import COMMITTED, PENDING

__all__ = ["CheckoutRows", "CorruptRowWarning", "Loaded", "QueriesMixin", "load_records", "resolve_ref"]


class CorruptRowWarning(UserWarning):
    """A listing skipped a checkpoint whose catalog rows are damaged."""


@dataclass(frozen=True, slots=True)
class _Corrupt:
    run: str
    step: int
    problem: str

    def describe(self) -> str:
        return (
            f"the catalog rows of checkpoint {self.run}@{self.step} are corrupt ({self.problem}); "
            "they were changed outside ckstore: restore the catalog from a backup, or fix that row"
        )


@dataclass(frozen=True, slots=True)
class Loaded:
    """Checkpoint records by id, and the ids whose rows could not be read."""

    records: dict[int, Checkpoint] = field(default_factory=dict)
    corrupt: dict[int, _Corrupt] = field(default_factory=dict)

    def listed(self, ids: Sequence[int]) -> list[Checkpoint]:
        """The records of ``ids`` in that order; a corrupt one is skipped with a warning."""
        for i in ids:
            if i in self.corrupt:
                warnings.warn(CorruptRowWarning(f"skipped: {self.corrupt[i].describe()}"), stacklevel=4)
        return [self.records[i] for i in ids if i in self.records]

    def one(self, ckpt_id: int) -> Checkpoint:
        if ckpt_id in self.corrupt:
            raise IntegrityError(self.corrupt[ckpt_id].describe())
        if ckpt_id not in self.records:
            raise CheckpointNotFoundError(f"checkpoint #{ckpt_id} no longer exists")
        return self.records[ckpt_id]


def _metric(value: Any) -> float:
    if value is None:
        return math.nan  # NaN is stored as NULL
    if isinstance(value, (bytes, str)):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


def _ids() -> Any:
    return bindparam("ids", expanding=True)


_PARENT, _PRUN = CHECKPOINTS.alias("parent"), RUNS.alias("prun")
#: statements built once (building one costs more than running it, on checkout's hot path)
_ROWS = (
    select(CHECKPOINTS, RUNS.c.name.label("run_name"), _PARENT.c.step.label("pstep"), _PRUN.c.name.label("prun"))
    .select_from(
        CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
        .outerjoin(_PARENT, _PARENT.c.id == CHECKPOINTS.c.parent_checkpoint_id)
        .outerjoin(_PRUN, _PRUN.c.id == _PARENT.c.run_id)
    )
    .where(CHECKPOINTS.c.id.in_(_ids()))
)
_METRICS = select(METRICS).where(METRICS.c.checkpoint_id.in_(_ids()))
_TAGS = select(TAGS.c.checkpoint_id, TAGS.c.name).where(TAGS.c.checkpoint_id.in_(_ids()))
_LAYOUT = (
    select(ENTRIES.c.checkpoint_id, ENTRIES.c.rank, ENTRIES.c.sub_key)
    .where(ENTRIES.c.checkpoint_id.in_(_ids()))
    .order_by(ENTRIES.c.id)
)
_LOCATIONS = (
    select(
        CHUNKS.c.digest, PACKS.c.key, CHUNKS.c.offset, CHUNKS.c.length, CHUNKS.c.raw_size, CHUNKS.c.codec, CHUNKS.c.base
    )
    .select_from(CHUNKS.join(PACKS, PACKS.c.id == CHUNKS.c.pack_id))
    .where(CHUNKS.c.digest.in_(bindparam("digests", expanding=True)))
)
_LOCATIONS_OF = (
    select(
        CHUNKS.c.digest, PACKS.c.key, CHUNKS.c.offset, CHUNKS.c.length, CHUNKS.c.raw_size, CHUNKS.c.codec, CHUNKS.c.base
    )
    .select_from(
        CHUNK_REFS.join(CHUNKS, CHUNKS.c.id == CHUNK_REFS.c.chunk_id).join(PACKS, PACKS.c.id == CHUNKS.c.pack_id)
    )
    .where(CHUNK_REFS.c.checkpoint_id == bindparam("ckpt"))
)
_ENTRIES = (
    select(ENTRIES.c.rank, ENTRIES.c.sub_key, ENTRIES.c.manifest)
    .where(ENTRIES.c.checkpoint_id == bindparam("ckpt"))
    .order_by(ENTRIES.c.rank, ENTRIES.c.id)
)
_ENTRIES_WITH_ID = _ENTRIES.add_columns(ENTRIES.c.id)


def load_records(
    conn: Connection, ids: Sequence[int], layouts: Mapping[int, tuple[set[int], list[str]]] | None = None
) -> Loaded:
    """The :class:`Checkpoint` records of checkpoint rows ``ids`` (missing ones left out);
    ``layouts``: their ranks and sub-checkpoint keys (in the order of their entries' ids), when
    the caller read them already."""
    out = Loaded()
    for batch in batches(list(ids)):
        params = {"ids": list(batch)}
        rows = execute(conn, _ROWS, params).all()
        problems: dict[int, str] = {}
        metrics: dict[int, dict[str, float]] = {}
        # names in code point order, here rather than by ORDER BY: a PostgreSQL collation may
        # order them otherwise, and a record reads the same from every catalog
        for m in sorted(execute(conn, _METRICS, params), key=lambda m: m.name):
            try:
                metrics.setdefault(m.checkpoint_id, {})[m.name] = _metric(m.value)
            except (TypeError, ValueError) as err:
                problems.setdefault(m.checkpoint_id, f"metric {m.name!r}: {err}")
        tags: dict[int, list[str]] = {}
        for t in sorted(execute(conn, _TAGS, params), key=lambda t: t.name):
            tags.setdefault(t.checkpoint_id, []).append(t.name)
        layout: dict[int, tuple[set[int], list[str]]] = {}
        if layouts is not None:
            layout = {i: layouts[i] for i in batch if i in layouts}
        else:
            for e in execute(conn, _LAYOUT, params):
                ranks, keys = layout.setdefault(e.checkpoint_id, (set(), []))
                ranks.add(e.rank)
                if e.sub_key not in keys:
                    keys.append(e.sub_key)
        for r in rows:
            ranks, keys = layout.get(r.id, (set(), []))
            _build(out, r, problems.get(r.id), metrics.get(r.id, {}), tags.get(r.id, ()), ranks, keys)
    return out


def written_record(
    conn: Connection, ckpt_id: int, metrics: dict[str, float], tags: Sequence[str], entries: Sequence[tuple[int, str]]
) -> Checkpoint:
    """The :class:`Checkpoint` record of a checkpoint this transaction just wrote, from its row
    and the ``metrics``, ``tags`` and entries ``(rank, sub_key)`` (in order) it wrote: what
    :func:`load_records` would read back, without reading them again."""
    out = Loaded()
    keys = list(dict.fromkeys(k for _, k in entries))
    for r in execute(conn, _ROWS, {"ids": [ckpt_id]}):
        values = {k: math.nan if math.isnan(v) else float(v) for k, v in sorted(metrics.items())}
        _build(out, r, None, values, sorted(set(tags)), {rank for rank, _ in entries}, keys)
    return out.one(ckpt_id)


def _build(
    out: Loaded,
    r: Any,
    problem: str | None,
    metrics: dict[str, float],
    tags: Iterable[str],
    ranks: set[int],
    keys: list[str],
) -> None:
    """Add checkpoint row ``r`` (a ``_ROWS`` row) to ``out``, as a record or as corrupt."""
    try:
        world = WorldLayout.from_json(json.loads(r.world_layout))
    except (ValueError, TypeError, KeyError, CkstoreError) as err:
        problem = problem or f"world layout {str(r.world_layout)[:80]!r}: {err}"
    if problem is not None:
        out.corrupt[r.id] = _Corrupt(r.run_name, int(r.step), problem)
        return
    out.records[r.id] = Checkpoint(
        id=r.id,
        run=r.run_name,
        step=int(r.step),
        kind=r.kind,
        status=r.status,
        created_at=aware(r.created_at),
        committed_at=aware(r.committed_at),
        logical_bytes=int(r.logical_bytes or 0),
        stored_bytes_added=int(r.stored_bytes_added or 0),
        world_layout=world,
        metrics=metrics,
        tags=tuple(tags),
        ranks=tuple(sorted(ranks)),
        sub_keys=tuple(keys),
        parent=f"{r.prun}@{r.pstep}" if r.prun is not None else None,
    )


# the refs resolved most often, built once (a metric's best is built per call)
_REF_BASE = (
    select(CHECKPOINTS.c.id, RUNS.c.name)
    .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
    .where(CHECKPOINTS.c.status == COMMITTED)
)
_IN_RUN = RUNS.c.name == bindparam("run")
_LATEST_IN_RUN = _REF_BASE.where(_IN_RUN).order_by(CHECKPOINTS.c.step.desc(), CHECKPOINTS.c.committed_at.desc()).limit(1)
_LATEST = _REF_BASE.order_by(CHECKPOINTS.c.committed_at.desc(), CHECKPOINTS.c.id.desc()).limit(1)
_STEP = _REF_BASE.where(CHECKPOINTS.c.step == bindparam("step")).limit(2)
_STEP_IN_RUN = _STEP.where(_IN_RUN)
_TAG = _REF_BASE.join(TAGS, TAGS.c.checkpoint_id == CHECKPOINTS.c.id).where(TAGS.c.name == bindparam("tag")).limit(2)
_TAG_IN_RUN = _TAG.where(_IN_RUN)


def resolve_ref(conn: Connection, ref: Ref, run: str | None) -> int:
    """The id of the committed checkpoint ``ref`` names, within ``run`` when given."""
    where = f" in run {run!r}" if run else ""
    if ref.kind == "latest":
        row = (execute(conn, _LATEST) if run is None else execute(conn, _LATEST_IN_RUN, {"run": run})).first()
        if row is None:
            raise CheckpointNotFoundError(f"no committed checkpoint{where} yet")
    elif ref.kind == "step":
        by_step = {"step": ref.value}
        rows = (execute(conn, _STEP, by_step) if run is None else execute(conn, _STEP_IN_RUN, {**by_step, "run": run})).all()
        if not rows:
            raise CheckpointNotFoundError(f"no committed checkpoint at step {ref.value}{where} (see `ckstore log`)")
        if len(rows) > 1:
            raise InvalidRefError(
                f"step {ref.value} exists in several runs ({', '.join(r.name for r in rows)}); "
                f"name one, as in {rows[0].name}@{ref.value}"
            )
        row = rows[0]
    elif ref.kind == "tag":
        by_tag = {"tag": ref.value}
        rows = (execute(conn, _TAG, by_tag) if run is None else execute(conn, _TAG_IN_RUN, {**by_tag, "run": run})).all()
        if not rows:
            raise CheckpointNotFoundError(f"no checkpoint tagged {ref.value!r}{where} (see `ckstore log`)")
        if len(rows) > 1:
            raise InvalidRefError(
                f"tag {ref.value!r} exists in several runs ({', '.join(r.name for r in rows)}); "
                f"name one, as in {rows[0].name}@{ref.value}"
            )
        row = rows[0]
    else:
        q = _REF_BASE if run is None else _REF_BASE.where(RUNS.c.name == run)
        value = METRICS.c.value.asc() if ref.kind == "min" else METRICS.c.value.desc()
        ranked = [METRICS.c.name == ref.value, METRICS.c.value.is_not(None)]
        if conn.dialect.name == "sqlite":  # a damaged value stored as text ranks like a missing one
            ranked.append(func.typeof(METRICS.c.value).in_(("real", "integer")))
        row = conn.execute(
            q.join(METRICS, METRICS.c.checkpoint_id == CHECKPOINTS.c.id)
            .where(*ranked)
            .order_by(value, CHECKPOINTS.c.step.desc())
            .limit(1)
        ).first()
        if row is None:
            raise CheckpointNotFoundError(f"no committed checkpoint{where} has metric {ref.value!r}")
    return int(row.id)


class QueriesMixin(CatalogBase):
    def checkpoints(self, run: str | None = None, *, status: str = COMMITTED) -> list[Checkpoint]:
        """Checkpoints of ``run`` (or of every run) by run and step; one whose rows are corrupt is
        skipped with a :class:`CorruptRowWarning`."""
        with self._read() as conn:
            q = (
                select(CHECKPOINTS.c.id)
                .join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
                .where(CHECKPOINTS.c.status == status)
            )
            if run is not None:
                run_id(conn, run)
                q = q.where(RUNS.c.name == run)
            ids = [i for (i,) in conn.execute(q.order_by(RUNS.c.id, CHECKPOINTS.c.step))]
            return load_records(conn, ids).listed(ids)

    def get(self, ckpt_id: int) -> Checkpoint:
        with self._read() as conn:
            return load_records(conn, [ckpt_id]).one(ckpt_id)

    def resolve(self, ref: Ref, default_run: str | None = None) -> Checkpoint:
        run = ref.run or default_run
        with self._read() as conn:
            if run is not None:
                run_id(conn, run)  # an unknown run is an error of its own
            found = resolve_ref(conn, ref, run)
            return load_records(conn, [found]).one(found)

    def checkout_rows(
        self,
        ref: Ref,
        default_run: str | None,
        scope: Callable[[Checkpoint], tuple[Iterable[int] | None, Iterable[str] | None]],
        *,
        locations: bool,
    ) -> CheckoutRows:
        """What a checkout reads of the catalog, from one snapshot: the checkpoint ``ref`` names
        (as :meth:`resolve`), its entries for the ranks and sub-checkpoints ``scope`` picks once
        it is known (None: all; ``scope`` may raise to refuse the checkout), and with
        ``locations`` (a checkout of all of it) every chunk location the checkpoint references
        (as :meth:`chunk_locations` with ``checkpoint_id``). One read transaction instead of
        three: a 4 MiB checkout from the page cache spent a fifth of its time opening and
        closing them."""
        run = ref.run or default_run
        with self._read() as conn:
            try:
                found = resolve_ref(conn, ref, run)
            except CheckpointNotFoundError:
                if run is not None:
                    run_id(conn, run)  # a run that does not exist is named as such
                raise
            where = None
            if locations:  # every entry: read once, for the record's layout too
                rows = execute(conn, _ENTRIES_WITH_ID, {"ckpt": found}).all()
                keys = list(dict.fromkeys(r.sub_key for r in sorted(rows, key=lambda r: r.id)))
                ckpt = load_records(conn, [found], {found: ({int(r.rank) for r in rows}, keys)}).one(found)
                scope(ckpt)
                entries = [(int(r.rank), r.sub_key, bytes(r.manifest)) for r in rows]
                packs: dict[str, str] = {}
                where = {bytes(r.digest): _location(r, packs) for r in execute(conn, _LOCATIONS_OF, {"ckpt": found}).all()}
            else:
                ckpt = load_records(conn, [found]).one(found)
                ranks, sub_keys = scope(ckpt)
                entries = _entries(conn, found, ranks, sub_keys)
        return CheckoutRows(ckpt, entries, where)

    def entries(
        self, ckpt_id: int, *, ranks: Iterable[int] | None = None, sub_keys: Iterable[str] | None = None
    ) -> list[tuple[int, str, bytes]]:
        """``(rank, sub_key, manifest)`` of a checkpoint's entries, by rank."""
        with self._read() as conn:
            return _entries(conn, ckpt_id, ranks, sub_keys)

    def chunk_locations(
        self, digests: Iterable[bytes], *, checkpoint_id: int | None = None
    ) -> dict[bytes, ChunkLocation]:
        """Where each chunk of ``digests`` is stored (a digest the catalog lacks is left out).

        ``checkpoint_id``: most of the digests are chunks of that checkpoint (a checkout of all
        of it): its chunks' locations are read in one query, through its references, and only
        the digests it does not reference are looked up by digest, a batch at a time.
        """
        wanted = list(dict.fromkeys(digests))
        out: dict[bytes, ChunkLocation] = {}
        packs: dict[str, str] = {}
        with self._read() as conn:
            if checkpoint_id is not None:
                want = set(wanted)
                for r in execute(conn, _LOCATIONS_OF, {"ckpt": checkpoint_id}).all():
                    d = bytes(r.digest)
                    if d in want:
                        out[d] = _location(r, packs)
                wanted = [d for d in wanted if d not in out]
            for batch in batches(wanted):
                for r in execute(conn, _LOCATIONS, {"digests": batch}).all():
                    out[bytes(r.digest)] = _location(r, packs)
        return out

    def is_empty(self) -> bool:
        """True when the catalog records no run and no pack yet."""
        with self._read() as conn:
            return not conn.execute(select(exists(select(RUNS.c.id)) | exists(select(PACKS.c.id)))).scalar()

    def stored_bytes(self) -> int:
        """Stored (compressed) bytes of every chunk the catalog records."""
        with self._read() as conn:
            return int(conn.execute(select(func.coalesce(func.sum(CHUNKS.c.length), 0))).scalar_one())

    def pending(self) -> list[Pending]:
        """Pending checkpoints (commits in flight, or dead ones gc has yet to reap), by id."""
        with self._read() as conn:
            return pending_checkpoints(conn)

    def delete_checkpoint(self, ckpt_id: int) -> None:
        """Remove a committed checkpoint's rows (its chunk references go with it)."""
        with self._write(lock="shared") as conn:
            conn.execute(delete(CHECKPOINTS).where(CHECKPOINTS.c.id == ckpt_id))


@dataclass(frozen=True, slots=True)
class CheckoutRows:
    """What :meth:`QueriesMixin.checkout_rows` read: the checkpoint, its ``(rank, sub_key,
    manifest)`` entries, and the locations of every chunk it references (None unless asked
    for)."""

    checkpoint: Checkpoint
    entries: list[tuple[int, str, bytes]]
    locations: dict[bytes, ChunkLocation] | None


def _entries(
    conn: Connection, ckpt_id: int, ranks: Iterable[int] | None, sub_keys: Iterable[str] | None
) -> list[tuple[int, str, bytes]]:
    if ranks is None and sub_keys is None:
        rows: Iterable[Any] = execute(conn, _ENTRIES, {"ckpt": ckpt_id})
    else:
        q = _ENTRIES
        if ranks is not None:
            q = q.where(ENTRIES.c.rank.in_(list(ranks)))
        if sub_keys is not None:
            q = q.where(ENTRIES.c.sub_key.in_(list(sub_keys)))
        rows = conn.execute(q, {"ckpt": ckpt_id})
    return [(int(r.rank), r.sub_key, bytes(r.manifest)) for r in rows]


def _location(r: Any, packs: dict[str, str]) -> ChunkLocation:
    """A chunk's location from its row; ``packs`` gives every location of a pack one key
    string (the driver makes one per row: ~8 MiB held through a checkout of 100,000 chunks)."""
    base = bytes(r.base) if r.base is not None else None
    return ChunkLocation(packs.setdefault(r.key, r.key), int(r.offset), int(r.length), int(r.raw_size), int(r.codec), base)


def pending_checkpoints(conn: Connection) -> list[Pending]:
    rows = conn.execute(
        select(CHECKPOINTS.c.id, RUNS.c.name, CHECKPOINTS.c.step, CHECKPOINTS.c.owner, CHECKPOINTS.c.heartbeat_at)
        .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
        .where(CHECKPOINTS.c.status == PENDING)
        .order_by(CHECKPOINTS.c.id)
    )
    return [pending_row(r) for r in rows]
