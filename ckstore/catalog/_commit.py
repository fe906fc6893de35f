"""The catalog's side of the commit protocol (call order in :mod:`ckstore.catalog`): a pending
checkpoint row claimed by its committer, its packs and chunks, and the one transaction that
makes it visible."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from sqlalchemy import BindParameter, Connection, Integer, bindparam, delete, exists, select, update
from sqlalchemy import exc as sa_exc

from .._crash import crash_point
from ..errors import AlreadyExistsError, CatalogError, CommitAbandonedError, CommitInProgressError
from ..layout import WorldLayout
from ..records import Checkpoint
from ._access import DriverStatement, execute
from ._owner import Owner, mark_live
from ._queries import written_record
from ._records import RecordFacts, read_facts
from ._rows import (
    CHECKPOINTS,
    CHUNK_REFS,
    CHUNKS,
    ENTRIES,
    METRICS,
    PACKS,
    RUN_ORIGIN,
    RUNS,
    ChunkRow,
    aware,
    batches,
    utcnow,
)
from ._runs import RunsMixin
from ._schema import COMMITTED, PENDING

__all__ = ["CommitMixin"]

# statements built once: building one costs more than running it, several times a commit
_ID: BindParameter[Any] = bindparam("ckpt")
# a commit's transactions lock their pending row (on PostgreSQL; SQLite has one writer at a time)
# against a takeover's DELETE, which then waits for the transaction and sees what it left
_OWN = (
    select(CHECKPOINTS.c.status, CHECKPOINTS.c.owner, CHECKPOINTS.c.run_id, CHECKPOINTS.c.step)
    .where(CHECKPOINTS.c.id == _ID)
    .with_for_update(read=True, key_share=True)
)
_STEP_ROWS = select(CHECKPOINTS.c.id, CHECKPOINTS.c.status, CHECKPOINTS.c.owner, CHECKPOINTS.c.heartbeat_at).where(
    CHECKPOINTS.c.run_id == bindparam("run"), CHECKPOINTS.c.step == bindparam("step")
)
_HEARTBEAT = (
    update(CHECKPOINTS)
    .where(CHECKPOINTS.c.id == _ID, CHECKPOINTS.c.status == PENDING, CHECKPOINTS.c.owner == bindparam("who"))
    .values(heartbeat_at=bindparam("now"))
)
_FOUND = select(CHUNKS.c.id, CHUNKS.c.digest).where(CHUNKS.c.digest.in_(bindparam("digests", expanding=True)))
_ADDED = select(CHUNKS.c.pack_id, CHUNKS.c.length).where(CHUNKS.c.digest.in_(bindparam("digests", expanding=True)))
_DROP_REFS = delete(CHUNK_REFS).where(
    CHUNK_REFS.c.checkpoint_id == _ID,
    CHUNK_REFS.c.chunk_id.in_(select(CHUNKS.c.id).where(CHUNKS.c.digest.in_(bindparam("digests", expanding=True)))),
)
_CHAINS = select(CHUNKS.c.digest, CHUNKS.c.chain).where(CHUNKS.c.digest.in_(bindparam("digests", expanding=True)))
_PACK_SIZE = update(PACKS).where(PACKS.c.id == bindparam("pack")).values(size=bindparam("new_size"))
_COMMITTED_AT_STEP = select(CHECKPOINTS.c.id).where(
    CHECKPOINTS.c.run_id == bindparam("run"), CHECKPOINTS.c.step == bindparam("step"), CHECKPOINTS.c.status == COMMITTED
)
_ANY_COMMITTED = (
    select(CHECKPOINTS.c.id).where(CHECKPOINTS.c.run_id == bindparam("run"), CHECKPOINTS.c.status == COMMITTED).limit(1)
)
_REF_OF = (
    select(RUNS.c.name, CHECKPOINTS.c.step)
    .join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
    .where(CHECKPOINTS.c.id == _ID, CHECKPOINTS.c.status == COMMITTED)
)
_CHUNK_COLUMNS = ("digest", "pack_id", "offset", "length", "raw_size", "codec", "base", "chain")
_NEW_PACK = PACKS.insert().returning(PACKS.c.id)
_RELEASE_PACKS = update(PACKS).where(PACKS.c.owner_checkpoint_id == _ID).values(owner_checkpoint_id=None)
_NEW_CHECKPOINT = CHECKPOINTS.insert().returning(CHECKPOINTS.c.id)
_NEW_ENTRIES = ENTRIES.insert()
_NEW_METRICS = METRICS.insert()
_DROP_CHECKPOINT = delete(CHECKPOINTS).where(CHECKPOINTS.c.id == _ID)
# a pending row taken over: still pending and still its committer's once its locks are released
_TAKE_OVER = delete(CHECKPOINTS).where(
    CHECKPOINTS.c.id == _ID, CHECKPOINTS.c.status == PENDING, CHECKPOINTS.c.owner == bindparam("who")
)
_MAKE_VISIBLE = (
    update(CHECKPOINTS)
    .where(CHECKPOINTS.c.id == _ID)
    .values(
        status=COMMITTED,
        committed_at=bindparam("at"),
        logical_bytes=bindparam("logical"),
        stored_bytes_added=bindparam("added"),
    )
)
# packs registered for a commit and never written (none of their chunks recorded)
_DROP_UNUSED_PACKS = delete(PACKS).where(
    PACKS.c.id.in_(bindparam("packs", expanding=True)),
    PACKS.c.owner_checkpoint_id == _ID,
    ~exists().where(CHUNKS.c.pack_id == PACKS.c.id),
)


class CommitMixin(RunsMixin):
    @cached_property
    def _chunk_statements(self) -> _ChunkStatements:
        return _ChunkStatements.build(self._insert, self.engine.dialect)

    def begin_checkpoint(
        self,
        run: str,
        step: int,
        *,
        kind: str,
        replace: bool,
        owner: Owner,
        world_layout: WorldLayout,
        lease_seconds: float,
        parent_checkpoint_id: int | None = None,
        fork_point: bool = False,
    ) -> int:
        """Insert a pending checkpoint row for ``(run, step)`` and return its id.

        Its parent is ``parent_checkpoint_id``; with none and ``fork_point``, a forked run's
        first commit descends from the checkpoint the run was forked from, if it still exists.

        A pending row whose owner is gone (a dead process on this host, a commit of this process
        that failed without cleaning up, or a lease not renewed in time) is taken over; a live
        one raises :class:`CommitInProgressError`. When this fails, the owner is no longer live:
        a pending row the failure left behind is taken over by the next commit of the step.
        """
        args = (run, step, kind, replace, owner, world_layout, lease_seconds, parent_checkpoint_id, fork_point)
        return self._opening(owner, args, None, None)[0]

    def begin_and_claim(
        self,
        run: str,
        step: int,
        *,
        kind: str,
        replace: bool,
        owner: Owner,
        world_layout: WorldLayout,
        lease_seconds: float,
        parent_checkpoint_id: int | None = None,
        fork_point: bool = False,
        digests: Iterable[bytes],
        keys_for: Callable[[set[bytes]], Sequence[str]],
        chains: dict[bytes, int] | None = None,
    ) -> tuple[int, set[bytes], list[tuple[str, int]]]:
        """:meth:`begin_checkpoint` and :meth:`claim_and_register` in one transaction, for a
        commit that knows its chunks before it opens its pending checkpoint (a single process
        hashes first): the pending checkpoint's id, the digests the catalog does not have, and
        the ``(key, id)`` of the packs ``keys_for(missing)`` names. One transaction fewer a
        commit (its BEGIN, ownership check and COMMIT). ``chains``: see :meth:`claim_chunks`."""
        args = (run, step, kind, replace, owner, world_layout, lease_seconds, parent_checkpoint_id, fork_point)
        ckpt_id, claimed = self._opening(owner, args, (list(digests), keys_for, chains), "shared")
        assert claimed is not None
        return ckpt_id, claimed[0], claimed[1]

    def _opening(
        self,
        owner: Owner,
        args: tuple[Any, ...],
        claim: tuple[list[bytes], Callable[[set[bytes]], Sequence[str]], dict[bytes, int] | None] | None,
        lock: str | None,
    ) -> tuple[int, tuple[set[bytes], list[tuple[str, int]]] | None]:
        """Open the pending checkpoint (``args``: :meth:`begin_checkpoint`'s), then claim and
        register in the same transaction when ``claim`` is given; retried when another commit of
        the step inserted its row meanwhile."""
        mark_live(owner.nonce, True)  # until finish_checkpoint, abort_checkpoint or a failure here
        for attempt in range(3):
            try:
                with self._write(lock=lock, durable=False) as conn:
                    ckpt_id = self._begin(conn, *args)
                    if claim is None:
                        return ckpt_id, None
                    missing = self._claim(conn, ckpt_id, claim[0], claim[2])
                    keys = list(claim[1](missing))
                    return ckpt_id, (missing, list(zip(keys, self._register(conn, ckpt_id, keys))))
            except BaseException as e:
                if isinstance(e, sa_exc.IntegrityError) and attempt < 2:
                    continue  # another commit of the step inserted its row meanwhile: look again
                # nothing of ours is in flight: a row this failure left (its COMMIT got through,
                # its answer was lost) belongs to a commit that failed, and is taken over
                mark_live(owner.nonce, False)
                raise
        raise AssertionError("unreachable")

    def _begin(
        self,
        conn: Connection,
        run: str,
        step: int,
        kind: str,
        replace: bool,
        owner: Owner,
        world_layout: WorldLayout,
        lease_seconds: float,
        parent_checkpoint_id: int | None,
        fork_point: bool,
    ) -> int:
        origin = execute(conn, RUN_ORIGIN, {"name": run}).first()
        rid = int(origin.id) if origin is not None else self._run_id(conn, run, create=True)
        parent = parent_checkpoint_id
        if parent is None and fork_point and origin is not None:
            parent = _fork_point(conn, rid, origin.parent_checkpoint_id, origin.parent_ref)
        while not self._free_step(conn, rid, run, step, replace, lease_seconds):
            pass  # a pending row's commit finished or gave up while we waited for it: look again
        now = utcnow()
        new_id = execute(
            conn,
            _NEW_CHECKPOINT,
            {
                "run_id": rid,
                "step": step,
                "status": PENDING,
                "kind": kind,
                "created_at": now,
                "heartbeat_at": now,
                "owner": str(owner),
                "world_layout": json.dumps(world_layout.to_json()),
                "logical_bytes": 0,
                "stored_bytes_added": 0,
                "parent_checkpoint_id": parent,
            },
        ).scalar()
        return int(new_id)

    def _free_step(self, conn: Connection, rid: int, run: str, step: int, replace: bool, lease_seconds: float) -> bool:
        """Take over an abandoned pending row of ``(run, step)``; False when that row changed
        before it could be deleted (a commit whose transaction was in flight: it may have made
        the step visible meanwhile), so the caller looks again. Raises when the step is taken."""
        now = utcnow()
        for r in execute(conn, _STEP_ROWS, {"run": rid, "step": step}).all():
            if r.status == COMMITTED and not replace:
                raise AlreadyExistsError(
                    f"run {run!r} already has a checkpoint at step {step}; pass replace=True "
                    "to overwrite it, or commit another step"
                )
            if r.status == PENDING:
                prev = Owner.parse(r.owner)
                age = (now - aware(r.heartbeat_at)).total_seconds()
                # a dead process, or a lease not renewed in time, gives the step up
                if prev.alive_here() is not False and age < lease_seconds:
                    raise CommitInProgressError(
                        f"step {step} of run {run!r} is being committed right now by "
                        f"{prev.describe()} (last heartbeat {age:.0f}s ago); wait for it to "
                        "finish or commit another step"
                    )
                if not execute(conn, _TAKE_OVER, {"ckpt": r.id, "who": r.owner}).rowcount:
                    return False
        return True

    def _own_pending(self, conn: Connection, ckpt_id: int, owner: Owner) -> Any:
        row = execute(conn, _OWN, {"ckpt": ckpt_id}).first()
        if row is None or row.status != PENDING or row.owner != str(owner):
            raise CommitAbandonedError(
                "this commit's claim was taken over while it was in flight (garbage collection or "
                "another commit judged it abandoned); nothing of it became visible. Commit again; "
                "if it happens again, raise gc's --grace or the store's lease"
            )
        return row

    def heartbeat(self, ckpt_id: int, owner: Owner) -> bool:
        """Refresh a pending checkpoint's lease; False when the claim was lost."""
        with self._write(durable=False) as conn:
            res = execute(conn, _HEARTBEAT, {"ckpt": ckpt_id, "who": str(owner), "now": utcnow()})
            return bool(res.rowcount)

    def claim_chunks(
        self, ckpt_id: int, owner: Owner, digests: Iterable[bytes], chains: dict[bytes, int] | None = None
    ) -> set[bytes]:
        """Reference every chunk the catalog already has; return the digests it does not have.
        ``chains`` (given by a commit that writes deltas: its candidate bases as keys): left
        holding those the catalog has, each with its delta depth (0: no delta), so the commit
        knows which it may write deltas against."""
        with self._write(lock="shared", durable=False) as conn:
            self._own_pending(conn, ckpt_id, owner)
            return self._claim(conn, ckpt_id, digests, chains)

    def claim_and_register(
        self,
        ckpt_id: int,
        owner: Owner,
        digests: Iterable[bytes],
        keys_for: Callable[[set[bytes]], Sequence[str]],
        chains: dict[bytes, int] | None = None,
    ) -> tuple[set[bytes], list[tuple[str, int]]]:
        """:meth:`claim_chunks` and :meth:`register_packs` in one transaction: the digests the
        catalog does not have, and the ``(key, id)`` of the packs ``keys_for(missing)`` names."""
        with self._write(lock="shared", durable=False) as conn:
            self._own_pending(conn, ckpt_id, owner)
            missing = self._claim(conn, ckpt_id, digests, chains)
            keys = list(keys_for(missing))
            return missing, list(zip(keys, self._register(conn, ckpt_id, keys)))

    def _claim(
        self, conn: Connection, ckpt_id: int, digests: Iterable[bytes], chains: dict[bytes, int] | None = None
    ) -> set[bytes]:
        wanted = list(dict.fromkeys(digests))
        found: set[bytes] = set()
        if chains:  # the candidate bases of a commit's deltas: those the catalog has, by depth
            depths = self._depths(conn, list(chains))
            chains.clear()
            chains.update(depths)
        for batch in batches(wanted):
            rows = execute(conn, _FOUND, {"digests": batch}).all()
            if rows:
                self._reference(conn, ckpt_id, [r.id for r in rows])
                found.update(bytes(r.digest) for r in rows)
        return set(wanted) - found

    def chain_depths(self, digests: Iterable[bytes]) -> dict[bytes, int]:
        """How many deltas deep each chunk of ``digests`` the catalog has is (0: no delta)."""
        with self._read() as conn:
            return self._depths(conn, list(digests))

    def _depths(self, conn: Connection, digests: list[bytes]) -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        for batch in batches(digests):
            out.update((bytes(r.digest), int(r.chain or 0)) for r in execute(conn, _CHAINS, {"digests": batch}))
        return out

    def _reference(self, conn: Connection, ckpt_id: int, chunk_ids: Sequence[int]) -> None:
        """Reference chunks from a checkpoint (a reference already there is kept)."""
        if chunk_ids:
            self._chunk_statements.insert_refs.executemany(conn, [(ckpt_id, i) for i in chunk_ids])

    def register_pack(self, ckpt_id: int, owner: Owner, key: str) -> int:
        """Record a pack before its object is written, owned by the pending checkpoint."""
        return self.register_packs(ckpt_id, owner, [key])[0]

    def register_packs(self, ckpt_id: int, owner: Owner, keys: Sequence[str]) -> list[int]:
        """:meth:`register_pack` for many keys in one transaction (a collective commit records
        every rank's packs up front); returns their ids in order."""
        with self._write(lock="shared", durable=False) as conn:
            self._own_pending(conn, ckpt_id, owner)
            return self._register(conn, ckpt_id, keys)

    def _register(self, conn: Connection, ckpt_id: int, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        now = utcnow()
        rows = [{"key": key, "size": 0, "created_at": now, "owner_checkpoint_id": ckpt_id} for key in keys]
        return [int(execute(conn, _NEW_PACK, row).scalar()) for row in rows]

    def add_chunks(self, ckpt_id: int, owner: Owner, pack_id: int, pack_size: int, chunks: Sequence[ChunkRow]) -> int:
        """Record a written pack's chunks and reference them; returns the stored bytes they added
        (a chunk another commit recorded first is referenced there instead). For commits that
        stream their packs; a commit that records all its packs at once passes them to
        :meth:`finish_checkpoint`."""
        with self._write(lock="shared", durable=False) as conn:
            self._own_pending(conn, ckpt_id, owner)
            return self._add_packs(conn, ckpt_id, [(pack_id, pack_size, chunks)], ())[0]

    def _add_packs(
        self,
        conn: Connection,
        ckpt_id: int,
        packs: Sequence[tuple[int, int, Sequence[ChunkRow]]],
        unused: Sequence[int],
    ) -> tuple[int, bool]:
        """Record the chunk rows of ``packs`` and reference them; returns the stored bytes they
        add, and whether every row was inserted here (none recorded by another commit first)."""
        added = 0
        all_ours = True
        # digest order across every pack: two commits inserting overlapping chunks lock them in
        # the same order, so on PostgreSQL one waits for the other instead of deadlocking
        ordered = sorted(((pack_id, c) for pack_id, _, chunks in packs for c in chunks), key=lambda pc: pc[1].digest)
        ours = {pack_id for pack_id, _, _ in packs}
        if packs:
            execute(conn, _PACK_SIZE, [{"pack": pack_id, "new_size": size} for pack_id, size, _ in packs])
        for dropped in batches(list(unused)):
            conn.execute(_DROP_UNUSED_PACKS, {"packs": dropped, "ckpt": ckpt_id})
        # executemany of one cached statement: a multi-row VALUES would be compiled anew for
        # every batch, which costs more than the inserts themselves
        st = self._chunk_statements
        for batch in batches(ordered):
            inserted = st.insert_chunks.executemany(
                conn,
                [(c.digest, pack_id, c.offset, c.length, c.raw_size, c.codec, c.base, c.chain) for pack_id, c in batch],
            )
            if inserted == len(batch):  # every row ours: what they add is known, and their
                added += sum(c.length for _, c in batch)  # references go in by pack, below
                continue
            all_ours = False
            # some rows another commit recorded first: reference the batch's chunks by digest,
            # wherever they were recorded, and ask which rows are ours (by digest only: a
            # condition on pack_id leads SQLite's planner to scan the pack's earlier rows)
            digests = [c.digest for _, c in batch]
            execute(conn, st.refs_by_digest, {"digests": digests, "ckpt": ckpt_id})
            rows = execute(conn, _ADDED, {"digests": digests})
            added += sum(int(r.length) for r in rows if r.pack_id in ours)
        # every chunk row in our packs is one this commit inserted: reference them all, a pack
        # at a time (a reference already there is kept)
        for pack_id, _, chunks in packs:
            if chunks:
                execute(conn, st.refs_by_pack, {"ckpt": ckpt_id, "pack": pack_id})
        return added, all_ours

    def finish_checkpoint(
        self,
        ckpt_id: int,
        owner: Owner,
        *,
        entries: Sequence[tuple[int, str, bytes, int]],
        metrics: dict[str, float],
        tags: Sequence[str],
        logical_bytes: int,
        stored_bytes_added: int = 0,
        replace: bool,
        committed_at: datetime | None = None,
        packs: Sequence[tuple[int, int, Sequence[ChunkRow]]] = (),
        unused: Sequence[int] = (),
        record: Callable[[int, RecordFacts], Callable[[], object]] | None = None,
        unneeded: Sequence[bytes] = (),
    ) -> Checkpoint:
        """Make the pending checkpoint visible, in one transaction; ``committed_at``: the commit
        time its blob-store record holds (now, when it has none).

        A commit that records all its packs at once (once every rank wrote its own) passes them
        here: ``packs``, every written pack ``(pack_id, pack_size, chunks)``, recorded first in
        the same transaction as :meth:`add_chunks` records one (the stored bytes they add count
        into ``stored_bytes_added``), and ``unused``, packs registered for the commit and never
        written, whose rows go. ``record`` is then called, in the transaction, with the stored
        bytes added and what the checkpoint's record needs (:meth:`record_facts`, chunk
        locations included); it starts writing the record and returns a function that waits
        until the record is durable, which runs before the COMMIT: the record is written while
        the transaction's other statements run, and is durable before the checkpoint is visible.

        A failure once every statement ran (the connection dropped at the COMMIT) raises a
        :class:`CatalogError` saying the step may or may not have been committed: the server may
        have committed it. Retrying the commit tells which: a step that did get through is
        refused as existing already (:class:`AlreadyExistsError`).

        ``unneeded``: chunks the claim referenced as candidate bases of deltas, none of them a
        chunk of the checkpoint: their references go, once the chunk rows of the deltas written
        against them are in (gc keeps a base while a delta of it is referenced)."""
        done: Checkpoint | None = None  # the checkpoint, once only the COMMIT is left
        try:
            with self._write(lock="shared") as conn:
                row = self._own_pending(conn, ckpt_id, owner)
                given: Sequence[tuple[int, int, Sequence[ChunkRow]]] = ()
                if packs or unused:
                    added, all_ours = self._add_packs(conn, ckpt_id, packs, unused)
                    stored_bytes_added += added
                    given = packs if all_ours else ()  # their chunks' locations, as recorded
                for dropped in batches(list(unneeded)):
                    execute(conn, _DROP_REFS, {"ckpt": ckpt_id, "digests": dropped})
                crash_point("pack.chunks_recorded")
                written = record(stored_bytes_added, read_facts(conn, ckpt_id, given)) if record is not None else None
                old = execute(conn, _COMMITTED_AT_STEP, {"run": row.run_id, "step": row.step}).scalar()
                if old is not None:
                    if not replace:
                        raise AlreadyExistsError(
                            f"step {row.step} was committed by another process meanwhile; pass replace=True "
                            "to overwrite it"
                        )
                    execute(conn, _DROP_CHECKPOINT, {"ckpt": old})
                for batch in batches(list(entries), 100):
                    execute(
                        conn,
                        _NEW_ENTRIES,
                        [
                            {"checkpoint_id": ckpt_id, "rank": r, "sub_key": k, "manifest": m, "logical_bytes": n}
                            for r, k, m, n in batch
                        ],
                    )
                if metrics:
                    execute(
                        conn,
                        _NEW_METRICS,
                        [
                            {"checkpoint_id": ckpt_id, "name": k, "value": None if math.isnan(v) else v}
                            for k, v in metrics.items()
                        ],
                    )
                for name in dict.fromkeys(tags):
                    self._set_tag(conn, row.run_id, name, ckpt_id)
                execute(
                    conn,
                    _MAKE_VISIBLE,
                    {"ckpt": ckpt_id, "at": committed_at or utcnow(), "logical": logical_bytes, "added": stored_bytes_added},
                )
                execute(conn, _RELEASE_PACKS, {"ckpt": ckpt_id})
                if written is not None:
                    written()  # the record is durable
                crash_point("finish.transaction")
                done = written_record(conn, ckpt_id, metrics, tags, [(r, k) for r, k, _, _ in entries])
            return done
        except CatalogError as e:
            if done is None:
                raise
            raise self._lost_at_commit(e, f"step {done.step} of run {done.run!r}") from e
        finally:
            mark_live(owner.nonce, False)

    def abort_checkpoint(self, ckpt_id: int, owner: Owner) -> None:
        """Drop a pending checkpoint of ours; what it wrote becomes garbage for gc."""
        mark_live(owner.nonce, False)
        with self._write() as conn:
            conn.execute(
                delete(CHECKPOINTS).where(
                    CHECKPOINTS.c.id == ckpt_id, CHECKPOINTS.c.status == PENDING, CHECKPOINTS.c.owner == str(owner)
                )
            )


def _fork_point(conn: Connection, rid: int, parent_id: int | None, parent_ref: str | None) -> int | None:
    """The checkpoint run ``rid`` was forked from (``parent_id``, ``parent_ref``: its run row's),
    while the run has no committed checkpoint of its own and that checkpoint still exists. A
    run keeps the id without a foreign key, and a database may reuse the id of a deleted row,
    so its ref must match too."""
    if parent_id is None or not parent_ref:
        return None
    if conn.execute(_ANY_COMMITTED, {"run": rid}).first() is not None:
        return None
    point = conn.execute(_REF_OF, {"ckpt": parent_id}).first()
    if point is None or f"{point.name}@{point.step}" != parent_ref:
        return None
    return int(parent_id)


@dataclass(frozen=True, slots=True)
class _ChunkStatements:
    """A dialect's statements of a commit's many-chunk steps, built once per catalog (see
    ``DriverStatement`` and ``execute``): inserts that skip rows already there, and references
    by a list of digests or by pack."""

    insert_chunks: DriverStatement  # rows of _CHUNK_COLUMNS
    insert_refs: DriverStatement  # rows of (checkpoint_id, chunk_id)
    refs_by_digest: Any  # a checkpoint's references to the chunks of these digests
    refs_by_pack: Any  # a checkpoint's references to every chunk of one pack

    @classmethod
    def build(cls, insert: Callable[[Any], Any], dialect: Any) -> _ChunkStatements:
        def refs_where(condition: Any) -> Any:
            chosen = select(bindparam("ckpt", type_=Integer), CHUNKS.c.id).where(condition)
            return insert(CHUNK_REFS).from_select(["checkpoint_id", "chunk_id"], chosen).on_conflict_do_nothing()

        return cls(
            DriverStatement(insert(CHUNKS).on_conflict_do_nothing(index_elements=["digest"]), dialect, _CHUNK_COLUMNS),
            DriverStatement(insert(CHUNK_REFS).on_conflict_do_nothing(), dialect, ("checkpoint_id", "chunk_id")),
            refs_where(CHUNKS.c.digest.in_(bindparam("digests", expanding=True))),
            refs_where(CHUNKS.c.pack_id == bindparam("pack")),
        )
