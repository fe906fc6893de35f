"""One rank of a real DeepSpeed job (CPU, gloo), for tests/test_deepspeed.py.

    python tests/_ds_job.py SCENARIO STORE PORT RANK WORLD OUT [ARG]

Each scenario checks what it can on its own rank and writes a JSON report to OUT/rank<R>.json;
an assertion that fails makes the process exit non-zero with the traceback in the report.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import traceback
from collections.abc import Iterator
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

import ckstore
from ckstore.integrations import deepspeed as ckds

#: (ZeRO stage, bf16) of the resume checks, per world size: together every stage runs with and
#: without bf16, and on 1 and 2 ranks
MATRIX = {2: [(0, False), (1, True), (2, False), (3, True)], 1: [(0, True), (1, False), (2, True), (3, False)]}
STOCK = (2, True)  # the stock folder that import and export round-trip
VOCAB, WIDTH = 32, 16


class Net(torch.nn.Module):
    """A frozen embedding under a small trainable head."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.emb.weight.requires_grad_(False)
        self.fc1 = torch.nn.Linear(width, 24)
        self.fc2 = torch.nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.emb(x).mean(1))))


def make_engine(stage: int, bf16: bool, seed: int, model: torch.nn.Module | None = None) -> Any:
    import deepspeed

    torch.manual_seed(seed)
    model = model or Net()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def train_step(engine: Any, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (2, 5), generator=g)
    target = torch.randn(2, 4, generator=g)
    out = engine(x)
    loss = (out.float() - target).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def digest(engine: Any) -> str:
    """A digest of every tensor of this rank's full checkpoint state (weights, optimizer
    moments, fp32 masters, scheduler), in a fixed order."""
    return tensor_digest(ckds.state_dicts(engine), str(engine.global_steps))


def tensor_digest(states: Any, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                if k not in ("ds_config", "ds_version"):
                    h.update(str(k).encode())
                    walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, (int, float, str, bool)) or x is None:
            h.update(repr(x).encode())

    walk(states)
    return h.hexdigest()


def expect_failure(fn: Any) -> str:
    try:
        fn()
    except ckstore.CkstoreError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("expected a failure")


def failing_writer(rank: int) -> Any:
    def writer(key: str, size_hint: int | None = None) -> Any:
        raise OSError(f"injected write failure on rank {rank}")

    return writer


# -- scenarios ----------------------------------------------------------------------------------


def resume(store: ckstore.Store, rank: int, world: int, stage: int, bf16: bool) -> dict[str, Any]:
    """Save after 2 steps, take step 3; a fresh engine loads and takes step 3: the same state."""
    run = f"z{stage}-{'bf16' if bf16 else 'fp32'}-w{world}"
    a = make_engine(stage, bf16, seed=0)
    for s in (1, 2):
        loss = train_step(a, s, rank)
    ck = ckds.save(a, store, metrics={"loss": loss}, tags=["resume"], kind="epoch", run=run,
                   client_state={"epoch": 3, "note": "resume"})  # fmt: skip
    train_step(a, 3, rank)
    want = digest(a)

    b = make_engine(stage, bf16, seed=1)
    fresh = digest(b)
    with counting_reads(store) as reads:
        client_state, got = ckds.load(b, store, f"{run}@resume")
    assert got.id == ck.id and b.global_steps == 2, (got, b.global_steps)
    assert client_state["epoch"] == 3 and client_state["note"] == "resume", client_state
    train_step(b, 3, rank)
    return {
        "run": run, "step": ck.step, "ranks": list(ck.ranks), "sub_keys": list(ck.sub_keys),
        "layout": ck.world_layout.mesh, "kind": ck.kind, "tags": list(ck.tags),
        "want": want, "got": digest(b), "fresh": fresh, "asked": reads["asked"], "read": reads["read"],
    }  # fmt: skip


