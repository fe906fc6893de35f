"""A local store recycles the pack files gc releases: later packs are written over them.

Real files throughout: inode numbers prove which file a pack was written into, a real flock
stands for another claimer, a real hard link for a user's ``cp -al`` backup, and a real SIGKILL
lands while a commit writes over a recycled file.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_same

import ckstore
from ckstore.blobstore import BlobNotFoundError, LocalBlobStore
from ckstore.blobstore._recycle import RECYCLE_FILES, check_unreleased
from ckstore.cli import main
from ckstore.errors import StoreConfigError
from ckstore.maintenance.retention import LatestN

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _free(blobs: LocalBlobStore) -> list[Path]:
    return sorted((Path(blobs.root) / "tmp").glob("*.free"))


def _ino(path: str | Path) -> int:
    return os.stat(path).st_ino


def test_a_released_pack_file_is_written_over_by_the_next_pack(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "b")
    first = os.urandom(MiB)
    blobs.put("packs/aa/a", first)
    ino = _ino(blobs._path("packs/aa/a"))

    blobs.delete(["packs/aa/a"])
    assert not blobs.exists("packs/aa/a")
    (free,) = _free(blobs)
    assert _ino(free) == ino and blobs.recycled() == (1, MiB)
    assert blobs.stats.recycled == 1

    shorter = os.urandom(300_000)  # truncated to its own length
    blobs.put("packs/bb/b", shorter)
    assert _ino(blobs._path("packs/bb/b")) == ino and blobs.stats.reused == 1
    assert blobs.read("packs/bb/b") == shorter and os.path.getsize(blobs._path("packs/bb/b")) == 300_000
    assert _free(blobs) == [] and blobs.recycled() == (0, 0)

    blobs.delete(["packs/bb/b"])
    longer = os.urandom(2 * MiB)  # grows past its old length
    with blobs.writer("packs/cc/c") as w:
        for i in range(0, len(longer), 100_000):
            w.write(longer[i : i + 100_000])
    assert _ino(blobs._path("packs/cc/c")) == ino and blobs.read("packs/cc/c") == longer
    assert list((Path(blobs.root) / "tmp").iterdir()) == []


def test_records_are_neither_recycled_nor_written_over_a_recycled_file(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "b")
    blobs.put("records/checkpoints/aa/r1", b"r" * 10_000)
    blobs.delete(["records/checkpoints/aa/r1"])
    assert _free(blobs) == [] and blobs.stats.recycled == 0

    blobs.put("packs/aa/a", os.urandom(100_000))
    blobs.delete(["packs/aa/a"])
    (free,) = _free(blobs)
    blobs.put("records/checkpoints/aa/r2", b"record")
    assert _free(blobs) == [free] and blobs.stats.reused == 0


def test_recycling_keeps_to_its_bounds(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "b", recycle_bytes=int(2.5 * MiB))
    keys = [f"packs/aa/{i}" for i in range(4)]
    for k in keys:
        blobs.put(k, os.urandom(MiB))
    blobs.delete(keys)
    assert blobs.recycled() == (2, 2 * MiB) and not any(blobs.exists(k) for k in keys)

    small = LocalBlobStore(tmp_path / "s")
    keys = [f"packs/bb/{i}" for i in range(RECYCLE_FILES + 6)]
    for k in keys:
        small.put(k, b"x" * 100)
    small.delete(keys)
    assert small.recycled() == (RECYCLE_FILES, RECYCLE_FILES * 100)

    off = LocalBlobStore(tmp_path / "o", recycle_bytes=0)
    off.put("packs/aa/a", b"x" * 1000)
    off.delete(["packs/aa/a"])
    assert off.recycled() == (0, 0) and list((Path(off.root) / "tmp").iterdir()) == []


def test_a_process_that_only_deletes_recycles_too(tmp_path: Path) -> None:
    """gc in a process of its own has written nothing: it tries a lock on a temp file first."""
    LocalBlobStore(tmp_path / "b").put("packs/aa/a", os.urandom(MiB))
    gc_only = LocalBlobStore(tmp_path / "b")
    gc_only.delete(["packs/aa/a"])
    assert gc_only.recycled() == (1, MiB) and gc_only.stats.recycled == 1
    assert [p.suffix for p in (tmp_path / "b" / "tmp").iterdir()] == [".free"]  # the probe left nothing


def test_the_sweep_deletes_recycled_files_beyond_the_bound(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "b")
    for i in range(3):
        blobs.put(f"packs/aa/{i}", os.urandom(MiB))
    blobs.delete([f"packs/aa/{i}" for i in range(3)])
    assert blobs.recycled() == (3, 3 * MiB)
    assert blobs.stale_temp_files(time.time() + 60) == []  # within the bound: not stale, at any age

    blobs.recycle_bytes = MiB + 1
    stale = blobs.stale_temp_files(0)  # beyond the bound: stale at any age
    assert len(stale) == 2 and blobs.discard_temp_files(stale) == 2
    assert blobs.recycled() == (1, MiB)
    blobs.recycle_bytes = 0
    assert blobs.discard_temp_files(blobs.stale_temp_files(0)) == 1
    assert list((Path(blobs.root) / "tmp").iterdir()) == []


def test_a_pack_file_with_another_hard_link_is_never_written_over(tmp_path: Path) -> None:
    """A ``cp -al`` backup shares the store's files: its copy must keep its bytes, whether the
    link was there when gc released the pack or made afterwards (a backup of ``tmp/`` too)."""
    blobs = LocalBlobStore(tmp_path / "b")
    data = os.urandom(MiB)
    blobs.put("packs/aa/a", data)
    backup = tmp_path / "backup-a"
    os.link(blobs._path("packs/aa/a"), backup)
    blobs.delete(["packs/aa/a"])
    assert _free(blobs) == [] and not blobs.exists("packs/aa/a")

    blobs.put("packs/aa/b", os.urandom(MiB))
    blobs.delete(["packs/aa/b"])
    (free,) = _free(blobs)
    later = tmp_path / "backup-b"
    os.link(free, later)
    kept = later.read_bytes()
    blobs.put("packs/aa/c", os.urandom(MiB))
    assert _ino(blobs._path("packs/aa/c")) not in (_ino(backup), _ino(later))
    assert backup.read_bytes() == data and later.read_bytes() == kept
    assert _free(blobs) == []  # the linked file lost its name in tmp/, not its bytes


def test_two_writers_never_share_a_recycled_file(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "b")
    blobs.put("packs/aa/a", os.urandom(MiB))
    blobs.delete(["packs/aa/a"])
    (free,) = _free(blobs)
    free_ino = _ino(free)
    fd = os.open(free, os.O_RDWR)  # another writer claiming it holds its lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        blobs.put("packs/bb/b", b"fresh")
        assert _ino(blobs._path("packs/bb/b")) != _ino(free) and blobs.stats.reused == 0
        assert _free(blobs) == [free]
        assert blobs.stale_temp_files(0) == []  # nor does the sweep take it
    finally:
        os.close(fd)
    blobs.put("packs/cc/c", b"reused")
    assert _ino(blobs._path("packs/cc/c")) == free_ino and blobs.stats.reused == 1

    # many writers at once over a few recycled files: each file goes to one writer
    for i in range(4):
        blobs.put(f"packs/dd/{i}", os.urandom(200_000))
    blobs.delete([f"packs/dd/{i}" for i in range(4)])
    datas = {f"packs/ee/{i}": os.urandom(150_000 + i) for i in range(12)}
    threads = [threading.Thread(target=blobs.put, args=(k, d)) for k, d in datas.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(blobs.read(k) == d for k, d in datas.items())
    assert len({_ino(blobs._path(k)) for k in datas}) == len(datas)
    assert blobs.stats.reused == 5 and _free(blobs) == []


def test_a_read_overlapping_a_release_never_returns_a_later_packs_bytes(tmp_path: Path) -> None:
    """Between a reader's open and its read, gc releases the object and a commit writes its next
    pack over the file: the read gets that pack's bytes (the hazard is real), and raises
    not-found instead of returning them."""

    class Raced(LocalBlobStore):
        def _pread(self, fd: int, out: memoryview, offset: int) -> int:
            if not raced:
                raced.append(True)
                self.delete(["packs/aa/old"])
                self.put("packs/bb/new", new)
            return super()._pread(fd, out, offset)

    raced: list[bool] = []
    blobs = Raced(tmp_path / "b")
    old, new = os.urandom(4096), os.urandom(4096)
    blobs.put("packs/aa/old", old)
    buf = bytearray(4096)
    with pytest.raises(BlobNotFoundError, match="'packs/aa/old' .* was deleted while it was being read"):
        blobs.read_into("packs/aa/old", 0, memoryview(buf))
    assert raced and blobs.stats.reused == 1 and bytes(buf) == new

    blobs.put("packs/cc/kept", old)  # with nothing racing, the same read returns the bytes
    blobs.read_into("packs/cc/kept", 0, memoryview(buf))
    assert bytes(buf) == old

    path = blobs._path("packs/cc/kept")  # and reads of whole objects check the same way
    fd = os.open(path, os.O_RDONLY)
    try:
        check_unreleased(path, fd, "packs/cc/kept", blobs.url)
        blobs.delete(["packs/cc/kept"])
        with pytest.raises(BlobNotFoundError):
            check_unreleased(path, fd, "packs/cc/kept", blobs.url)
    finally:
        os.close(fd)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(128, 256, generator=g) for i in range(6)}


def test_training_with_gc_every_step_writes_its_packs_over_released_files(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with ckstore.open(path, run="r", chunk_size=64 * 1024, pack_size=256 * 1024) as s:
        for step in range(12):
            s.commit(step, {0: {"model_states": _state(step)}})
            report = s.gc(LatestN(3), grace=3600)
        assert s.blobs.stats.reused > 0 and s.blobs.stats.recycled > 0
        assert report.recycled_files > 0 and report.recycled_bytes > 0
        assert [c.step for c in s.checkpoints()] == [9, 10, 11]
        for step in (9, 10, 11):
            assert_same(s.checkout(step)[0]["model_states"], _state(step))
        assert s.fsck(deep=True).ok
        du = s.du()
        assert (du.recycled_files, du.recycled_bytes) == s.blobs.recycled() != (0, 0)

    # a check counts them as kept, not stale; `ckstore gc` deletes the files a training process kept
    res = CliRunner().invoke(main, ["--store", str(path), "fsck", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["temp_files"] == []
    res = CliRunner().invoke(main, ["--store", str(path), "du"])
    assert res.exit_code == 0 and "kept for later commits to write over" in res.output
    res = CliRunner().invoke(main, ["--store", str(path), "gc", "--json"])
    assert res.exit_code == 0, res.output
    assert list((path / "tmp").glob("*.free")) == []
    with ckstore.open(path, run="r") as s:
        assert s.du().recycled_files == 0
        for step in (9, 10, 11):
            assert_same(s.checkout(step)[0]["model_states"], _state(step))


def test_recycle_bytes_is_checked(tmp_path: Path) -> None:
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(StoreConfigError, match="recycle_bytes must be"):
            ckstore.open(tmp_path / "s", recycle_bytes=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()
    with pytest.raises(StoreConfigError, match="applies to local folders"):
        ckstore.open("s3://bucket/x", catalog="sqlite://", recycle_bytes=MiB)
    with ckstore.open(tmp_path / "s", recycle_bytes=0) as s:
        assert s.blobs.recycle_bytes == 0


def test_a_commit_killed_while_writing_over_a_recycled_file_leaves_the_store_whole(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with ckstore.open(path, run="r", chunk_size=64 * 1024, pack_size=4 * MiB) as s:
        s.commit(1, {0: {"model_states": _state(1)}})
        s.commit(2, {0: {"model_states": _state(2)}})
        s.gc(LatestN(1))
        (free,) = (path / "tmp").glob("*.free")
        ino, old = _ino(free), free.read_bytes()
    script = f"""
        import torch, ckstore
        g = torch.Generator().manual_seed(3)
        state = {{f"w{{i}}": torch.randn(512, 1024, generator=g) for i in range(4)}}
        with ckstore.open({str(path)!r}, run="r") as s:
            s.commit(3, {{0: {{"model_states": state}}}})
        """
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CKSTORE_CRASH_AT="pack.mid")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -9 and b"ckstore crash point: pack.mid" in proc.stderr, proc.stderr[-2000:]
    # it died mid-write in the recycled file: that file is now one of its half-written temp files
    parts = {_ino(p): p for p in (path / "tmp").glob("*.part")}
    assert ino in parts and parts[ino].read_bytes()[:4096] != old[:4096]
    assert list((path / "tmp").glob("*.free")) == []

    with ckstore.open(path, run="r") as s:
        assert [c.step for c in s.checkpoints()] == [2]
        assert_same(s.checkout(2)[0]["model_states"], _state(2))
        assert s.fsck(deep=True).ok
        report = s.gc(grace=0)
        assert report.temp_files_deleted == len(parts) and not any(p.exists() for p in parts.values())
        s.commit(3, {0: {"model_states": _state(3)}})
        assert_same(s.checkout(3)[0]["model_states"], _state(3))


def test_a_pack_takes_the_recycled_file_that_fits_it_best(tmp_path: Path) -> None:
    """A commit's small-chunk pack takes a small released file and its large pack a large one:
    neither truncates much nor grows much (a pack opened on a large frame hints the pack size,
    on a small one nothing; a put hints its length)."""
    from ckstore.format.codec import encode
    from ckstore.format.hashing import digest as chunk_digest
    from ckstore.format.pack import PackWriter

    blobs = LocalBlobStore(tmp_path / "b")
    sizes = {"packs/aa/small": 20_000, "packs/aa/mid": 400_000, "packs/aa/large": 3 * MiB}
    for k, n in sizes.items():
        blobs.put(k, os.urandom(n))
    inos = {k: _ino(blobs._path(k)) for k in sizes}
    blobs.delete(list(sizes))

    blobs.put("packs/bb/p", os.urandom(300_000))  # the smallest file at least that long
    assert _ino(blobs._path("packs/bb/p")) == inos["packs/aa/mid"]

    keys = iter(["packs/cc/small-chunks", "packs/cc/large-chunks"])
    writer = PackWriter(blobs, 4 * MiB, lambda: (next(keys), None), lambda *a: None)
    for i in range(3):  # tiny frames first, as a commit writes its small chunks
        raw = os.urandom(1000 + i)
        writer.add(chunk_digest(raw), encode(memoryview(raw), 4, 1), len(raw))
    writer.seal()
    raw = os.urandom(2 * MiB)
    writer.add(chunk_digest(raw), encode(memoryview(raw), 4, 1), len(raw))
    writer.close()
    assert _ino(blobs._path("packs/cc/small-chunks")) == inos["packs/aa/small"]
    assert _ino(blobs._path("packs/cc/large-chunks")) == inos["packs/aa/large"]
    assert blobs.stats.reused == 3


def test_a_tmp_folder_replaced_by_a_link_is_neither_recycled_into_nor_swept(tmp_path: Path) -> None:
    """A link put in the store in place of ``tmp/`` must not lead a writer to overwrite, nor gc
    to delete, the files it points at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.free").write_bytes(b"p" * 100_000)
    (outside / "old.part").write_bytes(b"o" * 1000)
    os.utime(outside / "old.part", (0, 0))
    blobs = LocalBlobStore(tmp_path / "b")
    os.makedirs(Path(blobs.root), exist_ok=True)
    os.symlink(outside, Path(blobs.root) / "tmp")

    assert blobs.recycled() == (0, 0) and blobs.stale_temp_files(time.time() + 60) == []
    blobs.recycle_bytes = 0
    assert blobs.stale_temp_files(time.time() + 60) == []
    blobs.put("packs/aa/a", b"new pack")
    blobs.delete(["packs/aa/a"])
    assert (outside / "precious.free").read_bytes() == b"p" * 100_000 and (outside / "old.part").exists()
    assert blobs.discard_temp_files([str(Path(blobs.root) / "tmp" / "old.part")]) == 0
    assert (outside / "old.part").exists()


def test_a_claimed_file_is_stamped_and_odd_entries_are_skipped(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "b")
    blobs.put("packs/aa/a", os.urandom(100_000))
    os.utime(blobs._path("packs/aa/a"), (0, 0))  # written long ago
    blobs.delete(["packs/aa/a"])
    tmp = Path(blobs.root) / "tmp"
    (tmp / "dir.free").mkdir()  # entries that are no recycled files: never taken, never break gc
    os.symlink(tmp_path / "nowhere", tmp / "link.free")
    (tmp / "empty.free").write_bytes(b"")
    assert blobs.recycled() == (2, 100_000)
    with blobs.writer("packs/bb/b", 100_000) as w:
        (part,) = tmp.glob("*.part")
        assert time.time() - part.stat().st_mtime < 3600  # the sweep's grace runs from the claim
        w.write(b"x" * 1000)
    assert blobs.stats.reused == 1
    blobs.recycle_bytes = 0
    stale = blobs.stale_temp_files(0)
    assert stale == [str(tmp / "empty.free")] and blobs.discard_temp_files(stale) == 1
    assert (tmp / "dir.free").is_dir() and (tmp / "link.free").is_symlink()
