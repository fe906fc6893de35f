"""Diff and lineage commands: diff, fork, and the change columns of ``log --changes``."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import click
from rich.table import Table

from ._common import Ctx, console, esc, fmt_metric, handle_errors, human_bytes, pass_ctx, print_json

_MAX_LISTED = 8


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _magnitude(t: Any) -> tuple[float, int]:
    """Sort key, larger first: dtype/shape changes, then relative L2 change, then size."""
    if t.dtype_changed or t.shape_changed:
        return math.inf, t.nbytes_b
    if t.stats is not None:
        rel = t.stats.rel_l2
        return (math.inf if math.isnan(rel) else rel), t.nbytes_b
    return 0.0, t.nbytes_b


def _arrow(a: Any, b: Any) -> str:
    return esc(a) if a == b else f"[yellow]{esc(a)} → {esc(b)}[/]"


def _shape(s: Sequence[int]) -> str:
    return esc("[" + ", ".join(map(str, s)) + "]")


def _tensor_table(res: Any, shown: Sequence[Any]) -> Table:
    table = Table(
        title=f"changed tensors ({len(res.changed)} of {len(res.tensors)}), largest change first"
    )
    table.add_column("tensor")
    table.add_column("dtype")
    table.add_column("shape")
    if res.stats:
        for col in ("max |Δ|", "rel L2", "changed", "cosine"):
            table.add_column(col, justify="right")
    table.add_column("status")
    groups: dict[str, list[Any]] = {}
    for t in shown:
        groups.setdefault(t.module, []).append(t)
    ordered = sorted(groups.items(), key=lambda kv: max(_magnitude(t) for t in kv[1]), reverse=True)
    for module, items in ordered:
        table.add_row(f"[bold]{esc(module)}[/]")
        for t in sorted(items, key=_magnitude, reverse=True):
            name = t.key[len(module) :] or t.key.rpartition("/")[2]
            name = "  " + name.lstrip("/") if name.startswith("/") else "  " + name
            if t.rank is not None:
                name += f" (rank {t.rank})"
            row = [esc(name), _arrow(t.dtype_a, t.dtype_b), _arrow(list(t.shape_a), list(t.shape_b))]
            if res.stats:
                st = t.stats
                row += (
                    [
                        _g(st.max_abs_diff),
                        _g(st.rel_l2),
                        f"{100 * st.frac_changed:.1f}%",
                        f"{st.cosine:.6f}",
                    ]
                    if st is not None
                    else ["", "", "", ""]
                )
            row.append("close" if t.status == "close" else "[red]changed[/]")
            table.add_row(*row)
    return table


def _listing(names: Sequence[str]) -> str:
    head = ", ".join(names[:_MAX_LISTED])
    return head + (f", … and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def render(res: Any, *, show_all: bool = False) -> None:
    """Print a diff for people."""
    a, b = res.a, res.b
    layouts = (
        ""
        if a.world_layout == b.world_layout
        else f"   layout {esc(a.world_layout.mesh)} → {esc(b.world_layout.mesh)}"
    )
    console.print(f"[bold]diff {esc(a.ref)} → {esc(b.ref)}[/]{layouts}")
    if res.metrics:
        mt = Table(title="metrics")
        for col in ("metric", esc(a.ref), esc(b.ref), "Δ"):
            mt.add_column(col, justify="left" if col == "metric" else "right")
        for name, (va, vb) in res.metrics.items():
            delta = fmt_metric(vb - va) if va is not None and vb is not None else ""
            mt.add_row(
                esc(name),
                "" if va is None else fmt_metric(va),
                "" if vb is None else fmt_metric(vb),
                delta,
            )
        console.print(mt)
    shown = [t for t in res.tensors if t.status != "identical"]
    if shown:
        console.print(_tensor_table(res, shown))
    same = [t for t in res.tensors if t.status == "identical"]
    if same:
        free = sum(1 for t in same if t.read_bytes == 0)
        console.print(
            f"identical: {len(same)} tensor{'s' if len(same) != 1 else ''}, {human_bytes(sum(t.nbytes_a for t in same))}"
            f" ({free} of them decided by digests alone, nothing read)"
        )
        changed_modules = {t.module for t in shown}
        whole = list(dict.fromkeys(t.module for t in same if t.module not in changed_modules))
        if whole:
            console.print(f"  unchanged modules: {esc(_listing(whole))}")
        if show_all:
            for t in same:
                console.print(
                    f"  = {esc(t.key)}{'' if t.rank is None else f' (rank {t.rank})'}  {esc(t.dtype_a)} {_shape(t.shape_a)}"
                )
    if res.values:
        vt = Table(title=f"values changed ({len(res.values)}; {res.values_equal} equal)")
        for col in ("key", esc(a.ref), esc(b.ref)):
            vt.add_column(col)
        for v in res.values:
            vt.add_row(
                esc(v.key) + ("" if v.rank is None else f" (rank {v.rank})"), esc(repr(v.a)), esc(repr(v.b))
            )
        console.print(vt)
    for label, items, sign in (
        ("only in " + a.ref, res.only_in_a, "-"),
        ("only in " + b.ref, res.only_in_b, "+"),
    ):
        if items:
            console.print(f"{esc(label)}:")
            for x in items:
                what = f"{esc(x.dtype)} {_shape(x.shape or ())}" if x.kind == "tensor" else esc(repr(x.value))
                console.print(
                    f"  {sign} {esc(x.key)}{'' if x.rank is None else f' (rank {x.rank})'}  {what}"
                )
    sh = res.sharing
    console.print(
        f"chunks: {sh.shared_chunks} shared ({human_bytes(sh.shared_bytes)} stored), {sh.only_a_chunks} only in "
        f"{esc(a.ref)} ({human_bytes(sh.only_a_bytes)}), {sh.only_b_chunks} only in {esc(b.ref)} "
        f"({human_bytes(sh.only_b_bytes)}); read {human_bytes(res.read_bytes)} to compare"
    )
    console.print(
        "[bold red]checkpoints differ[/]"
        if res.differs
        else "[bold green]checkpoints are identical[/]"
    )


@click.command()
@click.argument("a")
@click.argument("b")
@click.option(
    "--sub-key", metavar="KEY", help="Only this sub-checkpoint (model_states, optim_states, …)."
)
@click.option(
    "--key", "key_glob", metavar="GLOB", help="Only keys matching GLOB (SUB_KEY/PATH or PATH)."
)
@click.option(
    "--stats/--no-stats",
    default=True,
    help="Compute numeric statistics of changed tensors (reads them).",
)
@click.option(
    "--tolerance",
    type=float,
    metavar="X",
    help="Tensors within X of each other everywhere count as equal.",
)
@click.option("--all", "show_all", is_flag=True, help="List identical tensors one by one too.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@handle_errors
def diff(
    obj: Ctx, a: str, b: str, sub_key: str | None, key_glob: str | None, stats: bool,
    tolerance: float | None, show_all: bool, as_json: bool,
) -> None:  # fmt: skip
    """Compare checkpoints A and B: refs of any runs, or bare run names (their latest).

    Exit status: 0 when they are the same, 1 when they differ, 2 on error.
    """
    res = obj.open().diff(a, b, sub_key=sub_key, key=key_glob, stats=stats, tolerance=tolerance)
    if as_json:
        print_json(res.to_json())
    else:
        render(res, show_all=show_all)
    sys.exit(1 if res.differs else 0)


@click.command()
@click.argument("ref")
@click.argument("new_run")
@pass_ctx
@handle_errors
def fork(obj: Ctx, ref: str, new_run: str) -> None:
    """Start run NEW_RUN from checkpoint REF (or a run name, for its latest checkpoint)."""
    store = obj.open()
    ckpt = store.fork(ref, new_run)
    console.print(f"run {esc(new_run)} starts from {esc(ckpt.ref)}; its first commit descends from it")
    console.print(
        f"load it with store.load(store.resolve({esc(repr(ckpt.ref))})) and commit with run={esc(repr(new_run))}"
    )


def change_columns(
    store: Any, shown: Sequence[Any], every: Sequence[Any]
) -> tuple[dict[int, dict[str, str]], dict[int, Any]]:
    """For ``log --changes``: per shown checkpoint, the tensors changed since the checkpoint before
    it in its run (or the one it was forked from), as table cells and as JSON."""
    from ..diff import series

    first_shown: dict[str, int] = {}
    for c in shown:
        first_shown.setdefault(c.run, c.id)
    context: list[Any] = []
    shown_ids = {c.id for c in shown}
    prev_by_run: dict[str, Any] = {}
    for c in every:
        if c.id == first_shown.get(c.run) and c.run in prev_by_run:
            context.append(prev_by_run[c.run])
        if c.id in shown_ids:
            context.append(c)
        prev_by_run[c.run] = c
    cells: dict[int, dict[str, str]] = {}
    docs: dict[int, Any] = {}
    for ckpt, res in series(store, context):
        if ckpt.id not in shown_ids:
            continue
        if res is None:
            cells[ckpt.id] = {"tensors changed": "-", "vs": ""}
            docs[ckpt.id] = None
            continue
        text = f"{len(res.changed)} of {len(res.tensors)}"
        if res.only_in_b or res.only_in_a:
            text += f" +{len(res.only_in_b)} -{len(res.only_in_a)}"
        cells[ckpt.id] = {"tensors changed": text, "vs": "" if res.a.run == ckpt.run else res.a.ref}
        docs[ckpt.id] = {
            "previous": res.a.ref,
            "tensors": len(res.tensors),
            "tensors_changed": len(res.changed),
            "added": len(res.only_in_b),
            "removed": len(res.only_in_a),
            "values_changed": len(res.values),
            "changed": [t.key for t in res.changed],
        }
    return cells, docs


COMMANDS = [diff, fork]
