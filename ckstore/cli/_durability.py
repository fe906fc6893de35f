"""``ckstore recover`` (rebuild a lost catalog from the blob store's records) and ``ckstore copy``
(checkpoints from one store into another)."""

from __future__ import annotations

import os
import time
from typing import Any

import click

from ._common import Ctx, console, esc, handle_errors, pass_ctx, print_json


def open_for_recovery(location: str, catalog: str | None) -> Any:
    """Open the store at ``location`` with its catalog (``catalog``: another URL, e.g. a fresh
    PostgreSQL database). A local SQLite catalog that cannot be opened is moved aside
    (``catalog.db.damaged-TIME``) and a fresh one is made."""
    from ..blobstore import open_blobstore
    from ..catalog import Catalog
    from ..errors import CatalogError, StoreConfigError
    from ..opening import catalog_url, read_config
    from ..store import Store

    blobs = open_blobstore(location)
    config = read_config(blobs)
    if config is None:
        raise StoreConfigError(f"no ckstore store at {location}: no ckstore.json there")
    url = catalog_url(location, blobs, config, catalog)
    try:
        cat = Catalog(url)
    except CatalogError:
        path = url.removeprefix("sqlite:///")
        if not url.startswith("sqlite:///") or not os.path.exists(path):
            raise
        aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.replace(path + suffix, aside + suffix)
        console.print(f"the catalog could not be opened; moved it aside to {esc(aside)}")
        cat = Catalog(url)
    return Store(location, blobs, cat, config)


