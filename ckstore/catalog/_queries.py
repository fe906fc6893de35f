"""Read queries of the catalog that build records: checkpoint records and ref resolution."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from sqlalchemy import Connection, select

from ..errors import CheckpointNotFoundError, InvalidRefError
from ..layout import WorldLayout
from ..records import Checkpoint
from ..refs import Ref
from ._rows import RUNS, C, E, M, T, aware, batches
from ._schema import COMMITTED

__all__ = ["load_records", "resolve_ref"]


def load_records(conn: Connection, ids: Sequence[int]) -> list[Checkpoint]:
    """The :class:`Checkpoint` records of checkpoint rows ``ids``, in that order (missing ones
    left out)."""
    if not ids:
        return []
    out: dict[int, Checkpoint] = {}
    for batch in batches(list(ids)):
        parent = C.alias("parent")
        prun = RUNS.alias("prun")
        rows = conn.execute(
            select(C, RUNS.c.name.label("run_name"), parent.c.step.label("pstep"), prun.c.name.label("prun"))
            .select_from(
                C.join(RUNS, RUNS.c.id == C.c.run_id)
                .outerjoin(parent, parent.c.id == C.c.parent_checkpoint_id)
                .outerjoin(prun, prun.c.id == parent.c.run_id)
            )
            .where(C.c.id.in_(batch))
        ).all()
        metrics: dict[int, dict[str, float]] = {}
        for m in conn.execute(select(M).where(M.c.checkpoint_id.in_(batch)).order_by(M.c.checkpoint_id, M.c.name)):
            metrics.setdefault(m.checkpoint_id, {})[m.name] = math.nan if m.value is None else float(m.value)
        tags: dict[int, list[str]] = {}
        for t in conn.execute(select(T.c.checkpoint_id, T.c.name).where(T.c.checkpoint_id.in_(batch)).order_by(T.c.name)):
            tags.setdefault(t.checkpoint_id, []).append(t.name)
        layout: dict[int, tuple[set[int], list[str]]] = {}
        for e in conn.execute(
            select(E.c.checkpoint_id, E.c.rank, E.c.sub_key).where(E.c.checkpoint_id.in_(batch)).order_by(E.c.id)
        ):
            ranks, keys = layout.setdefault(e.checkpoint_id, (set(), []))
            ranks.add(e.rank)
            if e.sub_key not in keys:
                keys.append(e.sub_key)
        for r in rows:
            ranks, keys = layout.get(r.id, (set(), []))
            out[r.id] = Checkpoint(
                id=r.id,
                run=r.run_name,
                step=int(r.step),
                kind=r.kind,
                status=r.status,
                created_at=aware(r.created_at),  # type: ignore[arg-type]
                committed_at=aware(r.committed_at),
                logical_bytes=int(r.logical_bytes or 0),
                stored_bytes_added=int(r.stored_bytes_added or 0),
                world_layout=WorldLayout.from_json(json.loads(r.world_layout)),
                metrics=metrics.get(r.id, {}),
                tags=tuple(tags.get(r.id, ())),
                ranks=tuple(sorted(ranks)),
                sub_keys=tuple(keys),
                parent=f"{r.prun}@{r.pstep}" if r.prun is not None else None,
            )
    return [out[i] for i in ids if i in out]


def resolve_ref(conn: Connection, ref: Ref, run: str | None) -> int:
    """The id of the committed checkpoint ``ref`` names, within ``run`` when given."""
    q = (
        select(C.c.id, RUNS.c.name)
        .select_from(C.join(RUNS, RUNS.c.id == C.c.run_id))
        .where(C.c.status == COMMITTED)
    )
    if run is not None:
        q = q.where(RUNS.c.name == run)
    where = f" in run {run!r}" if run else ""
    if ref.kind == "latest":
        order = (C.c.step.desc(), C.c.committed_at.desc()) if run else (C.c.committed_at.desc(), C.c.id.desc())
        row = conn.execute(q.order_by(*order).limit(1)).first()
        if row is None:
            raise CheckpointNotFoundError(f"no committed checkpoint{where} yet")
    elif ref.kind == "step":
        rows = conn.execute(q.where(C.c.step == ref.value).limit(2)).all()
        if not rows:
            raise CheckpointNotFoundError(f"no committed checkpoint at step {ref.value}{where} (see `ckstore log`)")
        if len(rows) > 1:
            raise InvalidRefError(
                f"step {ref.value} exists in several runs ({', '.join(r.name for r in rows)}); "
                f"name one, as in {rows[0].name}@{ref.value}"
            )
        row = rows[0]
    elif ref.kind == "tag":
        rows = conn.execute(
            q.join(T, T.c.checkpoint_id == C.c.id).where(T.c.name == ref.value).limit(2)
        ).all()
        if not rows:
            raise CheckpointNotFoundError(f"no checkpoint tagged {ref.value!r}{where} (see `ckstore log`)")
        if len(rows) > 1:
            raise InvalidRefError(
                f"tag {ref.value!r} exists in several runs ({', '.join(r.name for r in rows)}); "
                f"name one, as in {rows[0].name}@{ref.value}"
            )
        row = rows[0]
    else:
        value = M.c.value.asc() if ref.kind == "min" else M.c.value.desc()
        row = conn.execute(
            q.join(M, M.c.checkpoint_id == C.c.id)
            .where(M.c.name == ref.value, M.c.value.is_not(None))
            .order_by(value, C.c.step.desc())
            .limit(1)
        ).first()
        if row is None:
            raise CheckpointNotFoundError(f"no committed checkpoint{where} has metric {ref.value!r}")
    return int(row.id)
