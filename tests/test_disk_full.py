"""A commit into a file system that fills up mid-write (a real, small tmpfs)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_same

import ckstore
from ckstore.errors import CkstoreError
from ckstore.format.record import CHECKPOINTS_PREFIX


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_commit_into_a_full_file_system_fails_cleanly(small_fs: Path, tmp_path: Path) -> None:
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"  # the catalog lives elsewhere; the packs fill the disk
    s = ckstore.open(small_fs / "store", catalog=catalog, run="a", chunk_size=256 * 1024, pack_size=1 << 20)
    first = {0: {"m": {"w": torch.randn(100_000)}}}
    s.commit(1, first, {"loss": 1.0})
    used_before = sum(f.stat().st_size for f in (small_fs / "store").rglob("*") if f.is_file())

    big = {0: {"m": {"w": torch.randn(4_000_000)}}}  # 16 MB of incompressible floats into 8 MB
    with pytest.raises(CkstoreError, match=r"(?i)space|full|ENOSPC|errno 28"):
        s.commit(2, big)
    assert [c.step for c in s.checkpoints()] == [1]  # nothing of step 2 is visible
    assert_same(s.checkout(1), first)
    used_after_fail = sum(f.stat().st_size for f in (small_fs / "store").rglob("*") if f.is_file())
    assert used_after_fail > used_before  # the failed commit did write packs

    rep = s.gc(grace=0)
    assert rep.packs_deleted + len(rep.orphans_deleted) + rep.temp_files_deleted > 0
    used_after_gc = sum(f.stat().st_size for f in (small_fs / "store").rglob("*") if f.is_file())
    assert used_after_gc <= used_before
    # the failed commit's packs were deleted, not kept for recycling: the disk was nearly full
    assert s.blobs.recycle_bytes > 0 and s.blobs.recycled() == (0, 0) and s.blobs.stats.recycled == 0
    assert len(list(s.blobs.list(CHECKPOINTS_PREFIX))) == 1
    assert s.fsck(deep=True).ok
    assert_same(s.checkout(1), first)
    s.commit(2, {0: {"m": {"w": torch.randn(1000)}}})  # the store works again once there is room
    s.close()


def test_a_full_disk_gets_the_space_recycled_files_hold(small_fs: Path, tmp_path: Path) -> None:
    """gc kept a released pack's file while the disk had room; a commit then fills the disk: the
    failed write deletes the recycled files, so the retry has their space."""
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    s = ckstore.open(small_fs / "store", catalog=catalog, run="a", chunk_size=256 * 1024, pack_size=1 << 20,
                     recycle_bytes=1 << 20)  # fmt: skip
    s.commit(1, {0: {"m": {"w": torch.randn(100_000)}}})
    s.commit(2, {0: {"m": {"w": torch.randn(100_000)}}})
    s.delete(1)
    s.gc(grace=0)
    files, size = s.blobs.recycled()
    assert files >= 1 and size > 0  # kept: the disk had room

    with pytest.raises(CkstoreError, match=r"(?i)space|full|ENOSPC|errno 28"):
        s.commit(3, {0: {"m": {"w": torch.randn(4_000_000)}}})
    assert s.blobs.recycled() == (0, 0)  # given back by the failed write
    s.gc(grace=0)
    s.commit(3, {0: {"m": {"w": torch.randn(100_000)}}})
    assert [c.step for c in s.checkpoints()] == [2, 3] and s.fsck(deep=True).ok
    s.close()
