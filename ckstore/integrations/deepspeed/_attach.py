"""``attach``: the stock ``engine.save_checkpoint``/``load_checkpoint`` through a store.

After ``attach(engine, store)`` the engine's call sites stay as they are::

    engine.save_checkpoint(save_dir, tag)         # commits to the store, collectively
    engine.load_checkpoint(save_dir, tag)         # reads from the store

The attached checkpoint engine keeps each file DeepSpeed saves in memory and, when DeepSpeed
commits, makes them one checkpoint (step ``engine.global_steps``) through the collective
:meth:`ckstore.Store.commit`. Then each rank writes, at the paths DeepSpeed named, a small
*stub* file instead of the pickle: a JSON record naming the run, step, checkpoint, rank and
sub-key. DeepSpeed's own disk use keeps working as before: it creates the folders, rank 0 writes
``latest`` with ``open()`` (only after every rank committed), and loading globs the stubs and
hands each path to the attached engine, which reads that one sub-checkpoint from the store.

A commit that fails on any rank raises on every rank from ``save_checkpoint``, before stubs or
``latest`` are written: the folder keeps pointing at the previous checkpoint. Files in the
folder that are not stubs (a checkpoint saved before ``attach``) are pickles; they are loaded
with ``torch.load`` only when ``attach`` was given ``allow_pickle=True``.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointNotFoundError, IntegrityError, UnsupportedValueError
from ._engine import CheckpointEngineBase, _info_tag, stem_of
from ._objects import from_plain

if TYPE_CHECKING:
    from ...records import Checkpoint
    from ...store import Store

__all__ = ["attach", "STUB_FORMAT", "read_stub"]

STUB_FORMAT = "ckstore-deepspeed-stub"
_MAX_STUB = 16 * 1024


def read_stub(path: str) -> dict[str, Any] | None:
    """The record in a stub file, or None when ``path`` is not one (a DeepSpeed pickle, say)."""
    with open(path, "rb") as f:
        head = f.read(_MAX_STUB + 1)
    if len(head) > _MAX_STUB or not head.startswith(b"{"):
        return None
    try:
        rec = json.loads(head)
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("format") != STUB_FORMAT:
        return None
    types = {"run": str, "step": int, "checkpoint_id": int, "rank": int, "sub_key": str}
    for name, kind in types.items():
        if not isinstance(rec.get(name), kind) or isinstance(rec.get(name), bool):
            raise IntegrityError(f"{path}: a ckstore stub whose {name!r} is {rec.get(name)!r}")
    return rec


def _write_stub(path: str, rec: dict[str, Any]) -> None:
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".ckstore-stub-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
            f.write("\n")
        os.replace(tmp, path)  # a crash leaves the old file or the new one, never half a stub
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def attach(
    engine: Any,
    store: Store,
    *,
    run: str | None = None,
    kind: str = "checkpoint",
    replace: bool = True,
    allow_pickle: bool = False,
) -> Any:
    """Make ``engine.save_checkpoint``/``load_checkpoint`` go through ``store``; returns the
    checkpoint engine now assigned to ``engine.checkpoint_engine`` (its ``last`` attribute is the
    record of the latest commit). Call it on every rank.

    A save of a step the run already has replaces it (``replace``), as DeepSpeed overwrites a
    tag's files; stubs of the replaced checkpoint then refuse to load. ``allow_pickle`` stores
    objects ckstore cannot store as plain values pickled, and lets ``load_checkpoint`` read
    stock DeepSpeed files (pickles) found in the folder.
    """
    base = CheckpointEngineBase()
    from . import _Failed, _global_rank, rank_entries, world_layout

    class CkstoreCheckpointEngine(base):  # type: ignore[misc, valid-type]
        """DeepSpeed's checkpoint engine API over a ckstore store (see the module docstring)."""

        def __init__(self) -> None:
            self.name = "ckstore"
            self.store = store
            self.last: Checkpoint | None = None
            self._folder: str | None = None
            self._pending: dict[str, Any] = {}
            self._paths: dict[str, str] = {}
            self._resolved: dict[tuple[str, int], Checkpoint] = {}

        def create(self, info: Any) -> None:
            save_dir = getattr(info, "save_dir", None)  # DeepSpeed 0.16 passes only the tag
            self._folder = os.path.join(save_dir, _info_tag(info)) if save_dir else None
            self._pending, self._paths = {}, {}

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            os.makedirs(path, exist_ok=exist_ok)

        def save(self, state_dict: Any, path: str) -> None:
            if self._folder is None:
                self._folder = os.path.dirname(os.path.abspath(path))
            stem = stem_of(path, self._folder)
            self._pending[stem] = state_dict
            self._paths[stem] = path

        def commit(self, info: Any) -> bool:
            rank = _global_rank()
            failure: BaseException | None = None
            prepared: dict[str, Any] = {}
            try:
                prepared = rank_entries(engine, rank, self._pending, allow_pickle=allow_pickle)
            except Exception as e:  # noqa: BLE001 - reported to every rank by the commit
                failure = e
            layout = world_layout(engine)
            try:
                ck = store.commit(
                    int(engine.global_steps), _Failed(failure) if failure else {rank: prepared}, kind=kind, run=run,
                    replace=replace, world_layout=layout, allow_pickle=allow_pickle,
                )  # fmt: skip
            finally:
                self._pending = {}
            for stem, path in self._paths.items():
                _write_stub(path, {
                    "format": STUB_FORMAT, "run": ck.run, "step": ck.step, "checkpoint_id": ck.id,
                    "rank": rank, "sub_key": stem, "store": store.location,
                })  # fmt: skip
            self._paths = {}
            self.last = ck
            return True

        def load(self, path: str, map_location: Any = None) -> Any:
            rec = read_stub(path)
            if rec is None:
                if not allow_pickle:
                    raise UnsupportedValueError(
                        f"{path} is not a ckstore stub but a file DeepSpeed wrote itself (a pickle: "
                        "loading it runs code from the file). If you trust it, attach with "
                        "allow_pickle=True, or import the folder with `ckstore import --allow-pickle`"
                    )
                import torch

                return torch.load(path, map_location=map_location, weights_only=False)
            ckpt = self._checkpoint(rec, path)
            got = store.load(ckpt, ranks=[rec["rank"]], sub_keys=[rec["sub_key"]], allow_pickle=allow_pickle)
            where = f"{ckpt.ref}, rank {rec['rank']}, {rec['sub_key']}, "
            return from_plain(got[rec["rank"]][rec["sub_key"]], where=where)

        def _checkpoint(self, rec: dict[str, Any], path: str) -> Checkpoint:
            key = (rec["run"], rec["step"])
            ckpt = self._resolved.get(key)
            if ckpt is None or ckpt.id != rec["checkpoint_id"]:  # saved again since it was cached
                ckpt = self._resolved[key] = store.resolve(rec["step"], run=rec["run"])
            if ckpt.id != rec["checkpoint_id"]:
                raise CheckpointNotFoundError(
                    f"{path} points at {ckpt.ref} as it was first saved; that step was saved again "
                    "since (the folder's other tag holds it now). Load the newer tag"
                )
            return ckpt

        def preserves_storage_sharing(self) -> bool:
            return False  # nothing is pickled: the engine need not clone tensors

    ce = CkstoreCheckpointEngine()
    engine.checkpoint_engine = ce
    return ce
