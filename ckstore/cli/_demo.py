"""``ckstore demo``: the main job, end to end."""

from __future__ import annotations

import time
from typing import Any

import click

from ..urls import scrub
from ._common import DEFAULT_STORE, Ctx, console, esc, handle_errors, pass_ctx


@click.command()
@click.option("--steps", type=click.IntRange(min=1), default=240, show_default=True, help="Training steps of the first run.")
@click.option("--commit-every", type=click.IntRange(min=1), default=20, show_default=True, help="Commit every N steps.")
@click.option("--run", "run_name", default=None, help="Run name (default: demo-<time>).")
@pass_ctx
@handle_errors
def demo(obj: Ctx, steps: int, commit_every: int, run_name: str | None) -> None:
    """Train a small model on CPU, checkpointing into a store; then log, resume, diff and gc.

    The store is --store, or ./ckstore-demo when none is given.
    """
    if steps < commit_every:  # no checkpoint to log, resume from or diff: refused before the store is made
        raise click.UsageError(
            f"--steps {steps} is fewer than --commit-every {commit_every}, so the demo would commit no "
            "checkpoint; give --steps at least --commit-every"
        )
    import torch

    import ckstore

    from ..maintenance.retention import BestN, ByKind, KeepAll, LatestN
    from ._core import log_table
    from ._diff import render as render_diff
    from ._gc import render_gc
    from .demo_train import DemoConfig, Trainer, train

    torch.set_num_threads(max(1, torch.get_num_threads()))
    location = obj.location or DEFAULT_STORE
    run_name = run_name or time.strftime("demo-%Y%m%d-%H%M%S")
    store = ckstore.open(location, catalog=obj.catalog, run=run_name)
    cfg = DemoConfig(steps=steps, commit_every=commit_every)
    console.rule(f"[bold]1. training run {esc(run_name)}[/] into {esc(scrub(location))}")
    trainer = Trainer(cfg)

    # commits are asynchronous: training goes on while the chunks are hashed, compressed and written
    pending: list[Any] = []
    reported = [0]

    def show_commits(wait: bool = False) -> None:  # the finished commits, in order
        while reported[0] < len(pending) and (wait or pending[reported[0]].done()):
            p = pending[reported[0]]
            ck = p.wait()
            console.print(
                f"          committed {esc(ck.ref)} ({ck.kind}): {ck.logical_bytes / 2**20:.1f} MiB logical, "
                f"{ck.stored_bytes_added / 2**20:.2f} MiB new; training blocked {p.blocked_seconds * 1000:.0f} ms, "
                f"commit took {p.seconds:.2f}s"
            )
            reported[0] += 1

    def commit(step: int, metrics: dict[str, float]) -> None:
        epoch = step % cfg.epoch_every == 0
        pending.append(
            store.commit(
                step,
                {0: trainer.state()},
                metrics,
                kind="epoch" if epoch else "recovery",
                tags=[f"epoch-{step // cfg.epoch_every}"] if epoch else [],
                blocking=False,
            )
        )
        show_commits()

    train(trainer, cfg.steps, commit, cfg.commit_every, log=console.print)
    show_commits(wait=True)
    blocked = sum(p.blocked_seconds for p in pending)
    took = sum(p.seconds or 0.0 for p in pending)
    console.print(
        f"{len(pending)} asynchronous commits: training was blocked {blocked:.2f}s in total, while the commits "
        f"took {took:.2f}s (staging buffers: {store.staging_bytes / 2**20:.1f} MiB, reused by every commit)"
    )

    console.rule("[bold]2. the run's log[/]")
    console.print(log_table(store, run_name, store.checkpoints(run_name)))

    console.rule("[bold]3. resume from the best checkpoint by val_loss[/]")
    best = store.resolve("min:val_loss")
    states = store.checkout(best.ref)[0]
    resumed = Trainer(cfg)
    resumed.load(states)
    before = resumed.val_loss()
    console.print(f"checked out {esc(best.ref)} (val_loss {best.metrics['val_loss']:.4f}); re-measured val_loss {before:.4f}")
    if abs(before - best.metrics["val_loss"]) > 1e-4:
        raise click.ClickException("the checked-out model does not reproduce its recorded val_loss")
    for _ in range(10):
        resumed.train_step()
    console.print(f"resumed 10 steps from step {best.step}: val_loss now {resumed.val_loss():.4f}")

    ft_name = f"{run_name}-ft"
    console.rule(f"[bold]4. fine-tune run {esc(ft_name)}, forked from {esc(best.ref)}, embedding frozen[/]")
    store.fork(best.ref, ft_name)
    ft = Trainer(cfg)
    ft.load(store.checkout(best.ref)[0])
    ft.model.embed.weight.requires_grad_(False)
    steps = max(cfg.commit_every, cfg.steps // 4)

    def commit_ft(step: int, metrics: dict[str, float]) -> None:
        ck = store.commit(step, {0: ft.state()}, metrics, run=ft_name, kind="recovery")
        console.print(f"          committed {esc(ck.ref)}: {ck.stored_bytes_added / 2**20:.2f} MiB new")

    train(ft, steps, commit_ft, cfg.commit_every, log=console.print)

    console.rule(f"[bold]5. what the fine-tune changed: diff {esc(best.ref)} {esc(ft_name)}[/]")
    store.blobs.stats.reset()
    res = store.diff(best.ref, ft_name, sub_key="model_states")
    read = store.blobs.stats.snapshot()["bytes_read"]
    render_diff(res)
    same = [t.key for t in res.unchanged]
    console.print(
        f"{len(same)} tensor(s) identical without reading a byte ({esc(', '.join(same)) or 'none'}); "
        f"{len(res.changed)} changed; {read / 2**20:.2f} MiB read from the store"
    )

    console.rule(f"[bold]6. retention: keep the last 2, the best by val_loss and every epoch checkpoint of {esc(run_name)}[/]")
    policy = LatestN(2) | BestN(1, "val_loss") | ByKind("epoch", KeepAll())
    store.set_policy(run_name, policy)
    usage_before = store.du()
    # training is over: like `ckstore gc`, a store handle that keeps no released pack files for
    # later commits (recycle_bytes=0), so the space goes back to the disk
    with ckstore.open(location, catalog=obj.catalog, run=run_name, recycle_bytes=0) as maintenance:
        report = maintenance.gc()
        render_gc(report)
        usage_after = maintenance.du()
    console.print(
        f"packs on disk {usage_before.pack_bytes / 2**20:.1f} MiB -> {usage_after.pack_bytes / 2**20:.1f} MiB; "
        f"kept {', '.join(str(c.step) for c in store.checkpoints(run_name))}"
    )
    best_after = store.resolve("min:val_loss")
    store.checkout(best_after.ref)  # every kept checkpoint still checks out, verified
    console.print(f"\ndone. Explore with: ckstore --store {esc(scrub(location))} log {esc(run_name)}")


COMMANDS = [demo]
