"""What a commit of many tensors holds in memory: its manifests and its record are written a
batch of objects at a time, and what it staged goes once its chunks are written.

Python's own allocations are counted with tracemalloc (deterministic for the same code, unlike
a process's resident size); each bound sits between what the code measures now and what it
measured before these changes (docs/benchmarks.md, "Memory of many-tensor commits and checkouts")."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

import ckstore
from ckstore.errors import UnsupportedValueError
from ckstore.format import manifest as manifest_format
from ckstore.format import recordio
from ckstore.format.manifest import Manifest, manifest_bytes, tensor_json
from ckstore.format.record import CheckpointRecord, checkpoint_key, decode


def _records(n: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield tensor_json(f"layers.{i}.weight", "float32", (4,), 16, 1 << 20, [i.to_bytes(16, "little")], None)


def test_a_manifest_is_written_without_its_records_as_objects() -> None:
    n = 50_000
    tree = ["d", [[["s", f"layers.{i}.weight"], ["T", i]] for i in range(n)]]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        data = manifest_bytes(tree, _records(n))
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    raw = zstandard.ZstdDecompressor().decompress(data)
    # the frame declares its length (the one-call decompression of Manifest.from_bytes)
    assert zstandard.frame_content_size(data) == len(raw)
    assert raw == json.dumps(
        {"version": 1, "tree": tree, "tensors": list(_records(n))}, separators=(",", ":"), ensure_ascii=False
    ).encode()
    # the JSON text, its compressed bytes and a batch of records (measured: 1.8 times the JSON);
    # the records as a list of dicts alone came to about four times the JSON
    assert peak < 2.5 * len(raw), (peak, len(raw))
    back = Manifest.from_bytes(data)
    assert len(back.tensors) == n and back.tensors[-1].path == f"layers.{n - 1}.weight"


def _peak_of(fn: Any) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_a_manifest_is_read_a_record_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 20_000
    tree = ["d", [[["s", f"layers.{i}.weight"], ["T", i]] for i in range(n)]]
    data = manifest_bytes(tree, _records(n))
    streamed, peak = _peak_of(lambda: Manifest.from_bytes(data))
    monkeypatch.setattr(manifest_format, "_stream", lambda text, where: None)  # the whole parse
    whole, whole_peak = _peak_of(lambda: Manifest.from_bytes(data))
    assert streamed == whole
    # measured: 17.3 against 23.6 MiB (the records' JSON objects all at once)
    assert peak < 0.8 * whole_peak, (peak / 2**20, whole_peak / 2**20)


def test_a_manifest_past_the_limit_is_refused_and_nothing_stored_is_lost(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.commit(1, {0: {"model_states": {"w": torch.arange(8.0)}}})
    monkeypatch.setattr(manifest_format, "MAX_MANIFEST_BYTES", 20_000)
    state = {f"t{i}": torch.full((2,), float(i)) for i in range(1_000)}  # ~100 KB of JSON
    with pytest.raises(UnsupportedValueError, match="more than 20000 bytes of JSON.*split it"):
        store.commit(2, {0: {"model_states": state}})
    assert [c.step for c in store.checkpoints()] == [1]
    assert torch.equal(store.checkout(1)[0]["model_states"]["w"], torch.arange(8.0))
    monkeypatch.undo()
    store.commit(2, {0: {"model_states": state}})  # the same state goes in once the limit allows it
    assert torch.equal(store.checkout(2)[0]["model_states"]["t999"], state["t999"])


def test_a_many_tensor_commit_lets_go_of_what_it_staged_before_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 20_000
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(n)}
    store = ckstore.open(tmp_path / "s", run="exp", create=True)
    store.commit(0, {0: {"model_states": {"x": torch.zeros(4)}}})  # (statements and threads warm)
    held: list[int] = []
    build = recordio.record_from_catalog

    def measured(*args: Any, **kwargs: Any) -> Any:
        held.append(tracemalloc.get_traced_memory()[0])
        return build(*args, **kwargs)

    monkeypatch.setattr(recordio, "record_from_catalog", measured)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        store.commit(1, {0: {"model_states": state}})
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert len(held) == 1  # the record of step 1 was built once, inside its commit
    # measured: 14.2 MiB held when the record is built (34.8 MiB while the staged bytes, trees
    # and chunk lists stayed), 35.9 MiB at the peak (46.1 MiB)
    assert held[0] - start < 22 << 20, (held[0] - start) / 2**20
    assert peak < 41 << 20, peak / 2**20
    # the record, written a batch of chunk locations at a time, names every chunk
    rec = next(r for r in _records_of(store) if r.ident.step == 1)
    assert len(rec.chunks) == len({c.digest for c in rec.chunks}) == n
    store.close()


def _records_of(store: ckstore.Store) -> list[CheckpointRecord]:
    out = []
    for info in store.blobs.list("records/checkpoints/"):
        data = store.blobs.read(info.key)
        assert zstandard.frame_content_size(data) > 0  # every record's frame declares its length
        rec = decode(data, info.key)
        assert isinstance(rec, CheckpointRecord)
        out.append(rec)
    assert {checkpoint_key(r.ident) for r in out} == {i.key for i in store.blobs.list("records/checkpoints/")}
    return out


def test_a_many_tensor_checkout_builds_its_state_dicts_before_reading(tmp_path: Path) -> None:
    n = 20_000
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(n)}
    store = ckstore.open(tmp_path / "s", run="exp", create=True)
    store.commit(1, {0: {"model_states": state}})
    store.checkout(1)  # (statements and threads warm)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        got = store.checkout(1)[0]["model_states"]
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in state)
    # measured: 24.1 MiB (26.9 MiB while a manifest's records were parsed as one list of JSON
    # objects; 37.7 MiB while the manifests' trees and tensor records stayed through the reads, a
    # list of copies was kept per chunk and the manifest's bytes through its parse)
    assert peak < 29 << 20, peak / 2**20
    store.close()


def test_a_record_past_its_readers_limit_is_refused_and_nothing_stored_is_lost(
    store: ckstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckstore.format import record as record_format

    store.commit(1, {0: {"model_states": {"w": torch.arange(8.0)}}})
    records_before = {i.key for i in store.blobs.list("records/checkpoints/")}
    # one chunk location is ~80 bytes of JSON: 1,000 tiny tensors' record passes 20,000 bytes
    monkeypatch.setattr(record_format, "_MAX_RECORD_BYTES", 20_000)
    state = {f"t{i}": torch.full((2,), float(i)) for i in range(1_000)}
    with pytest.raises(UnsupportedValueError, match="record would be more than 20000 bytes of JSON"):
        store.commit(2, {0: {"model_states": state}})
    assert [c.step for c in store.checkpoints()] == [1]
    assert {i.key for i in store.blobs.list("records/checkpoints/")} == records_before
    assert torch.equal(store.checkout(1)[0]["model_states"]["w"], torch.arange(8.0))
    monkeypatch.undo()
    store.commit(2, {0: {"model_states": state}})  # the same state goes in once the limit allows it
    assert torch.equal(store.checkout(2)[0]["model_states"]["t999"], state["t999"])
    assert store.fsck().ok  # the refused commit left nothing damaged or pending
