"""Read queries that build records: checkpoint records, ref resolution, listings, manifests and
chunk locations.

Catalog rows are untrusted: a row damaged outside ckstore (a world layout that is not JSON, a
metric that is not a number, a column holding a value of another type) makes that one
checkpoint unreadable, never a listing. Listings skip it with a :class:`CorruptRowWarning`;
resolving it, or reading its entries or chunk locations, raises :class:`IntegrityError` naming
its run, step, table and column.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
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

__all__ = [
    "CheckoutRows", "CorruptRowWarning", "Loaded", "QueriesMixin", "corrupt_value", "entry_values", "load_records",
    "resolve_ref",
]  # fmt: skip


class CorruptRowWarning(UserWarning):
    """A listing skipped a checkpoint whose catalog rows are damaged."""


@dataclass(frozen=True, slots=True)
class _Corrupt:
    run: str
    step: int | str  # (as the row holds it, when that is not an integer)
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


class _BadValue(ValueError):
    """A catalog column holds a value of another type (a row changed outside ckstore)."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(value: Any, column: str) -> int:
    """An integer column's value (a driver hands back integers; SQLite keeps any text as it is)."""
    if type(value) is int:
        return value
    raise _BadValue(f"column {column} holds {_short(value)}, not an integer")


def _blob(value: Any, column: str) -> bytes:
    """A binary column's value (never ``bytes(n)`` of an integer: that allocates ``n`` bytes)."""
    if type(value) is bytes:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise _BadValue(f"column {column} holds {type(value).__name__} {_short(value)[:40]}, not bytes")


def _time(value: Any, column: str) -> datetime:
    if isinstance(value, datetime):
        return aware(value)
    raise _BadValue(f"column {column} holds {_short(value)}, not a time")


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
        problems: dict[int, str] = {}
        try:
            rows = execute(conn, _ROWS, params).all()
        except (ValueError, TypeError):  # a value the driver cannot convert (a time that is not one)
            rows = _rows_one_by_one(conn, batch, out)
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
                if type(e.rank) is not int:
                    problems.setdefault(e.checkpoint_id, f"column entries.rank holds {_short(e.rank)}, not an integer")
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
    world = None
    try:
        world = WorldLayout.from_json(json.loads(r.world_layout))
    except (ValueError, TypeError, KeyError, CkstoreError) as err:
        problem = problem or f"world layout {str(r.world_layout)[:80]!r}: {err}"
    try:
        step = _int(r.step, "checkpoints.step")
        created_at = _time(r.created_at, "checkpoints.created_at")
        committed_at = None if r.committed_at is None else _time(r.committed_at, "checkpoints.committed_at")
        logical_bytes = _int(r.logical_bytes or 0, "checkpoints.logical_bytes")
        stored_bytes_added = _int(r.stored_bytes_added or 0, "checkpoints.stored_bytes_added")
    except _BadValue as err:
        problem = problem or str(err)
    if problem is not None or world is None:
        out.corrupt[r.id] = _Corrupt(r.run_name, r.step, problem or "world layout")
        return
    out.records[r.id] = Checkpoint(
        id=r.id,
        run=r.run_name,
        step=step,
        kind=r.kind,
        status=r.status,
        created_at=created_at,
        committed_at=committed_at,
        logical_bytes=logical_bytes,
        stored_bytes_added=stored_bytes_added,
        world_layout=world,
        metrics=metrics,
        tags=tuple(tags),
        ranks=tuple(sorted(ranks)),
        sub_keys=tuple(keys),
        parent=f"{r.prun}@{r.pstep}" if r.prun is not None else None,
    )


def _rows_one_by_one(conn: Connection, ids: Sequence[int], out: Loaded) -> list[Any]:
    """The ``_ROWS`` rows of ``ids`` read one at a time, when reading them together failed: a row
    whose value the driver cannot convert is recorded in ``out`` as corrupt, naming the column."""
    rows: list[Any] = []
    for i in ids:
        try:
            rows.extend(execute(conn, _ROWS, {"ids": [i]}).all())
            continue
        except (ValueError, TypeError) as err:
            problem = f"a column of table checkpoints: {err}"
        for col in CHECKPOINTS.c:
            try:
                conn.execute(select(col).where(CHECKPOINTS.c.id == i)).all()
            except (ValueError, TypeError) as err:
                problem = f"column checkpoints.{col.name}: {err}"
                break
        name = _run_and_step(conn, i)
        if name is not None:
            out.corrupt[i] = _Corrupt(name.name, name.step, problem)
    return rows


