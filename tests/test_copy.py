"""Copying checkpoints between stores: runs, metrics, tags and lineage; only missing chunks sent;
resumable after a real kill; local → S3 and back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_same
from services import S3Server

import ckstore
from ckstore.cli import main
from ckstore.errors import AlreadyExistsError
from ckstore.format import codec
from ckstore.retention import LatestN

SETTINGS = {"chunk_size": 4096, "pack_size": 64 * 1024}
REPO = Path(__file__).resolve().parent.parent


def _state(step: int) -> dict[int, dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(20_000, generator=g)  # every step shares it
    return {0: {"model_states": {"frozen": frozen, "head": torch.full((500,), float(step)), "step": step}}}


def build(path: Path) -> ckstore.Store:
    s = ckstore.open(path, run="a", **SETTINGS)
    for step in (1, 2, 3):
        s.commit(step, _state(step), {"loss": 1.0 / step}, kind="epoch", tags=["first"] if step == 1 else ())
    s.tag(2, "best")
    s.set_policy("a", LatestN(5))
    s.fork("a@2", "b")
    s.commit(10, _state(10), {"loss": 0.1}, run="b")
    return s


def meta(s: ckstore.Store) -> dict[str, Any]:
    keep = ("kind", "metrics", "tags", "ranks", "sub_keys", "parent", "logical_bytes", "world_layout")
    return {
        "checkpoints": {c.ref: {k: v for k, v in c.to_json().items() if k in keep} for c in s.checkpoints()},
        "lineage": {r.name: s.catalog.lineage(r.name) for r in s.runs()},
        "policies": {r.name: s.catalog.run_policy(r.name) for r in s.runs()},
    }


def test_copy_brings_runs_metrics_tags_and_lineage(tmp_path: Path) -> None:
    src = build(tmp_path / "src")
    dest = ckstore.open(tmp_path / "dest", **SETTINGS)
    seen: list[tuple[int, int, int]] = []
    rep = src.copy([], dest, run="a", progress=lambda *a: seen.append(a))
    rep_b = src.copy(["b@10"], dest)
    assert sorted(rep.copied) == ["a@1", "a@2", "a@3"] and rep_b.copied == ("b@10",)
    assert seen and seen[-1][0] == seen[-1][1] == rep.bytes_sent > 0
    assert rep_b.chunks_skipped > 0 and rep_b.bytes_sent < rep.bytes_sent  # the frozen tensor was there
    assert meta(dest) == meta(src)
    for c in src.checkpoints():
        assert_same(dest.load(dest.resolve(c.step, run=c.run)), src.load(c))
    assert dest.fsck(deep=True).ok and dest.fsck().records.ok  # type: ignore[union-attr]

    dest.blobs.stats.reset()
    again = src.copy([], dest, run="a")
    assert again.copied == () and sorted(again.present) == ["a@1", "a@2", "a@3"]
    assert again.bytes_sent == 0 and dest.blobs.stats.snapshot()["bytes_written"] == 0

    src.commit(3, _state(33), run="x")
    dest.commit(3, _state(99), run="x")
    with pytest.raises(AlreadyExistsError, match="other content"):  # never overwritten
        src.copy(["x@3"], dest)
    assert_same(dest.checkout("x@3"), _state(99))
    src.close()
    dest.close()


def test_cli_copy(tmp_path: Path) -> None:
    build(tmp_path / "src").close()
    res = CliRunner().invoke(main, ["--store", str(tmp_path / "src"), "copy", "--run", "a", "--to", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    assert "copied 3 checkpoints" in res.output
    res = CliRunner().invoke(main, ["--store", str(tmp_path / "src"), "copy", "a@1", "--to", str(tmp_path / "d")])
    assert res.exit_code == 0 and "copied 0 checkpoints (1 were already there)" in res.output, res.output


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import ckstore
    src, dest = ckstore.open(sys.argv[1]), ckstore.open(sys.argv[2])
    def progress(sent, total, skipped):
        if sent > 4 * 64 * 1024:  # a few packs are durable: die without any cleanup
            os.kill(os.getpid(), signal.SIGKILL)
    src.copy(["big@1"], dest, progress=progress)
    """
)


