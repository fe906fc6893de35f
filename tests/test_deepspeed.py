"""The DeepSpeed integration against real DeepSpeed engines (CPU, gloo).

Two jobs run once per session, side by side (tests/_ds_job.py): one of 2 ranks and one of 1
rank. Each trains tiny models under ZeRO 0-3 with and without bf16 (see ``MATRIX``), saves
through ckstore, resumes a fresh engine and compares the full state after one more step; the
2-rank job also drives the stock save_checkpoint/load_checkpoint through ``attach``, fails a rank
and writes a stock DeepSpeed folder. The tests below read their reports and the stores they left.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from _ds_job import MATRIX
from click.testing import CliRunner
from services import require_module

import ckstore
from ckstore.cli import main
from ckstore.errors import IntegrityError, StoreConfigError, UnsupportedValueError
from ckstore.format.tensorio import flatten
from ckstore.integrations.deepspeed import META, export_folder, import_folder
from ckstore.integrations.deepspeed._attach import read_stub
from ckstore.integrations.deepspeed._folder import parse_file_name
from ckstore.integrations.deepspeed._objects import MARK, from_plain, to_plain

JOB = Path(__file__).with_name("_ds_job.py")
ROOT = Path(__file__).parent.parent
JOB_TIMEOUT = 240  # the first job of a session builds DeepSpeed's comm op with g++


@pytest.fixture(scope="session")
def torch_extensions(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One folder for DeepSpeed's JIT-built ops for the whole session (built once, ~30 s);
    a TORCH_EXTENSIONS_DIR set by the caller (a CI cache) is used as it is."""
    require_module("deepspeed")
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(tmp_path_factory.mktemp("torch-extensions"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    scenario: str
    world: int
    out: Path
    procs: list[subprocess.Popen[str]]

    def wait(self, deadline: float) -> list[dict[str, Any]]:
        logs = []
        try:
            for p in self.procs:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in self.procs:
                p.kill()
            pytest.fail(f"DeepSpeed job {self.scenario!r} of {self.world} ranks hung")
        reports = []
        for r, p in enumerate(self.procs):
            f = self.out / f"rank{r}.json"
            report = json.loads(f.read_text()) if f.exists() else {}
            assert p.returncode == 0 and report.get("ok"), (
                f"rank {r} of DeepSpeed job {self.scenario!r} failed:\n{report.get('traceback', '')}\n{logs[r][-3000:]}"
            )
            reports.append(report)
        return reports


def launch(scenario: str, world: int, store: Path, tmp: Path, arg: str, extensions: str) -> Job:
    out = tmp / f"out-{scenario}-{world}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": extensions}  # fmt: skip
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), scenario, str(store), port, str(r), str(world), str(out), arg],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    return Job(scenario, world, out, procs)


def new_store(path: Path) -> Path:
    ckstore.open(path, run="exp", chunk_size=64 * 1024, pack_size=1024 * 1024).close()
    return path


@dataclass
class Jobs:
    tmp: Path
    extensions: str
    stores: dict[int, Path]  # world size -> the store its job committed to
    reports: dict[int, list[dict[str, Any]]]


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory, torch_extensions: str) -> Jobs:
    tmp = tmp_path_factory.mktemp("deepspeed")
    stores = {w: new_store(tmp / f"store{w}") for w in (1, 2)}
    started = {w: launch("main", w, stores[w], tmp, str(tmp), torch_extensions) for w in (2, 1)}
    deadline = time.monotonic() + JOB_TIMEOUT
    return Jobs(tmp, torch_extensions, stores, {w: job.wait(deadline) for w, job in started.items()})


# -- real DeepSpeed jobs ------------------------------------------------------------------------

