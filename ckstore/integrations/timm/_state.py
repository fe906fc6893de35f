"""timm's checkpoint dict, as entries of one ckstore checkpoint, and back.

timm's saver writes one file per checkpoint holding ``{'epoch', 'arch', 'version', 'args',
'metric', 'optimizer', 'state_dict', 'state_dict_ema', <amp_scaler.state_dict_key>}``. Here each
top-level value that is a state dict (model, EMA, optimizer, loss scaler, a task's states) is its
own entry of rank 0, keyed by timm's key, and the small values (epoch, arch, version, metric and
the training arguments as plain values, and the saver's own state) are the entry ``timm``. :func:`checkpoint_dict` puts the
dict back together, so code that reads timm's files reads the same keys.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointNotFoundError, CkstoreError
from ...records import Checkpoint

if TYPE_CHECKING:
    from ...store import Store

__all__ = [
    "META",
    "unwrap_model",
    "clean_state_dict",
    "plain_args",
    "split_checkpoint",
    "checkpoint_dict",
    "resume_checkpoint",
]

_logger = logging.getLogger("ckstore.integrations.timm")

#: The entry that holds timm's small values: epoch, arch, version, metric, args.
META = "timm"

_PLAIN = (type(None), bool, int, float, str, bytes)


def unwrap_model(model: Any) -> Any:
    """The module inside wrappers, as timm's ``unwrap_model``: a ``ModelEma``'s ``.ema``, a
    ``DistributedDataParallel``'s or EMA's ``.module``, a compiled module's ``._orig_mod``."""
    while True:
        if type(model).__name__ == "ModelEma" and hasattr(model, "ema"):
            model = model.ema
        elif hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def clean_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the ``module.`` and ``_orig_mod.`` prefixes wrappers add to keys, wrapped in either
    order (``_orig_mod.module.``: a compiled DDP module), as timm does."""
    out: dict[str, Any] = {}
    for k, v in state_dict.items():
        for prefix in ("_orig_mod.", "module.", "_orig_mod."):
            if k.startswith(prefix):
                k = k[len(prefix) :]
        out[k] = v
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    return str(value)


def plain_args(args: Any) -> dict[str, Any]:
    """Training arguments (an ``argparse.Namespace`` or any object with attributes, or a dict)
    as plain values; a value that is not plain (a path, an enum) is recorded as its ``str()``."""
    items = args if isinstance(args, Mapping) else vars(args)
    return {str(k): _plain(v) for k, v in items.items()}


def build_checkpoint(
    *,
    epoch: int,
    model: Any,
    optimizer: Any,
    args: Any,
    model_ema: Any,
    amp_scaler: Any,
    task: Any,
    unwrap_fn: Callable[[Any], Any],
    metric: float | None,
) -> dict[str, Any]:
    """The dict timm's saver would write (``CheckpointSaver._save``), args as plain values."""
    state: dict[str, Any] = {
        "epoch": epoch,
        "arch": type(model).__name__.lower(),
        "optimizer": optimizer.state_dict(),
        "version": 2,  # version < 2 increments epoch before save
    }
    if args is not None:
        state["arch"] = getattr(args, "model", state["arch"])
        state["args"] = plain_args(args)
    if amp_scaler is not None:
        state[amp_scaler.state_dict_key] = amp_scaler.state_dict()
    if task is not None:
        state.update(task.get_checkpoint_state(unwrap_fn=unwrap_fn))
        state.update(task.get_checkpoint_state(ema=True, unwrap_fn=unwrap_fn))
    else:
        state["state_dict"] = unwrap_fn(model).state_dict()
        if model_ema is not None:
            state["state_dict_ema"] = unwrap_fn(model_ema).state_dict()
    if metric is not None:
        state["metric"] = metric
    return state


def split_checkpoint(state: Mapping[str, Any]) -> dict[str, Any]:
    """``{sub_key: state}`` for one commit: each state dict its own entry, the rest in ``timm``."""
    entries: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Mapping) and key not in (META, "args", "saver"):
            entries[key] = value
        else:
            meta[key] = value
    entries[META] = meta
    return entries


