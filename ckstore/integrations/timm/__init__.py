"""timm's checkpoint manager on a ckstore store; timm itself is not needed.

::

    from ckstore.integrations import timm as cktimm

    store = ckstore.open("s3://bucket/ckpts", run="resnet50-a1", catalog=...)
    saver = cktimm.CheckpointSaver(model, optimizer, args, model_ema=ema, amp_scaler=scaler,
                                   decreasing=False, max_history=3, store=store)
    best_metric, best_epoch = saver.save_checkpoint(epoch, metric=top1)   # timm's call sites
    saver.save_recovery(epoch, batch_idx)
    start_epoch = cktimm.resume_checkpoint(model, store, saver.find_recovery() or "last",
                                           optimizer, loss_scaler=scaler)

Each save commits one checkpoint of rank 0: timm's checkpoint dict with every state dict (model,
EMA, optimizer, loss scaler) as its own entry and the small values (epoch, arch, version, metric,
args) in the entry ``timm`` (:mod:`._state`). Checkpoints have kind ``epoch``, ``recovery`` or
``milestone`` and record ``metrics["epoch"]`` and the metric under ``args.eval_metric`` (else
``metric``); recovery checkpoints record ``metrics["batch_idx"]`` too. The saver keeps exactly the
epoch checkpoints timm's saver keeps (:mod:`._history`), with tags ``last`` and ``model_best``
where timm has those files, and timm's two recovery checkpoints (:mod:`._saver`).
"""

from __future__ import annotations

from ._history import Admission, Kept, admit
from ._saver import CheckpointSaver
from ._state import META, checkpoint_dict, clean_state_dict, resume_checkpoint, unwrap_model

__all__ = [
    "CheckpointSaver",
    "resume_checkpoint",
    "checkpoint_dict",
    "unwrap_model",
    "clean_state_dict",
    "admit",
    "Kept",
    "Admission",
    "META",
]