MATRIX_CASES = [(world, stage, bf16) for world, cases in MATRIX.items() for stage, bf16 in cases]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("world", "stage", "bf16"), MATRIX_CASES, ids=lambda v: str(v))
def test_resume_is_bit_exact(jobs: Jobs, world: int, stage: int, bf16: bool) -> None:
    run = f"z{stage}-{'bf16' if bf16 else 'fp32'}-w{world}"
    for rank, report in enumerate(jobs.reports[world]):
        (case,) = [c for c in report["resume"] if c["run"] == run]
        # the state after one more step (weights, fp32 masters, moments, scheduler) is the same
        # bits as the uninterrupted run's, and the fresh engine started elsewhere
        assert case["got"] == case["want"], (run, rank)
        assert case["fresh"] != case["want"], (run, rank)
        assert case["ranks"] == list(range(world)) and case["layout"] == {"dp": world}
        assert case["step"] == 2 and case["kind"] == "epoch" and case["tags"] == ["resume"]
        # every sub-checkpoint the engine asked for was read from the store once, though it asks
        # for the model states twice in a row (for their keys, then to load them)
        assert case["read"] == {stem: 1 for stem in case["asked"]}, (run, rank, case["asked"], case["read"])
        assert sum(case["asked"].values()) > len(case["asked"]), (run, rank, case["asked"])
    keys = set(jobs.reports[world][0]["resume"][[c["run"] for c in jobs.reports[world][0]["resume"]].index(run)]["sub_keys"])
    prefix = "bf16_" if bf16 and stage > 0 else ""
    optim = {f"{prefix}zero_pp_rank_{d}_mp_rank_00_optim_states" for d in range(world)} if stage else set()
    model = {f"zero_pp_rank_{d}_mp_rank_00_model_states" for d in range(world)} if stage == 3 else {"mp_rank_00_model_states"}
    assert keys == {META} | optim | model, keys
    with ckstore.open(jobs.stores[world]) as store:
        ck = store.resolve(f"{run}@resume")
        # each rank committed its own files, plus its record
        for (rank, sub_key), _ in store.manifests(ck).items():
            name = parse_file_name(sub_key)
            assert sub_key == META or name is not None and name.dp == (rank if name.kind != "model" else 0)
        meta = store.checkout(ck.ref, sub_keys=[META])
        assert [meta[r][META]["coords"]["dp"] for r in range(world)] == list(range(world))
        assert all(meta[r][META]["zero_stage"] == stage and meta[r][META]["bf16"] == bf16 for r in range(world))


