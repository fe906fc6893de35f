"""``ckstore recover`` (rebuild a lost catalog from the blob store's records)."""

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


COMMANDS = [recover]
