"""Core commands: init, runs, log, show, tag, untag, db upgrade."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table
from rich.tree import Tree

from ..urls import scrub
from ._common import (
    Ctx,
    console,
    esc,
    fmt_metric,
    handle_errors,
    human_bytes,
    human_time,
    pass_ctx,
    print_json,
)


@click.command()
@click.argument("location", required=False)
@click.option("--catalog", "catalog_url", metavar="URL", help="SQLAlchemy URL of a shared catalog (PostgreSQL).")
@click.option("--chunk-size", type=int, help="Chunk size in bytes (default 4 MiB).")
@click.option("--pack-size", type=int, help="Target pack object size in bytes (default 64 MiB).")
@click.option("--compression-level", type=int, help="zstd level (default 1).")
@pass_ctx
@handle_errors
def init(
    obj: Ctx,
    location: str | None,
    catalog_url: str | None,
    chunk_size: int | None,
    pack_size: int | None,
    compression_level: int | None,
) -> None:
    """Create a store at LOCATION (or --store) and record its settings."""
    import ckstore

    loc = location or obj.require_location()
    store = ckstore.init(
        loc,
        catalog=catalog_url or obj.catalog,
        chunk_size=chunk_size,
        pack_size=pack_size,
        compression_level=compression_level,
    )
    from ..urls import redact

    cfg = store.config
    shown = scrub(loc)  # a location may carry credentials (fsspec's user:password@)
    console.print(f"created store [bold]{esc(shown)}[/]")
    console.print(f"  catalog     {esc(redact(cfg.catalog)) if cfg.catalog else 'sqlite (catalog.db in the store folder)'}")
    console.print(f"  chunk size  {human_bytes(cfg.chunk_size)}, packs of {human_bytes(cfg.pack_size)}")
    console.print(f"use it with: ckstore --store {esc(shown)} log   or   ckstore.open({esc(repr(shown))}, run='NAME')")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def runs(obj: Ctx, as_json: bool) -> None:
    """List the store's runs."""
    store = obj.open()
    items = store.runs()
    if as_json:
        print_json(
            [
                {
                    "name": r.name,
                    "created_at": r.created_at.isoformat(),
                    "checkpoints": r.checkpoints,
                    "latest_step": r.latest_step,
                    "parent": r.parent,
                    "logical_bytes": r.logical_bytes,
                }
                for r in items
            ]
        )
        return
    if not items:
        console.print("no runs yet")
        return
    table = Table(title=f"runs in {esc(scrub(store.location))}")
    for col in ("run", "checkpoints", "latest step", "created", "forked from"):
        table.add_column(col, justify="right" if col in ("checkpoints", "latest step") else "left")
    for r in items:
        table.add_row(
            esc(r.name), str(r.checkpoints), "-" if r.latest_step is None else str(r.latest_step),
            human_time(r.created_at), esc(r.parent or ""),
        )  # fmt: skip
    console.print(table)


def log_table(store: Any, run: str | None, checkpoints: list[Any], extra: dict[int, dict[str, str]] | None = None) -> Table:
    metric_names = list(dict.fromkeys(k for c in checkpoints for k in c.metrics))
    title = f"run {esc(run)}" if run else f"all runs in {esc(scrub(store.location))}"
    table = Table(title=title)
    if not run:
        table.add_column("run")
    table.add_column("step", justify="right")
    table.add_column("kind")
    table.add_column("committed")
    for m in metric_names:
        table.add_column(esc(m), justify="right")
    table.add_column("tags")
    table.add_column("logical", justify="right")
    table.add_column("new bytes", justify="right")
    extra_cols = list(next(iter(extra.values())).keys()) if extra else []
    for col in extra_cols:
        table.add_column(col, justify="right")
    for c in checkpoints:
        row = [] if run else [esc(c.run)]
        row += [str(c.step), esc(c.kind), human_time(c.committed_at)]
        row += [fmt_metric(c.metrics[m]) if m in c.metrics else "" for m in metric_names]
        row += [esc(", ".join(c.tags)), human_bytes(c.logical_bytes), human_bytes(c.stored_bytes_added)]
        row += [esc(extra[c.id].get(col, "")) for col in extra_cols] if extra else []
        table.add_row(*row)
    return table


@click.command()
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--limit", "-n", type=click.IntRange(min=1), help="Show only the last N checkpoints.")
@click.option("--changes", is_flag=True, help="Count the tensors changed since the previous checkpoint.")
@pass_ctx
@handle_errors
def log(obj: Ctx, run: str | None, as_json: bool, limit: int | None, changes: bool) -> None:
    """Checkpoints of RUN (or of every run): steps, times, metrics, tags, sizes."""
    store = obj.open()
    run = run or obj.run
    every = ckpts = store.checkpoints(run)
    if limit:
        ckpts = ckpts[-limit:]
    extra, docs = None, None
    if changes:
        from ._diff import change_columns

        extra, docs = change_columns(store, ckpts, every)
    if as_json:
        print_json([{**c.to_json(), **({"changes": docs[c.id]} if docs is not None else {})} for c in ckpts])
        return
    if not ckpts:
        console.print(f"no checkpoints in {'run ' + esc(run) if run else 'this store'} yet")
        return
    for name in [run] if run else list(dict.fromkeys(c.run for c in ckpts)):
        lineage = store.catalog.lineage(name)
        if lineage:
            console.print(f"run {esc(name)} forked from {esc(' <- '.join(lineage))}")
    console.print(log_table(store, run, ckpts, extra))


