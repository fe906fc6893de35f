"""Fuzzing the readers of untrusted store contents: chunk frames, manifests, pack indexes.

Inputs are real frames, manifests and packs of a small real store, mutated at random (bit flips,
truncations, inserted and overwritten bytes, header field edits, zstd frames declaring huge
sizes, JSON field edits, swapped chunk lists). Each target asserts that only
:class:`CkstoreError` subclasses escape, that decoding allocates no more than the declared raw
length (tracemalloc), and, end to end, that a checkout of a store whose pack bytes were mutated
either fails or returns the exact original tensors.

The runs are bounded and replayable (``derandomize=True``, a fixed ``max_examples``), so CI runs
them with the rest of the suite; ``CKSTORE_FUZZ_EXAMPLES=N`` scales every target for a longer
local run. The files under ``corpus/`` (inputs that once mattered; see ``make_corpus.py``) are
replayed on every run. A hang fails through pytest's per-test timeout.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckstore
from ckstore.errors import CkstoreError
from ckstore.format import codec
from ckstore.format.manifest import Manifest
from ckstore.format.pack import read_index
from ckstore.format.tensorio import unflatten
from ckstore.layout import WorldLayout

from .hostile import Hostile, build, chunk_frame, zstd_frame

CORPUS = Path(__file__).parent / "corpus"
SCALE = float(os.environ.get("CKSTORE_FUZZ_EXAMPLES", "1"))
FUZZED: Counter[str] = Counter()


def examples(n: int) -> settings:
    return settings(
        max_examples=max(1, int(n * SCALE)),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ckstore.Store, Hostile, Any]]:
    path = tmp_path_factory.mktemp("fuzz") / "store"
    store = build(path)
    h = Hostile(path)
    yield store, h, store.checkout(1)
    store.close()
    print(f"\nfuzzed inputs: {dict(FUZZED)}, total {sum(FUZZED.values())}")


def _frames(h: Hostile) -> list[tuple[str, bytes, int]]:
    out = []
    for _, data in h.entries():
        man = Manifest.from_bytes(data)
        for t in man.tensors:
            for d in t.chunks:
                out.append((d.hex(), h.frame(d.hex()), h.chunk(d.hex())[4]))
    return sorted(dict((d, (d, f, n)) for d, f, n in out).values())


# -- mutations ---------------------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn, data: bytes, header: bool = False) -> bytes:
    """``data`` after a few random byte-level mutations."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite", "field"] if header else ["flip", "truncate", "insert", "overwrite"]))
        n = len(buf)
        if kind == "flip" and n:
            pos = draw(st.integers(0, n - 1))
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del buf[draw(st.integers(0, n)) :]
        elif kind == "insert":
            pos = draw(st.integers(0, n))
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "overwrite" and n:
            pos = draw(st.integers(0, n - 1))
            chunk = draw(st.binary(min_size=1, max_size=16))
            buf[pos : pos + len(chunk)] = chunk
        elif kind == "field" and n >= 8:
            fmt, at = draw(st.sampled_from([("<B", 0), ("<B", 1), ("<H", 2), ("<I", 4)]))
            top = (1 << (8 * struct.calcsize(fmt))) - 1
            value = draw(st.one_of(st.integers(0, 20), st.just(top), st.integers(0, top)))
            struct.pack_into(fmt, buf, at, value)
    return bytes(buf)


@st.composite
def frame_input(draw: st.DrawFn, frames: list[tuple[str, bytes, int]]) -> tuple[bytes, int]:
    """A mutated real frame, or a crafted one (bombs, odd headers), and the raw length it must have."""
    _, frame, n = draw(st.sampled_from(frames))
    how = draw(st.sampled_from(["mutate", "bomb", "planes"]))
    if how == "mutate":
        return draw(mutated(frame, header=True)), n
    if how == "bomb":
        declared = draw(st.sampled_from([None, n + 1, n - 1, 1 << 30, 1 << 40, (1 << 64) - 2]))
        blocks = draw(st.integers(0, 12))
        body = zstd_frame(declared, blocks, window_log=draw(st.integers(10, 31)), byte=draw(st.integers(0, 255)))
        return chunk_frame(codec.CODEC_ZSTD, n, draw(mutated(body)) if draw(st.booleans()) else body), n
    itemsize = draw(st.integers(0, 20))
    lengths = draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=0, max_size=itemsize))
    body = struct.pack(f"<{len(lengths)}I", *lengths) + draw(st.binary(max_size=64))
    return chunk_frame(codec.CODEC_PLANES, n, body, itemsize=itemsize % 256, mask=draw(st.integers(0, 0xFFFF))), n


def _decode_bounded(frame: bytes, n: int) -> None:
    dest = np.empty(n, dtype=np.uint8)
    tracemalloc.start()
    try:
        codec.decode_into(frame, dest.data)
    except CkstoreError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= n + (64 << 10), f"decoding a frame of {n} raw bytes allocated {peak} bytes"


def _doc(data: bytes) -> dict[str, Any]:
    return json.loads(zstandard.ZstdDecompressor().decompress(data))


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.sampled_from([0, -1, 1 << 40, 1 << 64]),
        st.floats(allow_nan=False), st.text(max_size=8), st.sampled_from(["T", "d", "l", "f", "float64", "int8", "00" * 16]),
    )  # fmt: skip
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def _paths(x: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*at, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*at, i))


