"""The catalog: what was saved, where its chunks live, and which checkpoints use them.

The catalog knows nothing of bytes. It records runs, checkpoints (pending while a commit is in
flight, then committed), entries with their manifests, packs, chunks, the chunks each checkpoint
references, metrics and tags.

Call order of a commit (one process, or rank 0 of a distributed commit)::

    begin_checkpoint  →  claim_chunks  →  (register_pack → write the pack → add_chunks)*
                      →  finish_checkpoint          (or abort_checkpoint on failure)

A collective commit registers every rank's packs at once (``register_packs``) before the ranks
write them, and records their chunks (``add_packs``) once every rank is done.

``heartbeat`` may be called from another thread at any time in between. Every method is safe to
call from many processes at once; ``docs/format.md`` explains why garbage collection running at
the same time never deletes a chunk a commit relies on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, delete, exists, func, select, update
from sqlalchemy import exc as sa_exc

from ..errors import (
    AlreadyExistsError,
    CatalogError,
    CheckpointNotFoundError,
    CommitAbandonedError,
    CommitInProgressError,
    NotFoundError,
)
from ..layout import WorldLayout
from ..records import Checkpoint, RunInfo
from ..refs import Ref, check_name
from ._engine import check_schema, make_engine, redact, upgrade_schema, write_txn
from ._queries import load_records, resolve_ref
from ._rows import (
    RUNS,
    TABLES,
    C,
    ChunkLocation,
    E,
    K,
    M,
    NewChunk,
    Owner,
    P,
    R,
    T,
    aware,
    batches,
    mark_live,
    utcnow,
)
from ._schema import COMMITTED, PENDING

__all__ = ["Catalog", "ChunkLocation", "NewChunk", "Owner", "TABLES", "utcnow"]

class Catalog:
    """The SQL catalog of one store (SQLite or PostgreSQL)."""

    def __init__(self, url: str, *, upgrade_hint: str = "ckstore db upgrade", check: bool = True) -> None:
        self.url = url
        self.engine: Engine = make_engine(url)
        self.dialect = self.engine.dialect.name
        if check:
            check_schema(self.engine, upgrade_hint)

    def __repr__(self) -> str:
        return f"Catalog({redact(self.url)!r})"

    def close(self) -> None:
        self.engine.dispose()

    def upgrade(self) -> tuple[str | None, str]:
        return upgrade_schema(self.engine)

    # -- plumbing -------------------------------------------------------------------------
    def transaction(self, lock: str | None = None) -> AbstractContextManager[Connection]:
        """A write transaction for set-based maintenance (gc, fsck); ``lock="exclusive"`` keeps
        commits from claiming chunks meanwhile. Database failures become :class:`CatalogError`."""
        return self._write(lock)

    def snapshot(self) -> AbstractContextManager[Connection]:
        """A read transaction that sees one snapshot of the catalog."""
        return self._read()

    @contextmanager
    def _write(self, lock: str | None = None) -> Iterator[Connection]:
        try:
            with write_txn(self.engine, lock) as conn:
                yield conn
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as e:
            raise CatalogError(
                f"catalog {redact(self.url)} failed during a write ({_reason(e)}); the transaction "
                "was rolled back, unless the connection dropped while it was committing. Retry once "
                "the catalog is reachable (a commit that did get through reports its step as taken)"
            ) from e

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with self.engine.connect() as conn:
                if self.dialect == "postgresql":  # one snapshot for every statement, as SQLite gives
                    conn = conn.execution_options(isolation_level="REPEATABLE READ")
                with conn.begin():
                    yield conn
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as e:
            raise CatalogError(
                f"reading catalog {redact(self.url)} failed ({_reason(e)}); retry once it is reachable"
            ) from e

    def _insert(self, table: Any) -> Any:
        if self.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return postgresql.insert(table)
        if self.dialect == "sqlite":
            from sqlalchemy.dialects import sqlite

            return sqlite.insert(table)
        raise CatalogError(f"catalog dialect {self.dialect} is not supported; use SQLite or PostgreSQL")

    # -- runs -----------------------------------------------------------------------------
    def _run_id(self, conn: Connection, name: str, *, create: bool = False) -> int:
        rid = conn.execute(select(RUNS.c.id).where(RUNS.c.name == name)).scalar()
        if rid is not None:
            return int(rid)
        if not create:
            raise NotFoundError(f"no run named {name!r} in this store (see `ckstore runs`)")
        check_name("run", name)
        conn.execute(
            self._insert(RUNS).values(name=name, created_at=utcnow()).on_conflict_do_nothing(index_elements=["name"])
        )
        return int(conn.execute(select(RUNS.c.id).where(RUNS.c.name == name)).scalar_one())

    def ensure_run(self, name: str, *, parent_checkpoint_id: int | None = None, parent_ref: str | None = None) -> None:
        with self._write() as conn:
            existed = conn.execute(select(RUNS.c.id, RUNS.c.parent_checkpoint_id).where(RUNS.c.name == name)).first()
            if existed is not None and parent_checkpoint_id is not None and existed.parent_checkpoint_id not in (
                None,
                parent_checkpoint_id,
            ):
                raise AlreadyExistsError(f"run {name!r} already exists with another parent")
            rid = self._run_id(conn, name, create=True)
            if parent_checkpoint_id is not None:
                conn.execute(
                    update(RUNS)
                    .where(RUNS.c.id == rid)
                    .values(parent_checkpoint_id=parent_checkpoint_id, parent_ref=parent_ref)
                )

    def runs(self) -> list[RunInfo]:
        with self._read() as conn:
            counts = (
                select(
                    C.c.run_id,
                    func.count().label("n"),
                    func.max(C.c.step).label("latest"),
                    func.sum(C.c.logical_bytes).label("logical"),
                )
                .where(C.c.status == COMMITTED)
                .group_by(C.c.run_id)
                .subquery()
            )
            rows = conn.execute(
                select(RUNS.c.name, RUNS.c.created_at, RUNS.c.parent_ref, counts.c.n, counts.c.latest, counts.c.logical)
                .select_from(RUNS.outerjoin(counts, counts.c.run_id == RUNS.c.id))
                .order_by(RUNS.c.created_at, RUNS.c.id)
            ).all()
        return [
            RunInfo(r.name, aware(r.created_at), int(r.n or 0), r.latest, r.parent_ref, int(r.logical or 0))  # type: ignore[arg-type]
            for r in rows
        ]

    def run_policy(self, name: str) -> str | None:
        with self._read() as conn:
            return conn.execute(select(RUNS.c.policy).where(RUNS.c.name == name)).scalar()

    def set_run_policy(self, name: str, policy_json: str | None) -> None:
        with self._write() as conn:
            rid = self._run_id(conn, name, create=True)
            conn.execute(update(RUNS).where(RUNS.c.id == rid).values(policy=policy_json))

    def lineage(self, name: str) -> list[str]:
        """Refs of a run's ancestors, nearest first (``["base@4000", "pretrain@90000"]``)."""
        out: list[str] = []
        seen = {name}
        with self._read() as conn:
            current = name
            while True:
                row = conn.execute(select(RUNS.c.parent_ref).where(RUNS.c.name == current)).first()
                if row is None or not row.parent_ref:
                    return out
                out.append(row.parent_ref)
                current = row.parent_ref.split("@", 1)[0]
                if current in seen:
                    return out
                seen.add(current)

    def run_origin(self, name: str) -> tuple[int | None, str | None, int] | None:
        """``(parent_checkpoint_id, parent_ref, committed checkpoints)`` of a run; None if no such run."""
        with self._read() as conn:
            row = conn.execute(
                select(RUNS.c.id, RUNS.c.parent_checkpoint_id, RUNS.c.parent_ref).where(RUNS.c.name == name)
            ).first()
            if row is None:
                return None
            n = conn.execute(
                select(func.count()).select_from(C).where(C.c.run_id == row.id, C.c.status == COMMITTED)
            ).scalar_one()
        return row.parent_checkpoint_id, row.parent_ref, int(n)

    # -- commit protocol --------------------------------------------------------------------
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
    ) -> int:
        """Insert a pending checkpoint row for ``(run, step)`` and return its id.

        A pending row whose owner is gone (a dead process on this host, a commit of this process
        that failed without cleaning up, or a lease not renewed in time) is taken over; a live
        one raises :class:`CommitInProgressError`.
        """
        mark_live(owner.nonce, True)  # until finish_checkpoint or abort_checkpoint
        for attempt in range(3):
            try:
                with self._write() as conn:
                    rid = self._run_id(conn, run, create=True)
                    rows = conn.execute(
                        select(C.c.id, C.c.status, C.c.owner, C.c.heartbeat_at).where(
                            C.c.run_id == rid, C.c.step == step
                        )
                    ).all()
                    now = utcnow()
                    for r in rows:
                        if r.status == COMMITTED and not replace:
                            raise AlreadyExistsError(
                                f"run {run!r} already has a checkpoint at step {step}; pass replace=True "
                                "to overwrite it, or commit another step"
                            )
                        if r.status == PENDING:
                            prev = Owner.parse(r.owner)
                            age = (now - aware(r.heartbeat_at)).total_seconds()  # type: ignore[operator]
                            # a dead process, or a lease not renewed in time, gives the step up
                            if prev.alive_here() is not False and age < lease_seconds:
                                raise CommitInProgressError(
                                    f"step {step} of run {run!r} is being committed right now by "
                                    f"{prev.describe()} (last heartbeat {age:.0f}s ago); wait for it to "
                                    "finish or commit another step"
                                )
                            conn.execute(delete(C).where(C.c.id == r.id))
                    res = conn.execute(
                        C.insert().values(
                            run_id=rid,
                            step=step,
                            status=PENDING,
                            kind=kind,
                            created_at=now,
                            heartbeat_at=now,
                            owner=str(owner),
                            world_layout=json.dumps(world_layout.to_json()),
                            logical_bytes=0,
                            stored_bytes_added=0,
                            parent_checkpoint_id=parent_checkpoint_id,
                        )
                    )
                    return int(res.inserted_primary_key[0])  # type: ignore[index]
            except sa_exc.IntegrityError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _own_pending(self, conn: Connection, ckpt_id: int, owner: Owner) -> Any:
        row = conn.execute(select(C.c.status, C.c.owner, C.c.run_id, C.c.step).where(C.c.id == ckpt_id)).first()
        if row is None or row.status != PENDING or row.owner != str(owner):
            raise CommitAbandonedError(
                "this commit's claim was taken over while it was in flight (garbage collection or "
                "another commit judged it abandoned); nothing of it became visible. Commit again; "
                "if it happens again, raise gc's --grace or the store's lease"
            )
        return row

    def heartbeat(self, ckpt_id: int, owner: Owner) -> bool:
        """Refresh a pending checkpoint's lease; False when the claim was lost."""
        with self._write() as conn:
            res = conn.execute(
                update(C)
                .where(C.c.id == ckpt_id, C.c.status == PENDING, C.c.owner == str(owner))
                .values(heartbeat_at=utcnow())
            )
            return bool(res.rowcount)

    def claim_chunks(self, ckpt_id: int, owner: Owner, digests: Iterable[bytes]) -> set[bytes]:
        """Reference every chunk the catalog already has; return the digests it does not."""
        wanted = list(dict.fromkeys(digests))
        found: set[bytes] = set()
        with self._write(lock="shared") as conn:
            self._own_pending(conn, ckpt_id, owner)
            for batch in batches(wanted):
                rows = conn.execute(select(K.c.id, K.c.digest).where(K.c.digest.in_(batch))).all()
                if rows:
                    conn.execute(
                        self._insert(R)
                        .values([{"checkpoint_id": ckpt_id, "chunk_id": r.id} for r in rows])
                        .on_conflict_do_nothing()
                    )
                    found.update(bytes(r.digest) for r in rows)
        return set(wanted) - found

    def register_pack(self, ckpt_id: int, owner: Owner, key: str) -> int:
        """Record a pack before its object is written, owned by the pending checkpoint."""
        with self._write(lock="shared") as conn:
            self._own_pending(conn, ckpt_id, owner)
            res = conn.execute(P.insert().values(key=key, size=0, created_at=utcnow(), owner_checkpoint_id=ckpt_id))
            return int(res.inserted_primary_key[0])  # type: ignore[index]

    def register_packs(self, ckpt_id: int, owner: Owner, keys: Sequence[str]) -> list[int]:
        """:meth:`register_pack` for many keys in one transaction (a collective commit records
        every rank's packs up front); returns their ids in order."""
        ids = []
        with self._write(lock="shared") as conn:
            self._own_pending(conn, ckpt_id, owner)
            now = utcnow()
            for key in keys:
                res = conn.execute(P.insert().values(key=key, size=0, created_at=now, owner_checkpoint_id=ckpt_id))
                ids.append(int(res.inserted_primary_key[0]))  # type: ignore[index]
        return ids

    def add_chunks(self, ckpt_id: int, owner: Owner, pack_id: int, pack_size: int, chunks: Sequence[NewChunk]) -> int:
        """Record a written pack's chunks and reference them; returns the stored bytes they added
        (a chunk another commit recorded first is referenced there instead)."""
        return self.add_packs(ckpt_id, owner, [(pack_id, pack_size, chunks)])

    def add_packs(
        self, ckpt_id: int, owner: Owner, packs: Sequence[tuple[int, int, Sequence[NewChunk]]]
    ) -> int:
        """:meth:`add_chunks` for many written packs ``(pack_id, pack_size, chunks)`` in one
        transaction (a collective commit records every rank's packs at once)."""
        added = 0
        # digest order across every pack: two commits inserting overlapping chunks lock them in
        # the same order, so on PostgreSQL one waits for the other instead of deadlocking
        ordered = sorted(((pack_id, c) for pack_id, _, chunks in packs for c in chunks), key=lambda pc: pc[1].digest)
        ours = {pack_id for pack_id, _, _ in packs}
        with self._write(lock="shared") as conn:
            self._own_pending(conn, ckpt_id, owner)
            for pack_id, pack_size, _ in packs:
                conn.execute(update(P).where(P.c.id == pack_id).values(size=pack_size))
            for batch in batches(ordered):
                conn.execute(
                    self._insert(K)
                    .values(
                        [
                            {
                                "digest": c.digest,
                                "pack_id": pack_id,
                                "offset": c.offset,
                                "length": c.length,
                                "raw_size": c.raw_size,
                                "codec": c.codec,
                            }
                            for pack_id, c in batch
                        ]
                    )
                    .on_conflict_do_nothing(index_elements=["digest"])
                )
                rows = conn.execute(
                    select(K.c.id, K.c.pack_id, K.c.length).where(K.c.digest.in_([c.digest for _, c in batch]))
                ).all()
                conn.execute(
                    self._insert(R)
                    .values([{"checkpoint_id": ckpt_id, "chunk_id": r.id} for r in rows])
                    .on_conflict_do_nothing()
                )
                added += sum(int(r.length) for r in rows if r.pack_id in ours)
        return added

    def finish_checkpoint(
        self,
        ckpt_id: int,
        owner: Owner,
        *,
        entries: Sequence[tuple[int, str, bytes, int]],
        metrics: dict[str, float],
        tags: Sequence[str],
        logical_bytes: int,
        stored_bytes_added: int,
        replace: bool,
    ) -> Checkpoint:
        """Make the pending checkpoint visible, in one transaction."""
        try:
            with self._write(lock="shared") as conn:
                row = self._own_pending(conn, ckpt_id, owner)
                old = conn.execute(
                    select(C.c.id).where(C.c.run_id == row.run_id, C.c.step == row.step, C.c.status == COMMITTED)
                ).scalar()
                if old is not None:
                    if not replace:
                        raise AlreadyExistsError(
                            f"step {row.step} was committed by another process meanwhile; pass replace=True "
                            "to overwrite it"
                        )
                    conn.execute(delete(C).where(C.c.id == old))
                for batch in batches(list(entries), 100):
                    conn.execute(
                        E.insert(),
                        [
                            {"checkpoint_id": ckpt_id, "rank": r, "sub_key": k, "manifest": m, "logical_bytes": n}
                            for r, k, m, n in batch
                        ],
                    )
                if metrics:
                    conn.execute(
                        M.insert(),
                        [
                            {"checkpoint_id": ckpt_id, "name": k, "value": None if math.isnan(v) else v}
                            for k, v in metrics.items()
                        ],
                    )
                for name in dict.fromkeys(tags):
                    self._set_tag(conn, row.run_id, name, ckpt_id)
                conn.execute(
                    update(C)
                    .where(C.c.id == ckpt_id)
                    .values(
                        status=COMMITTED,
                        committed_at=utcnow(),
                        logical_bytes=logical_bytes,
                        stored_bytes_added=stored_bytes_added,
                    )
                )
                conn.execute(update(P).where(P.c.owner_checkpoint_id == ckpt_id).values(owner_checkpoint_id=None))
                return self._records(conn, [ckpt_id])[0]
        finally:
            mark_live(owner.nonce, False)

    def abort_checkpoint(self, ckpt_id: int, owner: Owner) -> None:
        """Drop a pending checkpoint of ours; what it wrote becomes garbage for gc."""
        mark_live(owner.nonce, False)
        with self._write() as conn:
            conn.execute(delete(C).where(C.c.id == ckpt_id, C.c.status == PENDING, C.c.owner == str(owner)))

    # -- tags -------------------------------------------------------------------------------
    def _set_tag(self, conn: Connection, run_id: int, name: str, ckpt_id: int) -> None:
        check_name("tag", name)
        # one statement: two commits setting the same tag at once both succeed, the later wins
        stmt = self._insert(T).values(run_id=run_id, name=name, checkpoint_id=ckpt_id)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["run_id", "name"], set_={"checkpoint_id": stmt.excluded.checkpoint_id}
            )
        )

    def tag(self, ckpt: Checkpoint, name: str, *, move: bool = False) -> None:
        check_name("tag", name)
        with self._write() as conn:
            rid = self._run_id(conn, ckpt.run)
            existing = conn.execute(
                select(C.c.step).select_from(T.join(C, C.c.id == T.c.checkpoint_id)).where(
                    T.c.run_id == rid, T.c.name == name
                )
            ).scalar()
            if existing is not None and existing != ckpt.step and not move:
                raise AlreadyExistsError(
                    f"tag {name!r} already names step {existing} of run {ckpt.run!r}; pass move=True "
                    "(--move) to point it at step {ckpt.step}"
                )
            self._set_tag(conn, rid, name, ckpt.id)

    def untag(self, run: str, name: str) -> None:
        with self._write() as conn:
            rid = self._run_id(conn, run)
            res = conn.execute(delete(T).where(T.c.run_id == rid, T.c.name == name))
            if not res.rowcount:
                raise NotFoundError(f"run {run!r} has no tag {name!r}")

    # -- queries ----------------------------------------------------------------------------
    def _records(self, conn: Connection, ids: Sequence[int]) -> list[Checkpoint]:
        return load_records(conn, ids)

    def checkpoints(self, run: str | None = None, *, status: str = COMMITTED) -> list[Checkpoint]:
        with self._read() as conn:
            q = select(C.c.id).join(RUNS, RUNS.c.id == C.c.run_id).where(C.c.status == status)
            if run is not None:
                self._run_id(conn, run)
                q = q.where(RUNS.c.name == run)
            ids = [i for (i,) in conn.execute(q.order_by(RUNS.c.id, C.c.step))]
            return self._records(conn, ids)

    def get(self, ckpt_id: int) -> Checkpoint:
        with self._read() as conn:
            recs = self._records(conn, [ckpt_id])
        if not recs:
            raise CheckpointNotFoundError(f"checkpoint #{ckpt_id} no longer exists")
        return recs[0]

    def resolve(self, ref: Ref, default_run: str | None = None) -> Checkpoint:
        run = ref.run or default_run
        with self._read() as conn:
            if run is not None:
                self._run_id(conn, run)  # an unknown run is an error of its own
            return load_records(conn, [resolve_ref(conn, ref, run)])[0]

    def entries(
        self, ckpt_id: int, *, ranks: Iterable[int] | None = None, sub_keys: Iterable[str] | None = None
    ) -> list[tuple[int, str, bytes]]:
        with self._read() as conn:
            q = select(E.c.rank, E.c.sub_key, E.c.manifest).where(E.c.checkpoint_id == ckpt_id)
            if ranks is not None:
                q = q.where(E.c.rank.in_(list(ranks)))
            if sub_keys is not None:
                q = q.where(E.c.sub_key.in_(list(sub_keys)))
            return [(int(r.rank), r.sub_key, bytes(r.manifest)) for r in conn.execute(q.order_by(E.c.rank, E.c.id))]

    def chunk_locations(self, digests: Iterable[bytes]) -> dict[bytes, ChunkLocation]:
        wanted = list(dict.fromkeys(digests))
        out: dict[bytes, ChunkLocation] = {}
        with self._read() as conn:
            for batch in batches(wanted):
                rows = conn.execute(
                    select(K.c.digest, P.c.key, K.c.offset, K.c.length, K.c.raw_size, K.c.codec)
                    .select_from(K.join(P, P.c.id == K.c.pack_id))
                    .where(K.c.digest.in_(batch))
                )
                for r in rows:
                    out[bytes(r.digest)] = ChunkLocation(r.key, int(r.offset), int(r.length), int(r.raw_size), int(r.codec))
        return out

    def is_empty(self) -> bool:
        """True when the catalog records no run and no pack yet."""
        with self._read() as conn:
            return not conn.execute(select(exists(select(RUNS.c.id)) | exists(select(P.c.id)))).scalar()

    def stored_bytes(self) -> int:
        with self._read() as conn:
            return int(conn.execute(select(func.coalesce(func.sum(K.c.length), 0))).scalar_one())

    def pending(self) -> list[tuple[int, str, int, str, datetime]]:
        """Pending checkpoints: ``(id, run, step, owner, heartbeat_at)``."""
        with self._read() as conn:
            rows = conn.execute(
                select(C.c.id, RUNS.c.name, C.c.step, C.c.owner, C.c.heartbeat_at)
                .select_from(C.join(RUNS, RUNS.c.id == C.c.run_id))
                .where(C.c.status == PENDING)
                .order_by(C.c.id)
            ).all()
        return [(r.id, r.name, int(r.step), r.owner, aware(r.heartbeat_at)) for r in rows]  # type: ignore[misc]

    def delete_checkpoint(self, ckpt_id: int) -> None:
        """Remove a committed checkpoint's rows (its chunk references go with it)."""
        with self._write(lock="shared") as conn:
            conn.execute(delete(C).where(C.c.id == ckpt_id))


def _reason(e: sa_exc.DBAPIError) -> str:
    return " ".join(str(e.orig if e.orig is not None else e).split())


