"""Driving a DeepSpeed engine's own save and load code without its files.

DeepSpeed builds each rank's sub-checkpoints inside ``engine.save_checkpoint`` and consumes them
inside ``engine.load_checkpoint``, handing each one to its ``checkpoint_engine`` as
``save(state_dict, path)`` and ``load(path)``. :func:`capture` runs ``save_checkpoint`` with a
checkpoint engine that keeps the state dicts in memory, keyed by the file's stem
(``mp_rank_00_model_states``); :func:`serve` runs ``load_checkpoint`` with one that hands them
back. So every file kind DeepSpeed writes (model states, ZeRO and bf16 optimizer partitions,
pipeline layers, experts) goes through unchanged, in DeepSpeed's own order and collectives.

What DeepSpeed touches on disk around those calls: ``save_checkpoint`` copies its
``zero_to_fp32.py`` recovery scripts into the folder and rank 0 writes ``latest`` with
``open()``; ``load_checkpoint`` globs the folder for model and layer files. :func:`capture`
suppresses the script copy and ``latest`` and removes its scratch folder; :func:`serve` lays
out empty placeholder files in a scratch folder for the globs, and removes it.

Both are collectives, like the engine methods they drive: every rank of the job calls them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ...errors import CkstoreError, StoreConfigError

__all__ = ["SCRATCH_TAG", "require_deepspeed", "stem_of", "capture", "serve", "rank_coords", "CheckpointEngineBase"]

#: The tag under which the scratch folders hold a checkpoint.
SCRATCH_TAG = "ckstore"
_SUFFIX = ".pt"


def require_deepspeed() -> Any:
    """The ``deepspeed`` module, or an error that says how to install it."""
    try:
        import deepspeed
    except ImportError as e:
        raise StoreConfigError(
            "the DeepSpeed integration needs DeepSpeed: pip install 'ckstore[deepspeed]' "
            "(on a machine without CUDA: DS_BUILD_OPS=0 pip install deepspeed)"
        ) from e
    return deepspeed


def _base_class() -> type:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    base: type = CheckpointEngine
    return base


def CheckpointEngineBase() -> type:  # noqa: N802 - a class factory, used as a base class
    """DeepSpeed's ``CheckpointEngine`` (imported on first use)."""
    require_deepspeed()
    return _base_class()


