"""A DeepSpeed engine's checkpoint: its own save_checkpoint / load_checkpoint against ckstore's.

    python benchmarks/bench_deepspeed.py                          # ZeRO 1, 2 and 3 on 2 ranks
    python benchmarks/bench_deepspeed.py --configs 2,2:bf16 --width 512 --layers 4 --rounds 1

Each configuration (``STAGE`` or ``STAGE:bf16``) runs a real gloo job of ``--world`` ranks on
this machine: an MLP of ``--layers`` linear layers of ``--width`` x ``--width`` trained two
steps by DeepSpeed's engine (Adam, ZeRO at that stage), then, in every round, in an order
rotated from round to round:

* **DeepSpeed**: ``engine.save_checkpoint(folder, tag)`` into a fresh folder, the time to its
  return (DeepSpeed writes its files with ``torch.save`` and makes nothing durable) and, as a
  job needing durable checkpoints would, to the end of every rank's ``fsync`` of the files it
  wrote (and of the folders); then ``engine.load_checkpoint(folder, tag)``, from the page cache
  and, as root, after dropping it.
* **ckstore**: ``ckstore.integrations.deepspeed.save(engine, store)`` into a fresh store (a
  collective commit: durable when it returns), and ``load(engine, store)``, the same two ways.

Times are wall clock on rank 0 between barriers, medians over ``--rounds``; bytes are every byte
on disk (the store's catalog and records included). The first job builds DeepSpeed's small
communication op with g++ (about 30 s) in ``TORCH_EXTENSIONS_DIR`` (default: a folder under the
system's temporary folder, kept for later runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import drop_caches, du, free_port, fsync_files, scratch_dir, table  # noqa: E402

METHODS = ("deepspeed", "ckstore")


def _parse_config(text: str) -> tuple[int, bool]:
    stage, _, flag = text.partition(":")
    if stage not in {"0", "1", "2", "3"} or flag not in {"", "bf16"}:
        raise SystemExit(f"--configs: {text!r} is not STAGE or STAGE:bf16 (stages 0-3)")
    return int(stage), flag == "bf16"


# -- one rank --------------------------------------------------------------------------------------


def _engine(args: argparse.Namespace, stage: int, bf16: bool) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(2):
        g = torch.Generator().manual_seed(1000 * step + args.rank)
        x = torch.randn(4, args.width, generator=g)
        out = engine(x.to(next(engine.module.parameters()).dtype))
        loss = out.float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    return engine


def _own_files(folder: Path, rank: int) -> list[Path]:
    """The files of a DeepSpeed checkpoint folder that ``rank`` wrote: its ZeRO partitions
    (``zero_pp_rank_R_...``), and on rank 0 everything else (model states, ``latest``)."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    ours = [p for p in files if p.name.startswith(f"zero_pp_rank_{rank}_")]
    if rank == 0:
        ours += [p for p in files if not p.name.startswith("zero_pp_rank_")]
    return ours