@st.composite
def doc_edit(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a manifest's JSON) after random field edits, deletions or swapped chunk lists."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["set", "set", "delete", "swap", "grow"]))
        paths = [p for p in _paths(doc) if p]
        records = [t for t in doc.get("tensors") or [] if isinstance(t, dict)] if isinstance(doc, dict) else []
        if kind == "swap" and len(records) >= 2:
            i, j = draw(st.lists(st.integers(0, len(records) - 1), min_size=2, max_size=2, unique=True))
            a, b = records[i], records[j]
            field = draw(st.sampled_from(["chunks", "shape", "dtype", "nbytes", "shard"]))
            a[field], b[field] = b.get(field), a.get(field)
            continue
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if kind == "delete":
            del parent[path[-1]]
        elif kind == "grow" and isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool):
            parent[path[-1]] = parent[path[-1]] * draw(st.sampled_from([2, 1 << 20, -1])) + draw(st.integers(-1, 1))
        else:
            parent[path[-1]] = draw(_json_values())
    return doc


# -- targets -----------------------------------------------------------------------------------


def test_fuzz_chunk_frames(world: tuple[ckstore.Store, Hostile, Any]) -> None:
    frames = _frames(world[1])

    @examples(400)
    @given(frame_input(frames))
    def run(inp: tuple[bytes, int]) -> None:
        FUZZED["frames"] += 1
        _decode_bounded(*inp)

    run()


def test_fuzz_manifests(world: tuple[ckstore.Store, Hostile, Any]) -> None:
    entries = [data for _, data in world[1].entries()]

    @examples(300)
    @given(st.sampled_from(entries), st.data())
    def run(data: bytes, draw: st.DataObject) -> None:
        FUZZED["manifests"] += 1
        if draw.draw(st.booleans()):
            raw = json.dumps(draw.draw(doc_edit(_doc(data)))).encode()
            data = zstandard.compress(raw)
        else:
            data = draw.draw(mutated(data))
        try:
            man = Manifest.from_bytes(data, "fuzz")
            unflatten(man.tree, lambda i: None, allow_pickle=False)
        except CkstoreError:
            pass

    run()


def test_fuzz_pack_indexes(world: tuple[ckstore.Store, Hostile, Any]) -> None:
    h = world[1]
    packs = [(h.path / k).read_bytes() for k in h.packs()]

    @examples(200)
    @given(st.sampled_from(packs), st.data())
    def run(pack: bytes, draw: st.DataObject) -> None:
        FUZZED["pack indexes"] += 1
        tail = 8 + 32 * draw.draw(st.integers(0, 4))
        head, rest = pack[: max(0, len(pack) - tail)], pack[max(0, len(pack) - tail) :]
        data = head + draw.draw(mutated(rest)) if draw.draw(st.booleans()) else draw.draw(mutated(pack))
        try:
            entries = read_index(data)
        except CkstoreError:
            return
        for _, off, ln, _ in entries:
            assert off >= 8 and off + ln <= len(data)

    run()


def _readers(store: ckstore.Store) -> list[Any]:
    return [
        lambda: store.checkout(1),
        lambda: store.checkout(1, WorldLayout.single()),
        lambda: store.diff(1, 2),
        lambda: store.fsck(deep=True),
    ]


def test_fuzz_real_store(world: tuple[ckstore.Store, Hostile, Any]) -> None:
    """Mutations written into the real pack files and the real SQLite rows, read by checkout,
    consolidated checkout, diff and fsck --deep."""
    store, h, original = world
    frames = _frames(h)
    entries = h.entries()

    @examples(40)
    @given(st.data())
    def run(draw: st.DataObject) -> None:
        FUZZED["store edits"] += 1
        target = draw.draw(st.sampled_from(["frame", "manifest", "row"]))
        if target == "frame":
            digest, frame, n = draw.draw(st.sampled_from(frames))
            new, _ = draw.draw(frame_input([(digest, frame, n)]))
            _, key, offset, _, _ = h.chunk(digest)
            if len(new) <= len(frame) and draw.draw(st.booleans()):
                undo = h.write_pack(key, offset, new)  # in place, same catalog row
            else:
                undo = h.replace_frame(digest, new)
        elif target == "manifest":
            entry_id, data = draw.draw(st.sampled_from(entries))
            undo = h.set_doc(entry_id, draw.draw(doc_edit(_doc(data))))
        else:
            digest, _, _ = draw.draw(st.sampled_from(frames))
            field = draw.draw(st.sampled_from(["offset", "length", "raw_size", "codec"]))
            undo = h.set_chunk_row(digest, **{field: draw.draw(st.integers(-(1 << 40), 1 << 40))})
        try:
            for i, read in enumerate(_readers(store)):
                try:
                    got = read()
                except CkstoreError:
                    continue
                if i == 0 and target != "manifest":  # pack bytes and rows may only fail, never lie
                    _same(got, original)
        finally:
            undo()

    run()


def _same(a: Any, b: Any) -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes()
    elif isinstance(b, dict):
        assert list(a) == list(b)
        for k in b:
            _same(a[k], b[k])
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b or (a != a and b != b)


# -- the corpus --------------------------------------------------------------------------------


def _corpus() -> list[Path]:
    return sorted(p for p in CORPUS.iterdir() if p.suffix in (".frame", ".manifest", ".pack"))


@pytest.mark.parametrize("path", _corpus(), ids=lambda p: p.name)
def test_corpus_replays(path: Path) -> None:
    """Every stored input is refused with a CkstoreError or read within its declared sizes."""
    data = path.read_bytes()
    FUZZED["corpus"] += 1
    try:
        if path.suffix == ".frame":
            n = codec.raw_length(data)
            _decode_bounded(data, min(n, 1 << 20))
        elif path.suffix == ".manifest":
            man = Manifest.from_bytes(data, path.name)
            unflatten(man.tree, lambda i: None)
        else:
            read_index(data)
    except CkstoreError:
        pass