@contextlib.contextmanager
def counting_reads(store: ckstore.Store) -> Iterator[dict[str, dict[str, int]]]:
    """Count, by sub-checkpoint, what the engine asks the serving checkpoint engine for
    (``asked``) and what is read from the store for it (``read``)."""
    from ckstore.integrations.deepspeed import _engine

    counts: dict[str, dict[str, int]] = {"asked": {}, "read": {}}
    serve_engine, load = _engine._serve_engine, store.load

    def counted_serve_engine(fetch: Any, folder: str) -> Any:
        eng = serve_engine(fetch, folder)
        served = eng.load

        def asked(path: str, map_location: Any = None) -> Any:
            stem = _engine.stem_of(path, folder)
            counts["asked"][stem] = counts["asked"].get(stem, 0) + 1
            return served(path, map_location)

        eng.load = asked
        return eng

    def read(ckpt: Any, **kwargs: Any) -> Any:
        for key in kwargs.get("sub_keys") or ["*"]:
            counts["read"][key] = counts["read"].get(key, 0) + 1
        return load(ckpt, **kwargs)

    _engine._serve_engine, store.load = counted_serve_engine, read  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        _engine._serve_engine, store.load = serve_engine, load  # type: ignore[method-assign]


def scenario_main(store: ckstore.Store, rank: int, world: int, out: dict[str, Any], arg: str) -> None:
    out["resume"] = [resume(store, rank, world, stage, bf16) for stage, bf16 in MATRIX[world]]
    if world == 1:
        frozen(store, rank, out)
        reloaded(store, rank, out, Path(arg))
    else:
        attached(store, rank, world, out, Path(arg))
        failing(store, rank, out)
        stock(store, rank, out, Path(arg))
    out["ok"] = True