def _run_and_step(conn: Connection, ckpt_id: int) -> Any:
    """The run name and step (as the row holds it) of checkpoint ``ckpt_id``, or None."""
    return conn.execute(
        select(RUNS.c.name, CHECKPOINTS.c.step)
        .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
        .where(CHECKPOINTS.c.id == ckpt_id)
    ).first()


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
                entries = entry_values(conn, found, rows)
                keys = list(dict.fromkeys(r.sub_key for r in sorted(rows, key=lambda r: r.id)))
                ckpt = load_records(conn, [found], {found: ({r for r, _, _ in entries}, keys)}).one(found)
                scope(ckpt)
                where = _locations(execute(conn, _LOCATIONS_OF, {"ckpt": found}).all(), ckpt.ref)
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
                for d, loc in _locations(execute(conn, _LOCATIONS_OF, {"ckpt": checkpoint_id}).all(), None, packs).items():
                    if d in want:
                        out[d] = loc
                wanted = [d for d in wanted if d not in out]
            for batch in batches(wanted):
                out.update(_locations(execute(conn, _LOCATIONS, {"digests": batch}).all(), None, packs))
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
    return entry_values(conn, ckpt_id, rows)


def corrupt_value(conn: Connection, ckpt_id: int, problem: str) -> IntegrityError:
    """The error for a row of checkpoint ``ckpt_id`` (other than its own) holding a value of
    another type: it names the checkpoint's run and step, and ``problem`` the table and column."""
    row = _run_and_step(conn, ckpt_id)
    run, step = (row.name, row.step) if row is not None else ("?", f"#{ckpt_id}")
    return IntegrityError(_Corrupt(run, step, problem).describe())


def entry_values(conn: Connection, ckpt_id: int, rows: Iterable[Any]) -> list[tuple[int, str, bytes]]:
    """``(rank, sub_key, manifest)`` of entry rows of checkpoint ``ckpt_id``; a value of another
    type is an :class:`IntegrityError` naming the checkpoint, the entry and the column."""
    out = []
    for r in rows:
        try:
            out.append((_int(r.rank, "entries.rank"), r.sub_key, _blob(r.manifest, "entries.manifest")))
        except _BadValue as err:
            raise corrupt_value(conn, ckpt_id, f"its entry of rank {_short(r.rank)}, {r.sub_key}: {err}") from None
    return out


def _locations(rows: Sequence[Any], ref: str | None, packs: dict[str, str] | None = None) -> dict[bytes, ChunkLocation]:
    """Chunk locations from their rows; ``packs`` gives every location of a pack one key string
    (the driver makes one per row: ~8 MiB held through a checkout of 100,000 chunks). A value of
    another type is an :class:`IntegrityError` naming the chunk and the column (and checkpoint
    ``ref``, when the rows are its chunks)."""
    if packs is None:
        packs = {}
    try:
        # (a digest or base that is not bytes is never given to bytes(): of an integer n, that
        # allocates n bytes)
        return {
            r.digest if type(r.digest) is bytes else _blob(r.digest, "chunks.digest"): ChunkLocation(
                packs.setdefault(r.key, r.key), int(r.offset), int(r.length), int(r.raw_size), int(r.codec),
                None if r.base is None else _blob(r.base, "chunks.base"),
            )
            for r in rows
        }  # fmt: skip
    except (TypeError, ValueError, OverflowError) as err:
        first = str(err)
    for r in rows:  # (only when one is damaged: name it)
        digest = r.digest.hex() if isinstance(r.digest, bytes) else _short(r.digest)
        try:
            _blob(r.digest, "chunks.digest")
            for column in ("offset", "length", "raw_size", "codec"):
                _int(getattr(r, column), f"chunks.{column}")
            if r.base is not None:
                _blob(r.base, "chunks.base")
            if not isinstance(r.key, str):
                raise _BadValue(f"column packs.key holds {_short(r.key)}, not text")
        except _BadValue as err:
            first = f"chunk {digest}: {err}"
            break
    of = f" of checkpoint {ref}" if ref is not None else ""
    raise IntegrityError(
        f"the catalog row of a chunk{of} is corrupt ({first}); it was changed outside ckstore: restore "
        "the catalog from a backup, or fix that row (`ckstore fsck` lists the checkpoints it breaks)"
    )


def pending_checkpoints(conn: Connection) -> list[Pending]:
    rows = conn.execute(
        select(CHECKPOINTS.c.id, RUNS.c.name, CHECKPOINTS.c.step, CHECKPOINTS.c.owner, CHECKPOINTS.c.heartbeat_at)
        .select_from(CHECKPOINTS.join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id))
        .where(CHECKPOINTS.c.status == PENDING)
        .order_by(CHECKPOINTS.c.id)
    )
    return [pending_row(r) for r in rows]
