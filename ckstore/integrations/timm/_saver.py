"""``CheckpointSaver``: timm's checkpoint manager with a ckstore run in place of a folder.

The saver commits one checkpoint per call (kind ``epoch``, ``recovery`` or ``milestone``) and
keeps the run the way timm keeps its folder: the top-``max_history`` epoch checkpoints by metric
(:mod:`._history`), tags ``last`` and ``model_best`` moved where timm rewrites ``last.pth.tar``
and ``model_best.pth.tar``, and the two newest recovery checkpoints. What timm deletes as files,
the saver deletes from the catalog (:meth:`ckstore.Store.delete`); ``gc`` frees the bytes. It
deletes only checkpoints it committed itself (or learned of through :meth:`load_state_dict`) and
leaves one a user tagged. Tensors that did not change (a frozen backbone) are stored once: every
commit deduplicates them against the chunks already stored.

Each call commits first, then moves tags, then deletes, so a crash at any point leaves at most
an extra checkpoint, never a missing one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...errors import (
    CheckpointNotFoundError,
    NotFoundError,
    ProtectedCheckpointError,
    StoreConfigError,
)
from ...records import Checkpoint
from ._history import Kept, admit
from ._state import META, build_checkpoint, split_checkpoint, unwrap_model

if TYPE_CHECKING:
    from ...store import Store

__all__ = ["CheckpointSaver"]

_logger = logging.getLogger("ckstore.integrations.timm")

_STATE_VERSION = 1


def _check_index(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StoreConfigError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _check_metric(value: object, *, finite: bool = True) -> float | None:
    """``value`` as a metric; with ``finite=False`` a NaN or infinity passes too."""
    if value is None:
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise StoreConfigError(f"metric must be a number or None, got {type(value).__name__} {value!r}") from None
    if finite and not math.isfinite(number):
        raise StoreConfigError(f"metric must be finite, got {value!r}")
    if isinstance(value, (int, float)):
        return value  # kept as given: timm hands it back unchanged
    return number  # a numpy or 0-d tensor scalar: stored as a plain float


class CheckpointSaver:
    """timm's ``timm.utils.CheckpointSaver`` on a ckstore run: the same constructor arguments
    (plus ``store=``, and ``run=`` defaulting to the store's run), methods and return values.

    ``checkpoint_prefix``, ``recovery_prefix``, ``checkpoint_dir`` and ``recovery_dir`` are
    accepted for compatibility; the store decides where bytes go. ``step=`` on the save methods
    picks the checkpoint's step in the run (default: one past the run's highest step). In a
    ``torch.distributed`` job only the rank that saves calls the saver, as in timm's
    ``train.py``; its commits run on a process group of that rank alone (``process_group`` to
    pass one).
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        args: Any = None,
        model_ema: Any = None,
        amp_scaler: Any = None,
        checkpoint_prefix: str = "checkpoint",
        recovery_prefix: str = "recovery",
        checkpoint_dir: str = "",
        recovery_dir: str = "",
        decreasing: bool = False,
        max_history: int = 10,
        unwrap_fn: Callable[[Any], Any] = unwrap_model,
        task: Any = None,
        *,
        store: Store,
        run: str | None = None,
        process_group: Any = None,
    ) -> None:
        if isinstance(max_history, bool) or not isinstance(max_history, int) or max_history < 1:
            raise StoreConfigError(f"max_history must be an int of at least 1, got {max_history!r}")
        run_name = run if run is not None else store.run
        if run_name is None:
            raise StoreConfigError("CheckpointSaver needs a run: pass run='NAME' or open the store with one")
        self.model = model
        self.optimizer = optimizer
        self.args = args
        self.model_ema = model_ema
        self.amp_scaler = amp_scaler
        self.task = task
        self.store = store
        self.run = run_name
        self.checkpoint_dir = checkpoint_dir
        self.recovery_dir = recovery_dir
        self.save_prefix = checkpoint_prefix
        self.recovery_prefix = recovery_prefix
        self.decreasing = bool(decreasing)
        self.max_history = max_history
        self.unwrap_fn = unwrap_fn
        eval_metric = getattr(args, "eval_metric", None) if args is not None else None
        self.metric_name: str = eval_metric if isinstance(eval_metric, str) and eval_metric else "metric"
        if self.metric_name in ("epoch", "batch_idx"):
            raise StoreConfigError(f"the eval metric may not be named {self.metric_name!r}: the saver records that value itself")
        self._process_group = process_group
        # the saver's state (see state_dict)
        self._kept: tuple[Kept, ...] = ()
        self.best_epoch: int | None = None
        self.best_metric: float | None = None
        self._best_step: int | None = None
        self._last_step: int | None = None
        self._curr_recovery: int | None = None
        self._prev_recovery: int | None = None

    # -- timm's methods -------------------------------------------------------------------------
    def save_checkpoint(self, epoch: int, metric: float | None = None, *, step: int | None = None) -> tuple[Any, Any]:
        """Commit an epoch checkpoint; returns ``(best_metric, best_epoch)``, ``(None, None)``
        while no checkpoint had a metric. Tags it ``last``; keeps it if it ranks among the
        ``max_history`` best (then tags it ``model_best`` if its metric is the best so far)."""
        epoch = _check_index("epoch", epoch)
        metric = _check_metric(metric, finite=False)
        if metric is not None and not math.isfinite(metric):  # an evaluation that diverged: saved, not ranked
            _logger.warning(
                "epoch %d: metric %r is not a finite number; its checkpoint is saved and kept as one without a metric",
                epoch, metric,
            )  # fmt: skip
            metric = None
        step = self._step(step)
        admission = admit(
            self._kept, Kept(step, epoch, metric), self.best_metric, max_history=self.max_history, decreasing=self.decreasing
        )  # fmt: skip
        metrics: dict[str, float] = {"epoch": epoch}
        if metric is not None:
            metrics[self.metric_name] = metric
        after = self._state(
            kept=admission.kept, last=step,
            best=(metric, epoch, step) if admission.new_best else (self.best_metric, self.best_epoch, self._best_step),
        )  # fmt: skip
        ckpt = self._commit(step, epoch, metric, metrics, "epoch", after)
        old_last, old_best = self._last_step, self._best_step
        self.store.tag(ckpt.ref, "last", move=True)
        self._last_step = step
        if admission.entered:
            self._kept = admission.kept
            _logger.info("Current checkpoints:\n%s", "".join(f" ({k.step}, epoch {k.epoch}, {k.metric})\n" for k in self._kept))
            if admission.new_best:
                self.store.tag(ckpt.ref, "model_best", move=True)
                self.best_epoch, self.best_metric, self._best_step = epoch, metric, step
        for gone in (*(k.step for k in admission.evicted), old_last, old_best):
            if gone is not None and gone not in self._held():
                self._drop(gone)
        return (None, None) if self.best_metric is None else (self.best_metric, self.best_epoch)

    def save_recovery(self, epoch: int, batch_idx: int = 0, *, step: int | None = None) -> Checkpoint:
        """Commit a recovery checkpoint; the saver keeps the two newest, as timm keeps two files."""
        epoch = _check_index("epoch", epoch)
        batch_idx = _check_index("batch_idx", batch_idx)
        step = self._step(step)
        after = self._state(recovery=(step, self._curr_recovery))
        ckpt = self._commit(step, epoch, None, {"epoch": epoch, "batch_idx": batch_idx}, "recovery", after)
        if self._prev_recovery is not None:
            self._drop(self._prev_recovery)
        self._prev_recovery, self._curr_recovery = self._curr_recovery, ckpt.step
        return ckpt

    def find_recovery(self) -> str:
        """The ref (``run@step``) of the run's newest recovery checkpoint, or ``''`` if it has none.

        timm returns the recovery file whose name sorts first, which is not always the newest
        (``recovery-10-0`` sorts before ``recovery-9-0``); this returns the newest."""
        found = [c for c in self._checkpoints() if c.kind == "recovery"]
        return max(found, key=lambda c: c.step).ref if found else ""

    def save_milestone(self, completed_epochs: int, *, step: int | None = None) -> str:
        """Copy the run's ``last`` checkpoint as a checkpoint of kind ``milestone`` tagged
        ``milestone-N`` (N the completed epoch count), which the saver never deletes; returns
        its ref. As in timm, call it after ``save_checkpoint`` for the epoch. The copy adds no
        tensor bytes: every chunk is already stored."""
        completed_epochs = _check_index("completed_epochs", completed_epochs)
        try:
            last = self.store.resolve(f"{self.run}@last")
        except NotFoundError:  # no such tag, or no such run yet
            raise CheckpointNotFoundError(
                f"run {self.run!r} has no 'last' checkpoint to keep as milestone {completed_epochs}; "
                "call save_checkpoint first"
            ) from None
        states = self.store.load(last)
        ckpt = self.store.commit(
            self._step(step), states, last.metrics, kind="milestone", run=self.run,
            world_layout=last.world_layout, process_group=self._group(),
        )  # fmt: skip
        self.store.tag(ckpt.ref, f"milestone-{completed_epochs}", move=True)
        _logger.info("Saved milestone checkpoint %s", ckpt.ref)
        return ckpt.ref

    # -- timm's attributes, as refs -------------------------------------------------------------
    @property
    def checkpoint_files(self) -> list[tuple[str, float | None]]:
        """``[(ref, metric)]`` of the kept epoch checkpoints, best first (timm: file names)."""
        return [(f"{self.run}@{k.step}", k.metric) for k in self._kept]

    @property
    def curr_recovery_file(self) -> str:
        return "" if self._curr_recovery is None else f"{self.run}@{self._curr_recovery}"

    @property
    def prev_recovery_file(self) -> str:
        return "" if self._prev_recovery is None else f"{self.run}@{self._prev_recovery}"

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The saver's state as plain values: the kept epoch checkpoints ``[step, epoch,
        metric]`` best first, the best metric, and the checkpoints it may delete later. Every
        checkpoint the saver commits records the state after its own save (``timm`` entry,
        key ``saver``): see :meth:`load_state_dict_from_checkpoint`."""
        return self._state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take over a state :meth:`state_dict` returned, checked first; entries whose
        checkpoints are no longer in the store are dropped, as timm drops missing files."""
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise StoreConfigError(f"not a CheckpointSaver state of version {_STATE_VERSION}: {str(state)[:80]}")
        if state.get("run") != self.run:
            raise StoreConfigError(f"the state is of run {state.get('run')!r}, this saver writes run {self.run!r}")
        rows = state.get("checkpoint_files")
        if not isinstance(rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) and len(r) == 3 for r in rows):
            raise StoreConfigError("the state's 'checkpoint_files' must be a list of [step, epoch, metric]")
        kept = [Kept(_check_index("step", s), _check_index("epoch", e), _check_metric(m)) for s, e, m in rows]
        if len(kept) > self.max_history:
            raise StoreConfigError(f"the state keeps {len(kept)} checkpoints, more than max_history={self.max_history}")
        best_metric = _check_metric(state.get("best_metric"))
        best_epoch, best_step, last_step, curr, prev = (
            None if state.get(name) is None else _check_index(name, state.get(name))
            for name in ("best_epoch", "best_step", "last_step", "curr_recovery", "prev_recovery")
        )
        present = {c.step for c in self._checkpoints()}

        def alive(step: int | None) -> int | None:
            return step if step in present else None

        self._kept = tuple(k for k in kept if k.step in present)
        self.best_metric, self.best_epoch, self._best_step = best_metric, best_epoch, alive(best_step)
        self._last_step, self._curr_recovery, self._prev_recovery = alive(last_step), alive(curr), alive(prev)

    def load_state_dict_from_checkpoint(self, ref: str | int | Checkpoint) -> bool:
        """Take over the state recorded in checkpoint ``ref`` (one this saver's kind committed);
        returns False, as timm does, when the checkpoint records none."""
        ckpt = ref if isinstance(ref, Checkpoint) else self.store.resolve(ref, run=self.run)
        if META not in ckpt.sub_keys:
            _logger.warning("%s records no checkpoint history; ranked checkpoints start fresh", ckpt.ref)
            return False
        meta = self.store.load(ckpt, ranks=[0], sub_keys=[META])[0][META]
        state = meta.get("saver") if isinstance(meta, Mapping) else None
        if state is None:
            _logger.warning("%s records no checkpoint history; ranked checkpoints start fresh", ckpt.ref)
            return False
        self.load_state_dict(state)
        return True

    # -- helpers --------------------------------------------------------------------------------
    def _state(
        self,
        *,
        kept: tuple[Kept, ...] | None = None,
        last: int | None = None,
        best: tuple[float | None, int | None, int | None] | None = None,
        recovery: tuple[int | None, int | None] | None = None,
    ) -> dict[str, Any]:
        best_metric, best_epoch, best_step = best or (self.best_metric, self.best_epoch, self._best_step)
        curr, prev = recovery or (self._curr_recovery, self._prev_recovery)
        return {
            "version": _STATE_VERSION,
            "run": self.run,
            "checkpoint_files": [[k.step, k.epoch, k.metric] for k in (self._kept if kept is None else kept)],
            "best_metric": best_metric,
            "best_epoch": best_epoch,
            "best_step": best_step,
            "last_step": self._last_step if last is None else last,
            "curr_recovery": curr,
            "prev_recovery": prev,
        }

    def _held(self) -> set[int]:
        held = {k.step for k in self._kept}
        held.update(s for s in (self._last_step, self._best_step, self._curr_recovery, self._prev_recovery) if s is not None)
        return held

    def _checkpoints(self) -> list[Checkpoint]:
        try:
            return self.store.checkpoints(self.run)
        except NotFoundError:  # the run has no checkpoint yet
            return []

    def _step(self, step: int | None) -> int:
        if step is not None:
            return _check_index("step", step)
        return max((c.step for c in self._checkpoints()), default=-1) + 1

    def _group(self) -> Any:
        if self._process_group is not None:
            return self._process_group
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # only this rank saves: commit on a group of this rank alone (created by it alone)
            self._process_group = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
        return self._process_group

    def _commit(
        self, step: int, epoch: int, metric: float | None, metrics: dict[str, float], kind: str, saver: dict[str, Any]
    ) -> Checkpoint:
        state = build_checkpoint(
            epoch=epoch, model=self.model, optimizer=self.optimizer, args=self.args, model_ema=self.model_ema,
            amp_scaler=self.amp_scaler, task=self.task, unwrap_fn=self.unwrap_fn, metric=metric,
        )  # fmt: skip
        state["saver"] = saver
        return self.store.commit(
            step, {0: split_checkpoint(state)}, metrics, kind=kind, run=self.run, process_group=self._group()
        )

    def _drop(self, step: int) -> None:
        ref = f"{self.run}@{step}"
        try:
            self.store.delete(ref)
        except CheckpointNotFoundError:
            pass  # deleted already (by hand, or by a retention policy)
        except ProtectedCheckpointError as e:
            _logger.warning("keeping %s, which the saver would delete: %s", ref, e)