def test_copy_resumes_after_a_kill(tmp_path: Path) -> None:
    src = ckstore.open(tmp_path / "src", run="big", **SETTINGS)
    big = {0: {"m": {"w": torch.randn(400_000)}}}  # 1.6 MB, about 25 packs
    src.commit(1, big)
    dest = ckstore.open(tmp_path / "dest", **SETTINGS)
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(tmp_path / "src"), str(tmp_path / "dest")],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert dest.checkpoints() == [] and len(dest.catalog.pending()) == 1  # consistent: nothing visible
    assert dest.fsck().ok
    arrived = dest.catalog.stored_bytes()  # the packs the killed copy finished are recorded
    assert arrived > 0
    rep = src.copy(["big@1"], dest)
    assert rep.copied == ("big@1",) and rep.chunks_skipped > 0 and rep.bytes_skipped == arrived  # not sent again
    assert rep.bytes_sent + rep.bytes_skipped == src.catalog.stored_bytes()
    assert_same(dest.checkout("big@1"), big)
    dest.gc(grace=0)
    assert dest.fsck(deep=True).ok
    src.close()
    dest.close()


def test_copy_local_to_s3_and_back(tmp_path: Path, s3_server: S3Server, s3_bucket: str, pg_catalog_url: str) -> None:
    src = build(tmp_path / "src")
    loc = f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}"
    remote = ckstore.open(loc, catalog=pg_catalog_url, storage_options=s3_server.storage_options(), **SETTINGS)
    first = src.copy([], remote, run="a")
    assert len(first.copied) == 3 and remote.blobs.stats.snapshot()["bytes_written"] >= first.bytes_sent > 0
    src.copy(["b@10"], remote)
    assert meta(remote) == meta(src)

    back = ckstore.open(tmp_path / "back", **SETTINGS)
    remote.copy([], back, run="a")
    remote.copy([], back, run="b")
    assert meta(back) == meta(src)
    for c in src.checkpoints():
        assert_same(back.load(back.resolve(c.step, run=c.run)), src.load(c))

    src.blobs.stats.reset()
    home = remote.copy([], src, run="a")  # back into the store it came from: nothing to send
    assert home.copied == () and home.bytes_sent == 0 and src.blobs.stats.snapshot()["bytes_written"] == 0
    remote.blobs.stats.reset()
    second = src.copy([], remote, run="a")
    assert second.bytes_sent == 0 and remote.blobs.stats.snapshot()["bytes_written"] == 0
    for s in (src, remote, back):
        s.close()


def test_a_delta_is_sent_at_the_destinations_level_and_progress_ends_at_its_total(tmp_path: Path) -> None:
    """A delta travels as a whole chunk encoded again: at the destination's compression level (it
    was the source's), and counted in the progress by its stored length (the figure ran past the
    total it was counted against)."""
    src = ckstore.open(tmp_path / "src", run="r", delta_chain=2, **SETTINGS)
    w = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    src.commit(1, {0: {"m": {"w": w}}})
    src.commit(2, {0: {"m": {"w": w + 1e-4}}})
    order = src.manifests(src.resolve(2))[(0, "m")].tensors[0].chunks  # w's chunks, in order
    locs = src.catalog.chunk_locations(order)
    deltas = [i for i, d in enumerate(order) if locs[d].base is not None]
    assert deltas  # step 2 holds deltas
    dest = ckstore.open(tmp_path / "dest", compression_level=19, **SETTINGS)
    seen: list[tuple[int, int, int]] = []
    src.copy(["r@2"], dest, progress=lambda *a: seen.append(a))
    total = seen[0][1]
    assert total == sum(loc.length for loc in locs.values())
    assert all(done <= t == total for done, t, _ in seen) and seen[-1][0] == total
    raw = dest.checkout("r@2")[0]["m"]["w"]
    assert_same(raw, w + 1e-4)
    got = dest.catalog.chunk_locations(order)
    size = SETTINGS["chunk_size"]
    for i in deltas:
        chunk = raw.view(torch.uint8)[i * size : (i + 1) * size].numpy()
        assert got[order[i]].length == codec.encode(memoryview(chunk), 4, 19).length, i
    src.close()
    dest.close()