def checkpoint_dict(
    store: Store, ref: str | int | Checkpoint, *, sub_keys: Iterable[str] | None = None, run: str | None = None
) -> dict[str, Any]:
    """The checkpoint ``ref`` as the dict timm's file would hold (``args`` as an
    ``argparse.Namespace`` of plain values); ``sub_keys`` limits which state dicts are read.

    Reads rank 0 only and is not a collective: every rank of a job may call it."""
    ckpt = ref if isinstance(ref, Checkpoint) else store.resolve(ref, run=run)
    wanted = list(ckpt.sub_keys) if sub_keys is None else [k for k in sub_keys if k in ckpt.sub_keys]
    if META in ckpt.sub_keys and META not in wanted:
        wanted.append(META)
    if 0 not in ckpt.ranks:
        raise CheckpointNotFoundError(f"{ckpt.ref} has no entries of rank 0 (it has ranks {list(ckpt.ranks)})")
    states = store.load(ckpt, ranks=[0], sub_keys=wanted)[0]
    out: dict[str, Any] = dict(states.pop(META, {}))
    if isinstance(out.get("args"), Mapping):
        out["args"] = argparse.Namespace(**out["args"])
    out.update(states)
    return out


def resume_checkpoint(
    model: Any,
    store: Store,
    ref: str | int | Checkpoint,
    optimizer: Any = None,
    loss_scaler: Any = None,
    log_info: bool = True,
    *,
    run: str | None = None,
) -> int | None:
    """Restore ``model`` (and ``optimizer``, ``loss_scaler``) from checkpoint ``ref``, as timm's
    ``timm.models.resume_checkpoint`` does from a file; returns the epoch to resume from (one past
    the saved epoch), or None for a checkpoint that holds only a model's state dict.

    Reads only the entries it restores, from rank 0, and is not a collective: in a
    data-parallel job every rank may call it. A checkpoint with no ``state_dict`` entry but a
    single entry (a plain state dict, such as one ``ckstore import`` made) loads that entry
    into ``model``. ``run`` qualifies a ref that names no run (default: the store's run)."""
    ckpt = ref if isinstance(ref, Checkpoint) else store.resolve(ref, run=run)
    if "state_dict" not in ckpt.sub_keys:
        if len(ckpt.sub_keys) != 1:
            raise CkstoreError(
                f"{ckpt.ref} has no 'state_dict' entry to resume a model from; it has {list(ckpt.sub_keys)}"
            )
        (only,) = ckpt.sub_keys
        model.load_state_dict(checkpoint_dict(store, ckpt)[only])
        if log_info:
            _logger.info("Loaded checkpoint '%s'", ckpt.ref)
        return None
    wanted = ["state_dict"]
    if optimizer is not None:
        wanted.append("optimizer")
    if loss_scaler is not None:
        wanted.append(loss_scaler.state_dict_key)
    checkpoint = checkpoint_dict(store, ckpt, sub_keys=wanted)
    if log_info:
        _logger.info("Restoring model state from checkpoint...")
    model.load_state_dict(clean_state_dict(checkpoint["state_dict"]))
    if optimizer is not None and "optimizer" in checkpoint:
        if log_info:
            _logger.info("Restoring optimizer state from checkpoint...")
        optimizer.load_state_dict(checkpoint["optimizer"])
    if loss_scaler is not None and loss_scaler.state_dict_key in checkpoint:
        if log_info:
            _logger.info("Restoring AMP loss scaler state from checkpoint...")
        loss_scaler.load_state_dict(checkpoint[loss_scaler.state_dict_key])
    resume_epoch: int | None = None
    if "epoch" in checkpoint:
        resume_epoch = int(checkpoint["epoch"])
        if int(checkpoint.get("version", 0)) > 1:
            resume_epoch += 1  # start at the next epoch; old checkpoints incremented before save
        if log_info:
            _logger.info("Loaded checkpoint '%s' (epoch %s)", ckpt.ref, checkpoint["epoch"])
    return resume_epoch
