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
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    StoreConfigError,
    UnsupportedValueError,
)
from ..format.tensorio import format_path
from ..format.tree import MAX_DEPTH
from ..layout import WorldLayout
from ..records import Checkpoint
from ..urls import parse

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


#: What torch's restricted loader says when a file holds objects it may not build (a class, a
#: function): those, and only those, load with ``allow_pickle``. Its other refusals (an opcode it
#: does not know, a string too long) mean the bytes are no pickle torch.save wrote.
_OBJECT_REFUSALS = ("Unsupported global", "unsupported GLOBAL", "Can only create new object", "Can only build")


def _load_reason(e: BaseException) -> str:
    """The line of a failed ``torch.load`` that says what was wrong (the restricted loader's own
    error follows a paragraph about ``weights_only``)."""
    text = str(e)
    _, marker, rest = text.partition("WeightsUnpickler error:")
    if marker:
        reason = next((x.strip() for x in rest.splitlines() if x.strip()), "")
        if reason:
            return f"{type(e).__name__}: {reason}"
    return _one_line(e)


#: The most values an imported file's state tree may hold beyond those its pickle spells out. A
#: torch.save file may refer to one container from many places, and each place reads as a copy of
#: it: a 1.7 KB file of 22 nested ``[x, x]`` lists reads as 12 million values (gigabytes in memory
#: before the commit gave up), a few bytes more as 2**40. Ordinary sharing adds a few (an
#: optimizer's param groups share one ``betas`` tuple).
MAX_SHARED_VALUES = 1 << 20


def _check_untrusted_tree(state: Any, path: str) -> None:
    """Refuse a state tree, loaded from an untrusted file, that a commit would blow up in memory.

    Two ways a few bytes of a torch.save file read as gigabytes: containers referred to from many
    places (their expanded copies counted against :data:`MAX_SHARED_VALUES`), and a tensor whose
    elements need more bytes than its storage holds (``torch.zeros(1).expand(2**31)``: 4 bytes
    of storage that a commit would stage as 8 GiB). Tensors sharing a storage (tied weights, views
    of one storage) are ordinary and pass. Walks each container once; a cycle, or nesting deeper
    than the commit allows, is left to the commit to refuse by its key path.
    """
    expanded: dict[int, int] = {}  # id of each container -> the values its subtree reads as
    held = [0]  # the values the file spells out: each container once, and its members

    def visit(x: Any, keys: tuple[Any, ...]) -> int:
        if isinstance(x, torch.Tensor):
            problem = _overreach(x)
            if problem is not None:
                raise UnsupportedValueError(
                    f"{path}: key {format_path(keys)!r} {problem}; importing it would allocate all of "
                    "that. Save a copy (.clone()) of it instead, or pass allow_pickle=True "
                    "(--allow-pickle) if you trust the file"
                )
            return 1
        if not isinstance(x, (dict, list, tuple)):
            return 1
        known = expanded.get(id(x))
        if known is not None:
            return known
        expanded[id(x)] = 1  # reached again inside itself: a cycle, which the commit refuses
        if len(keys) > MAX_DEPTH:
            return 1  # which the commit refuses too
        held[0] += 1 + len(x)
        items = x.items() if isinstance(x, dict) else enumerate(x)
        n = expanded[id(x)] = 1 + sum(visit(v, (*keys, k)) for k, v in items)
        return n

    total = visit(state, ())
    if total - held[0] > MAX_SHARED_VALUES:
        raise UnsupportedValueError(
            f"{path} refers to the same containers from so many places that it reads as {total} values, "
            f"more than {MAX_SHARED_VALUES} beyond the {held[0]} it holds, and an import copies each. If "
            "you trust the file, allow_pickle=True (--allow-pickle) reads it without this limit"
        )


def _overreach(t: torch.Tensor) -> str | None:
    """Why tensor ``t`` reads more bytes than its storage holds, or None."""
    if t.layout != torch.strided or t.is_quantized or t.is_meta or t.numel() == 0:
        return None  # the commit refuses the others by name; an empty tensor reads nothing
    try:
        storage = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one: the commit decides
        return None
    reach = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    if t.nbytes <= storage and (reach + 1) * t.element_size() <= storage:
        return None
    return (
        f"is a tensor of shape {list(t.shape)} and strides {list(t.stride())}, {t.nbytes} bytes, over a "
        f"storage of {storage} bytes (an expanded or overlapping view)"
    )


