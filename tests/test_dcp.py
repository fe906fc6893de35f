"""DCP (torch.distributed.checkpoint) on ckstore, and asynchronous collective commits, in real
multi-process gloo jobs (tests/_dcp_job.py) and in this process.

One job of 4 ranks saves (an async collective commit, a failing one, FSDP2 model + optimizer
through ``dcp.save`` and ``dcp.async_save``, a failing rank); a job of 2 ranks and this process
(1 rank) load it back through the Reader.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import bits

import ckstore
from ckstore import WorldLayout
from ckstore.integrations import dcp as ckdcp

JOB = Path(__file__).with_name("_dcp_job.py")
ROOT = Path(__file__).parent.parent


def run_job(scenario: str, world: int, store: Path, timeout: float = 150) -> list[dict[str, Any]]:
    from test_distributed import run_job as run

    return run(scenario, world, store, store.parent, timeout, job=JOB)


def _plain_model_and_opt() -> tuple[Any, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from _dcp_job import make_model, train_step

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 99)
    return model, opt


@pytest.mark.distributed
def test_dcp_sharded_save_on_4_ranks_loads_on_2_and_1(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = tmp_path / "store"
    ckstore.open(path, run="exp", chunk_size=64 * 1024, pack_size=1024 * 1024).close()
    saved = run_job("save", 4, path)
    assert all(r["ok"] for r in saved)
    for r in saved:  # failures reach every rank, and name the failing one
        assert "DistributedCommitError" in r["async_failure"] and "rank 1" in r["async_failure"], r["async_failure"]
        assert "read-only blob store" in r["dcp_failure"], r["dcp_failure"]
    store = ckstore.open(path, run="exp")
    assert [c.step for c in store.checkpoints("exp")] == [1, 2, 10]  # steps 3 and 11 failed: not visible
    assert not store.fsck().damage and not store.fsck().pending
    ck1, ck2 = store.resolve(1), store.resolve(2)
    assert ck1.ranks == (0, 1, 2, 3) and ck1.world_layout == WorldLayout({"dp": 4}) and ck1.tags == ("dcp",)
    assert ck1.sub_keys == ("model", "optim") and ck1.metrics == {"loss": 1.0}
    # frozen layers add no bytes: the second save stores about the trainable bytes only
    trainable = saved[0]["trainable_bytes"]
    assert ck2.stored_bytes_added <= 1.2 * trainable + 16 * 1024, (ck2.stored_bytes_added, trainable)
    assert ck1.stored_bytes_added > 5 * trainable, (ck1.stored_bytes_added, trainable)

    # consolidated by ckstore itself: the full tensors
    expected = {s: torch.load(tmp_path / f"expected{s}.pt", weights_only=True) for s in (1, 2)}
    for step in (1, 2):
        full = store.checkout(step, WorldLayout.single())[0]
        for name, t in expected[step]["model"].items():
            assert type(full["model"][name]) is torch.Tensor and bits(full["model"][name]) == bits(t), (step, name)
        for name, st in expected[step]["optim"]["state"].items():
            for k, t in st.items():
                assert bits(full["optim"]["state"][name][k]) == bits(t), (step, name, k)

    # loaded through DCP by 2 ranks, and by this process alone into a plain model
    loaded = run_job("load", 2, path)
    assert all(r["ok"] for r in loaded)
    model, opt = _plain_model_and_opt()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=ckdcp.Reader(store, 2))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for name, t in model.state_dict().items():
        assert bits(t) == bits(expected[2]["model"][name]), name
    store.close()


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(64, 300, generator=g), "b": torch.randn(7, generator=g).half()},
        "extra": {"step": 4, "names": ["a", "b"], "nested": [torch.arange(5), torch.ones(2, 2)]},
    }


def test_dcp_one_process_save_load_async_and_store_commit(store: ckstore.Store) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _state()
        writer = ckdcp.Writer(store, step=1, metrics={"loss": 2.0}, kind="epoch")
        dcp.save(state, storage_writer=writer)
        assert writer.checkpoint is not None and writer.checkpoint.kind == "epoch"
        got = store.checkout(1)[0]
        assert bits(got["model"]["w"]) == bits(state["model"]["w"]) and got["extra"]["step"] == 4
        assert got["extra"]["names"] == ["a", "b"] and bits(got["extra"]["nested"][1]) == bits(torch.ones(2, 2))

        target = {"model": {"w": torch.zeros(64, 300), "b": torch.zeros(7).half()},
                  "extra": {"step": 0, "names": [], "nested": [torch.zeros(5, dtype=torch.long), torch.zeros(2, 2)]}}  # fmt: skip
        dcp.load(target, storage_reader=ckdcp.Reader(store, "latest"))
        assert bits(target["model"]["w"]) == bits(state["model"]["w"]) and bits(target["model"]["b"]) == bits(state["model"]["b"])
        assert target["extra"]["step"] == 4 and target["extra"]["names"] == ["a", "b"]
        assert bits(target["extra"]["nested"][0]) == bits(torch.arange(5))

        # dcp.async_save through the Writer: an unchanged state adds no bytes
        fut = dcp.async_save(state, storage_writer=ckdcp.Writer(store, step=2))
        fut.result()
        assert store.resolve(2).stored_bytes_added == 0

        # a checkpoint committed with store.commit loads through the Reader when keys match
        store.commit(3, {0: {"model": {"w": state["model"]["w"] * 2, "b": state["model"]["b"]}}})
        target = {"model": {"w": torch.zeros(64, 300), "b": torch.zeros(7).half()}}
        dcp.load(target, storage_reader=ckdcp.Reader(store, 3))
        assert bits(target["model"]["w"]) == bits(state["model"]["w"] * 2)

        # ...and a pickled value is refused unless the reader opts in
        store.commit(4, {0: {"model": {"w": state["model"]["w"]}, "obj": {"o": complex(1, 2)}}}, allow_pickle=True)
        target = {"model": {"w": torch.zeros(64, 300)}, "obj": {"o": None}}
        with pytest.raises(BaseException, match="pickled"):
            dcp.load(target, storage_reader=ckdcp.Reader(store, 4))
        dcp.load(target, storage_reader=ckdcp.Reader(store, 4, allow_pickle=True))
        assert target["obj"]["o"] == complex(1, 2)


def test_the_writers_arguments_are_checked_when_it_is_made(store: ckstore.Store) -> None:
    """A string of tags is refused, not stored as one tag per character (what the Writer did),
    and a bad step or metric is named in the rank's own call, before DCP's save runs."""
    with pytest.raises(ckstore.InvalidRefError, match=r"for one tag pass tags=\['best'\]"):
        ckdcp.Writer(store, step=1, tags="best")
    with pytest.raises(ckstore.StoreConfigError, match="step must be a non-negative int"):
        ckdcp.Writer(store, step="1")  # type: ignore[arg-type]
    with pytest.raises(ckstore.StoreConfigError, match="metric 'loss' must be a number"):
        ckdcp.Writer(store, step=1, metrics={"loss": "low"})  # type: ignore[dict-item]
    with pytest.raises(ckstore.CkstoreError, match="Writer needs a ckstore.Store"):
        ckdcp.Writer(str(store.location), step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=ckdcp.Writer(store, step=1, tags=["best"]))
    assert store.resolve("best").tags == ("best",) and store.checkpoints() == [store.resolve(1)]


def test_export_dcp_folder_loads_with_dcps_own_reader(store: ckstore.Store, tmp_path: Path) -> None:
    from click.testing import CliRunner
    from torch.distributed.checkpoint import FileSystemReader

    from ckstore.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _state()
        dcp.save(state, storage_writer=ckdcp.Writer(store, step=5))
        out = tmp_path / "exported"
        res = CliRunner().invoke(main, ["--store", str(store.location), "export", "5", str(out), "--format", "dcp"])
        assert res.exit_code == 0, res.output
        assert (out / ".metadata").is_file()
        # the same state dict loads from the exported folder (DCP's reader) and from the store
        a = {"model": {"w": torch.zeros(64, 300), "b": torch.zeros(7).half()}, "extra": {"step": 0}}
        b = {"model": {"w": torch.zeros(64, 300), "b": torch.zeros(7).half()}, "extra": {"step": 0}}
        dcp.load(a, storage_reader=FileSystemReader(str(out)))
        dcp.load(b, storage_reader=ckdcp.Reader(store, 5))
    for s in (a, b):
        assert bits(s["model"]["w"]) == bits(state["model"]["w"]) and bits(s["model"]["b"]) == bits(state["model"]["b"])
        assert s["extra"]["step"] == 4


@pytest.mark.distributed
def test_readers_that_resolved_latest_to_different_steps_fail_the_load(tmp_path: Path) -> None:
    """Ranks whose Readers named "latest" on either side of a commit loaded different steps, each
    without a word: the load now fails on every rank, naming both checkpoints."""
    path = tmp_path / "store"
    ckstore.open(path, run="exp").close()
    reports = run_job("latest_race", 2, path)
    assert [r["step"] for r in reports] == [1, 2]  # the race happened
    for r in reports:
        assert r["ok"] and "exp@2" in r.get("failure", "") and "exp@1" in r["failure"], r
