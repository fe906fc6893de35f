"""The ranks a commit or checkout runs on: this process alone, or a torch.distributed group.

:class:`Group` is the group of one: every step runs here and a failure raises as it is.
:class:`DistGroup` runs the same steps over a process group (gloo, NCCL), where every collective
also carries each rank's success or error, so that when one rank fails every rank raises
:class:`~ckstore.errors.DistributedCommitError` naming it, at the same step. The commit protocol
(:mod:`ckstore.commit.protocol`) is written once against :class:`Group`, as PyTorch DCP writes its
save path once over ``_DistWrapper`` with or without a process group.

A step is ``group.<collective>(step_name, group.attempt(local_part))``: ``attempt`` runs this
rank's part (or skips it once a failure is known) and the collective moves the values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import OUTCOME_UNKNOWN, DistributedCommitError, LayoutError
from ..layout import WorldLayout

__all__ = [
    "Group",
    "DistGroup",
    "Outcome",
    "bind",
    "active_group",
    "group_rank",
    "own_ranks",
    "failure_message",
]

_MAX_ERROR = 600

T = TypeVar("T")

#: This rank's part of a step: ``(error text, None)`` when it failed, else ``(None, value)``.
Outcome = tuple[str | None, Any]


def active_group(process_group: Any = None) -> Any:
    """The process group a call should be collective over, or None for a single-process call."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise RuntimeError("process_group was given but torch.distributed is not initialized")
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if process_group is None and dist.get_world_size(group) == 1:
        return None
    return group


def group_rank(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_rank(group))


def own_ranks(group: Any, world_layout: WorldLayout | None) -> list[int]:
    """The ranks a checkout inside a distributed job loads: this rank's own (or rank 0 of a
    one-rank layout: every rank that asks gets the consolidated states)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if world_layout is not None and world_layout.world_size == 1:
        return [0]
    if world_layout is not None and world_layout.world_size != size:
        raise LayoutError(
            f"world_layout {world_layout.mesh} has {world_layout.world_size} ranks but the process group "
            f"has {size}; pass the layout of this job, or ranks=[...] to load other ranks' states"
        )
    return [group_rank(group)]


def bind(process_group: Any, what: str) -> Group:
    """The group a call named ``what`` runs on: ``process_group`` (or the initialized default
    group, when it has more than one rank) or this process alone."""
    group = active_group(process_group)
    return Group(what) if group is None else DistGroup(group, what)


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 1] + "…"


class Group:
    """A group of one rank: this process. Every collective hands this rank's value back as it
    is (no copy, no pickling), and ``attempt`` lets a failure raise at once, as it is.

    Subclasses run the same steps over many ranks. Every rank calls the same collectives in the
    same order; ``outcome`` of :meth:`scatter` and :meth:`broadcast` matters only on rank 0.
    """

    rank = 0
    size = 1

    def __init__(self, what: str) -> None:
        self.what = what  # "commit of run 'exp', step 3": how failures name the call

    def attempt(self, fn: Callable[[], T]) -> Outcome:
        """Run this rank's part of a step."""
        return None, fn()

    def all_gather(self, step: str, outcome: Outcome) -> list[Any]:
        """Every rank's value, on every rank."""
        return [outcome[1]]

    def gather(self, step: str, outcome: Outcome) -> list[Any] | None:
        """Every rank's value on rank 0 (None elsewhere)."""
        return [outcome[1]]

    def scatter(self, step: str, outcome: Outcome) -> Any:
        """Rank 0 sends each rank its own value from the list ``outcome`` holds."""
        values: list[Any] = outcome[1]
        return values[0]

    def broadcast(self, step: str, outcome: Outcome, *, final: bool = False) -> Any:
        """Rank 0 sends one value to every rank (``final``: the commit's last step, after which
        rank 0 may already have made the checkpoint visible)."""
        return outcome[1]

    def settle(self, step: str, outcome: Outcome) -> Any:
        """End a step without a collective (the caller tells the other ranks, as DCP does): this
        rank's value, or raise the failures this rank knows of (its own; on rank 0 every rank's)."""
        return outcome[1]


