"""Runs: creation, listing, stored retention policies, lineage (the checkpoint a run was forked
from), and tags on a run's checkpoints."""

from __future__ import annotations

from sqlalchemy import Connection, bindparam, delete, func, select, update

from ..errors import AlreadyExistsError, CheckpointNotFoundError, NotFoundError
from ..records import Checkpoint, RunInfo
from ..refs import check_name
from ._access import CatalogBase
from ._rows import CHECKPOINTS, RUN_ID, RUN_ORIGIN, RUNS, TAGS, aware, run_id, utcnow
from ._schema import COMMITTED

__all__ = ["RunsMixin"]

# statements built once: building one costs more than running it, at every commit
_COMMITTED_IN_RUN = (
    select(func.count())
    .select_from(CHECKPOINTS)
    .where(CHECKPOINTS.c.run_id == bindparam("run"), CHECKPOINTS.c.status == COMMITTED)
)

_COMMITTED_ROW = (
    select(CHECKPOINTS.c.id)
    .where(CHECKPOINTS.c.id == bindparam("ckpt"), CHECKPOINTS.c.status == COMMITTED)
    .with_for_update(read=True, key_share=True)
)


class RunsMixin(CatalogBase):
    def _run_id(self, conn: Connection, name: str, *, create: bool = False) -> int:
        """The id of run ``name``, made when ``create``; else an unknown run is an error."""
        if not create:
            return run_id(conn, name)
        rid = conn.execute(RUN_ID, {"name": name}).scalar()
        if rid is not None:
            return int(rid)
        check_name("run", name)
        conn.execute(
            self._insert(RUNS).values(name=name, created_at=utcnow()).on_conflict_do_nothing(index_elements=["name"])
        )
        return run_id(conn, name)

    def require_run(self, name: str) -> None:
        """Raise :class:`NotFoundError` unless the store has a run ``name``."""
        with self._read() as conn:
            run_id(conn, name)

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
                    CHECKPOINTS.c.run_id,
                    func.count().label("n"),
                    func.max(CHECKPOINTS.c.step).label("latest"),
                    func.sum(CHECKPOINTS.c.logical_bytes).label("logical"),
                )
                .where(CHECKPOINTS.c.status == COMMITTED)
                .group_by(CHECKPOINTS.c.run_id)
                .subquery()
            )
            rows = conn.execute(
                select(RUNS.c.name, RUNS.c.created_at, RUNS.c.parent_ref, counts.c.n, counts.c.latest, counts.c.logical)
                .select_from(RUNS.outerjoin(counts, counts.c.run_id == RUNS.c.id))
                .order_by(RUNS.c.created_at, RUNS.c.id)
            ).all()
        return [
            RunInfo(r.name, aware(r.created_at), int(r.n or 0), r.latest, r.parent_ref, int(r.logical or 0))
            for r in rows
        ]

    # -- retention policies -----------------------------------------------------------------------
    def run_policy(self, name: str) -> str | None:
        """The JSON of ``name``'s stored retention policy (None: it has none)."""
        with self._read() as conn:
            return conn.execute(select(RUNS.c.policy).where(RUNS.c.name == name)).scalar()

    def set_run_policy(self, name: str, policy_json: str | None) -> None:
        with self._write() as conn:
            rid = self._run_id(conn, name, create=True)
            conn.execute(update(RUNS).where(RUNS.c.id == rid).values(policy=policy_json))

    # -- lineage ------------------------------------------------------------------------------------
    def lineage(self, name: str) -> list[str]:
        """Refs of a run's ancestors, nearest first (``["base@4000", "pretrain@90000"]``); none
        for a root run or an unknown one."""
        with self._read() as conn:
            return [ref for _, ref in _ancestry(conn, name)]

    def ancestry(self, name: str) -> list[tuple[int | None, str]]:
        """``(parent_checkpoint_id, parent_ref)`` of each fork point ``name`` descends from,
        nearest first; :class:`NotFoundError` for an unknown run."""
        with self._read() as conn:
            run_id(conn, name)
            return _ancestry(conn, name)

    def run_origin(self, name: str) -> tuple[int | None, str | None, int] | None:
        """``(parent_checkpoint_id, parent_ref, committed checkpoints)`` of a run; None if no such run."""
        with self._read() as conn:
            row = conn.execute(RUN_ORIGIN, {"name": name}).first()
            if row is None:
                return None
            n = conn.execute(_COMMITTED_IN_RUN, {"run": row.id}).scalar_one()
        return row.parent_checkpoint_id, row.parent_ref, int(n)

    # -- tags -------------------------------------------------------------------------------------
    def _set_tag(self, conn: Connection, rid: int, name: str, ckpt_id: int) -> None:
        check_name("tag", name)
        # one statement: two commits setting the same tag at once both succeed, the later wins
        stmt = self._insert(TAGS).values(run_id=rid, name=name, checkpoint_id=ckpt_id)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["run_id", "name"], set_={"checkpoint_id": stmt.excluded.checkpoint_id}
            )
        )

    def tag(self, ckpt: Checkpoint, name: str, *, move: bool = False) -> None:
        check_name("tag", name)
        with self._write() as conn:
            rid = self._run_id(conn, ckpt.run)
            # locked (on PostgreSQL) until the tag is in: gc or a delete then waits for it
            if conn.execute(_COMMITTED_ROW, {"ckpt": ckpt.id}).first() is None:
                raise CheckpointNotFoundError(
                    f"step {ckpt.step} of run {ckpt.run!r} was deleted meanwhile (by gc, a delete or a "
                    "commit replacing it); resolve the ref again and tag what it names now"
                )
            existing = conn.execute(
                select(CHECKPOINTS.c.step)
                .select_from(TAGS.join(CHECKPOINTS, CHECKPOINTS.c.id == TAGS.c.checkpoint_id))
                .where(TAGS.c.run_id == rid, TAGS.c.name == name)
            ).scalar()
            if existing is not None and existing != ckpt.step and not move:
                raise AlreadyExistsError(
                    f"tag {name!r} already names step {existing} of run {ckpt.run!r}; pass move=True "
                    f"(--move) to point it at step {ckpt.step}"
                )
            self._set_tag(conn, rid, name, ckpt.id)

    def untag(self, run: str, name: str) -> None:
        with self._write() as conn:
            rid = self._run_id(conn, run)
            res = conn.execute(delete(TAGS).where(TAGS.c.run_id == rid, TAGS.c.name == name))
            if not res.rowcount:
                raise NotFoundError(f"run {run!r} has no tag {name!r}")


def _ancestry(conn: Connection, name: str) -> list[tuple[int | None, str]]:
    out: list[tuple[int | None, str]] = []
    seen = {name}
    current = name
    while True:
        row = conn.execute(
            select(RUNS.c.parent_checkpoint_id, RUNS.c.parent_ref).where(RUNS.c.name == current)
        ).first()
        if row is None or not row.parent_ref:
            return out
        out.append((row.parent_checkpoint_id, row.parent_ref))
        current = row.parent_ref.rpartition("@")[0]
        if current in seen:
            return out
        seen.add(current)