def read_checkpoint(path: str, fmt: str = "auto", *, allow_pickle: bool = False) -> Any:
    """Load a checkpoint file or folder of another tool into memory (tensors on the CPU).

    Nothing is unpickled without ``allow_pickle``: a ``torch.save`` file is read by torch's
    restricted loader (``weights_only=True``: tensors and plain values only), a safetensors file
    holds no pickle, and a DCP folder is refused outright, because its ``.metadata`` is a pickle
    that DCP's reader loads unrestricted. What the restricted loader hands back is checked before
    anything allocates for it (:func:`_check_untrusted_tree`): a file that would read as far more
    than it holds is refused. Errors are :class:`~ckstore.errors.CkstoreError` subclasses with
    one-line messages.
    """
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "torch":
        try:
            state = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds for unsafe or bad files
            if not allow_pickle and any(m in str(e) for m in _OBJECT_REFUSALS):
                raise _untrusted(path, "holds Python objects beyond tensors and plain values") from e
            raise StoreConfigError(f"cannot read {path} as a torch.save file: {_load_reason(e)}") from e
        if not allow_pickle:
            _check_untrusted_tree(state, path)
        return state
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


def _flat_tensors(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors of a state tree under safetensors names (key paths joined with '.'), refusing
    a value that is no tensor (None included) and two tensors whose names would be the same."""
    out: dict[str, torch.Tensor] = {}
    paths: dict[str, tuple[Any, ...]] = {}

    def walk(x: Any, keys: tuple[Any, ...]) -> None:
        if isinstance(x, torch.Tensor):
            name = ".".join(map(str, keys))
            other = paths.setdefault(name, keys)
            if other is not keys:
                raise UnsupportedValueError(
                    f"keys {format_path(other)!r} and {format_path(keys)!r} would both be the tensor "
                    f"{name!r} of the safetensors file (its names join key paths with '.'); export "
                    "to the torch or dcp format instead, or rename one of them"
                )
            out[name] = x
        elif isinstance(x, Mapping):
            for k, v in x.items():
                walk(v, (*keys, k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, (*keys, i))
        else:
            raise UnsupportedValueError(
                f"key {format_path(keys)!r} holds {'None' if x is None else 'a ' + type(x).__name__}; "
                "safetensors files hold tensors only (export to the torch or dcp format instead, or "
                "pick a sub-checkpoint of tensors)"
            )

    walk(obj, ())
    return out


def _save_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    try:
        save_file(tensors, path)
    except KeyError as e:  # safetensors' own table of dtypes has no entry for this one
        dtype = e.args[0] if e.args else None
        if not isinstance(dtype, torch.dtype):
            raise
        key = next((k for k, t in tensors.items() if t.dtype == dtype), "?")
        raise UnsupportedValueError(
            f"key {key!r} is a {str(dtype).removeprefix('torch.')} tensor, a dtype safetensors files "
            "cannot hold; export to the torch or dcp format instead, or convert it (say, to complex64)"
        ) from None


def write_checkpoint(state: Any, path: str, fmt: str) -> None:
    """Write ``state`` to ``path`` as it stands (the export's checks are :func:`export_checkpoint`'s)."""
    if fmt == "torch":
        torch.save(state, path)
    elif fmt == "safetensors":
        _save_safetensors(_flat_tensors(state), path)
    elif fmt == "dcp":
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        if not isinstance(state, dict):
            raise UnsupportedValueError("a Distributed Checkpoint needs a dict at the top level")
        try:
            with _single_process():
                dcp_save(state, checkpoint_id=path, no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own is a BaseException
            raise StoreConfigError(f"cannot write {path} as a Distributed Checkpoint: {_dcp_reason(e)}") from e
    else:
        raise StoreConfigError(f"unknown checkpoint format {fmt!r}: use one of {', '.join(FORMATS)}")


def _store_paths(store: Any) -> tuple[str | None, str | None]:
    """The local folder a store keeps its files in, and its SQLite catalog file (None: not local)."""
    blobs = getattr(store, "blobs", None)
    root = getattr(blobs, "root", None) if getattr(blobs, "is_local", False) else None
    database = None
    url = getattr(getattr(store, "catalog", None), "url", None)
    if isinstance(url, str) and url.startswith("sqlite"):
        database = parse(url).database
        if not database or database == ":memory:" or database.startswith("file:"):
            database = None
    return (os.path.realpath(root) if isinstance(root, str) else None), (
        os.path.realpath(database) if database else None
    )


def _check_destination(store: Any, path: Any, fmt: str, overwrite: bool) -> None:
    """Refuse an export that could not be written, or should not be, before the checkpoint is
    read: an unknown format; a path inside the store's own folder or onto its catalog (it would
    write over the store); a file whose folder does not exist or whose path is a folder; a dcp
    folder that is a file; and a destination that exists already, unless ``overwrite``."""
    if fmt not in FORMATS:
        raise StoreConfigError(f"unknown checkpoint format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise StoreConfigError(f"the export's path must be a file or folder name, got {path!r}")
    real = os.path.realpath(path)  # through links: a link into the store is the store
    root, database = _store_paths(store)
    if root is not None and (real == root or real.startswith(root.rstrip(os.sep) + os.sep)):
        raise StoreConfigError(
            f"{path} is inside the store's own folder {root}; an export there would write over the "
            "store's files. Export to a path outside it"
        )
    if database is not None and real in {database + suffix for suffix in ("", "-wal", "-shm", "-journal")}:
        raise StoreConfigError(
            f"{path} is the store's catalog database; an export there would destroy it. Export to another path"
        )
    target = Path(path)
    if fmt in ("torch", "safetensors"):
        if target.is_dir():
            raise StoreConfigError(f"{path} is a folder; a {fmt} export writes one file")
        if not target.parent.is_dir():
            raise StoreConfigError(f"no folder {str(target.parent)!r} to write {path} into; create it first")
        if os.path.lexists(target) and not overwrite:
            raise AlreadyExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
    elif fmt == "dcp":
        if os.path.lexists(target) and not target.is_dir():
            raise StoreConfigError(
                f"{path} is a file; a dcp export writes a folder (a Distributed Checkpoint). Name a "
                "folder that does not exist yet, or an empty one"
            )
        if target.is_dir() and any(target.iterdir()) and not overwrite:
            raise AlreadyExistsError(
                f"the folder {path} is not empty; pass overwrite=True (--overwrite) to write the "
                "Distributed Checkpoint into it anyway, or name a new or empty folder"
            )


def _write_through_temp(state: Any, path: str, fmt: str) -> None:
    """:func:`write_checkpoint` into a temporary file (a dcp: folder) beside ``path``, renamed onto
    it once complete: a failed export leaves no half-written file. A dcp export onto a folder that
    is not empty (``overwrite``), or a link to one, writes into it, as DCP does: a rename cannot
    replace it."""
    folder, name = os.path.split(os.path.abspath(path))
    if fmt == "dcp":
        if os.path.isdir(path) and (os.path.islink(path) or any(os.scandir(path))):
            write_checkpoint(state, path, fmt)
            return
        os.makedirs(folder, exist_ok=True)  # as DCP's writer made the folders on the way
    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write_checkpoint(state, tmp, fmt)
        os.replace(tmp, path)  # a dcp folder: onto nothing, or onto an empty folder
    except BaseException:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _sharded(store: Any, ckpt: Checkpoint, sub_keys: list[str] | None) -> bool:
    """Whether any rank holds a shard of a tensor (a checkpoint an export consolidates)."""
    if ckpt.world_layout.world_size <= 1:
        return False
    manifests = store.manifests(ckpt, sub_keys=sub_keys)
    return any(t.shard is not None for m in manifests.values() for t in m.tensors)


def export_checkpoint(
    store: Any,
    ref: str | int,
    path: str,
    *,
    fmt: str = "torch",
    rank: int = 0,
    sub_key: str | None = None,
    consolidate: bool = True,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Checkpoint:
    """Write checkpoint ``ref`` to ``path``: one rank, or one sub-key.

    A sharded checkpoint is consolidated into full tensors (unless ``consolidate=False``), its
    unsharded values taken from the lowest rank; any other checkpoint exports ``rank``'s state.
    Without ``sub_key`` the file holds ``{sub_key: state_dict}`` for every sub-checkpoint.
    ``fmt="deepspeed"`` writes every rank's files as a stock DeepSpeed folder at ``path``.
    Nothing is written inside the store's own folder, and an existing file (or a folder that is
    not empty, for ``dcp``) is replaced only with ``overwrite``; a file is written through a
    temporary one beside it, so a failed export leaves none half-written.
    """
    _check_destination(store, path, fmt, overwrite)
    if fmt == "deepspeed":
        from .deepspeed import export_folder

        return export_folder(store, ref, path, allow_pickle=allow_pickle, progress=progress)
    ckpt: Checkpoint = store.resolve(ref)
    if rank not in ckpt.ranks:
        raise CheckpointNotFoundError(
            f"run {ckpt.run!r}, step {ckpt.step} was saved by ranks {list(ckpt.ranks)}, not rank {rank!r}; "
            "export one of them"
        )
    sub_keys = [sub_key] if sub_key else None
    if consolidate and _sharded(store, ckpt, sub_keys):
        if rank != 0:
            raise StoreConfigError(
                f"run {ckpt.run!r}, step {ckpt.step} is sharded: an export consolidates all its ranks into "
                f"full tensors, so it takes no rank (asked for rank {rank}); leave the rank out"
            )
        states = store.load(
            ckpt, WorldLayout.single(), ranks=[0], sub_keys=sub_keys, allow_pickle=allow_pickle, progress=progress
        )[0]
    else:
        states = store.load(ckpt, ranks=[rank], sub_keys=sub_keys, allow_pickle=allow_pickle, progress=progress)[rank]
    _write_through_temp(states[sub_key] if sub_key else states, os.fspath(path), fmt)
    return ckpt
