"""Side by side with timm's own CheckpointSaver: the same calls into a folder and into a store keep
the same epochs, return the same bests, point ``last``/``model_best`` at the same epochs and keep
as many recovery and milestone checkpoints. Needs timm (scripts/test runs this folder in
.venv-timm, where timm and PyPI's torch and torchvision are installed)."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckstore
from ckstore.integrations import timm as cktimm

if os.environ.get("CKSTORE_REQUIRE_TIMM") == "1":
    import timm  # a missing timm fails the run
else:
    timm = pytest.importorskip("timm")
from timm.models import resume_checkpoint as timm_resume  # noqa: E402
from timm.utils import CheckpointSaver as TimmSaver  # noqa: E402

Op = tuple[str, Any]


def _file_epoch(path: str) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])


def _numbered(folder: Path, prefix: str) -> list[str]:
    return sorted(glob.glob(str(folder / f"{prefix}-*.pth.tar")))


class Pair:
    """timm's saver on a folder and ours on a store, fed the same calls."""

    def __init__(self, root: Path, max_history: int, decreasing: bool) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.dir = root / "timm"
        self.dir.mkdir()
        self.store = ckstore.open(root / "store", run="exp", chunk_size=4096, pack_size=1 << 20)
        self.kw = dict(max_history=max_history, decreasing=decreasing)
        self.theirs = self._timm()
        self.ours = cktimm.CheckpointSaver(self.model, self.opt, store=self.store, **self.kw)
        self.restarted = False

    def _timm(self) -> Any:
        d = str(self.dir)
        return TimmSaver(self.model, self.opt, checkpoint_dir=d, recovery_dir=d, **self.kw)

    def restart(self) -> None:
        """Both savers start again and take their history over from ``last``."""
        self.theirs = self._timm()
        assert self.theirs.load_state_dict_from_checkpoint(str(self.dir / "last.pth.tar"))
        self.ours = cktimm.CheckpointSaver(self.model, self.opt, store=self.store, **self.kw)
        assert self.ours.load_state_dict_from_checkpoint("last")
        self.restarted = True

    def check(self) -> None:
        theirs_kept = [int(re.search(r"checkpoint-(\d+)\.pth\.tar$", f).group(1)) for f, _ in self.theirs.checkpoint_files]  # type: ignore[union-attr]
        ours_kept = [int(self.store.resolve(r).metrics["epoch"]) for r, _ in self.ours.checkpoint_files]
        assert ours_kept == theirs_kept
        assert [m for _, m in self.ours.checkpoint_files] == [m for _, m in self.theirs.checkpoint_files]
        assert (self.ours.best_metric, self.ours.best_epoch) == (self.theirs.best_metric, self.theirs.best_epoch)
        cks = self.store.checkpoints("exp") if self.store.runs() else []
        tagged = {t: int(c.metrics["epoch"]) for c in cks for t in c.tags}
        for name in ("last", "model_best"):
            path = self.dir / f"{name}.pth.tar"
            assert tagged.get(name) == (_file_epoch(str(path)) if path.exists() else None), name
        # every epoch timm still has a file for, and no other
        files = {int(re.search(r"-(\d+)\.pth", f).group(1)) for f in _numbered(self.dir, "checkpoint")}  # type: ignore[union-attr]
        files |= {tagged[t] for t in ("last", "model_best") if t in tagged}
        assert sorted(int(c.metrics["epoch"]) for c in cks if c.kind == "epoch") == sorted(files)
        milestones = {int(re.search(r"milestone-(\d+)", f).group(1)) for f in _numbered(self.dir, "milestone")}  # type: ignore[union-attr]
        assert {int(t.split("-")[1]) for t in tagged if t.startswith("milestone-")} == milestones
        assert sum(c.kind == "milestone" for c in cks) == len(milestones)
        if not self.restarted:  # a restarted timm saver forgets its recovery files; ours does not
            assert sum(c.kind == "recovery" for c in cks) == len(_numbered(self.dir, "recovery"))


