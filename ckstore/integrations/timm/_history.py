"""Which epoch checkpoints timm's ``CheckpointSaver`` keeps: its top-``max_history`` rules, pure.

These are the rules of timm 1.0.31's saver. It keeps a list of ``(file, metric)``, best first. A
new epoch checkpoint enters the list when the list is not full, when the worst entry kept has no
metric, or when its metric strictly beats the worst one kept; when the list is full the worst
entry makes room. Ranked entries are sorted by metric with Python's stable sort, so among equal
metrics the earlier checkpoint ranks first (and a tie with the worst of a full list does not
enter). Unranked entries (metric ``None``) follow the ranked ones, newest first: without metrics
the list holds the last ``max_history`` epochs, an unranked checkpoint never displaces a ranked
one, and a ranked one always displaces an unranked one. ``model_best`` moves only to an
entering checkpoint whose metric strictly beats the best so far. (timm releases before 1.0.31
differ only for checkpoints saved without a metric: those raise ``TypeError`` in timm's sort.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Kept", "Admission", "better", "admit"]


@dataclass(frozen=True, slots=True)
class Kept:
    """One epoch checkpoint in the saver's history: the step it was committed as."""

    step: int
    epoch: int
    metric: float | None


@dataclass(frozen=True, slots=True)
class Admission:
    """What one ``save_checkpoint`` did to the history."""

    entered: bool
    kept: tuple[Kept, ...]  # best first, as timm's ``checkpoint_files``
    evicted: tuple[Kept, ...]
    new_best: bool


def better(a: float, b: float, *, decreasing: bool) -> bool:
    """True if metric ``a`` is strictly better than ``b`` (lower when ``decreasing``)."""
    return a < b if decreasing else a > b


def _ordered(kept: Sequence[Kept], new: Kept, decreasing: bool) -> tuple[Kept, ...]:
    ranked = [k for k in (*kept, new) if k.metric is not None]
    # stable sort, as timm's: ties keep arrival order (reverse=True keeps it too)
    ranked.sort(key=lambda k: k.metric, reverse=not decreasing)  # type: ignore[arg-type,return-value]
    unranked = [k for k in kept if k.metric is None]
    if new.metric is None:
        unranked.insert(0, new)  # newest first
    return (*ranked, *unranked)


def admit(
    kept: Sequence[Kept],
    new: Kept,
    best_metric: float | None,
    *,
    max_history: int,
    decreasing: bool,
) -> Admission:
    """The history after ``new`` is saved, given the history ``kept`` (best first) and the best
    metric so far; see the module docstring for the rules."""
    worst = kept[-1] if kept else None
    enters = (
        worst is None
        or len(kept) < max_history
        or worst.metric is None
        or (new.metric is not None and better(new.metric, worst.metric, decreasing=decreasing))
    )
    if not enters:
        return Admission(False, tuple(kept), (), False)
    keep = list(kept)
    evicted: tuple[Kept, ...] = ()
    if len(keep) >= max_history:  # timm's _cleanup_checkpoints(trim=1)
        cut = max(max_history - 1, 0)
        evicted, keep = tuple(keep[cut:]), keep[:cut]
    new_best = new.metric is not None and (
        best_metric is None or better(new.metric, best_metric, decreasing=decreasing)
    )
    return Admission(True, _ordered(keep, new, decreasing), evicted, new_best)