@click.command()
@click.argument("ref", default="latest")
@click.option("--rank", "ranks", type=click.IntRange(min=0), multiple=True, help="Only these ranks (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def show(obj: Ctx, ref: str, ranks: tuple[int, ...], as_json: bool) -> None:
    """The key tree of checkpoint REF: shapes, dtypes, sizes, sharding."""
    from ..format.tree import tensor_paths as iter_tensor_paths

    store = obj.open()
    ckpt = store.resolve(ref)
    unknown = sorted(set(ranks) - set(ckpt.ranks))
    if unknown:
        from ..errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(
            f"run {ckpt.run!r}, step {ckpt.step} was saved by ranks {list(ckpt.ranks)}, not {unknown}; "
            "pass --rank with one of those (or none, for every rank)"
        )
    mans = store.manifests(ckpt, ranks=ranks or None)
    if as_json:
        print_json(
            {
                "checkpoint": ckpt.to_json(),
                "entries": [
                    {"rank": r, "sub_key": k, "tensors": [t.to_json() for t in m.tensors]}
                    for (r, k), m in sorted(mans.items())
                ],
            }
        )
        return
    head = (
        f"[bold]{esc(ckpt.ref)}[/] kind={esc(ckpt.kind)} layout={esc(ckpt.world_layout.mesh)} "
        f"committed {human_time(ckpt.committed_at)}  logical {human_bytes(ckpt.logical_bytes)}, "
        f"new {human_bytes(ckpt.stored_bytes_added)}"
    )
    root = Tree(head)
    if ckpt.metrics:
        root.add("metrics: " + ", ".join(f"{esc(k)}={fmt_metric(v)}" for k, v in ckpt.metrics.items()))
    if ckpt.tags:
        root.add("tags: " + esc(", ".join(ckpt.tags)))
    if ckpt.parent:
        root.add(f"parent: {esc(ckpt.parent)}")
    by_rank: dict[int, Tree] = {}
    for (rank, key), man in sorted(mans.items()):
        rnode = by_rank.get(rank)
        if rnode is None:
            rnode = by_rank[rank] = root.add(f"rank {rank}")
        knode = rnode.add(f"[bold]{esc(key)}[/] ({len(man.tensors)} tensors, {human_bytes(man.logical_bytes)})")
        paths = iter_tensor_paths(man.tree)
        for i, t in enumerate(man.tensors):
            shard = ""
            if t.shard is not None:
                shard = f"  shard of {esc(list(t.shard.global_shape))} at {esc(list(t.shard.offsets))} by " + ", ".join(
                    f"{esc(m)}→dim {d}" for d, m in t.shard.splits
                )
            path = "/".join(map(str, paths.get(i, (t.path,))))
            knode.add(f"{esc(path)}  {esc(t.dtype)} {esc(list(t.shape))}  {human_bytes(t.nbytes)}{shard}")
    console.print(root)


@click.command()
@click.argument("ref")
@click.argument("name")
@click.option("--move", is_flag=True, help="Move the tag if it names another checkpoint.")
@pass_ctx
@handle_errors
def tag(obj: Ctx, ref: str, name: str, move: bool) -> None:
    """Tag checkpoint REF as NAME."""
    ckpt = obj.open().tag(ref, name, move=move)
    console.print(f"tagged {esc(ckpt.ref)} as {esc(name)}")


@click.command()
@click.argument("name")
@pass_ctx
@handle_errors
def untag(obj: Ctx, name: str) -> None:
    """Remove tag NAME (RUN@NAME to name the run)."""
    run, _, tag_name = name.rpartition("@")
    obj.open().untag(tag_name, run=run or None)
    console.print(f"removed tag {esc(name)}")


@click.group()
def db() -> None:
    """Catalog schema maintenance."""


def _unchecked_catalog(obj: Ctx) -> Any:
    """The store's catalog, opened without the schema check (which would refuse an old one)."""
    from ..blobstore import open_blobstore
    from ..catalog import Catalog
    from ..errors import StoreConfigError
    from ..opening import catalog_url, read_config

    loc = obj.require_location()
    blobs = open_blobstore(loc)
    cfg = read_config(blobs)
    if cfg is None:
        raise StoreConfigError(f"no ckstore store at {loc} (create one with `ckstore init {loc}`)")
    return Catalog(catalog_url(loc, blobs, cfg, obj.catalog), check=False)


@db.command()
@pass_ctx
@handle_errors
def upgrade(obj: Ctx) -> None:
    """Upgrade the catalog's schema to this ckstore's version."""
    before, after = _unchecked_catalog(obj).upgrade()
    if before == after:
        console.print(f"catalog already at schema revision {esc(after)}")
    else:
        console.print(f"catalog upgraded from revision {esc(before or '(none)')} to {esc(after)}")


@db.command()
@pass_ctx
@handle_errors
def current(obj: Ctx) -> None:
    """Print the catalog's schema revision and the one this ckstore needs."""
    rev, head = _unchecked_catalog(obj).revisions()
    console.print(f"catalog revision {esc(rev or '(none)')}; this ckstore needs {esc(head)}")


COMMANDS = [init, runs, log, show, tag, untag, db]
