"""Retention and space commands: gc, policy, fsck, du, rm."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from rich.table import Table

from ._common import (
    Ctx,
    console,
    err_console,
    esc,
    handle_errors,
    human_bytes,
    pass_ctx,
    print_json,
)

F = TypeVar("F", bound=Callable[..., Any])

_PHASES = {
    "list": "listing pack objects",
    "delete": "deleting packs",
    "orphans": "deleting orphans",
    "read": "reading packs",
}


def rule_options(fn: F) -> F:
    """The ``--keep-*`` flags shared by ``gc`` and ``policy set``."""
    opts = [
        click.option("--keep-last", type=click.IntRange(min=0), metavar="N", help="Keep the N latest steps."),
        click.option("--keep-best", multiple=True, metavar="K:METRIC:min|max",
                     help="Keep the K best by METRIC (repeatable), e.g. 3:val_loss:min; a METRIC holding ':' "
                          "needs the mode, as in 1:val:loss:min."),
        click.option("--keep-every", type=click.IntRange(min=1), metavar="N", help="Keep every step divisible by N."),
        click.option("--keep-within", metavar="DURATION", help="Keep checkpoints committed within DURATION (7d, 12h, 90m)."),
        click.option("--keep-tagged", is_flag=True, help="Keep every tagged checkpoint."),
        click.option("--keep-kind", multiple=True, metavar="KIND:N",
                     help="Keep the N newest of KIND, or KIND:all (repeatable), e.g. recovery:1 epoch:all."),
    ]  # fmt: skip
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _policy(keep_last: int | None, keep_best: Sequence[str], keep_every: int | None, keep_within: str | None,
            keep_tagged: bool, keep_kind: Sequence[str]) -> Any:  # fmt: skip
    from ..maintenance.retention import policy_from_flags

    return policy_from_flags(
        keep_last=keep_last, keep_best=keep_best, keep_every=keep_every, keep_within=keep_within,
        keep_tagged=keep_tagged, keep_kind=keep_kind,
    )  # fmt: skip


def _grace(value: str | None) -> float | None:
    from ..maintenance.retention import parse_duration

    return None if value is None else parse_duration(value)


@contextmanager
def _progress() -> Iterator[Callable[[str, int, int], None]]:
    """A progress callback drawing rich bars on stderr (nothing when stderr is not a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not err_console.is_terminal:
        yield lambda phase, done, total: None
        return
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=True,
    ) as bar:  # fmt: skip
        tasks: dict[str, Any] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(_PHASES.get(phase, phase), total=total or None)
            bar.update(tasks[phase], completed=done, total=total or None)

        yield update


def _steps(steps: Sequence[int], limit: int = 24) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", … ({len(steps) - limit} more)" if len(steps) > limit else "")


def _jsonable(obj: Any) -> Any:
    return (
        dataclasses.asdict(obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type)
        else obj
    )


def render_gc(report: Any) -> None:
    dry = report.dry_run
    drop, free, delete, reap = ("would drop", "would free", "would delete", "would reap") if dry else (
        "dropped", "freed", "deleted", "reaped")  # fmt: skip
    if dry:
        console.print("[bold yellow]dry run:[/] nothing is changed; this is what gc would do")
    for r in report.runs:
        if r.policy is None:
            console.print(
                f"run [bold]{esc(r.run)}[/]: no retention policy, keeps all {len(r.kept)} checkpoints"
            )
            continue
        console.print(f"run [bold]{esc(r.run)}[/]: policy {esc(r.policy)} ({esc(r.source)})")
        table = Table(show_header=False, box=None, padding=(0, 2))
        for k in reversed(r.kept):
            table.add_row("[green]keep[/]", str(k.step), esc(k.kind), esc(", ".join(k.reasons)))
        console.print(table)
        if r.dropped:
            console.print(
                f"  [red]{drop}[/] {len(r.dropped)}: steps {_steps([d.step for d in r.dropped])}"
            )
        if r.unranked:
            missing = sorted({m for _, ms in r.unranked for m in ms})
            console.print(
                f"  [yellow]kept without {esc(', '.join(missing))}[/] (a rule ranks by it): steps "
                f"{_steps([s for s, _ in r.unranked])}"
            )
    for p in report.reaped:
        console.print(f"{reap} abandoned commit {esc(p.run)}@{p.step}: {esc(p.why)}")
    for key in report.refused:
        console.print(
            f"[bold red]refused[/] to delete {esc(key)}: a trash row names it outside ckstore's own "
            "objects (a damaged or tampered catalog); it was left in place"
        )
    console.print(
        f"{drop} {len(report.dropped)} checkpoints; "
        f"{free} {report.chunks_freed} chunks ({human_bytes(report.chunk_bytes_freed)}); "
        f"{delete} {report.packs_deleted} pack objects ({human_bytes(report.pack_bytes_freed)}), "
        f"{len(report.orphans_deleted)} orphans ({human_bytes(report.orphan_bytes_freed)}) and "
        f"{report.temp_files_deleted} stale temp files; {report.seconds:.2f}s"
    )
    if report.recycled_files:
        console.print(
            f"{report.recycled_files} released pack files ({human_bytes(report.recycled_bytes)}) are kept for "
            "later commits to write over (`ckstore gc` deletes them)"
        )


