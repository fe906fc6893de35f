"""Delta chunks (``ckstore.open(..., delta_chain=N)``): a changed chunk stored as its XOR with the
same chunk of the previous commit; every reader decodes through its bases, and gc, fsck, copy,
repack and recovery keep the bases a delta needs."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_clean, assert_same
from services import S3Server
from sqlalchemy import text

import ckstore
from ckstore.config import MAX_DELTA_CHAIN
from ckstore.errors import CkstoreError, IntegrityError
from ckstore.format import codec, hashing
from ckstore.format.manifest import Manifest
from ckstore.retention import LatestN

SETTINGS = {"chunk_size": 64 * 1024, "pack_size": 1 << 20}


def _states(steps: int, seed: int = 0) -> list[dict[int, dict[str, Any]]]:
    """A model and its optimizer moments drifting a little each step, as training does."""
    g = torch.Generator().manual_seed(seed)
    w, m = torch.randn(40_000, generator=g), torch.randn(20_000, generator=g).abs()
    out = []
    for step in range(steps):
        w = w + 1e-4 * torch.randn(w.shape, generator=g)
        m = m * 0.999 + 1e-6 * torch.randn(m.shape, generator=g).abs()
        out.append({0: {"model": {"w": w.clone(), "bias": torch.full((8,), float(step))}, "optim": {"m": m.clone()}}})
    return out


def _rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path / "catalog.db") as conn:
        return conn.execute(sql).fetchall()


def _deltas(path: Path) -> list[tuple[bytes, bytes, int]]:
    return [(bytes(d), bytes(b), c) for d, b, c in _rows(path, "SELECT digest, base, chain FROM chunks WHERE codec = 3")]


def _two_steps(path: Path) -> tuple[ckstore.Store, bytes, bytes]:
    """A store at ``path`` with steps 0 and 1 committed as deltas: it, and a delta of step 1 and its base."""
    s = ckstore.open(path, run="r", delta_chain=2, **SETTINGS)
    for step, st in enumerate(_states(2)):
        s.commit(step, st)
    digest, base, _ = _deltas(path)[0]
    return s, digest, base


def _stored(path: Path) -> int:
    return int(_rows(path, "SELECT coalesce(sum(length), 0) FROM chunks")[0][0])


def test_delta_frames_round_trip_and_need_their_base() -> None:
    g = np.random.default_rng(0)
    base = g.standard_normal(1 << 16).astype(np.float32)
    new = base + np.float32(1e-4) * g.standard_normal(base.size).astype(np.float32)
    raw, braw = new.view(np.uint8).data, base.view(np.uint8).data
    frame = codec.encode_delta(raw, braw, hashing.digest(braw), 4)
    data = b"".join(frame.parts)
    assert frame.codec == codec.CODEC_DELTA and frame.length == len(data)
    assert frame.length < 0.6 * codec.encode(raw, 4).length  # what the delta is for
    assert codec.delta_base(data) == hashing.digest(braw) and codec.delta_itemsize(data) == 4
    with pytest.raises(IntegrityError, match="without its base"):
        codec.decode_into(data, np.empty(new.nbytes, dtype=np.uint8).data)
    # in place, as a chain decodes: the base's bytes become the delta's chunk
    inplace, scratch = base.view(np.uint8).copy(), np.empty(new.nbytes, dtype=np.uint8)
    codec.apply_delta(data, inplace.data, scratch.data)
    assert inplace.tobytes() == new.tobytes()
    whole = b"".join(codec.encode(raw, 4).parts)
    assert codec.delta_base(whole) is None
    with pytest.raises(IntegrityError, match="not a delta"):
        codec.apply_delta(whole, inplace.data, scratch.data)
    with pytest.raises(IntegrityError, match="raw bytes, expected"):
        codec.apply_delta(data, inplace.data, scratch[:-4].data)
    with pytest.raises(IntegrityError, match="raw bytes, expected"):  # a base of another length
        codec.apply_delta(data, inplace[:-4].data, scratch.data)
    nested = data[: codec.DELTA_OVERHEAD] + data  # a delta frame inside a delta frame
    with pytest.raises(IntegrityError, match="another delta"):
        codec.apply_delta(nested, inplace.data, scratch.data)


def test_deltas_store_fewer_bytes_and_every_step_checks_out(tmp_path: Path) -> None:
    states = _states(9)
    plain = ckstore.open(tmp_path / "plain", run="r", **SETTINGS)
    delta = ckstore.open(tmp_path / "delta", run="r", delta_chain=3, **SETTINGS)
    for step, st in enumerate(states):
        plain.commit(step, st)
        delta.commit(step, st)
    deltas = _deltas(tmp_path / "delta")
    assert deltas and all(1 <= chain <= 3 for _, _, chain in deltas)
    assert max(chain for _, _, chain in deltas) == 3  # the chain is cut at its bound
    assert _stored(tmp_path / "delta") < 0.85 * _stored(tmp_path / "plain")
    assert not _deltas(tmp_path / "plain")
    for step, st in enumerate(states):
        assert_same(delta.checkout(step), st)
    # a tiny tensor is never tried as a delta: its rows are whole chunks
    sizes = {int(n) for n, in _rows(tmp_path / "delta", "SELECT raw_size FROM chunks WHERE codec = 3")}
    assert min(sizes) >= 4096
    assert_clean(delta)


def test_each_checkpoint_references_its_own_chunks_only(store_path: Path) -> None:
    """The bases of its deltas are gc's to keep: a checkpoint's references are the chunks its
    manifests name, and the candidate bases its claim referenced are let go once it commits."""
    s = ckstore.open(store_path, run="r", delta_chain=4, **SETTINGS)
    for step, st in enumerate(_states(4)):
        s.commit(step, st)
    g = torch.Generator().manual_seed(7)  # step 4: all new bytes, no delta pays
    fresh = {0: {"model": {"w": torch.randn(40_000, generator=g), "bias": torch.zeros(8)},
                 "optim": {"m": torch.randn(20_000, generator=g)}}}  # fmt: skip
    s.commit(4, fresh)
    assert _deltas(store_path)
    for ck in s.checkpoints(run="r"):
        refs = _rows(
            store_path,
            f"SELECT c.digest FROM chunk_refs r JOIN chunks c ON c.id = r.chunk_id WHERE r.checkpoint_id = {ck.id}",
        )
        own = {d for _, _, m in s.catalog.entries(ck.id) for d in Manifest.from_bytes(m).digests()}
        assert {bytes(d) for d, in refs} == own, ck.step
    with s.catalog.snapshot() as survey:  # every row is some checkpoint's, or a base of one
        assert survey.unreferenced_chunks() == (0, 0)


def test_gc_keeps_the_bases_of_what_it_keeps(store_path: Path) -> None:
    states = _states(7)
    s = ckstore.open(store_path, run="r", delta_chain=3, **SETTINGS)
    for step, st in enumerate(states):
        s.commit(step, st)
    deep = [c for c in _deltas(store_path) if c[2] == 3]
    assert deep  # the last checkpoint to keep below holds deltas whose chains start in dropped steps
    s.gc(LatestN(1), grace=0)
    assert [c.step for c in s.checkpoints(run="r")] == [6]
    assert _deltas(store_path)  # the kept checkpoint's chain survived
    assert_same(s.checkout(6), states[6])
    assert_clean(s)
    # the next commit, after the sweep, writes deltas against what is left
    s.commit(7, _states(8)[7])
    assert_same(s.checkout(7), _states(8)[7])
    s.gc(LatestN(1), grace=0)
    assert_clean(s)


def test_du_says_what_dropping_a_checkpoint_of_deltas_frees(tmp_path: Path) -> None:
    """A checkpoint holds its chunks and the bases its deltas decode through: du's exclusive
    bytes for each checkpoint of two runs of chained deltas are what deleting it and sweeping
    frees (each tried on its own copy of the store), and the bases gc keeps for checkpoints it
    kept are reported as such."""
    import shutil

    origin = tmp_path / "origin"
    with ckstore.open(origin, run="a", delta_chain=3, **SETTINGS) as s:
        for step, st in enumerate(_states(6)):
            s.commit(step, st)
        for step, st in enumerate(_states(3, seed=1)):
            s.commit(step, st, run="b")
        rep = s.du()
        assert rep.base_bytes == 0 and rep.garbage_bytes == 0
        predicted = {u.name: u.exclusive_bytes for u in rep.checkpoints}
        by_run = {u.name: u.exclusive_bytes for u in rep.runs}
    # the first checkpoints' chunks are every later delta's bases: dropping them frees ~nothing
    assert predicted["a@0"] < 100 < predicted["a@5"]
    for ref, expect in predicted.items():
        path = tmp_path / ref.replace("@", "-")
        shutil.copytree(origin, path)
        with ckstore.open(path) as s:
            s.delete(ref, force=True)
            assert s.gc(grace=0).chunk_bytes_freed == expect, ref
            assert_clean(s)
    for run, expect in by_run.items():
        path = tmp_path / f"run-{run}"
        shutil.copytree(origin, path)
        with ckstore.open(path) as s:
            for ck in s.checkpoints(run=run):
                s.delete(ck.ref, force=True)
            assert s.gc(grace=0).chunk_bytes_freed == expect, run
    # keeping a@3 (three deltas deep) to a@5 keeps the bases of a@3's deltas, chunks no kept
    # checkpoint references: du reports them apart, and counts them as a@3's own
    with ckstore.open(origin) as s:
        s.gc(LatestN(3), run="a", grace=0)
        assert [c.step for c in s.checkpoints(run="a")] == [3, 4, 5]
        rep = s.du()
        assert rep.base_bytes > 0 and rep.garbage_bytes == 0
        assert rep.total.exclusive_bytes == rep.total.stored_bytes + rep.base_bytes
        held = {u.name: u for u in rep.checkpoints}
        assert held["a@3"].exclusive_bytes > rep.base_bytes
        s.delete("a@3", force=True)
        assert s.gc(grace=0).chunk_bytes_freed == held["a@3"].exclusive_bytes
        assert s.du().base_bytes == 0
        assert_clean(s)


def test_a_damaged_base_is_reported_and_never_decoded_into_wrong_bytes(store_path: Path) -> None:
    s, digest, base = _two_steps(store_path)
    key, offset, length = _rows(
        store_path, f"SELECT p.key, c.offset, c.length FROM chunks c JOIN packs p ON p.id = c.pack_id WHERE c.digest = x'{base.hex()}'"
    )[0]
    pack = store_path / key
    data = bytearray(pack.read_bytes())
    data[offset + length - 3] ^= 0xFF  # inside the base's frame: its last plane is raw bytes
    pack.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"base chunk {base.hex()}"):
        s.checkout(1)
    report = s.fsck(deep=True, grace=0)
    bad = {d.chunk for d in report.damage}
    assert base.hex() in bad and digest.hex() in bad, [d.describe() for d in report.damage]


def test_copy_sends_deltas_as_whole_chunks(tmp_path: Path) -> None:
    states = _states(4)
    src = ckstore.open(tmp_path / "src", run="r", delta_chain=3, **SETTINGS)
    for step, st in enumerate(states):
        src.commit(step, st)
    assert _deltas(tmp_path / "src")
    dest = ckstore.open(tmp_path / "dest", **SETTINGS)
    rep = src.copy(["r@3"], dest)  # only the last step: none of its bases travel
    assert rep.copied == ("r@3",)
    assert not _deltas(tmp_path / "dest")
    assert_same(dest.checkout("r@3"), states[3])
    assert_clean(dest)


def test_recover_restores_the_bases_of_deltas(store_path: Path) -> None:
    states = _states(5)
    s = ckstore.open(store_path, run="r", delta_chain=2, **SETTINGS)
    for step, st in enumerate(states):
        s.commit(step, st)
    before = sorted(_deltas(store_path))
    s.close()
    for suffix in ("", "-wal", "-shm"):
        p = store_path / f"catalog.db{suffix}"
        if p.exists():
            p.unlink()
    s = ckstore.open(store_path, run="r")
    assert s.recover().ok
    assert sorted(_deltas(store_path)) == before
    for step, st in enumerate(states):
        assert_same(s.checkout(step), st)
    s.gc(LatestN(1), grace=0)  # the restored references hold the chains too
    assert_same(s.checkout(4), states[4])
    assert_clean(s)


def test_repack_moves_deltas_and_their_bases(store_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    states, w = [], torch.randn(16_000, generator=g)
    for _ in range(5):  # one drifting chunk, beside noise that no delta shrinks
        w = w + 1e-4 * torch.randn(w.shape, generator=g)
        states.append({0: {"m": {"w": w.clone(), "noise": torch.randn(40_000, generator=g)}}})
    s = ckstore.open(store_path, run="r", delta_chain=4, chunk_size=64 * 1024, pack_size=1 << 20)
    for step, st in enumerate(states):
        s.commit(step, st)
    s.gc(LatestN(1), grace=0)  # the packs of steps 0-3 keep only their chunks of w: step 4's chain
    assert len(_deltas(store_path)) == 4
    report = s.gc(grace=0, repack=True).repack
    assert report is not None and report.chunks_moved >= 4
    assert len(_deltas(store_path)) == 4
    assert_same(s.checkout(4), states[4])
    assert_clean(s)


def test_asynchronous_commits_write_deltas(store_path: Path) -> None:
    states = _states(5)
    s = ckstore.open(store_path, run="r", delta_chain=2, **SETTINGS)
    for step, st in enumerate(states):
        s.commit(step, st, blocking=False)
    s.wait()
    assert _deltas(store_path)
    for step, st in enumerate(states):
        assert_same(s.checkout(step), st)


def test_a_failed_commit_writes_no_delta_against_its_chunks(store_path: Path) -> None:
    states = _states(3)
    s = ckstore.open(store_path, run="r", delta_chain=2, **SETTINGS)
    s.commit(0, states[0])
    s.commit(1, states[1])
    with pytest.raises(ckstore.errors.AlreadyExistsError):
        s.commit(1, states[2])  # refused: nothing of it is stored
    n = len(_deltas(store_path))
    s.commit(2, states[2])
    assert len(_deltas(store_path)) == n  # whole chunks: the cache was dropped with the failure
    assert_same(s.checkout(2), states[2])


@pytest.mark.parametrize("chain", [-1, 17, True, 2.0])
def test_delta_settings_are_checked(store_path: Path, chain: Any) -> None:
    with pytest.raises(CkstoreError, match="delta_chain must be an int from 0"):
        ckstore.open(store_path, delta_chain=chain)
    with pytest.raises(CkstoreError, match="delta_memory must be"):
        ckstore.open(store_path, delta_chain=2, delta_memory=-1)


def test_the_memory_budget_bounds_what_is_kept(tmp_path: Path) -> None:
    bounded = ckstore.open(tmp_path / "bounded", run="r", delta_chain=2, delta_memory=100_000, **SETTINGS)
    unbounded = ckstore.open(tmp_path / "unbounded", run="r", delta_chain=2, **SETTINGS)
    for step, st in enumerate(_states(3)):
        bounded.commit(step, st)
        unbounded.commit(step, st)
    # 100,000 bytes hold a 64 KiB and a 32 KiB chunk of the state's 240 KB: two deltas a step
    assert len(_deltas(tmp_path / "bounded")) == 2 * 2 < len(_deltas(tmp_path / "unbounded"))
    assert_clean(bounded)


def test_deltas_on_s3_with_a_postgresql_catalog(s3_server: S3Server, s3_bucket: str, pg_catalog_url: str) -> None:
    states = _states(6)
    loc = f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}"
    s = ckstore.open(
        loc, run="r", catalog=pg_catalog_url, storage_options=s3_server.storage_options(), delta_chain=3, **SETTINGS
    )
    for step, st in enumerate(states[:5]):
        s.commit(step, st)
    with s.catalog.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM chunks WHERE codec = 3 AND base IS NOT NULL")).scalar()
    with s.catalog.snapshot() as survey:
        assert survey.unreferenced_chunks() == (0, 0)  # the unused candidate bases were let go
    s.gc(LatestN(1), grace=0)
    assert_same(s.checkout(4), states[4])
    s.commit(5, states[5])  # a delta against the chain gc kept
    for step in (4, 5):
        assert_same(s.checkout(step), states[step])
    assert_clean(s)
    held = {u.name: u for u in s.du().checkpoints}  # r@4's chunks are r@5's bases: dropping r@4 frees ~none
    assert held["r@4"].exclusive_bytes < held["r@4"].stored_bytes // 2 and held["r@5"].exclusive_bytes > 0
    s.gc(LatestN(1), grace=0)
    assert s.du().base_bytes > 0  # r@4's chunks, kept for r@5's deltas
    assert_same(s.checkout(5), states[5])
    s.close()


def test_collective_commits_write_deltas_on_every_rank(tmp_path: Path) -> None:
    from test_distributed import run_job

    path = tmp_path / "store"
    ckstore.open(path, run="exp", **SETTINGS).close()
    reports = run_job("delta", 2, path, tmp_path)
    assert all(r["ok"] for r in reports)
    # both ranks' own shards and the replicated tensor (written by one of them) went as deltas
    assert len({b for _, b, _ in _deltas(path)}) >= 3 * 2
    with ckstore.open(path, run="exp") as s:
        assert_clean(s)


def test_fsck_follows_the_chains_of_deltas(store_path: Path) -> None:
    s, digest, base = _two_steps(store_path)
    assert s.fsck(grace=0).ok
    (key,) = _rows(store_path, f"SELECT p.key FROM chunks c JOIN packs p ON p.id = c.pack_id WHERE c.digest = x'{base.hex()}'")[0]
    (store_path / key).unlink()  # damage: the base's pack is gone; a shallow check names the delta too
    report = s.fsck(grace=0)
    damaged = {(d.step, d.chunk) for d in report.damage}
    assert (0, base.hex()) in damaged and (1, digest.hex()) in damaged, [d.describe() for d in report.damage]
    with sqlite3.connect(store_path / "catalog.db") as conn:  # damage: the base's row is gone too
        conn.execute("DELETE FROM chunk_refs WHERE chunk_id = (SELECT id FROM chunks WHERE digest = ?)", (base,))
        conn.execute("DELETE FROM chunks WHERE digest = ?", (base,))
    report = s.fsck(grace=0)
    (delta,) = [d for d in report.damage if d.chunk == digest.hex()]
    assert delta.step == 1 and f"delta base chunk {base.hex()} is not in the catalog" in delta.problem


_CHILD = """
import sys
import ckstore, ckstore._crash
from test_delta import SETTINGS, _states
point, path = sys.argv[1], sys.argv[2]
s = ckstore.open(path, run="r", delta_chain=2, **SETTINGS)
states = _states(3)
s.commit(0, states[0])
s.commit(1, states[1])
ckstore._crash._AT = point  # armed once the store object holds step 1's chunks to write deltas against
s.commit(2, states[2])
"""


@pytest.mark.parametrize("point", ["write", "pack.chunks_recorded"])
def test_a_delta_commit_killed_mid_way_damages_nothing(store_path: Path, point: str) -> None:
    import subprocess
    import sys

    from ckstore.format.pack import read_index
    from ckstore.maintenance.gc import list_packs
    from ckstore.maintenance.recover import read_pack_index

    env = {**__import__("os").environ, "PYTHONPATH": f"{Path(__file__).parent.parent}:{Path(__file__).parent}"}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, point, str(store_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == -9 and child.stderr.rstrip().endswith(f"ckstore crash point: {point}"), child.stderr
    s = ckstore.open(store_path, run="r")
    assert [p.step for p in s.catalog.pending()] == [2]  # the kill landed mid-commit
    known = set(_rows(store_path, "SELECT key FROM packs WHERE id IN (SELECT pack_id FROM chunks)"))
    frames = [
        s.blobs.read(key, offset, offset + 1)[0]
        for key, (size, _) in list_packs(s.blobs).items() if (key,) not in known
        for _, offset, _, _ in read_pack_index(s.blobs, key, size)
    ]  # fmt: skip
    for part in (store_path / "tmp").glob("*.part"):  # its last pack, whole, not yet renamed into place
        data = part.read_bytes()
        frames += [data[offset] for _, offset, _, _ in read_index(data)]
    assert codec.CODEC_DELTA in frames  # the dead commit had written its deltas
    states = _states(3)
    assert [c.step for c in s.checkpoints(run="r")] == [0, 1]
    assert_same(s.checkout(1), states[1])
    assert_clean(s)
    s.close()
    s = ckstore.open(store_path, run="r", delta_chain=2)
    s.commit(1, states[1], replace=True)
    s.commit(2, states[2])  # a delta against the step the killed commit wrote deltas against
    assert_same(s.checkout(2), states[2])
    assert_clean(s)


def test_a_catalog_row_naming_another_base_is_refused(store_path: Path) -> None:
    s, digest, base = _two_steps(store_path)
    with sqlite3.connect(store_path / "catalog.db") as conn:  # a damaged row: the delta is its own base
        conn.execute("UPDATE chunks SET base = digest WHERE digest = ?", (digest,))
    with pytest.raises(IntegrityError, match=f"its frame names base {base.hex()}, the catalog {digest.hex()}"):
        s.checkout(1)
    shallow = s.fsck(grace=0)
    assert any("longer than 16" in d.problem for d in shallow.damage), [d.describe() for d in shallow.damage]
    deep = s.fsck(deep=True, grace=0)
    assert digest.hex() in {d.chunk for d in deep.damage}
    assert s.du().total.checkpoints == 2  # du's walk down the chains ends on a cycle too
    s.gc(grace=0)  # gc's walk down the chains ends on a cycle, and keeps what is referenced
    assert [c.step for c in s.checkpoints(run="r")] == [0, 1]
    assert len(_rows(store_path, f"SELECT id FROM chunks WHERE digest = x'{digest.hex()}'")) == 1


def test_diff_and_export_read_deltas(store_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ckstore.integrations.files import export_checkpoint

    states = _states(4)
    s = ckstore.open(store_path, run="r", delta_chain=3, **SETTINGS)
    for step, st in enumerate(states):
        s.commit(step, st)
    assert {c for _, _, c in _deltas(store_path)} == {1, 2, 3}
    res = s.diff("r@0", "r@3")  # the whole chunk of step 0 against the end of its chain
    w0, w3 = states[0][0]["model"]["w"], states[3][0]["model"]["w"]
    (w,) = [t for t in res.changed if t.key == "model/w"]
    assert w.stats is not None and w.stats.max_abs_diff == pytest.approx((w3 - w0).abs().max().item(), rel=1e-12)
    out = tmp_path / "step3.safetensors"
    export_checkpoint(s, 3, str(out), fmt="safetensors", sub_key="model")
    got = load_file(str(out))
    assert torch.equal(got["w"], w3) and torch.equal(got["bias"], states[3][0]["model"]["bias"])


def test_dcp_saves_through_a_delta_store(store_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from ckstore.integrations import dcp as ckdcp

    states = [st[0] for st in _states(3)]
    s = ckstore.open(store_path, run="r", delta_chain=2, **SETTINGS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, st in enumerate(states):
            dcp.save(st, storage_writer=ckdcp.Writer(s, step=step))
        assert _deltas(store_path)  # DCP's save path writes deltas too
        target = {"model": {"w": torch.zeros(40_000), "bias": torch.zeros(8)}, "optim": {"m": torch.zeros(20_000)}}
        dcp.load(target, storage_reader=ckdcp.Reader(s, 2))
    assert_same(target, states[2])
    assert_clean(s)


def test_delta_memory_without_a_delta_chain_is_refused(store_path: Path) -> None:
    with pytest.raises(CkstoreError, match="delta_memory=1000 .*pass delta_chain=N"):
        ckstore.open(store_path, delta_memory=1000)  # else silently ignored: no deltas written
    with pytest.raises(CkstoreError, match="pass delta_chain=N"):
        ckstore.open(store_path, delta_chain=0, delta_memory=1000)
    s = ckstore.open(store_path, delta_chain=0)
    assert s._delta is None
    s.close()


def test_a_chain_of_the_longest_length_is_healthy(store_path: Path) -> None:
    """fsck called a chain of MAX_DELTA_CHAIN deltas, which every reader decodes, longer than that."""
    states = _states(MAX_DELTA_CHAIN + 1)
    s = ckstore.open(store_path, run="r", delta_chain=MAX_DELTA_CHAIN, **SETTINGS)
    for step, st in enumerate(states):
        s.commit(step, st)
    assert max(chain for _, _, chain in _deltas(store_path)) == MAX_DELTA_CHAIN
    assert_same(s.checkout(MAX_DELTA_CHAIN), states[-1])
    assert_clean(s)
    s.close()