def frozen(store: ckstore.Store, rank: int, out: dict[str, Any]) -> None:
    """A large frozen embedding: the second save stores only what training changed."""
    model = Net(vocab=4096, width=64)
    engine = make_engine(2, True, seed=0, model=model)
    cks = []
    for s in (1, 2):
        train_step(engine, s, rank)
        cks.append(ckds.save(engine, store, run="frozen"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["frozen"] = {
        "frozen_bytes": model.emb.weight.numel() * model.emb.weight.element_size(),
        "trainable_params": trainable,
        # bf16 weight + fp32 master + Adam's two fp32 moments, per trainable parameter
        "trainable_state_bytes": trainable * (2 + 4 + 4 + 4),
        "first_added": cks[0].stored_bytes_added,
        "second_added": cks[1].stored_bytes_added,
        "second_logical": cks[1].logical_bytes,
    }


def outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported, for the test to judge
        return f"{type(e).__name__}: {e}"
    return "ok"


def reloaded(store: ckstore.Store, rank: int, out: dict[str, Any], base: Path) -> None:
    """attach: a step saved again under another tag after a load; and a checkpoint that holds no
    model states this engine reads."""
    folder = str(base / "reloaded")
    a = make_engine(0, False, seed=0)
    ckds.attach(a, store, run="reload")
    train_step(a, 1, rank)
    a.save_checkpoint(folder, "a")
    a.load_checkpoint(folder, "a")
    want = digest(a)
    a.save_checkpoint(folder, "b")  # the same step: it replaces the checkpoint "a" pointed at
    b = make_engine(0, False, seed=1)
    ckds.attach(b, store, run="reload")
    out["reload"] = {
        "b": outcome(lambda: a.load_checkpoint(folder, "b")), "a": outcome(lambda: a.load_checkpoint(folder, "a")),
        "fresh_b": outcome(lambda: b.load_checkpoint(folder, "b")), "same": digest(a) == want == digest(b),
    }  # fmt: skip
    store.commit(0, {0: {"state_dict": {"w": torch.zeros(2)}}}, run="plain")
    out["no_model_states"] = outcome(lambda: ckds.load(a, store, "plain@0"))
    z3 = make_engine(3, False, seed=0)
    out["stage_mismatch"] = outcome(lambda: ckds.load(z3, store, "reload@1"))


def attached(store: ckstore.Store, rank: int, world: int, out: dict[str, Any], base: Path) -> None:
    """The stock save_checkpoint/load_checkpoint call sites, after attach."""
    folder = base / "attached"
    a = make_engine(1, True, seed=0)
    ckds.attach(a, store, run="attach")
    for s in (1, 2):
        train_step(a, s, rank)
    a.save_checkpoint(str(folder), "t2", client_state={"epoch": 1})
    train_step(a, 3, rank)
    want = digest(a)
    a.save_checkpoint(str(folder))  # the default tag, global_step3
    # a rank failing inside save_checkpoint: every rank raises; latest and stubs stay as they were
    real = store.blobs.writer
    if rank == 1:
        store.blobs.writer = failing_writer(rank)  # type: ignore[method-assign]
    train_step(a, 4, rank)
    out["attach_failure"] = expect_failure(lambda: a.save_checkpoint(str(folder), "bad"))
    store.blobs.writer = real  # type: ignore[method-assign]
    torch.distributed.barrier()
    # DeepSpeed 0.16's calls: create/commit get the tag string, and no save_dir
    train_step(a, 5, rank)
    ce, legacy = a.checkpoint_engine, folder / "legacy"
    states = ckds.state_dicts(a)
    want_legacy = tensor_digest(states)
    ce.create("legacy")
    ce.makedirs(str(legacy), exist_ok=True)
    for stem, sd in states.items():
        ce.save(sd, str(legacy / f"{stem}.pt"))
    ce.commit("legacy")
    out["legacy"] = {"step": ce.last.step, "same": tensor_digest({s: ce.load(str(legacy / f"{s}.pt")) for s in states}) == want_legacy}

    b = make_engine(1, True, seed=1)
    ckds.attach(b, store, run="attach")
    path, client_state = b.load_checkpoint(str(folder), "t2")
    assert client_state["epoch"] == 1 and b.global_steps == 2, (client_state, b.global_steps)
    train_step(b, 3, rank)
    out["attach"] = {
        "want": want, "got": digest(b), "latest": (folder / "latest").read_text(),
        "files": sorted(os.listdir(folder / "t2")), "bad_files": sorted(os.listdir(folder / "bad")),
    }  # fmt: skip


def failing(store: ckstore.Store, rank: int, out: dict[str, Any]) -> None:
    """A rank that fails in save makes every rank raise; nothing becomes visible."""
    engine = make_engine(1, False, seed=0)
    train_step(engine, 1, rank)
    real = store.blobs.writer
    if rank == 1:
        store.blobs.writer = failing_writer(rank)  # type: ignore[method-assign]
    out["fail_write"] = expect_failure(lambda: ckds.save(engine, store, run="fail"))
    store.blobs.writer = real  # type: ignore[method-assign]
    # an object ckstore cannot store as plain values (rank 0 writes the model states)
    odd = {"frac": Fraction(1, 3)}
    out["fail_object"] = expect_failure(lambda: ckds.save(engine, store, run="fail", client_state=odd))
    ck = ckds.save(engine, store, run="fail", step=5, client_state=odd, allow_pickle=True)
    out["pickled_refused"] = expect_failure(lambda: ckds.load(engine, store, ck.ref))
    torch.distributed.barrier()


def stock(store: ckstore.Store, rank: int, out: dict[str, Any], base: Path) -> None:
    """A folder the stock engine writes (no ckstore), and the state one step after it."""
    engine = make_engine(*STOCK, seed=0)
    for s in (1, 2):
        train_step(engine, s, rank)
    engine.save_checkpoint(str(base / "stock"), "step2", client_state={"epoch": 7})
    train_step(engine, 3, rank)
    out["stock_want"] = digest(engine)


def scenario_stock_load(store: ckstore.Store, rank: int, world: int, out: dict[str, Any], arg: str) -> None:
    """The stock engine loads an exported folder and takes the next step; DeepSpeed's
    zero_to_fp32 consolidates it as it does the stock folder."""
    exported, stock = arg.split(os.pathsep)
    engine = make_engine(*STOCK, seed=1)
    path, client_state = engine.load_checkpoint(exported)
    assert client_state["epoch"] == 7 and engine.global_steps == 2, (client_state, engine.global_steps)
    train_step(engine, 3, rank)
    out["stock_got"] = digest(engine)
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        got = get_fp32_state_dict_from_zero_checkpoint(exported)
        want = get_fp32_state_dict_from_zero_checkpoint(stock)
        out["fp32_tensors"] = len(want)
        out["fp32_equal"] = list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    out["ok"] = True


def main() -> None:
    scenario, store_path, port, rank_s, world_s, out_dir, arg = sys.argv[1:8]
    rank, world = int(rank_s), int(world_s)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": rank_s, "WORLD_SIZE": world_s,
                       "LOCAL_RANK": rank_s, "LOCAL_WORLD_SIZE": world_s})  # fmt: skip
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60), verbose=False)
    out: dict[str, Any] = {"rank": rank}
    store = ckstore.open(store_path, run="exp", create=False, workers=2)
    try:
        globals()[f"scenario_{scenario}"](store, rank, world, out, arg)
    except BaseException:
        out["traceback"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        store.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