@pytest.mark.slow
@pytest.mark.distributed
def test_attach_keeps_the_stock_call_sites(jobs: Jobs) -> None:
    folder = jobs.tmp / "attached"
    for rank, report in enumerate(jobs.reports[2]):
        a = report["attach"]
        assert a["got"] == a["want"], rank  # load_checkpoint(dir, "t2") then a step: bit-exact
        assert a["latest"] == "global_step3"  # written by the engine itself, after the commit
        assert "failed on rank 1: OSError: injected write failure on rank 1" in report["attach_failure"]
        assert a["bad_files"] == []  # the failed save left no stubs
        assert report["legacy"] == {"step": 5, "same": True}  # DeepSpeed 0.16's string tags
    assert (folder / "latest").read_text() == "global_step3"
    stubs = {p.name: read_stub(str(p)) for p in (folder / "t2").glob("*.pt")}
    assert sorted(stubs) == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                             "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]  # fmt: skip
    assert stubs["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]["rank"] == 1
    assert all(s is not None and s["run"] == "attach" and s["step"] == 2 for s in stubs.values())
    assert max(p.stat().st_size for p in (folder / "t2").iterdir()) < 1024  # stubs, not pickles
    with ckstore.open(jobs.stores[2]) as store:
        assert [c.step for c in store.checkpoints("attach")] == [2, 3, 5]  # the failed step 4 is not there
        assert store.catalog.pending() == []


@pytest.mark.slow
@pytest.mark.distributed
def test_attach_loads_a_step_saved_again_after_a_load(jobs: Jobs) -> None:
    r = jobs.reports[1][0]["reload"]
    # the engine that loaded tag a, saved the same step again as b and loads b gets b; a refuses
    assert r["b"] == "ok" and r["fresh_b"] == "ok" and r["same"], r
    assert "saved again" in r["a"], r


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_without_loadable_model_states_is_refused(jobs: Jobs) -> None:
    report = jobs.reports[1][0]
    assert report["no_model_states"].startswith("CkstoreError: plain@0 holds no model states"), report["no_model_states"]
    assert "'state_dict'" in report["no_model_states"]
    # saved without ZeRO-3, loaded into a ZeRO-3 engine: named, not DeepSpeed's bare assert
    assert report["stage_mismatch"].startswith("CkstoreError: reload@1 holds no model states"), report["stage_mismatch"]
    assert "zero_pp_rank_*_mp_rank_*_model_states" in report["stage_mismatch"]

@pytest.mark.slow
@pytest.mark.distributed
def test_a_failing_rank_commits_nothing(jobs: Jobs) -> None:
    for report in jobs.reports[2]:
        assert "commit of run 'fail', step 1 failed on rank 1: OSError: injected write failure" in report["fail_write"]
        assert "failed on rank 0: UnsupportedValueError: rank 0, mp_rank_00_model_states, key 'frac'" in report["fail_object"]
        assert "allow_pickle=True" in report["fail_object"] and "nothing was committed" in report["fail_object"]
        assert "holds a pickled object" in report["pickled_refused"]
    with ckstore.open(jobs.stores[2]) as store:
        assert [c.step for c in store.checkpoints("fail")] == [5]  # only the opted-in pickle
        assert store.catalog.pending() == []
        state = store.checkout("fail@5", ranks=[0], sub_keys=["mp_rank_00_model_states"], allow_pickle=True)
        assert state[0]["mp_rank_00_model_states"]["frac"] == Fraction(1, 3)


@pytest.mark.slow
@pytest.mark.distributed
def test_frozen_parameters_cost_no_new_bytes(jobs: Jobs) -> None:
    f = jobs.reports[1][0]["frozen"]
    print(f"\nfrozen embedding {f['frozen_bytes']} B; trainable state {f['trainable_state_bytes']} B "
          f"({f['trainable_params']} params); first save added {f['first_added']} B, second "
          f"{f['second_added']} B of {f['second_logical']} B logical")  # fmt: skip
    assert f["second_logical"] > f["frozen_bytes"]  # the embedding is in the second checkpoint
    assert f["first_added"] > f["frozen_bytes"] // 2  # and was stored by the first (bf16 compresses ~70%)
    # the second stores about the trainable state only (compressed), not the embedding again
    assert f["second_added"] <= f["trainable_state_bytes"]
    assert f["second_added"] < f["frozen_bytes"] // 20


@pytest.mark.slow
@pytest.mark.distributed
def test_tags_refs_diff_log_and_gc(jobs: Jobs) -> None:
    loc = str(jobs.stores[2])
    with ckstore.open(loc) as store:
        assert store.resolve("z1-bf16-w2@resume").step == 2
        assert store.resolve("z2-fp32-w2@min:loss").step == 2
        d = store.diff("attach@2", "attach@3")
        by_key = {t.key: t for t in d.tensors}
        frozen = [t for k, t in by_key.items() if k.endswith("module/emb.weight")]
        assert frozen and all(t.status == "identical" for t in frozen), list(by_key)[:8]
        assert any(t.status == "changed" for k, t in by_key.items() if "optim_states" in k)
    r = CliRunner().invoke(main, ["--store", loc, "log", "z3-bf16-w2"])
    assert r.exit_code == 0 and "resume" in r.output, r.output
    # retention and gc: keep the latest checkpoint of the run. The dropped one's tensors are the
    # same bits as z1-bf16-w2@2's (same seed, config and data), so those chunks stay for it
    from ckstore.retention import LatestN

    with ckstore.open(loc) as store:
        report = store.gc(LatestN(1), run="attach", grace=0)
        assert [c.step for c in store.checkpoints("attach")] == [5]
        assert report.dropped == ["attach@2", "attach@3"]
        with pytest.raises(ckstore.CheckpointNotFoundError):
            store.resolve("attach@2")
        assert store.fsck(deep=True).ok
        assert "mp_rank_00_model_states" in store.checkout("z1-bf16-w2@2", ranks=[0])[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_import_and_export_of_a_stock_folder(jobs: Jobs, tmp_path: Path) -> None:
    stock = jobs.tmp / "stock"
    loc = str(tmp_path / "s")
    new_store(tmp_path / "s")
    cli = CliRunner()
    r = cli.invoke(main, ["--store", loc, "import", str(stock), "--run", "ds"])
    assert r.exit_code != 0 and "pickles" in r.output and "--allow-pickle" in r.output, r.output
    r = cli.invoke(main, ["--store", loc, "import", str(stock), "--run", "ds", "--allow-pickle", "--tag", "stock"])
    assert r.exit_code == 0, r.output
    with ckstore.open(loc) as store:
        ck = store.resolve("ds@stock")
        assert ck.step == 2 and ck.ranks == (0, 1) and ck.world_layout.mesh == {"dp": 2}
        assert set(ck.sub_keys) == {"mp_rank_00_model_states", "bf16_zero_pp_rank_0_mp_rank_00_optim_states",
                                    "bf16_zero_pp_rank_1_mp_rank_00_optim_states"}  # fmt: skip
        # the loss scaler came in as a plain record, not a pickle
        optim = store.checkout(ck.ref, ranks=[1], sub_keys=["bf16_zero_pp_rank_1_mp_rank_00_optim_states"])
        scaler = optim[1]["bf16_zero_pp_rank_1_mp_rank_00_optim_states"]["optimizer_state_dict"]["loss_scaler"]
        assert scaler[MARK] == "object" and scaler["class"].endswith("LossScaler")
        # the same folder again (its tag folder this time) stores nothing new
        again = import_folder(store, str(stock / "step2"), run="ds2", allow_pickle=True)
        assert again.stored_bytes_added == 0 and again.step == 2
    out = tmp_path / "exported"
    r = cli.invoke(main, ["--store", loc, "export", "ds@stock", str(out), "--format", "deepspeed"])
    assert r.exit_code == 0, r.output
    assert (out / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in (out / "global_step2").iterdir()) == sorted(p.name for p in (stock / "step2").glob("*.pt"))
    for p in (stock / "step2").glob("*.pt"):
        want = torch.load(p, weights_only=False)
        got = torch.load(out / "global_step2" / p.name, weights_only=False)
        _same_tensors(got, want, p.name)

    # the stock engine resumes from the exported folder bit-exact, and zero_to_fp32 reads it
    job = launch("stock_load", 2, tmp_path / "s", tmp_path, os.pathsep.join([str(out), str(stock)]), jobs.extensions)
    reports = job.wait(time.monotonic() + JOB_TIMEOUT)
    for rank, report in enumerate(reports):
        assert report["stock_got"] == jobs.reports[2][rank]["stock_want"], rank
    assert reports[0]["fp32_equal"] and reports[0]["fp32_tensors"] > 0


def _same_tensors(a: Any, b: Any, where: str) -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(b, dict):  # an OrderedDict comes back as a dict, in the same order
        assert isinstance(a, dict) and list(a) == list(b), where
        for k in b:
            _same_tensors(a[k], b[k], f"{where}/{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where  # torch.Size stays a torch.Size
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tensors(x, y, f"{where}/{i}")
    elif isinstance(b, (int, float, str, bool, type(None))):
        assert a == b, where
    else:
        assert type(a) is type(b) and vars(a) == vars(b), where


# -- without engines ----------------------------------------------------------------------------


def test_deepspeed_objects_become_plain_values_and_come_back() -> None:
    require_module("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    dyn = DynamicLossScaler(init_scale=2.0**16, scale_window=100, min_scale=1, delayed_shift=2,
                            consecutive_hysteresis=False, dtype=torch.float16)  # fmt: skip
    dyn.cur_iter = 7
    state = {"loss_scaler": dyn, "static": LossScaler(scale=4), "stage": ZeroStageEnum.gradients,
             "maps": [{"w": fragment_address(numel=32, start=8)}], "dtype": torch.bfloat16,
             "t": torch.arange(3), "shape": torch.Size([3, 4])}  # fmt: skip
    plain = to_plain(state)
    assert plain["loss_scaler"][MARK] == "object" and plain["loss_scaler"]["state"]["cur_iter"] == 7
    assert plain["stage"] == {MARK: "enum", "class": "deepspeed.runtime.zero.config.ZeroStageEnum", "value": 2}
    flatten(plain, allow_pickle=False)  # ckstore stores it without pickle
    back = from_plain(plain)
    assert type(back["loss_scaler"]) is DynamicLossScaler and vars(back["loss_scaler"]) == vars(dyn)
    assert type(back["static"]) is LossScaler and back["static"].cur_scale == 4
    assert back["stage"] is ZeroStageEnum.gradients and back["dtype"] is torch.bfloat16
    assert back["maps"][0]["w"] == fragment_address(numel=32, start=8) and torch.equal(back["t"], state["t"])
    assert type(back["shape"]) is torch.Size and back["shape"].numel() == 12


def test_unknown_objects_need_the_pickle_opt_in() -> None:
    with pytest.raises(UnsupportedValueError, match=r"key 'a/0'.*fractions.Fraction.*allow_pickle=True"):
        to_plain({"a": [Fraction(1, 2)]})
    assert to_plain({"a": [Fraction(1, 2)]}, allow_pickle=True)["a"][0] == Fraction(1, 2)
    with pytest.raises(UnsupportedValueError, match="reserved"):
        to_plain({"x": {MARK: "object"}})


@pytest.mark.parametrize(
    "node",
    [
        {MARK: "object", "class": "os._wrap_close", "state": {}},  # not DeepSpeed
        {MARK: "object", "class": "deepspeed.comm.comm.init_distributed", "state": {}},  # not a class
        {MARK: "object", "class": "deepspeed.runtime.zero.config.ZeroStageEnum", "state": {}},  # an enum
        {MARK: "enum", "class": "deepspeed.runtime.zero.config.ZeroStageEnum", "value": 99},
        {MARK: "dtype", "name": "__class__"},
        {MARK: "shell", "cmd": "rm -rf /"},
    ],
)
def test_stored_objects_name_only_deepspeed_records(node: dict[str, Any]) -> None:
    require_module("deepspeed")
    with pytest.raises((IntegrityError, UnsupportedValueError)):
        from_plain({"k": node})


def test_file_names_give_the_writing_ranks() -> None:
    cases = {
        "mp_rank_01_model_states": ("model", 0, 1),
        "zero_pp_rank_3_mp_rank_00_model_states": ("zero_model", 3, 0),
        "bf16_zero_pp_rank_2_mp_rank_01_optim_states": ("zero_optim", 2, 1),
        "layer_03-model_states": ("layer", 0, 0),
        "layer_03-model_01-model_states": ("layer", 0, 1),
        "layer_0_expert_2_mp_rank_00_model_states": ("expert", 0, 0),
        "expp_rank_1_mp_rank_00_optim_states": ("expert_optim", 0, 0),
    }
    for stem, (kind, dp, mp) in cases.items():
        name = parse_file_name(stem)
        assert name is not None and (name.kind, name.dp, name.mp) == (kind, dp, mp), stem
    assert parse_file_name("zero_to_fp32") is None


def test_import_refuses_pickles_before_reading_them(tmp_path: Path, store: ckstore.Store) -> None:
    folder = tmp_path / "ck"
    (folder / "global_step1").mkdir(parents=True)
    (folder / "latest").write_text("global_step1")
    (folder / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"not even a pickle")
    with pytest.raises(UnsupportedValueError, match="pickles"):
        import_folder(store, str(folder))
    (folder / "latest").write_text("../../etc")
    with pytest.raises(StoreConfigError, match="does not name a tag folder"):
        import_folder(store, str(folder), allow_pickle=True)
    assert store.checkpoints() == []


def test_export_writes_only_inside_the_folder(tmp_path: Path, store: ckstore.Store) -> None:
    t = torch.arange(4.0)
    store.commit(1, {0: {"mp_rank_00_model_states": {"module": {"w": t}}, "../../escape_model_states": {"w": t}}})
    out = tmp_path / "out"
    with pytest.raises(UnsupportedValueError, match="not plain file names"):
        export_folder(store, 1, str(out))
    assert not out.exists() and not (tmp_path / "escape_model_states.pt").exists()
    with pytest.raises(StoreConfigError, match="plain folder name"):
        export_folder(store, 1, str(out), tag="../x")
    store.commit(2, {0: {"mp_rank_00_model_states": {"module": {"w": t}}}})
    outside = tmp_path / "outside"
    outside.mkdir()
    out.mkdir()
    (out / "global_step2").symlink_to(outside)
    with pytest.raises(StoreConfigError, match="symbolic link"):
        export_folder(store, 2, str(out))
    (out / "global_step2").unlink()
    (out / "latest").symlink_to(outside / "latest-target")
    export_folder(store, 2, str(out))
    assert list(outside.iterdir()) == []  # the link at latest was replaced, not followed
    assert (out / "latest").read_text() == "global_step2" and not (out / "latest").is_symlink()
    assert torch.equal(torch.load(out / "global_step2" / "mp_rank_00_model_states.pt")["module"]["w"], t)


def test_export_takes_a_tag_that_is_no_string_as_deepspeed_does(tmp_path: Path, store: ckstore.Store) -> None:
    t = torch.arange(4.0)
    store.commit(2, {0: {"mp_rank_00_model_states": {"module": {"w": t}}}})
    export_folder(store, 2, str(tmp_path / "out"), tag=7)  # engine.save_checkpoint(dir, 7) writes dir/7
    assert (tmp_path / "out" / "latest").read_text() == "7"
    assert torch.equal(torch.load(tmp_path / "out" / "7" / "mp_rank_00_model_states.pt")["module"]["w"], t)


def test_import_follows_latest_to_a_tag_with_spaces(tmp_path: Path, store: ckstore.Store) -> None:
    folder = tmp_path / "ck"
    (folder / "epoch 3=final").mkdir(parents=True)  # engine.save_checkpoint(dir, "epoch 3=final")
    (folder / "latest").write_text("epoch 3=final")
    w = torch.arange(4.0)
    torch.save({"module": {"w": w}, "global_steps": 3}, folder / "epoch 3=final" / "mp_rank_00_model_states.pt")
    ck = import_folder(store, str(folder), allow_pickle=True)
    assert ck.step == 3 and torch.equal(store.checkout(ck.ref)[0]["mp_rank_00_model_states"]["module"]["w"], w)
    for bad in ("../x", "a/b", "..", ""):
        (folder / "latest").write_text(bad)
        with pytest.raises(StoreConfigError, match="does not name a tag folder"):
            import_folder(store, str(folder), allow_pickle=True)