@click.command()
@click.option(
    "--run",
    "run_name",
    metavar="RUN",
    help="Apply retention to RUN only (default: every run; the sweep is store-wide).",
)
@rule_options
@click.option("--grace", metavar="SECONDS", help="How long a commit may go without a heartbeat, and an unknown "
              "object or temp file sit untouched, before gc treats it as abandoned (default 3600; 15m, 2h work).")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Change nothing; print exactly what gc would do.")
@click.option("--repack", is_flag=True, help="Also rewrite packs whose bytes are mostly dead (the old ones are "
              "deleted by a gc after the grace period).")
@click.option("--min-dead", type=click.FloatRange(0, 1, max_open=True), default=None, metavar="FRACTION",
              help="With --repack: rewrite packs whose dead fraction exceeds this (default 0.5).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def gc(obj: Ctx, run_name: str | None, keep_last: int | None, keep_best: tuple[str, ...], keep_every: int | None,
       keep_within: str | None, keep_tagged: bool, keep_kind: tuple[str, ...], grace: str | None, dry_run: bool,
       repack: bool, min_dead: float | None, as_json: bool) -> None:  # fmt: skip
    """Drop the checkpoints retention policies release, then free unreferenced chunks.

    With --keep-* rules, they replace the stored policy of RUN (or of every run) for this call;
    without, each run's stored policy applies (`ckstore policy set`), and a run with none keeps
    everything. A run's latest checkpoint is never dropped. Safe while training commits.
    Pack files that a training process's own gc kept for its later commits to write over
    (`tmp/*.free` in a local store) are deleted too.
    """
    policy = _policy(keep_last, keep_best, keep_every, keep_within, keep_tagged, keep_kind)
    store = obj.open(recycle_bytes=0)
    with _progress() as progress:
        report = store.gc(
            policy, run=run_name, dry_run=dry_run, grace=_grace(grace), progress=progress,
            repack=repack, min_dead=min_dead,
        )  # fmt: skip
    if as_json:
        print_json(
            {**_jsonable(report), "dropped": report.dropped, "bytes_freed": report.bytes_freed}
        )
        return
    render_gc(report)
    rp = getattr(report, "repack", None)
    if rp is not None:
        console.print(
            f"repacked {rp.packs_rewritten} packs ({human_bytes(rp.bytes_before)}) into {rp.packs_written} "
            f"({human_bytes(rp.bytes_after)}), moving {rp.chunks_moved} chunks; the old packs are deleted by a gc "
            f"after the grace period; {rp.seconds:.2f}s"
        )


@click.group()
def policy() -> None:
    """Retention policies stored per run (applied by `ckstore gc`)."""


@policy.command("set")
@click.argument("run")
@rule_options
@pass_ctx
@handle_errors
def policy_set(obj: Ctx, run: str, keep_last: int | None, keep_best: tuple[str, ...], keep_every: int | None,
               keep_within: str | None, keep_tagged: bool, keep_kind: tuple[str, ...]) -> None:  # fmt: skip
    """Store RUN's retention policy: the union of the --keep-* rules given."""
    pol = _policy(keep_last, keep_best, keep_every, keep_within, keep_tagged, keep_kind)
    if pol is None:
        raise click.UsageError(
            f"give at least one --keep-* rule (or clear the policy: ckstore policy clear {run})"
        )
    obj.open().set_policy(run, pol)
    console.print(
        f"run {esc(run)}: retention policy {esc(pol.describe())} (the latest checkpoint is always kept)"
    )


