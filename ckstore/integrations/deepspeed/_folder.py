"""Stock DeepSpeed checkpoint folders: import into a store, export back.

A folder ``engine.save_checkpoint(DIR, TAG)`` wrote looks like::

    DIR/latest                                          "TAG", written by rank 0
    DIR/TAG/mp_rank_00_model_states.pt                  per model-parallel rank (dp rank 0 writes)
    DIR/TAG/zero_pp_rank_1_mp_rank_00_model_states.pt   ZeRO-3: per data-parallel rank
    DIR/TAG/[bf16_]zero_pp_rank_1_mp_rank_00_optim_states.pt   ZeRO partitions, per dp rank
    DIR/TAG/layer_03-model_states.pt                    pipeline layers (layer_03-model_01-…)
    DIR/TAG/layer_0_expert_2_mp_rank_00_model_states.pt, expp_rank_0_mp_rank_00_optim_states.pt

:func:`import_folder` takes ``DIR`` (following ``latest``) or ``DIR/TAG``, parses each file's
rank coordinates from its name, takes the step from the engine state in the model states, and
commits every file as the entry ``(rank, stem)`` of one checkpoint over a ``dp``/``mp`` layout.
The files are pickles (torch.save of DeepSpeed objects), so reading them runs code from them:
import refuses without ``allow_pickle``. :func:`export_folder` writes a checkpoint's entries
back as ``DIR/TAG/<stem>.pt`` plus ``DIR/latest``, which the stock ``engine.load_checkpoint``
and ``zero_to_fp32`` read. Export writes only inside ``DIR``: every stem must be a plain file
name, the tag one folder name, and files are replaced atomically, never written through links.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import CkstoreError, StoreConfigError, UnsupportedValueError
from ...layout import WorldLayout
from ._objects import from_plain, to_plain

if TYPE_CHECKING:
    from ...records import Checkpoint
    from ...store import Store

__all__ = ["FileName", "parse_file_name", "is_deepspeed_folder", "import_folder", "export_folder"]

_SUFFIX = ".pt"
_MAX_LATEST = 4096
_SAFE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_META = "ckstore_deepspeed"

_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("model", re.compile(r"^mp_rank_(?P<mp>\d+)_model_states$")),
    ("zero_model", re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states$")),
    ("zero_optim", re.compile(r"^(?:bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_?optim_states$")),
    # pipeline layers: layer_03-model_states, or with the rank's non-data, non-pipe axes named
    # (layer_03-model_01-model_states)
    ("layer", re.compile(r"^layer_\d+-(?:[a-z]+_\d+-)*?(?:model_(?P<mp>\d+)-)?(?:[a-z]+_\d+-)*model_states$")),
    ("expert", re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_(?P<mp>\d+)_model_states$")),
    ("expert_optim", re.compile(r"^expp_rank_\d+_mp_rank_(?P<mp>\d+)_optim_states$")),
]


@dataclass(frozen=True, slots=True)
class FileName:
    """What a DeepSpeed file's name says: its kind and the ranks that wrote it."""

    stem: str
    kind: str
    dp: int
    mp: int


def parse_file_name(stem: str) -> FileName | None:
    """The kind and coordinates of a DeepSpeed checkpoint file (its name without ``.pt``)."""
    for kind, pattern in _PATTERNS:
        m = pattern.match(stem)
        if m:
            groups = m.groupdict()
            return FileName(stem, kind, int(groups.get("dp") or 0), int(groups.get("mp") or 0))
    return None


def _checkpoint_files(folder: str) -> list[str]:
    return sorted(
        n for n in os.listdir(folder) if n.endswith(_SUFFIX) and os.path.isfile(os.path.join(folder, n))
    )


def _read_latest(path: str) -> str:
    with open(os.path.join(path, "latest"), "rb") as f:
        raw = f.read(_MAX_LATEST + 1)
    tag = raw.decode("utf-8", "replace").strip()
    if len(raw) > _MAX_LATEST or not _one_component(tag):
        raise StoreConfigError(f"{path}/latest does not name a tag folder inside {path} (it holds {tag[:80]!r})")
    return tag


def _safe_component(name: str) -> bool:
    return bool(_SAFE.match(name)) and name not in (".", "..")


def _one_component(name: str) -> bool:
    """A name that is one folder inside its parent: DeepSpeed takes any string as a tag
    (``epoch 3``, ``step=3``), so only separators, NUL, ``.`` and ``..`` are refused."""
    seps = {"/", "\\", "\0", os.sep, os.altsep or "/"}
    return bool(name) and name not in (".", "..") and not any(c in name for c in seps)


def _tag_folder(path: str) -> tuple[str, str]:
    """``(folder, tag)`` of the checkpoint at ``path``: a tag folder, or its parent with ``latest``."""
    if not os.path.isdir(path):
        raise StoreConfigError(f"no folder at {path}")
    if os.path.isfile(os.path.join(path, "latest")):
        tag = _read_latest(path)
        folder = os.path.join(path, tag)
        if not os.path.isdir(folder):
            raise StoreConfigError(f"{path}/latest names tag {tag!r}, but {folder} is not a folder")
        return folder, tag
    return path, os.path.basename(os.path.normpath(path))


def is_deepspeed_folder(path: str) -> bool:
    """Whether ``path`` holds a DeepSpeed checkpoint: model states files, in it or in the tag
    folder its ``latest`` file names."""
    try:
        folder, _ = _tag_folder(path)
        return any(n.endswith("model_states" + _SUFFIX) for n in _checkpoint_files(folder))
    except (OSError, CkstoreError):
        return False


