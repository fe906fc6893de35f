"""``ckstore import`` and ``ckstore export``: torch.save files, safetensors and DCP folders."""

from __future__ import annotations

import os
import shutil

import click
from click.core import ParameterSource

from ._common import Ctx, byte_progress, console, esc, handle_errors, human_bytes, pass_ctx


@click.command("import")
@click.argument("path", type=click.Path(exists=True))
@click.option("--step", type=int, help="Step number to record it as (a DeepSpeed folder: its global_steps).")
@click.option("--run", "run_name", help="Run to commit into (default: the --run of the store).")
@click.option("--format", "fmt", type=click.Choice(["auto", "torch", "safetensors", "dcp", "deepspeed"]), default="auto", show_default=True)
@click.option("--sub-key", default="model_states", show_default=True, help="Sub-checkpoint name for the file's contents.")
@click.option("--split", is_flag=True, help="Make the file's top-level keys the sub-checkpoints.")
@click.option("--metric", "metrics", multiple=True, metavar="NAME=VALUE", help="A metric to record (repeatable).")
@click.option("--tag", "tags", multiple=True, help="A tag (repeatable).")
@click.option("--allow-pickle", is_flag=True, help="Trust the file: unpickle Python objects in a torch.save file, or a DCP folder's "
              ".metadata (runs code from it). Without it, pickled content is refused.")
@pass_ctx
@handle_errors
def import_(
    obj: Ctx, path: str, step: int | None, run_name: str | None, fmt: str, sub_key: str, split: bool,
    metrics: tuple[str, ...], tags: tuple[str, ...], allow_pickle: bool,
) -> None:  # fmt: skip
    """Commit a torch.save file, a .safetensors file, a DCP folder or a DeepSpeed folder as a checkpoint."""
    from ..integrations.files import import_checkpoint

    if split and click.get_current_context().get_parameter_source("sub_key") is not ParameterSource.DEFAULT:
        raise click.UsageError(
            "--split makes the file's top-level keys the sub-checkpoints, and --sub-key names the one "
            "sub-checkpoint the whole file becomes: pass one of them"
        )
    values = {}
    for m in metrics:
        name, sep, value = m.partition("=")
        if not sep:
            raise click.BadParameter(f"expected NAME=VALUE, got {m!r}", param_hint="--metric")
        try:
            values[name] = float(value)
        except ValueError as e:
            raise click.BadParameter(f"{value!r} is not a number", param_hint="--metric") from e
    made = _new_folder(obj.location)
    try:
        store = obj.open(create=True)
        with byte_progress("committing") as progress:
            ck = import_checkpoint(
                store, path, step, fmt=fmt, run=run_name, sub_key=None if split else sub_key, metrics=values,
                tags=tags, allow_pickle=allow_pickle, progress=progress,
            )  # fmt: skip
    except BaseException:
        if made is not None:  # the store this command made: nothing was committed to it
            if obj._store is not None:
                obj._store.close()
            shutil.rmtree(made, ignore_errors=True)
        raise
    console.print(
        f"imported {esc(path)} as {esc(ck.ref)}: {human_bytes(ck.logical_bytes)} logical, "
        f"{human_bytes(ck.stored_bytes_added)} new"
    )


def _new_folder(location: str | None) -> str | None:
    """The outermost folder that opening a local store at ``location`` creates (None: the location
    exists already, or is no local folder): a failed import removes it again, so that it leaves no
    empty store behind. A catalog named apart from the store is left alone (it may be shared)."""
    from ..blobstore import is_local_url

    if not location or not is_local_url(location):
        return None
    path = os.path.abspath(location.removeprefix("file://"))
    if os.path.lexists(path):
        return None
    while not os.path.lexists(os.path.dirname(path)) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


@click.command()
@click.argument("ref")
@click.argument("path", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors", "dcp", "deepspeed"]), default="torch", show_default=True)
@click.option("--rank", type=int, default=0, show_default=True, help="Rank to export (unsharded checkpoints).")
@click.option("--sub-key", help="Export only this sub-checkpoint's state dict.")
@click.option("--allow-pickle", is_flag=True, help="Unpickle Python objects stored with the checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace PATH if it exists (a file; for --format dcp, a folder that is not empty).")
@pass_ctx
@handle_errors
def export(
    obj: Ctx, ref: str, path: str, fmt: str, rank: int, sub_key: str | None, allow_pickle: bool, overwrite: bool
) -> None:
    """Write checkpoint REF as a torch.save file, a .safetensors file, a DCP folder or a DeepSpeed folder."""
    from ..integrations.files import export_checkpoint

    with byte_progress("checking out") as progress:
        ck = export_checkpoint(
            obj.open(), ref, path, fmt=fmt, rank=rank, sub_key=sub_key, overwrite=overwrite,
            allow_pickle=allow_pickle, progress=progress,
        )  # fmt: skip
    console.print(f"exported {esc(ck.ref)} to {esc(path)} ({fmt})")


COMMANDS = [import_, export]