@policy.command("show")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def policy_show(obj: Ctx, run: str | None, as_json: bool) -> None:
    """Show RUN's stored policy (or every run's)."""
    store = obj.open()
    names = [run] if run else [r.name for r in store.runs()]
    if run:
        store.catalog.require_run(run)
    pols = {n: store.policy(n) for n in names}
    if as_json:
        print_json({n: (p.to_json() if p else None) for n, p in pols.items()})
        return
    for n, p in pols.items():
        console.print(f"{esc(n)}: {esc(p.describe()) if p else '(no policy: keeps everything)'}")


@policy.command("clear")
@click.argument("run")
@pass_ctx
@handle_errors
def policy_clear(obj: Ctx, run: str) -> None:
    """Remove RUN's stored policy (it then keeps everything)."""
    store = obj.open()
    store.catalog.require_run(run)
    store.set_policy(run, None)
    console.print(f"run {esc(run)}: no retention policy (keeps everything)")


@click.command()
@click.option(
    "--deep", is_flag=True, help="Read every chunk, decode it and check it against its digest."
)
@click.option("--repair", is_flag=True, help="Delete orphan objects and stale temp files older than the grace, and "
              "abandoned commits; never data a checkpoint uses.")  # fmt: skip
@click.option(
    "--grace",
    metavar="SECONDS",
    help="Age before an orphan or a silent commit counts as abandoned (default 3600).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def fsck(obj: Ctx, deep: bool, repair: bool, grace: str | None, as_json: bool) -> None:
    """Check that every checkpoint's chunks are stored (and, with --deep, intact).

    Exits 1 naming each damaged checkpoint, rank, key, tensor and chunk.
    """
    # --repair deletes recycled pack files too, as gc does; a check alone counts them as kept
    store = obj.open(recycle_bytes=0 if repair else None)
    with _progress() as progress:
        rep = store.fsck(deep=deep, repair=repair, grace=_grace(grace), progress=progress)
    if as_json:
        print_json({**_jsonable(rep), "ok": rep.ok, "damaged_checkpoints": rep.damaged_checkpoints})
    else:
        _render_fsck(rep)
    if not rep.ok:
        sys.exit(1)


def _render_fsck(rep: Any) -> None:
    what = "read and verified" if rep.deep else "checked"
    console.print(
        f"{what} {rep.chunks} chunks in {rep.packs} packs for {rep.checkpoints} checkpoints"
        + (f" ({human_bytes(rep.bytes_read)} read)" if rep.deep else "")
        + f" in {rep.seconds:.2f}s"
    )
    if rep.damage:
        by_ckpt: dict[str, list[Any]] = {}
        for d in rep.damage:
            by_ckpt.setdefault(d.ref, []).append(d)
        console.print(f"[bold red]DAMAGED[/]: {len(by_ckpt)} checkpoints ({esc(', '.join(by_ckpt))})")
        for ref, items in by_ckpt.items():
            console.print(f"  [bold]{esc(ref)}[/]: {len(items)} damaged chunk uses")
            for d in items[:20]:
                where = f"rank {d.rank} {esc(d.sub_key)} {esc(d.path)} chunk {esc(d.chunk or '-')}" if d.rank >= 0 else (
                    f"chunk {esc(d.chunk)}" if d.chunk else "the checkpoint's catalog rows"
                )  # a rank below 0: damage that is no one rank's (a record, a pack)
                console.print(f"    {where}: {esc(d.problem)}", soft_wrap=True)
            if len(items) > 20:
                console.print(f"    … {len(items) - 20} more (see --json)")
        console.print(
            "restore the missing objects if you can; otherwise delete the damaged checkpoints (ckstore rm REF)"
        )
    else:
        console.print(
            "[bold green]ok[/]: every checkpoint's chunks are "
            + ("intact" if rep.deep else "stored")
        )
    rec = rep.records
    if rec is not None and (rec.unrecorded or rec.unknown or rec.unreadable):
        console.print(
            f"records: {len(rec.unrecorded)} checkpoints without a blob-store record"
            + (f" ({esc(', '.join(rec.unrecorded[:5]))}…; write them with `ckstore recover --backfill-records`)" if rec.unrecorded else "")
            + f", {len(rec.unknown)} records of checkpoints the catalog lacks (gc removes them; "
            "`ckstore recover` restores them), "
            f"{len(rec.unreadable)} unreadable"
        )
    if rep.damaged_unused_chunks:
        console.print(
            f"{rep.damaged_unused_chunks} damaged chunks no checkpoint uses (gc frees them)"
        )
    if rep.orphans:
        size = sum(s for _, s in rep.orphans)
        console.print(
            f"{len(rep.orphans)} orphan objects ({human_bytes(size)}) the catalog does not know"
        )
    if rep.temp_files:
        console.print(
            f"{len(rep.temp_files)} stale temp files of unfinished writes (or recycled pack files beyond the bound)"
        )
    for p in rep.pending:
        state = f"abandoned: {p.abandoned}" if p.abandoned else "in flight"
        console.print(
            f"pending commit {esc(p.run)}@{p.step} ({esc(state)}; last heartbeat {p.heartbeat_age:.0f}s ago)"
        )
    if rep.unreferenced_chunks or rep.trash:
        console.print(
            f"garbage for gc: {rep.unreferenced_chunks} unreferenced chunks ({human_bytes(rep.unreferenced_bytes)}), "
            f"{rep.trash} objects in the trash"
        )
    if rep.repaired_orphans or rep.repaired_pending or rep.repaired_temp_files:
        console.print(
            f"repaired: deleted {len(rep.repaired_orphans)} orphans and {rep.repaired_temp_files} temp files, "
            f"removed {len(rep.repaired_pending)} abandoned commits (run gc to free their chunks)"
        )


@click.command()
@click.argument("run", required=False)
@click.option(
    "--checkpoints", "per_ckpt", is_flag=True, help="Also list every checkpoint (implied by RUN)."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def du(obj: Ctx, run: str | None, per_ckpt: bool, as_json: bool) -> None:
    """Logical and stored bytes, dedup and compression ratios, and what dropping each run (or
    checkpoint of RUN) would free."""
    rep = obj.open().du(run)
    if as_json:
        print_json(_jsonable(rep))
        return
    runs = [u for u in rep.runs if run is None or u.name == run]
    console.print(_usage_table("runs", runs, rep.total))
    if run or per_ckpt:
        console.print(
            _usage_table(
                f"checkpoints of {esc(run)}" if run else "checkpoints", list(rep.checkpoints), None
            )
        )
    console.print(
        f"pack objects hold {human_bytes(rep.pack_bytes)}; {human_bytes(rep.garbage_bytes)} of chunks no checkpoint "
        "references (the next gc frees them)"
        + (
            f"; {rep.recycled_files} released pack files ({human_bytes(rep.recycled_bytes)}) kept for later "
            "commits to write over (`ckstore gc` deletes them)"
            if rep.recycled_files
            else ""
        )
        + (
            f"; {human_bytes(rep.base_bytes)} of chunks no checkpoint references kept as the bases of delta chunks"
            if rep.base_bytes
            else ""
        )
    )


def _usage_table(title: str, rows: Sequence[Any], total: Any) -> Table:
    table = Table(title=title)
    for col in (
        "name",
        "ckpts",
        "logical",
        "unique",
        "stored",
        "dedup",
        "compression",
        "freed if dropped",
    ):
        table.add_column(col, justify="left" if col == "name" else "right")
    for u in [*rows, *([total] if total is not None else [])]:
        table.add_row(
            esc(u.name), str(u.checkpoints), human_bytes(u.logical_bytes), human_bytes(u.unique_bytes),
            human_bytes(u.stored_bytes), f"{u.dedup_ratio:.2f}x", f"{u.compression_ratio:.2f}x",
            human_bytes(u.exclusive_bytes),
        )  # fmt: skip
    return table


@click.command()
@click.argument("ref")
@click.option("--force", is_flag=True, help="Delete even a tagged checkpoint.")
@click.option(
    "--sweep", is_flag=True, help="Free the bytes now (a gc sweep that drops nothing else)."
)
@click.option("--grace", metavar="SECONDS", help="gc grace for --sweep (default 3600).")
@pass_ctx
@handle_errors
def rm(obj: Ctx, ref: str, force: bool, sweep: bool, grace: str | None) -> None:
    """Delete checkpoint REF from the catalog (a tagged one only with --force)."""
    from ..maintenance.retention import KeepAll

    store = obj.open(recycle_bytes=0 if sweep else None)  # --sweep frees the bytes, as gc does
    ckpt = store.delete(ref, force=force)
    console.print(f"deleted {esc(ckpt.ref)} from the catalog")
    if not sweep:
        console.print("its bytes are freed by the next `ckstore gc` (or use rm --sweep)")
        return
    with _progress() as progress:
        report = store.gc(KeepAll(), grace=_grace(grace), progress=progress)
    console.print(
        f"swept: freed {report.chunks_freed} chunks ({human_bytes(report.chunk_bytes_freed)}), deleted "
        f"{report.packs_deleted} pack objects ({human_bytes(report.pack_bytes_freed)})"
    )


COMMANDS = [gc, policy, fsck, du, rm]