@click.command()
@click.option("--backfill-records", is_flag=True, help="Instead: write the blob-store records of every checkpoint "
              "the catalog has and the blob store lacks (stores made before records existed).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def recover(obj: Ctx, backfill_records: bool, as_json: bool) -> None:
    """Rebuild a missing, empty or damaged catalog from the blob store alone.

    Give a fresh PostgreSQL database with --catalog to rebuild into it. Safe to run twice.
    Exits 1 when something could not be used (incomplete checkpoints, damaged packs or records).
    """
    store = open_for_recovery(obj.require_location(), obj.catalog)
    with store:
        if backfill_records:
            n = store.backfill_records()
            console.print(f"wrote {n} records")
            return
        rep = store.recover()
    if as_json:
        import dataclasses

        print_json({**dataclasses.asdict(rep), "ok": rep.ok})
    else:
        console.print(
            f"recovered {len(rep.restored)} checkpoints ({len(rep.present)} were already there) in "
            f"{len(rep.runs)} runs, {len(rep.tags)} tags, {rep.events} events, from {rep.packs} packs "
            f"holding {rep.chunks} chunks"
        )
        if rep.no_records:
            console.print(
                "[bold red]this store has no records[/] (written before ckstore kept them): its catalog "
                "cannot be rebuilt from the blob store. With the catalog, write them: "
                "`ckstore recover --backfill-records`"
            )
        for ref, missing in rep.incomplete:
            console.print(f"[bold red]incomplete[/]: {esc(ref)} lacks {missing} chunks (see `ckstore fsck`)")
        for key, problem in rep.bad_packs:
            console.print(f"[bold red]unusable pack[/] {esc(key)}: {esc(problem)}", soft_wrap=True)
        for key, problem in rep.bad_records:
            console.print(f"[bold red]unusable record[/] {esc(key)}: {esc(problem)}", soft_wrap=True)
        if rep.superseded:
            console.print(f"{len(rep.superseded)} older records of steps committed again were skipped")
    if not rep.ok:
        raise SystemExit(1)



@click.command("copy")
@click.argument("refs", nargs=-1)
@click.option("--to", "dest", required=True, metavar="LOCATION", help="The destination store (made if missing, "
              "with the source's settings).")
@click.option("--catalog", "dest_catalog", metavar="URL", help="The destination's catalog URL, when not the one it "
              "records (needed to create a store on an object store).")
@click.option("--run", "run_name", metavar="RUN", help="Copy every checkpoint of this run too.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def copy(obj: Ctx, refs: tuple[str, ...], dest: str, dest_catalog: str | None, run_name: str | None, as_json: bool) -> None:
    """Copy checkpoints REF... (and with --run, a whole run) into another store.

    Runs, metrics, tags and lineage come along; only chunks the destination lacks are sent,
    as stored, and each is verified against its digest. Copying again resumes: what arrived is
    skipped.
    """
    import ckstore

    from ..blobstore import open_blobstore
    from ..opening import read_config

    if not refs and not run_name:
        raise click.UsageError("name checkpoints to copy (REF...) or a run (--run RUN)")
    src = obj.open()
    for ref in refs:  # what to copy is checked before a missing destination is made
        src.resolve(ref)
    if run_name:
        src.catalog.require_run(run_name)
    if read_config(open_blobstore(dest)) is not None:
        with ckstore.open(dest, catalog=dest_catalog, create=False) as target, _copy_progress() as progress:
            rep = src.copy(refs, target, run=run_name, progress=progress)
    else:
        made = _local_folder(dest)  # what is there before the copy makes the store
        cfg = src.config
        try:
            target = ckstore.open(
                dest, catalog=dest_catalog, chunk_size=cfg.chunk_size, pack_size=cfg.pack_size,
                compression_level=cfg.compression_level,
            )  # fmt: skip
            with target, _copy_progress() as progress:
                try:
                    rep = src.copy(refs, target, run=run_name, progress=progress)
                except BaseException:
                    if _any_checkpoint(target):  # kept: copying again resumes
                        made = None
                    raise
        except BaseException:
            if made is not None:
                _remove_made(*made)
            raise
    if as_json:
        import dataclasses

        print_json(dataclasses.asdict(rep))
        return
    from ._common import human_bytes

    console.print(
        f"copied {len(rep.copied)} checkpoints ({len(rep.present)} were already there): sent "
        f"{rep.chunks_sent} chunks, {human_bytes(rep.bytes_sent)}; skipped {rep.chunks_skipped} chunks, "
        f"{human_bytes(rep.bytes_skipped)} the destination had"
    )
    for r in rep.lineage_lost:
        console.print(f"run {esc(r)} was forked from a checkpoint the destination lacks: copied without its origin")


def _local_folder(location: str) -> tuple[str, set[str] | None] | None:
    """A local destination's folder and the names already in it (None: no folder yet), for
    :func:`_remove_made`; None for an object store, where a failed copy's store is left."""
    from ..blobstore import is_local_url

    if not is_local_url(location):
        return None
    path = location.removeprefix("file://")
    return path, (set(os.listdir(path)) if os.path.isdir(path) else None)


def _any_checkpoint(store: Any) -> bool:
    try:
        return bool(store.checkpoints())
    except Exception:  # noqa: BLE001 - unreadable: keep what is there
        return True


def _remove_made(path: str, before: set[str] | None) -> None:
    """Remove what a failed copy made at a local destination: the folder, or what it added to a
    folder that was there (its new entries only)."""
    import shutil

    if before is None:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in set(os.listdir(path)) - before:
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            os.unlink(entry)


def _copy_progress() -> Any:
    """``progress(sent, to_send, skipped)`` drawing a rich bar on stderr when it is a terminal."""
    import contextlib

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from ._common import err_console, human_bytes

    @contextlib.contextmanager
    def bar() -> Any:
        if not err_console.is_terminal:
            yield lambda sent, total, skipped: None
            return
        with Progress(
            TextColumn("copying"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TextColumn("{task.fields[skipped]}"), console=err_console, transient=True,
        ) as p:  # fmt: skip
            task = p.add_task("copying", total=None, skipped="")

            def update(sent: int, total: int, skipped: int) -> None:
                p.update(task, completed=sent, total=total or None, skipped=f"{human_bytes(skipped)} skipped")

            yield update

    return bar()


COMMANDS = [recover, copy]
