"""DeepSpeed's checkpoints in a ckstore store, alongside ``save_checkpoint``/``load_checkpoint``.

::

    from ckstore.integrations import deepspeed as ckds

    ck = ckds.save(engine, store, metrics={"val_loss": v}, tags=["epoch-3"], kind="epoch",
                   client_state={"epoch": 3})                        # every rank calls it
    client_state, ck = ckds.load(engine, store, "exp1@min:val_loss")  # every rank calls it
    ckds.attach(engine, store)        # engine.save_checkpoint / load_checkpoint go through the store
    states = ckds.state_dicts(engine)        # {sub_key: state_dict} of this rank, nothing written
    ckds.load_state_dicts(engine, states)    # and back

Each rank's sub-checkpoints are what ``engine.save_checkpoint`` would write as files, keyed by
the file's stem: ``mp_rank_00_model_states``, ``zero_pp_rank_1_mp_rank_00_optim_states``,
``bf16_zero_pp_rank_0_mp_rank_00_optim_states``, ``layer_03-model_states``, expert files. They
are built and consumed by DeepSpeed's own code (see :mod:`._engine`), so a resume is bit-exact
for every ZeRO stage and optimizer wrapper. A commit stores them as entries ``(rank, stem)``
plus one small ``ckstore_deepspeed`` entry per rank (its coordinates, the files it wrote), with
the job's pipeline/data/model parallel mesh as the world layout. DeepSpeed's loss scalers, enums
and dtypes are stored as plain values (:mod:`._objects`); other objects need ``allow_pickle``.

Saving is the one collective commit of :meth:`ckstore.Store.commit`: nothing becomes visible
unless every rank succeeded, and a rank that fails makes every rank raise. Loading reads only the
sub-checkpoints this rank's engine asks for. ``ckstore import``/``export --format deepspeed``
convert stock DeepSpeed folders (:mod:`._folder`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointNotFoundError, CkstoreError
from ...layout import WorldLayout
from ...records import Checkpoint
from ._attach import attach
from ._engine import capture, rank_coords, require_deepspeed, serve
from ._folder import export_folder, import_folder, is_deepspeed_folder
from ._objects import from_plain, to_plain

if TYPE_CHECKING:
    from ...store import Store

__all__ = [
    "META",
    "save",
    "load",
    "attach",
    "state_dicts",
    "load_state_dicts",
    "import_folder",
    "export_folder",
    "is_deepspeed_folder",
]

#: The sub-key of each rank's own record: its DeepSpeed coordinates and the files it wrote.
META = "ckstore_deepspeed"


def state_dicts(
    engine: Any, *, client_state: Mapping[str, Any] | None = None, exclude_frozen_parameters: bool = False
) -> dict[str, Any]:
    """This rank's sub-checkpoints, ``{stem: state_dict}``, exactly as ``engine.save_checkpoint``
    would write them (``client_state`` merged into the model states); nothing is written.

    Every rank calls it (DeepSpeed's save code synchronizes the ranks). The tensors are the
    engine's own, not copies: use or copy them before the next training step.
    """
    return capture(engine, client_state=client_state, exclude_frozen_parameters=exclude_frozen_parameters)


def load_state_dicts(
    engine: Any,
    states: Mapping[str, Any],
    *,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> dict[str, Any]:
    """Restore the engine from ``{stem: state_dict}`` (what :func:`state_dicts` returned, or a
    checkout of one rank); returns the client state, as ``engine.load_checkpoint`` does.

    Every rank calls it with the states its engine reads (under ZeRO, each data-parallel rank
    reads its own optimizer partition, plus the model states of its model-parallel rank).
    """
    have = {k: v for k, v in states.items() if k != META}

    def fetch(stem: str) -> Any:
        if stem not in have:
            raise CheckpointNotFoundError(
                f"DeepSpeed asked for sub-checkpoint {stem!r}, which the states do not have "
                f"(they have {sorted(have)}); pass this rank's states"
            )
        return from_plain(have[stem], where=f"{stem}, ")

    return serve(  # type: ignore[no-any-return]
        engine, list(have), fetch, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
    )  # fmt: skip


def save(
    engine: Any,
    store: Store,
    step: int | None = None,
    metrics: Mapping[str, float] | None = None,
    *,
    tags: Sequence[str] = (),
    kind: str = "checkpoint",
    client_state: Mapping[str, Any] | None = None,
    run: str | None = None,
    replace: bool = False,
    allow_pickle: bool = False,
    exclude_frozen_parameters: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Checkpoint:
    """Commit the engine's checkpoint as ``step`` (default: ``engine.global_steps``) of a run.

    Collective, like ``engine.save_checkpoint``: every rank calls it and gets the same record
    back, or every rank raises (:class:`~ckstore.DistributedCommitError` naming the rank that
    failed) and nothing is visible. ``client_state`` is stored with the model states and comes
    back from :func:`load`. Objects other than tensors, plain values and DeepSpeed's known
    records are refused unless ``allow_pickle``.
    """
    rank = _global_rank()
    failure: BaseException | None = None
    prepared: dict[str, Any] = {}
    try:
        states = capture(engine, client_state=client_state, exclude_frozen_parameters=exclude_frozen_parameters)
        prepared = rank_entries(engine, rank, states, allow_pickle=allow_pickle)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the commit below
        failure = e
    layout = world_layout(engine)  # a collective too: every rank takes part, failed or not
    rank_states: Mapping[int, Mapping[str, Any]] = _Failed(failure) if failure else {rank: prepared}
    return store.commit(
        engine.global_steps if step is None else step, rank_states, metrics, tags=tags, kind=kind, run=run,
        replace=replace, world_layout=layout, allow_pickle=allow_pickle, progress=progress,
    )  # fmt: skip


def load(
    engine: Any,
    store: Store,
    ref: str | int = "latest",
    *,
    run: str | None = None,
    allow_pickle: bool = False,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[dict[str, Any], Checkpoint]:
    """Restore the engine from checkpoint ``ref``; returns ``(client_state, checkpoint)``.

    Every rank calls it; each reads only the sub-checkpoints its engine asks for. The next
    training step is bit-exact with the one the saving job would have taken.
    """
    ckpt = store.resolve(ref, run=run)
    stems = [k for k in ckpt.sub_keys if k != META]
    rank = _global_rank()

    def fetch(stem: str) -> Any:
        if stem not in ckpt.sub_keys:
            raise CheckpointNotFoundError(
                f"DeepSpeed asked for sub-checkpoint {stem!r}, which {ckpt.ref} does not have; it has {stems}"
            )
        # the entries of this stem only (one rank wrote each file); ours if we wrote it
        got = store.load(ckpt, sub_keys=[stem], allow_pickle=allow_pickle)
        src = rank if rank in got else min(got)
        return from_plain(got[src][stem], where=f"{ckpt.ref}, rank {src}, {stem}, ")

    client_state = serve(
        engine, stems, fetch, source=ckpt.ref, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
    )  # fmt: skip
    return client_state, ckpt


# -- helpers shared with attach -----------------------------------------------------------------


def rank_entries(engine: Any, rank: int, states: Mapping[str, Any], *, allow_pickle: bool) -> dict[str, Any]:
    """The entries one rank commits: its sub-checkpoints as plain trees, and its record."""
    if META in states:
        raise CkstoreError(f"DeepSpeed wrote a file named {META!r}, which ckstore reserves for its own record")
    out: dict[str, Any] = {META: rank_record(engine, rank, sorted(states))}
    for stem, state in states.items():
        out[stem] = to_plain(state, allow_pickle=allow_pickle, where=f"rank {rank}, {stem}, ")
    return out


def rank_record(engine: Any, rank: int, files: Sequence[str]) -> dict[str, Any]:
    deepspeed = require_deepspeed()
    sizes, coords = rank_coords(engine)
    return {
        "format": 1,
        "rank": rank,
        "coords": coords,
        "sizes": sizes,
        "files": list(files),
        "deepspeed": str(deepspeed.__version__),
        "zero_stage": int(engine.zero_optimization_stage()),
        "bf16": bool(engine.bfloat16_enabled()),
        "fp16": bool(engine.fp16_enabled()),
        "global_steps": int(engine.global_steps),
    }


def world_layout(engine: Any) -> WorldLayout:
    """The job's ``pp``/``dp``/``mp`` mesh (dims of size 1 left out), when every rank's DeepSpeed
    coordinates follow it in row-major order; otherwise every rank along ``dp``. Collective."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    try:
        sizes, coords = rank_coords(engine)
    except Exception:  # noqa: BLE001 - an engine without these attributes: a flat layout
        sizes, coords = {}, {}
    every: list[Any] = [coords]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, coords)
    dims = {n: s for n, s in sizes.items() if s > 1} or {"dp": 1}
    layout = WorldLayout(dims)
    if layout.world_size == world and all(
        c and {n: c.get(n) for n in dims} == layout.coords(r) for r, c in enumerate(every)
    ):
        return layout
    return WorldLayout.flat(world)


def _global_rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


class _Failed(Mapping[int, Mapping[str, Any]]):
    """Rank states whose reading raises this rank's failure, from inside the collective commit:
    so every rank learns of it, at the same step, and nothing is committed."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[int]:
        raise self.error

    def __getitem__(self, rank: int) -> Mapping[str, Any]:
        raise self.error