def worker(args: argparse.Namespace) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port), "RANK": str(args.rank),
                       "WORLD_SIZE": str(args.world), "LOCAL_RANK": str(args.rank),
                       "LOCAL_WORLD_SIZE": str(args.world)})  # fmt: skip
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist

    import ckstore
    from ckstore.integrations import deepspeed as ckds

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300), verbose=False)
    stage, bf16 = _parse_config(args.config)
    engine = _engine(args, stage, bf16)
    root = Path(args.dir) / f"z{stage}{'-bf16' if bf16 else ''}"
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}

    def timed(name: str, fn: Any) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    def cold() -> bool:
        dist.barrier()
        ok = drop_caches() if args.rank == 0 else True
        dist.barrier()
        return ok

    for rnd in range(args.rounds):
        order = METHODS[rnd % 2 :] + METHODS[: rnd % 2]
        for method in order:
            if method == "deepspeed":
                folder = root / f"deepspeed-{rnd}"
                dist.barrier()
                t0 = time.perf_counter()
                engine.save_checkpoint(str(folder), tag="bench")
                dist.barrier()
                t1 = time.perf_counter()
                fsync_files([*_own_files(folder, args.rank), folder / "bench", folder])
                dist.barrier()
                times.setdefault("ds_save", []).append(t1 - t0)
                times.setdefault("ds_save_fsync", []).append(time.perf_counter() - t0)
                timed("ds_load_hot", lambda: engine.load_checkpoint(str(folder), tag="bench"))
                if cold():
                    timed("ds_load_cold", lambda: engine.load_checkpoint(str(folder), tag="bench"))
                sizes["deepspeed"] = du(str(folder))
            else:
                path = root / f"ckstore-{rnd}"
                if args.rank == 0:
                    ckstore.open(path, run="bench", create=True).close()
                dist.barrier()
                store = ckstore.open(path, run="bench")
                store.commit(0, {args.rank: {"warm": {"x": torch.zeros(4)}}}, world_layout=ckds.world_layout(engine))
                store.checkout(0)  # (catalog connected, threads started, as in a job that commits often)
                timed("ck_save", lambda: ckds.save(engine, store, step=1))
                timed("ck_load_hot", lambda: ckds.load(engine, store, 1))
                if cold():
                    timed("ck_load_cold", lambda: ckds.load(engine, store, 1))
                store.close()
                sizes["ckstore"] = du(str(path))
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({"config": args.config, "times": times, "sizes": sizes}))
    dist.barrier()
    dist.destroy_process_group()


# -- the launcher ------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, config: str, extensions: str) -> dict[str, Any]:
    out = Path(args.dir) / f"result-{config.replace(':', '-')}.json"
    cmd = [sys.executable, __file__, "--worker", "--dir", args.dir, "--port", str(free_port()),
           "--world", str(args.world), "--config", config, "--rounds", str(args.rounds),
           "--width", str(args.width), "--layers", str(args.layers), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": extensions}
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(args.world)]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"the job of configuration {config} failed (exit codes {codes})")
    return dict(json.loads(out.read_text()))


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    def med(r: dict[str, Any], key: str) -> float | None:
        got = r["times"].get(key)
        return statistics.median(got) if got else None

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    rows = []
    for r in results:
        save, fsync, ck = med(r, "ds_save"), med(r, "ds_save_fsync"), med(r, "ck_save")
        hot, ck_hot = med(r, "ds_load_hot"), med(r, "ck_load_hot")
        cold, ck_cold = med(r, "ds_load_cold"), med(r, "ck_load_cold")
        ds_b, ck_b = r["sizes"]["deepspeed"], r["sizes"]["ckstore"]
        rows.append([
            f"ZeRO {r['config']}", s(save), s(fsync), s(ck), ratio(ck, fsync), s(hot), s(ck_hot), ratio(ck_hot, hot),
            s(cold), s(ck_cold), ratio(ck_cold, cold), f"{ds_b / 2**20:.1f}", f"{ck_b / 2**20:.1f}",
            f"{ck_b / ds_b:.1%}",
        ])  # fmt: skip
    headers = ["config", "DS save s", "DS save + fsync s", "ckstore save s", "ckstore / DS+fsync",
               "DS load hot s", "ckstore load hot s", "ratio hot", "DS load cold s", "ckstore load cold s",
               "ratio cold", "DS MiB", "ckstore MiB", "ckstore / DS bytes"]  # fmt: skip
    print(f"\n### A DeepSpeed engine's checkpoint on {args.world} ranks: {args.layers} layers of "
          f"{args.width} x {args.width} (median of {args.rounds} rounds)\n")  # fmt: skip
    print(table(headers, rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="1,2,3", help="comma-separated STAGE or STAGE:bf16 (default: 1,2,3)")
    p.add_argument("--world", type=int, default=2, help="ranks of every job (default: 2)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the folders and stores go (default: a temporary folder)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--config", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise SystemExit("bench_deepspeed.py needs DeepSpeed: DS_BUILD_OPS=0 pip install deepspeed") from None
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        _parse_config(c)
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(tempfile.gettempdir()) / "ckstore-bench-torch-extensions")
    own = args.dir is None
    args.dir = scratch_dir(args.dir, "ckstore-bench-ds-")
    try:
        results = [launch(args, c, extensions) for c in configs]
        report(args, results)
    finally:
        if own:
            import shutil

            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
