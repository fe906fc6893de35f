"""Import checkpoints written by other tools, and export ckstore checkpoints to them.

Formats: ``torch`` (a ``torch.save`` file), ``safetensors`` (a ``.safetensors`` file) and ``dcp``
(a PyTorch Distributed Checkpoint folder); ``deepspeed`` folders are handed to
:mod:`ckstore.integrations.deepspeed`. Imports commit into a store like any other
checkpoint, so re-importing the same weights stores nothing new; exports check out a checkpoint
(consolidated to one rank when it was sharded) and write it in the chosen format. A ``dcp``
export holds ``{sub_key: state_dict}``, so DCP's own ``FileSystemReader`` loads it with the same
keys as :class:`ckstore.integrations.dcp.Reader` reads from the store (DCP's storage writer and
reader on the store itself live in :mod:`ckstore.integrations.dcp`).

Imported files are untrusted: no import unpickles anything unless the caller passes
``allow_pickle=True`` (``--allow-pickle``), see :func:`read_checkpoint`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import StoreConfigError, UnsupportedValueError
from ..layout import WorldLayout
from ..records import Checkpoint

__all__ = ["FORMATS", "detect_format", "read_checkpoint", "write_checkpoint", "import_checkpoint", "export_checkpoint"]

FORMATS = ("torch", "safetensors", "dcp", "deepspeed")


def _not_from_dcp(record: logging.LogRecord) -> bool:
    return "distributed/checkpoint" not in record.pathname.replace(os.sep, "/")


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    # a single-process DCP read or write is what the caller asked for; no need to warn. DCP also
    # logs the tracebacks of failed reads to the root logger: the error raised says it in one line
    root = logging.getLogger()
    root.addFilter(_not_from_dcp)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        root.removeFilter(_not_from_dcp)


def detect_format(path: str) -> str:
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, ".metadata")):
            return "dcp"
        from .deepspeed import is_deepspeed_folder

        if is_deepspeed_folder(path):
            return "deepspeed"
        raise StoreConfigError(
            f"{path} is a folder but neither a Distributed Checkpoint (no .metadata file in it) nor a "
            "DeepSpeed checkpoint (no *model_states.pt files, in it or in the tag folder its latest names)"
        )
    if not os.path.isfile(path):
        raise StoreConfigError(f"no file or folder at {path}")
    if path.endswith(".safetensors"):
        return "safetensors"
    return "torch"


def _one_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _dcp_reason(e: BaseException) -> str:
    """The last line of a DCP failure (its message carries each rank's whole traceback)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (exception, its stack summary)
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return _one_line(first[0])
    return _one_line(e)


def _untrusted(path: str, what: str) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"{path} {what}; loading it runs code from the file. If you trust it, pass "
        "allow_pickle=True (--allow-pickle)"
    )