def _layout(names: Sequence[FileName], states: Mapping[str, Any]) -> WorldLayout:
    dp = max([n.dp for n in names] + [0]) + 1
    mp = max([n.mp for n in names] + [0]) + 1
    for n in names:  # the engine state records the job's sizes; trust them when they cover the files
        state = states[n.stem]
        if n.kind in ("model", "zero_model") and isinstance(state, Mapping):
            d, m = state.get("dp_world_size"), state.get("mp_world_size")
            if isinstance(d, int) and not isinstance(d, bool) and d >= dp:
                dp = d
            if isinstance(m, int) and not isinstance(m, bool) and m >= mp:
                mp = m
    return WorldLayout({k: v for k, v in (("dp", dp), ("mp", mp)) if v > 1} or {"dp": 1})


def _step_of(path: str, names: Sequence[FileName], states: Mapping[str, Any]) -> int:
    for n in names:
        state = states[n.stem]
        if n.kind in ("model", "zero_model") and isinstance(state, Mapping):
            step = state.get("global_steps")
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                return step
    raise StoreConfigError(f"{path}: no model states file records global_steps; pass the step (--step)")


def import_folder(
    store: Store,
    path: str,
    *,
    step: int | None = None,
    run: str | None = None,
    metrics: Mapping[str, float] | None = None,
    tags: Sequence[str] = (),
    kind: str = "imported",
    allow_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Checkpoint:
    """Commit the DeepSpeed checkpoint at ``path`` (a tag folder, or its parent with ``latest``)
    as one checkpoint; ``step`` defaults to the engine state's ``global_steps``. Call it from one
    process."""
    import torch
    import torch.distributed as dist

    folder, _ = _tag_folder(path)
    files = _checkpoint_files(folder)
    if not any(f.endswith("model_states" + _SUFFIX) for f in files):
        raise StoreConfigError(f"{folder} holds no DeepSpeed model states file (*model_states.pt)")
    names = []
    for f in files:
        parsed = parse_file_name(f[: -len(_SUFFIX)])
        if parsed is None:
            raise StoreConfigError(f"{os.path.join(folder, f)} is not a DeepSpeed checkpoint file name ckstore knows")
        names.append(parsed)
    if not allow_pickle:
        raise UnsupportedValueError(
            f"{folder}: DeepSpeed checkpoint files are pickles (torch.save of DeepSpeed loss scalers, "
            "enums and configs), and loading a pickle runs code from the file. If you trust the "
            "folder, pass allow_pickle=True (--allow-pickle); ckstore stores DeepSpeed's known "
            "objects as plain values, so loading the imported checkpoint needs no pickle"
        )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CkstoreError("import a DeepSpeed folder from one process, not from every rank of a job")
    states = {
        n.stem: torch.load(os.path.join(folder, n.stem + _SUFFIX), map_location="cpu", weights_only=False)
        for n in names
    }
    layout = _layout(names, states)
    at_step = _step_of(path, names, states) if step is None else step
    rank_states: dict[int, dict[str, Any]] = {}
    for n in names:
        rank = layout.rank({"dp": n.dp, "mp": n.mp})
        plain = to_plain(states.pop(n.stem), allow_pickle=True, where=f"{n.stem}, ")
        rank_states.setdefault(rank, {})[n.stem] = plain
    return store.commit(
        at_step, rank_states, metrics, tags=tags, kind=kind, run=run, world_layout=layout, allow_pickle=True,
        progress=progress,
    )  # fmt: skip


def export_folder(
    store: Store,
    ref: str | int,
    path: str,
    *,
    tag: str | int | None = None,
    allow_pickle: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Checkpoint:
    """Write checkpoint ``ref`` as a stock DeepSpeed folder: ``path/TAG/<stem>.pt`` for every
    sub-checkpoint and ``path/latest`` naming ``TAG`` (default ``global_step<STEP>``)."""
    import torch

    ckpt = store.resolve(ref)
    tag = f"global_step{ckpt.step}" if tag is None or tag == "" else str(tag)  # str(tag), as DeepSpeed's save
    if not _safe_component(tag):
        raise StoreConfigError(f"tag {tag!r} is not a plain folder name (letters, digits, _ . -)")
    stems = [k for k in ckpt.sub_keys if k != _META]
    bad = [k for k in stems if not _safe_component(k)]
    if bad:
        raise UnsupportedValueError(
            f"{ckpt.ref} has sub-checkpoints {bad[:5]} that are not plain file names; export writes "
            f"only DeepSpeed files inside {path}"
        )
    if not any(k.endswith("model_states") for k in stems):
        raise UnsupportedValueError(f"{ckpt.ref} is not a DeepSpeed checkpoint: none of {stems[:8]} is model states")
    os.makedirs(path, exist_ok=True)
    folder = os.path.join(path, tag)
    if os.path.islink(folder):
        raise StoreConfigError(f"{folder} is a symbolic link; export writes only inside {path}")
    os.makedirs(folder, exist_ok=True)
    for stem in stems:
        got = store.load(ckpt, sub_keys=[stem], allow_pickle=allow_pickle, progress=progress)
        src = min(got)
        state = from_plain(got[src][stem], where=f"{ckpt.ref}, rank {src}, {stem}, ")

        def write(f: Any, state: Any = state) -> None:
            torch.save(state, f)

        _replace(folder, stem + _SUFFIX, write)
    latest = tag.encode()
    _replace(path, "latest", lambda f: f.write(latest))
    return ckpt


def _replace(folder: str, name: str, write: Callable[[Any], Any]) -> None:
    """Write ``folder/name`` through a fresh temporary file and an atomic rename (a link at
    ``name`` is replaced, never followed)."""
    fd, tmp = tempfile.mkstemp(prefix=".ckstore-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
