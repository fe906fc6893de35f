"""The profiling benchmarks time ckstore's own functions by wrapping them from outside; a rename
inside ckstore must not leave them crashing (timeline_commit.py) or silently timing less
(profile_commit.py). These tests load both scripts and check every function they wrap exists."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ckstore_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # module-level code only: main() runs under __main__
    return module


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])


def test_every_call_the_commit_timeline_traces_exists() -> None:
    timeline = _load("timeline_commit")
    absent = [f"{getattr(o, '__name__', o)}.{name}" for o, name, _ in timeline.TRACED if not hasattr(o, name)]
    assert not absent, f"timeline_commit.py traces functions ckstore no longer has: {absent}"
    tl = timeline.Timeline()
    tl.trace()
    try:
        assert len(tl._undo) == len(timeline.TRACED)
    finally:
        tl.untrace()


def test_the_stage_profiler_times_every_stage_it_names() -> None:
    profile = _load("profile_commit")
    timer = profile.StageTimer()
    profile.install(timer)
    try:
        assert timer.missing == [], f"profile_commit.py wraps functions ckstore no longer has: {timer.missing}"
    finally:
        timer.undo()
