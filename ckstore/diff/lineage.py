"""Lineage: runs started from a checkpoint of another run, and each run's chain of ancestors.

A run records the checkpoint it was forked from (its id, and ``run@step`` as text that outlives
the checkpoint). The run's first commit descends from that checkpoint unless it names another
``parent=``; a first commit that names a parent in another run also records where the run came
from, so forking explicitly is optional.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import AlreadyExistsError, CheckpointNotFoundError, NotFoundError
from ..records import Checkpoint
from ..refs import check_name
from ._view import StoreView

__all__ = ["Ancestor", "resolve_ref_or_run", "fork", "lineage", "commit_parent"]


@dataclass(frozen=True, slots=True)
class Ancestor:
    """A checkpoint a run descends from."""

    run: str
    step: int
    checkpoint: Checkpoint | None  # None once it has been deleted (its ref stays as history)

    @property
    def ref(self) -> str:
        return f"{self.run}@{self.step}"


def resolve_ref_or_run(store: StoreView, ref: str | int | Checkpoint) -> Checkpoint:
    """The checkpoint ``ref`` names; a bare run name (no ``@``) names that run's latest checkpoint.

    A bare name is read as a run when a run of that name exists, else as a ref (a tag, or a step
    of the store's default run, say); write ``RUN@TAG`` or ``RUN@STEP`` to name a tag or a step
    that shares a run's name. An int is always a step.
    """
    if isinstance(ref, Checkpoint):
        return ref
    text = ref.strip() if isinstance(ref, str) else ""
    if not text or "@" in text or ":" in text or text == "latest":
        return store.resolve(ref)
    if store.catalog.run_origin(text) is not None:  # a run named by digits too: not a step
        return store.resolve("latest", run=text)
    if text.isdigit():
        return store.resolve(ref)
    try:
        return store.resolve(ref)
    except NotFoundError as e:
        raise CheckpointNotFoundError(
            f"{text!r} names no run and no tag{f' in run {store.run!r}' if store.run else ''} "
            "(see `ckstore runs` and `ckstore log`)"
        ) from e


def fork(store: StoreView, ref: str | int | Checkpoint, new_run: str) -> Checkpoint:
    """Start run ``new_run`` from the checkpoint ``ref`` names; returns that checkpoint.

    Forking again into the same run from the same checkpoint is a no-op, so a training script
    may fork on every start. A run that already has checkpoints or another origin is an error.
    """
    check_name("run", new_run)
    ckpt = resolve_ref_or_run(store, ref)
    if ckpt.run == new_run:
        raise AlreadyExistsError(
            f"run {new_run!r} cannot be forked from its own checkpoint {ckpt.ref}; name a new run"
        )
    origin = store.catalog.run_origin(new_run)
    if origin is not None:
        parent_id, parent_ref, count = origin
        if parent_id == ckpt.id:
            return ckpt
        if count or parent_ref:
            came = f"forked from {parent_ref}" if parent_ref else "not forked"
            raise AlreadyExistsError(
                f"run {new_run!r} already exists ({count} checkpoints, {came}); fork {ckpt.ref} into a "
                "new run name"
            )
    store.catalog.ensure_run(new_run, parent_checkpoint_id=ckpt.id, parent_ref=ckpt.ref)
    return ckpt


def lineage(store: StoreView, run: str) -> list[Ancestor]:
    """The checkpoints ``run`` descends from, nearest first (its fork point, that run's fork
    point, …). A root run has none."""
    out: list[Ancestor] = []
    for parent_id, parent_ref in store.catalog.ancestry(run):
        prun, _, pstep = parent_ref.rpartition("@")
        out.append(Ancestor(prun, int(pstep), _fork_point(store, parent_id, parent_ref)))
    return out


def commit_parent(store: StoreView, parent: str | int | None, run: str) -> int | None:
    """The parent checkpoint id a commit into ``run`` records when it names a ``parent``; None
    when it names none (the catalog then records a forked run's fork point as the parent of the
    run's first commit: ``begin_checkpoint(fork_point=True)``).

    A first commit naming a parent in another run records that checkpoint as the run's origin too.
    """
    if parent is None:
        return None
    origin = store.catalog.run_origin(run)
    ckpt = store.resolve(parent)
    if ckpt.run != run and (origin is None or (origin[1] is None and not origin[2])):
        store.catalog.ensure_run(run, parent_checkpoint_id=ckpt.id, parent_ref=ckpt.ref)
    return int(ckpt.id)


def _fork_point(store: StoreView, parent_id: int | None, parent_ref: str | None) -> Checkpoint | None:
    """The checkpoint a run was forked from, if it still exists. A run keeps the id without a
    foreign key, and a database may reuse the id of a deleted row, so the ref must match too."""
    if parent_id is None or not parent_ref:
        return None
    try:
        ckpt = store.catalog.get(parent_id)
    except CheckpointNotFoundError:
        return None
    return ckpt if ckpt.ref == parent_ref else None