class DistGroup(Group):
    """A torch.distributed process group. Each collective carries every rank's success or error
    and raises :class:`DistributedCommitError` on every rank as soon as any rank has failed (a
    :meth:`gather` reports at the next scatter or broadcast); a backend error (a dead peer, a
    timeout) raises it on the ranks that see it."""

    def __init__(self, group: Any, what: str) -> None:
        import torch.distributed as dist

        super().__init__(what)
        self.dist = dist
        self.group = group
        self.rank = int(dist.get_rank(group))
        self.size = int(dist.get_world_size(group))
        self.error: BaseException | None = None  # this rank's own failure
        self.failures: dict[int, str] = {}  # on rank 0: failures it gathered and not yet reported

    def attempt(self, fn: Callable[[], T]) -> Outcome:
        """Run this rank's part of a step; a failure is kept and reported at the next collective.

        Nothing runs once this rank failed, or (on rank 0) once another rank's failure is known."""
        if self.error is not None:
            return _describe(self.error), None
        if self.failures:
            return None, None
        try:
            return None, fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported to every rank
            self.error = e
            return _describe(e), None

    def all_gather(self, step: str, outcome: Outcome) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._call(step, lambda: self.dist.all_gather_object(out, outcome, group=self.group))
        self._check({r: err for r, (err, _) in enumerate(out) if err})
        return [value for _, value in out]

    def gather(self, step: str, outcome: Outcome) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._call(step, lambda: self.dist.gather_object(outcome, out, group=self.group, group_dst=0))
        if out is None:
            return None
        self.failures.update({r: err for r, (err, _) in enumerate(out) if err})
        return [value for _, value in out]

    def scatter(self, step: str, outcome: Outcome) -> Any:
        box: list[Any] = [None]
        send = None
        if self.rank == 0:
            failures = self._pending(outcome[0])
            values = outcome[1] if outcome[1] is not None and not failures else [None] * self.size
            send = [(failures, v) for v in values]
        self._call(step, lambda: self.dist.scatter_object_list(box, send, group=self.group, group_src=0))
        failures, value = box[0]
        self._check(failures)
        return value

    def broadcast(self, step: str, outcome: Outcome, *, final: bool = False) -> Any:
        box: list[Any] = [None]
        if self.rank == 0:
            failures = self._pending(outcome[0])
            box = [(failures, None if failures else outcome[1])]
        self._call(step, lambda: self.dist.broadcast_object_list(box, group=self.group, group_src=0), final=final)
        failures, value = box[0]
        self._check(failures)
        return value

    def settle(self, step: str, outcome: Outcome) -> Any:
        failures = self._pending(outcome[0]) if self.rank == 0 else {}
        if self.error is not None:
            failures[self.rank] = _describe(self.error)
        self._check(failures)
        return outcome[1]

    def _pending(self, own: str | None) -> dict[int, str]:
        failures = dict(self.failures)
        if own is not None:
            failures[0] = own
        return failures

    def _call(self, step: str, fn: Callable[[], Any], *, final: bool = False) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the backend's own errors vary (gloo, NCCL, timeouts)
            outcome = (
                "rank 0 may have committed the checkpoint before contact was lost: `ckstore log` shows "
                "whether it did"
                if final
                else "nothing was committed"
            )
            raise DistributedCommitError(
                f"{self.what} failed: rank {self.rank} lost contact with the other ranks while "
                f"{step} ({_describe(e)}); {outcome}. Check the other ranks' logs"
            ) from (self.error or e)

    def _check(self, failures: Mapping[int, str]) -> None:
        if not failures:
            return
        raise DistributedCommitError(failure_message(self.what, failures)) from self.error


def failure_message(what: str, failures: Mapping[int, str]) -> str:
    """``what`` failed on these ranks, with their errors (ranks failing alike are named once),
    and nothing was committed, unless an error says the checkpoint may have been committed
    (rank 0 lost the catalog's answer to its COMMIT)."""
    by_error: dict[str, list[int]] = {}
    for r in sorted(failures):
        by_error.setdefault(failures[r], []).append(r)
    if len(by_error) == 1:
        ((error, ranks),) = by_error.items()
        detail = f"{_ranks(ranks)}: {error}"
    else:
        each = "; ".join(f"{_ranks(rs)}: {e}" for e, rs in by_error.items())
        detail = f"{_ranks(sorted(failures))} ({each})"
    if any(OUTCOME_UNKNOWN in error for error in failures.values()):
        return f"{what} failed on {detail}"
    return f"{what} failed on {detail}; nothing was committed"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