def read_checkpoint(path: str, fmt: str = "auto", *, allow_pickle: bool = False) -> Any:
    """Load a checkpoint file or folder of another tool into memory (tensors on the CPU).

    Nothing is unpickled without ``allow_pickle``: a ``torch.save`` file is read by torch's
    restricted loader (``weights_only=True``: tensors and plain values only), a safetensors file
    holds no pickle, and a DCP folder is refused outright, because its ``.metadata`` is a pickle
    that DCP's reader loads unrestricted. Errors are :class:`~ckstore.errors.CkstoreError`
    subclasses with one-line messages.
    """
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "torch":
        try:
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds for unsafe or bad files
            if not allow_pickle and "weights_only" in str(e):
                raise _untrusted(path, "holds Python objects beyond tensors and plain values") from e
            raise StoreConfigError(f"cannot read {path} as a torch.save file: {_one_line(e)}") from e
    if fmt == "safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, a bad header
            raise StoreConfigError(f"cannot read {path} as a safetensors file: {_one_line(e)}") from e
    if fmt == "dcp":
        if not allow_pickle:  # before DCP's reader touches the folder: its .metadata is a pickle
            raise _untrusted(path, "is a Distributed Checkpoint folder, whose .metadata file is a Python pickle")
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise StoreConfigError(f"{path} is not a Distributed Checkpoint folder (no .metadata file in it)")
        # what torch.distributed.checkpoint.format_utils.dcp_to_torch_save does, without the file
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        sd: dict[str, Any] = {}
        try:
            with _single_process():
                planner = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
                _load_state_dict(sd, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own is a BaseException
            raise StoreConfigError(f"cannot read {path} as a Distributed Checkpoint: {_dcp_reason(e)}") from e
        return sd
    raise StoreConfigError(f"unknown checkpoint format {fmt!r}: use one of {', '.join(FORMATS)} or auto")


def import_checkpoint(
    store: Any,
    path: str,
    step: int | None,
    *,
    fmt: str = "auto",
    run: str | None = None,
    sub_key: str | None = "model_states",
    metrics: Mapping[str, float] | None = None,
    tags: Sequence[str] = (),
    kind: str = "imported",
    allow_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Checkpoint:
    """Commit a checkpoint file or folder as ``step`` of a run, as rank 0.

    With ``sub_key=None`` the file's top-level keys become sub-checkpoints (a file saved as
    ``{"model": ..., "optimizer": ...}``); otherwise the whole file is one sub-checkpoint.
    A DeepSpeed folder keeps its ranks and files (``step`` None: its engine state's step).
    """
    if fmt == "deepspeed" or fmt == "auto" and detect_format(path) == "deepspeed":
        from .deepspeed import import_folder

        return import_folder(
            store, path, step=step, run=run, metrics=metrics, tags=tags, kind=kind, allow_pickle=allow_pickle,
            progress=progress,
        )  # fmt: skip
    if step is None:
        raise StoreConfigError("pass the step to record the checkpoint as (--step)")
    state = read_checkpoint(path, fmt, allow_pickle=allow_pickle)
    if sub_key is None:
        if not isinstance(state, Mapping) or not state or not all(isinstance(k, str) for k in state):
            raise UnsupportedValueError(
                f"{path}: to split it into sub-checkpoints its top level must be a dict with string keys"
            )
        rank_states = {0: dict(state)}
    else:
        rank_states = {0: {sub_key: state}}
    return store.commit(  # type: ignore[no-any-return]
        step, rank_states, metrics, tags=tags, kind=kind, run=run, allow_pickle=allow_pickle, progress=progress
    )


def _flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(_flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    elif obj is not None:
        raise UnsupportedValueError(
            f"key {prefix!r} holds a {type(obj).__name__}; safetensors files hold tensors only "
            "(export to the torch or dcp format instead, or pick a sub-checkpoint of tensors)"
        )
    return out


def write_checkpoint(state: Any, path: str, fmt: str) -> None:
    if fmt == "torch":
        torch.save(state, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(_flat_tensors(state), path)
    elif fmt == "dcp":
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        if not isinstance(state, dict):
            raise UnsupportedValueError("a Distributed Checkpoint needs a dict at the top level")
        with _single_process():
            dcp_save(state, checkpoint_id=path, no_dist=True)
    else:
        raise StoreConfigError(f"unknown checkpoint format {fmt!r}: use one of {', '.join(FORMATS)}")


def _check_destination(path: Any, fmt: str) -> None:
    """Refuse an export that could not be written, before the checkpoint is read: an unknown
    format, or a file whose folder does not exist or whose path is a folder."""
    if fmt not in FORMATS:
        raise StoreConfigError(f"unknown checkpoint format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise StoreConfigError(f"the export's path must be a file or folder name, got {path!r}")
    if fmt in ("torch", "safetensors"):
        target = Path(path)
        if target.is_dir():
            raise StoreConfigError(f"{path} is a folder; a {fmt} export writes one file")
        if not target.parent.is_dir():
            raise StoreConfigError(f"no folder {str(target.parent)!r} to write {path} into; create it first")


def export_checkpoint(
    store: Any,
    ref: str | int,
    path: str,
    *,
    fmt: str = "torch",
    rank: int = 0,
    sub_key: str | None = None,
    consolidate: bool = True,
    allow_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Checkpoint:
    """Write checkpoint ``ref`` to ``path``: one rank (consolidated when sharded), or one sub-key.

    Without ``sub_key`` the file holds ``{sub_key: state_dict}`` for every sub-checkpoint.
    ``fmt="deepspeed"`` writes every rank's files as a stock DeepSpeed folder at ``path``.
    """
    _check_destination(path, fmt)
    if fmt == "deepspeed":
        from .deepspeed import export_folder

        return export_folder(store, ref, path, allow_pickle=allow_pickle, progress=progress)
    ckpt: Checkpoint = store.resolve(ref)
    layout = WorldLayout.single() if consolidate and ckpt.world_layout.world_size > 1 else None
    sub_keys = [sub_key] if sub_key else None
    if layout is not None:
        states = store.load(ckpt, layout, ranks=[0], sub_keys=sub_keys, allow_pickle=allow_pickle, progress=progress)[0]
    else:
        states = store.load(ckpt, ranks=[rank], sub_keys=sub_keys, allow_pickle=allow_pickle, progress=progress)[rank]
    write_checkpoint(states[sub_key] if sub_key else states, path, fmt)
    return ckpt
