"""Value types the store hands back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .layout import WorldLayout

__all__ = ["Checkpoint", "RunInfo"]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One committed (or, while committing, pending) checkpoint of a run."""

    id: int
    run: str
    step: int
    kind: str
    status: str
    created_at: datetime
    committed_at: datetime | None
    logical_bytes: int
    stored_bytes_added: int
    world_layout: WorldLayout
    metrics: dict[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    sub_keys: tuple[str, ...] = ()
    parent: str | None = None  # "run@step" of the checkpoint this one descends from

    @property
    def ref(self) -> str:
        return f"{self.run}@{self.step}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; a metric recorded as NaN (no value) is ``None``, so the text is strict
        JSON, as in the checkpoint's record (``docs/format.md``)."""
        return {
            "run": self.run,
            "step": self.step,
            "kind": self.kind,
            "created_at": self.created_at.isoformat(),
            "committed_at": self.committed_at.isoformat() if self.committed_at else None,
            "logical_bytes": self.logical_bytes,
            "stored_bytes_added": self.stored_bytes_added,
            "world_layout": self.world_layout.mesh,
            "metrics": {k: v if math.isfinite(v) else None for k, v in self.metrics.items()},
            "tags": list(self.tags),
            "ranks": list(self.ranks),
            "sub_keys": list(self.sub_keys),
            "parent": self.parent,
        }


@dataclass(frozen=True, slots=True)
class RunInfo:
    name: str
    created_at: datetime
    checkpoints: int
    latest_step: int | None
    parent: str | None  # "run@step" this run was forked from
    logical_bytes: int = 0