def _ops() -> st.SearchStrategy[list[Op]]:
    metric = st.one_of(st.none(), st.sampled_from([0.1, 0.2, 0.2, 0.3, 0.5, 0.8]))
    op = st.one_of(
        st.tuples(st.just("epoch"), metric),
        st.tuples(st.just("epoch"), metric),
        st.tuples(st.just("recovery"), st.none()),
        st.tuples(st.just("milestone"), st.none()),
        st.tuples(st.just("restart"), st.none()),
    )
    return st.lists(op, min_size=1, max_size=14)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=_ops(), max_history=st.integers(1, 4), decreasing=st.booleans())
def test_same_calls_keep_the_same_checkpoints(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Op], max_history: int, decreasing: bool
) -> None:
    pair = Pair(tmp_path_factory.mktemp("pair"), max_history, decreasing)
    epoch, batch, milestone_done = -1, 0, True
    for kind, metric in ops:
        if kind == "epoch":
            epoch += 1
            with torch.no_grad():
                pair.model.weight.add_(0.01)
            assert pair.ours.save_checkpoint(epoch, metric) == pair.theirs.save_checkpoint(epoch, metric)
            milestone_done = False
        elif kind == "recovery":
            batch += 1  # distinct file names, as in training
            pair.theirs.save_recovery(max(epoch, 0), batch)
            pair.ours.save_recovery(max(epoch, 0), batch)
        elif kind == "milestone" and not milestone_done:
            pair.theirs.save_milestone(epoch + 1)
            pair.ours.save_milestone(epoch + 1)
            milestone_done = True
        elif kind == "restart" and epoch >= 0:
            pair.restart()
        pair.check()


def test_resume_matches_timms_resume(tmp_path: Path) -> None:
    pair = Pair(tmp_path, 2, False)
    x = torch.randn(8, 4)
    for epoch in range(3):
        pair.opt.zero_grad()
        pair.model(x).square().mean().backward()
        pair.opt.step()
        pair.theirs.save_checkpoint(epoch, 0.1 * epoch)
        pair.ours.save_checkpoint(epoch, 0.1 * epoch)
    results = []
    for resume in (lambda m, o: timm_resume(m, str(pair.dir / "last.pth.tar"), o),
                   lambda m, o: cktimm.resume_checkpoint(m, pair.store, "last", o)):  # fmt: skip
        torch.manual_seed(5)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        start = resume(model, opt)
        results.append((start, model.state_dict(), opt.state_dict()))
    (s1, m1, o1), (s2, m2, o2) = results
    assert s1 == s2 == 3
    assert all(torch.equal(m1[k], m2[k]) for k in m1)
    assert all(torch.equal(o1["state"][i]["momentum_buffer"], o2["state"][i]["momentum_buffer"]) for i in o1["state"])
    assert o1["param_groups"] == o2["param_groups"]


def test_timm_reads_the_same_checkpoint_dict(tmp_path: Path) -> None:
    """checkpoint_dict gives the keys and values timm's file holds (args as plain values)."""
    import argparse

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = argparse.Namespace(model="linear", eval_metric="top1", lr=0.1)
    TimmSaver(model, opt, args, checkpoint_dir=str(tmp_path)).save_checkpoint(0, 0.7)
    store = ckstore.open(tmp_path / "store", run="exp")
    cktimm.CheckpointSaver(model, opt, args, store=store).save_checkpoint(0, 0.7)
    theirs = torch.load(tmp_path / "last.pth.tar", map_location="cpu", weights_only=False)
    ours = cktimm.checkpoint_dict(store, "last")
    assert set(ours) == set(theirs)
    assert vars(ours["args"]) == vars(theirs["args"])
    for key in ("epoch", "arch", "version", "metric"):
        assert ours[key] == theirs[key]
    assert all(torch.equal(ours["state_dict"][k], v) for k, v in theirs["state_dict"].items())
    assert store.resolve("last").metrics == {"epoch": 0.0, "top1": 0.7}