def stem_of(path: str, folder: str) -> str:
    """The sub-key of a file DeepSpeed names ``path`` inside tag folder ``folder``: its path
    relative to the folder without ``.pt`` (``mp_rank_00_model_states``)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(folder))
    if rel.startswith(os.pardir) or os.path.isabs(rel):
        raise CkstoreError(f"DeepSpeed named a checkpoint file {path!r} outside its tag folder {folder!r}")
    rel = rel.replace(os.sep, "/")
    return rel[: -len(_SUFFIX)] if rel.endswith(_SUFFIX) else rel


def _info_tag(info: Any) -> str:
    """The tag of a ``create``/``commit`` call: DeepSpeed 0.16 passes a string, 0.19 a
    ``CheckpointCommitInfo``."""
    return str(getattr(info, "tag", info))


def _capture_engine(states: dict[str, Any], folder: str) -> Any:
    base = CheckpointEngineBase()

    class _Capture(base):  # type: ignore[misc, valid-type]
        """Keeps what the engine saves in memory, keyed by stem."""

        def __init__(self) -> None:
            self.name = "ckstore-capture"

        def create(self, info: Any) -> None:
            pass

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            states[stem_of(path, folder)] = state_dict

        def load(self, path: str, map_location: Any = None) -> Any:
            raise CkstoreError(f"nothing can be loaded while a checkpoint is captured ({path})")

        def commit(self, info: Any) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            return False  # the engine need not clone tensors for torch.save: nothing is pickled

    return _Capture()


@contextlib.contextmanager
def _swapped(engine: Any, checkpoint_engine: Any, **overrides: Any) -> Iterator[None]:
    saved = engine.checkpoint_engine
    engine.checkpoint_engine = checkpoint_engine
    for name, value in overrides.items():
        setattr(engine, name, value)
    try:
        yield
    finally:
        engine.checkpoint_engine = saved
        for name in overrides:
            with contextlib.suppress(AttributeError):
                delattr(engine, name)


def capture(engine: Any, *, client_state: Any = None, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """This rank's sub-checkpoints as ``engine.save_checkpoint`` would write them:
    ``{stem: state_dict}`` (empty on a rank that writes no file). Collective.

    The tensors are the engine's own (no copies): use or copy them before the next step.
    """
    require_deepspeed()
    states: dict[str, Any] = {}
    scratch = tempfile.mkdtemp(prefix="ckstore-ds-")
    try:
        cap = _capture_engine(states, os.path.join(scratch, SCRATCH_TAG))
        with _swapped(engine, cap, _copy_recovery_script=lambda *a, **k: None):
            engine.save_checkpoint(
                scratch, tag=SCRATCH_TAG, client_state=dict(client_state or {}), save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return states


def _serve_engine(fetch: Callable[[str], Any], folder: str) -> Any:
    base = CheckpointEngineBase()

    class _Serve(base):  # type: ignore[misc, valid-type]
        """Hands the engine its sub-checkpoints from ``fetch(stem)``.

        DeepSpeed reads the model states twice in a row: once for their keys (its state-dict
        loader's ``check_ckpt_list``), then to load them. So the last sub-checkpoint handed out
        is kept and handed out again when the engine asks for the same one next, provided the
        engine let go of it (nothing but this holds it: two of the engine's reads never share
        an object); otherwise, or for another sub-checkpoint, it is dropped before ``fetch``
        reads anew."""

        def __init__(self) -> None:
            self.name = "ckstore-serve"
            self._last: tuple[str, Any] | None = None

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            raise CkstoreError(f"nothing can be saved while a checkpoint is loaded ({path})")

        def load(self, path: str, map_location: Any = None) -> Any:
            stem = stem_of(path, folder)
            last, self._last = self._last, None
            # references to the object once the engine let go: the pair's, and getrefcount's own
            if last is not None and last[0] == stem and sys.getrefcount(last[1]) == 2:
                got = last[1]
            else:
                last = None
                got = fetch(stem)
            self._last = (stem, got)
            return got

        def commit(self, info: Any) -> bool:
            return True

    return _Serve()


def serve(
    engine: Any, stems: Iterable[str], fetch: Callable[[str], Any], *, source: str = "the states", **load_kwargs: Any
) -> Any:
    """Run ``engine.load_checkpoint`` on the sub-checkpoints ``fetch(stem)`` returns; returns its
    client state. ``stems`` are every sub-checkpoint the checkpoint has (the engine globs for
    them); ``fetch`` is called only for those this rank reads; ``source`` names them in errors.
    Collective."""
    require_deepspeed()
    if not load_kwargs.get("load_optimizer_states", True) and engine.zero_optimization_partition_weights():
        raise CkstoreError(
            "under ZeRO-3, DeepSpeed loads a checkpoint without its optimizer states by reading the "
            "folder's files itself (zero_to_fp32); load with load_optimizer_states=True, or export "
            "the checkpoint (ckstore export --format deepspeed) and load that folder"
        )
    stems = list(stems)
    # the model states the engine globs for (engine._get_all_ckpt_names); without one, DeepSpeed
    # fails a bare assert
    pattern = "zero_pp_rank_*_mp_rank_*_model_states" if engine.zero_optimization_partition_weights() else "mp_rank_*_model_states"
    if not any(fnmatch.fnmatchcase(stem, pattern) for stem in stems):
        raise CkstoreError(
            f"{source} holds no model states this engine loads: it reads {pattern} (ZeRO-3 engines read "
            f"each rank's zero_pp_rank_D_mp_rank_NN_model_states, others mp_rank_NN_model_states), "
            f"and there are {sorted(stems)[:8]}. Load a checkpoint ckds.save or attach wrote, with the "
            "ZeRO stage it was saved with"
        )
    scratch = tempfile.mkdtemp(prefix="ckstore-ds-")
    try:
        folder = os.path.join(scratch, SCRATCH_TAG)
        os.makedirs(folder)
        for stem in stems:
            target = os.path.join(folder, *stem.split("/")) + _SUFFIX
            stem_of(target, folder)  # never outside the scratch folder, whatever the stem says
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb"):
                pass
        with _swapped(engine, _serve_engine(fetch, folder)):
            load_path, client_state = engine.load_checkpoint(scratch, tag=SCRATCH_TAG, **load_kwargs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if load_path is None:
        raise CkstoreError("DeepSpeed found no model states in the checkpoint (no *_model_states sub-checkpoint)")
    return client_state


def rank_coords(engine: Any) -> tuple[dict[str, int], dict[str, int]]:
    """This rank's ``(sizes, coords)`` along DeepSpeed's pipeline, data and model parallel dims."""
    from deepspeed.utils import groups

    sizes = {
        "pp": int(getattr(engine, "num_stages", 1) or 1),
        "dp": int(getattr(engine, "seq_dp_world_size", None) or engine.dp_world_size),
        "mp": int(getattr(engine, "mp_world_size", 1) or 1),
    }
    try:
        dp = int(groups._get_sequence_data_parallel_rank())
    except (AttributeError, AssertionError, RuntimeError):
        dp = int(groups._get_data_parallel_rank())
    coords = {"pp": int(getattr(engine, "stage_id", 0) or 0), "dp": dp, "mp": int(engine.checkpoint_mp_rank or 0)}
    return sizes, coords
