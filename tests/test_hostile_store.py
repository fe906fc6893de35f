"""Hostile store contents: manifests that lie, decompression bombs, malformed frames and packs.

Every case edits a real store on disk (bytes in its pack files, rows of its SQLite catalog) and
drives every reader: checkout, consolidated checkout, diff, export, ``fsck --deep``. Each must
refuse with an :class:`IntegrityError` naming run, step, rank and key (fsck: report damage),
never return wrong data, never raise anything else, never allocate what the lie declares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuzz.hostile import Hostile, build, chunk_frame, tensor_record, zstd_frame
from helpers import assert_same

import ckstore
from ckstore.errors import CkstoreError, IntegrityError
from ckstore.format import codec, tree
from ckstore.format.manifest import Manifest
from ckstore.format.pack import read_index
from ckstore.format.tensorio import MAX_DEPTH, unflatten
from ckstore.integrations.files import export_checkpoint
from ckstore.layout import WorldLayout

WHERE = "run 'exp', step 1"


@pytest.fixture
def hs(tmp_path: Path) -> tuple[ckstore.Store, Hostile]:
    store = build(tmp_path / "store")
    yield store, Hostile(tmp_path / "store")
    store.close()


def readers(store: ckstore.Store, tmp: Path) -> dict[str, Callable[[], Any]]:
    return {
        "checkout": lambda: store.checkout(1),
        "consolidate": lambda: store.checkout(1, WorldLayout.single()),
        "diff": lambda: store.diff(1, 2),
        "export": lambda: export_checkpoint(store, 1, str(tmp / "out.pt")),
    }


def assert_refused(
    store: ckstore.Store, tmp: Path, *needles: str, only: tuple[str, ...] | None = None, fsck: bool = True
) -> None:
    """Every reader raises IntegrityError naming the checkpoint and ``needles``; fsck reports it."""
    for name, read in readers(store, tmp).items():
        if only is not None and name not in only:
            continue
        with pytest.raises(IntegrityError) as e:
            read()
        msg = str(e.value)
        assert WHERE in msg, f"{name}: {msg}"
        for n in needles:
            assert n in msg, f"{name}: {n!r} not in {msg}"
    if fsck:
        rep = store.fsck(deep=True)
        assert not rep.ok
        assert "exp@1" in rep.damaged_checkpoints


# -- manifests that lie ------------------------------------------------------------------------


def test_untouched_store_reads_back(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    store, _ = hs
    from fuzz.hostile import rank_state

    want = {r: rank_state(1, r) for r in (0, 1)}
    for r in want:
        want[r]["model_states"]["emb"] = want[r]["model_states"]["emb"].tensor
    assert_same(store.checkout(1), want)
    for read in readers(store, tmp_path).values():
        read()
    assert store.fsck(deep=True).ok


def test_flipped_dtype_is_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    store, h = hs
    h.edit_doc(1, 0, "model_states", lambda d: tensor_record(d, "w").update(dtype="float64"))
    assert_refused(store, tmp_path, "rank 0", "model_states", "key 'w'", "float64")


@pytest.mark.parametrize("consistent_nbytes", [False, True])
def test_bigger_shape_is_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path, consistent_nbytes: bool) -> None:
    store, h = hs

    def edit(d: dict[str, Any]) -> None:
        t = tensor_record(d, "w")
        t["shape"] = [4800, 128]
        if consistent_nbytes:
            t["nbytes"] = 4800 * 128 * 4
    h.edit_doc(1, 0, "model_states", edit)
    assert_refused(store, tmp_path, "rank 0", "key 'w'", "chunks" if consistent_nbytes else "nbytes")


def test_swapped_chunk_lists_are_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    """``w`` and ``codes`` both have two chunks, of different raw lengths."""
    store, h = hs

    def edit(d: dict[str, Any]) -> None:
        a, b = tensor_record(d, "w"), tensor_record(d, "codes")
        a["chunks"], b["chunks"] = b["chunks"], a["chunks"]
    h.edit_doc(1, 0, "model_states", edit)
    assert_refused(store, tmp_path, "rank 0", "model_states", "raw bytes")
    assert any("the catalog records" in d.problem for d in store.fsck(deep=True).damage)


def test_catalog_raw_size_that_lies_is_refused_before_allocating(
    hs: tuple[ckstore.Store, Hostile], tmp_path: Path
) -> None:
    store, h = hs
    _, doc = h.doc(1, 0, "model_states")
    h.set_chunk_row(tensor_record(doc, "w")["chunks"][0], raw_size=1 << 40)
    assert_refused(store, tmp_path, "key 'w'", str(1 << 40))


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("offset", 0, "at byte 0"),
        ("offset", -5, "at byte -5"),
        ("length", 1 << 40, f"{1 << 40}-byte frame"),
        ("length", 3, "3-byte frame"),
    ],
)
def test_catalog_chunk_location_that_lies_is_refused(
    hs: tuple[ckstore.Store, Hostile], tmp_path: Path, field: str, value: int, needle: str
) -> None:
    store, h = hs
    _, doc = h.doc(1, 0, "model_states")
    h.set_chunk_row(tensor_record(doc, "noise")["chunks"][0], **{field: value})
    assert_refused(store, tmp_path, "key 'noise'", needle, only=("checkout", "consolidate", "export"), fsck=False)


def test_pack_key_outside_packs_is_never_read(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    store, h = hs
    _, doc = h.doc(1, 0, "model_states")
    h.set_pack_key(tensor_record(doc, "noise")["chunks"][0], "ckstore.json")
    assert_refused(store, tmp_path, "'ckstore.json'", only=("checkout",), fsck=False)


#: a 128 TiB tensor: more than any process can map (x86-64 gives a process 128 TiB of addresses)
_HUGE = 1 << 47


def _huge_w(h: Hostile, raw_size_in_catalog: bool) -> None:
    """Make ``w`` of step 1 a uint8 tensor of :data:`_HUGE` bytes in chunks of 1 GiB, all its first
    chunk; with ``raw_size_in_catalog`` the chunk's row agrees (a raw size of 1 GiB), and rank 1's
    ``w`` (the same chunks) is made the same."""
    _, doc = h.doc(1, 0, "model_states")
    first = tensor_record(doc, "w")["chunks"][0]

    def edit(d: dict[str, Any]) -> None:
        tensor_record(d, "w").update(
            dtype="uint8", shape=[_HUGE], nbytes=_HUGE, chunk_size=1 << 30, chunks=[first] * (_HUGE >> 30)
        )

    h.edit_doc(1, 0, "model_states", edit)
    if raw_size_in_catalog:
        h.edit_doc(1, 1, "model_states", edit)
        h.set_chunk_row(first, raw_size=1 << 30)


def test_a_huge_tensor_is_refused_by_its_chunk_locations_before_it_is_allocated(
    hs: tuple[ckstore.Store, Hostile], tmp_path: Path
) -> None:
    """The catalog's raw size of the chunk disagrees with the manifest: checkout says so, before
    it tries to allocate the 128 TiB the manifest declares (it used to fail allocating them)."""
    store, h = hs
    _huge_w(h, raw_size_in_catalog=False)
    assert_refused(store, tmp_path, "key 'w'", "the catalog records 65536 raw bytes", only=("checkout", "consolidate", "export"))


def test_a_tensor_that_cannot_be_allocated_is_an_integrity_error(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    """Manifest and catalog agree on a 128 TiB tensor: its allocation fails with an
    IntegrityError naming run, step, rank and key (it was torch's bare RuntimeError)."""
    store, h = hs
    _huge_w(h, raw_size_in_catalog=True)
    assert_refused(
        store, tmp_path, "rank 0", "model_states", "key 'w'", f"cannot allocate {_HUGE} bytes",
        only=("checkout", "consolidate", "export"),
    )  # fmt: skip


def _deep(depth: int) -> list[Any]:
    node: list[Any] = ["n"]
    for _ in range(depth):
        node = ["l", [node]]
    return node


def _set_tree(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        d["tree"] = value(d["tree"])
    return edit


def _put(key: str, node: Any) -> Callable[[Any], Any]:
    return lambda t: ["d", [*t[1], [["s", key], node]]]


TREE_LIES = {
    "unknown tag": (_put("x", ["Q", 1]), "unknown node tag 'Q'"),
    "tensor index out of range": (_put("x", ["T", 99]), "tensor 99"),
    "tensor used twice": (_put("x", ["T", 0]), "referenced twice"),
    "tensor never used": (lambda t: ["d", t[1][1:]], "never references"),
    "negative tensor index": (lambda t: ["d", [[t[1][0][0], ["T", -1]], *t[1][1:]]], "tensor -1"),
    "tensor index not an int": (lambda t: ["d", [[t[1][0][0], ["T", "0"]], *t[1][1:]]], "not a tensor index"),
    "dict item not a pair": (lambda t: ["d", [*t[1], [["s", "x"]]]], "[key, value] pair"),
    "duplicate key": (lambda t: ["d", [*t[1], [t[1][0][0], ["n"]]]], "same key twice"),
    "int and bool keys that collide": (
        _put("x", ["d", [[["i", 1], ["n"]], [["b", True], ["n"]]]]), "same key twice"
    ),
    "bytes key": (_put("x", ["d", [[["y", "AA=="], ["n"]]]]), "dict key"),
    "nested too deep": (_put("x", _deep(MAX_DEPTH + 1)), "deeper than"),
    "float not a repr": (_put("x", ["f", "pi"]), "float node"),
    "int holding a string": (_put("x", ["i", "7"]), "node 'i'"),
    "bytes not base64": (_put("x", ["y", "!!"]), "base64"),
    "root not a node": (lambda t: 7, "tagged JSON array"),
    "container without items": (_put("x", ["l"]), "container node"),
}


@pytest.mark.parametrize("case", list(TREE_LIES))
def test_tree_lies_are_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path, case: str) -> None:
    store, h = hs
    edit, needle = TREE_LIES[case]
    h.edit_doc(1, 0, "model_states", _set_tree(edit))
    assert_refused(store, tmp_path, "rank 0", "model_states", needle)


def _rec(field: str, value: Any, path: str = "w") -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        if value is KeyError:
            del tensor_record(d, path)[field]
        else:
            tensor_record(d, path)[field] = value
    return edit


def _shard(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: tensor_record(d, "emb")["shard"].__setitem__(field, value)


RECORD_LIES = {
    "chunk_size zero": (_rec("chunk_size", 0), "chunk_size 0"),
    "chunks missing": (_rec("chunks", KeyError), "'chunks'"),
    "digest not hex": (_rec("chunks", ["zz" * 16, "00" * 16]), "not hex"),
    "digest too short": (_rec("chunks", ["00" * 15, "00" * 16]), "hex"),
    "negative dim": (_rec("shape", [-48, -128]), "non-negative"),
    # a 0 elsewhere in the shape keeps nbytes 0 whatever the other dims say (torch refused them
    # with a bare TypeError)
    "dim 2**63 beside a 0": (_rec("shape", [1 << 63, 0], "empty"), "below 2**63"),
    "dim 2**70 beside a 0": (_rec("shape", [1 << 70, 0], "empty"), "below 2**63"),
    "dim 2**64 after a 0": (_rec("shape", [0, 1 << 64], "empty"), "below 2**63"),
    "bool as dim": (_rec("shape", [True, 128]), "non-negative"),
    "unknown dtype": (_rec("dtype", "float99"), "float99"),
    "dtype alias": (_rec("dtype", "float"), "'float'"),
    "quantized dtype": (_rec("dtype", "qint8"), "qint8"),
    "dtype not a string": (_rec("dtype", 4), "'dtype'"),
    "too many dims": (_rec("shape", [1] * 65), "65 dims"),
    "record not an object": (lambda d: d["tensors"].__setitem__(0, [1, 2]), "not an object"),
    "shard past the global shape": (_shard("offsets", [30, 0]), "reaches past"),
    "shard of another rank": (_shard("global_shape", [32]), "1-dim global shape"),
    "split of a missing dim": (_shard("splits", [[5, "dp"]]), "not [tensor dim"),
    "mesh dim split twice": (_shard("splits", [[0, "dp"], [1, "dp"]]), "twice"),
    "version": (lambda d: d.__setitem__("version", 2), "version 2"),
    "tensors not a list": (lambda d: d.__setitem__("tensors", {}), "'tensors'"),
}


@pytest.mark.parametrize("case", list(RECORD_LIES))
def test_record_lies_are_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path, case: str) -> None:
    store, h = hs
    edit, needle = RECORD_LIES[case]
    h.edit_doc(1, 0, "model_states", edit)
    assert_refused(store, tmp_path, "rank 0", "model_states", needle)


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"not zstd at all", "does not decompress"),
        (zstd_frame(1 << 40, 2), "declares"),
        (zstd_frame(None, 8192), "more than"),  # a real 1 GiB of zeros, no declared size
        (zstd_frame(1000, 2), "does not decompress"),  # declares less than it holds
        (zstd_frame(None, 2, byte=ord(" ")) + b"\x00" * 3, "does not decompress"),  # no size, then garbage
        (__import__("zstandard").compress(b"[" * 200_000), "not valid JSON"),
        (__import__("zstandard").compress(b"[1, 2]"), "not a JSON object"),
    ],
    ids=["garbage", "declares-1TiB", "bomb-1GiB", "declares-less", "unsized-then-garbage", "nested-json", "not-object"],
)
def test_unreadable_manifests_are_refused(
    hs: tuple[ckstore.Store, Hostile], tmp_path: Path, data: bytes, needle: str
) -> None:
    store, h = hs
    entry_id, _ = h.entry(1, 0, "model_states")
    h.set_manifest_bytes(entry_id, data)
    assert_refused(store, tmp_path, "rank 0", "model_states", needle)


def test_overlapping_shards_are_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    """Rank 1 claims rows 8..24 of ``emb`` instead of 16..32: counting covered elements alone would
    hand back rows 24..32 unfilled."""
    store, h = hs
    h.edit_doc(1, 1, "model_states", _shard("offsets", [8, 0]))
    store.checkout(1)  # each rank's own pieces are still whole
    assert_refused(store, tmp_path, "key 'emb'", "overlap", only=("consolidate", "diff", "export"))


def test_shards_that_disagree_on_dtype_are_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    store, h = hs

    def edit(d: dict[str, Any]) -> None:
        t = tensor_record(d, "emb")
        t["dtype"], t["shape"] = "int32", [16, 64]
    h.edit_doc(1, 1, "model_states", edit)
    assert_refused(store, tmp_path, "key 'emb'", "disagree", only=("consolidate", "diff", "export"))


# -- chunk frames ------------------------------------------------------------------------------


def _w_chunk(h: Hostile) -> tuple[str, int]:
    """The first chunk of ``w`` (64 KiB raw), which differs between steps 1 and 2, so diff reads it."""
    _, doc = h.doc(1, 0, "model_states")
    digest = tensor_record(doc, "w")["chunks"][0]
    return digest, h.chunk(digest)[4]


@pytest.mark.parametrize("declared", [1 << 30, 1 << 40], ids=["1GiB", "1TiB"])
def test_bomb_frames_are_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path, declared: int) -> None:
    store, h = hs
    digest, raw = _w_chunk(h)
    bomb = chunk_frame(codec.CODEC_ZSTD, raw, zstd_frame(declared, 8192))
    assert len(bomb) < 40_000
    h.replace_frame(digest, bomb)
    assert_refused(store, tmp_path, "key 'w'", f"declares {declared} bytes")
    assert any(f"declares {declared}" in d.problem for d in store.fsck(deep=True).damage)


_PEAK_SCRIPT = textwrap.dedent(
    """
    import gc, json, resource, sys
    import ckstore
    from ckstore.errors import CkstoreError
    from ckstore.layout import WorldLayout
    store = ckstore.open(sys.argv[1])
    store.checkout(1, sub_keys=["optim_states"])  # warm every code path on intact chunks
    store.fsck(deep=False)
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    errors = []
    for op in (lambda: store.checkout(1, WorldLayout.single()),):
        try:
            op()
        except CkstoreError as e:
            errors.append(type(e).__name__)
    rep = store.fsck(deep=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"before_kib": before, "after_kib": after, "errors": errors, "damage": len(rep.damage)}))
    """
)


@pytest.mark.parametrize(
    "declared,blocks",
    [(1 << 30, 8192), (1 << 40, 8192), (None, 8192)],
    ids=["declares-1GiB", "declares-1TiB", "undeclared-1GiB"],
)
def test_bomb_frames_never_allocate_what_they_declare(
    hs: tuple[ckstore.Store, Hostile], declared: int | None, blocks: int
) -> None:
    """Peak RSS of a real process checking out and deep-checking a store holding a bomb grows by
    far less than the bomb's size (the old decoder grew by the declared size, or died)."""
    store, h = hs
    digest, raw = _w_chunk(h)
    h.replace_frame(digest, chunk_frame(codec.CODEC_ZSTD, raw, zstd_frame(declared, blocks)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(ckstore.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(h.path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["errors"] == ["IntegrityError"]
    assert res["damage"] > 0
    grown_mib = (res["after_kib"] - res["before_kib"]) / 1024
    assert grown_mib < 64, f"peak RSS grew by {grown_mib:.0f} MiB"


MALFORMED = {
    "shorter than the header": lambda raw: b"\x01\x01\x00",
    "unknown codec": lambda raw: chunk_frame(9, raw, b""),
    "header length lies": lambda raw: chunk_frame(codec.CODEC_RAW, raw + 1, bytes(raw + 1)),
    "zstd header garbage": lambda raw: chunk_frame(codec.CODEC_ZSTD, raw, b"\x28\xb5\x2f\xfd\xff"),
    "not zstd": lambda raw: chunk_frame(codec.CODEC_ZSTD, raw, b"hello"),
    "zstd too short": lambda raw: chunk_frame(codec.CODEC_ZSTD, raw, zstd_frame(raw, 0)[:-1]),
    "zstd trailing frame": lambda raw: chunk_frame(codec.CODEC_ZSTD, raw, zstd_frame(None, 1) * 2),
    "zstd huge window": lambda raw: chunk_frame(codec.CODEC_ZSTD, raw, zstd_frame(None, 1, window_log=30)),
    "plane table truncated": lambda raw: chunk_frame(codec.CODEC_PLANES, raw, b"\x00\x00\x01", itemsize=4),
    "plane table lies": lambda raw: chunk_frame(codec.CODEC_PLANES, raw, b"\xff" * 16, itemsize=4),
    "plane itemsize 0": lambda raw: chunk_frame(codec.CODEC_PLANES, raw, b"", itemsize=0),
    "plane itemsize 17": lambda raw: chunk_frame(codec.CODEC_PLANES, raw, b"", itemsize=17),
    "plane mask past itemsize": lambda raw: chunk_frame(codec.CODEC_PLANES, raw, b"", itemsize=2, mask=0x8000),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frames_are_refused(hs: tuple[ckstore.Store, Hostile], tmp_path: Path, case: str) -> None:
    store, h = hs
    digest, raw = _w_chunk(h)
    h.replace_frame(digest, MALFORMED[case](raw))
    assert_refused(store, tmp_path, "key 'w'", digest)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frames_raise_integrity_error_from_the_codec(case: str) -> None:
    frame = MALFORMED[case](16384)
    with pytest.raises(IntegrityError):
        codec.decode_into(frame, memoryview(np.empty(16384, dtype=np.uint8)))


def test_flipped_frame_bytes_never_return_wrong_data(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    store, h = hs
    _, doc = h.doc(1, 0, "model_states")
    for path in ("w", "codes", "noise"):
        digest = tensor_record(doc, path)["chunks"][0]
        _, key, offset, length, _ = h.chunk(digest)
        frame = h.frame(digest)
        for pos in (3, 9, length // 2, length - 1):
            undo = h.write_pack(key, offset + pos, bytes([frame[pos] ^ 0x10]))
            with pytest.raises(IntegrityError, match=digest):
                store.checkout(1)
            undo()


# -- pack indexes ------------------------------------------------------------------------------


def test_pack_index_lies_are_refused(hs: tuple[ckstore.Store, Hostile]) -> None:
    _, h = hs
    data = (h.path / h.packs()[0]).read_bytes()
    entries = read_index(data)
    assert entries and all(off >= 8 and off + ln <= len(data) for _, off, ln, _ in entries)
    count_at = len(data) - 8
    cases = {
        "count past the pack": data[:count_at] + (0xFFFFFFFF).to_bytes(4, "little") + data[-4:],
        "footer magic": data[:-1] + b"X",
        "header magic": b"XXXX" + data[4:],
        "version": data[:4] + b"\x02" + data[5:],
        "truncated": data[:10],
    }
    start = len(data) - 8 - 32 * len(entries)
    offset_at = start + 16  # entry 0's u64 offset
    cases["entry past the index"] = (
        data[:offset_at] + (len(data)).to_bytes(8, "little") + data[offset_at + 8 :]
    )
    cases["entry inside the header"] = data[:offset_at] + (2).to_bytes(8, "little") + data[offset_at + 8 :]
    length_at = start + 24
    cases["frame longer than its raw bytes allow"] = (
        data[:length_at] + (10**6).to_bytes(4, "little") + data[length_at + 4 :]
    )
    for name, bad in cases.items():
        with pytest.raises(IntegrityError):
            read_index(bad)
        assert name


# -- the tree walker ---------------------------------------------------------------------------


def test_tree_walker_rebuilds_at_the_depth_limit_without_recursion() -> None:
    deep = _deep(MAX_DEPTH)
    tree.check_tree(deep, 0)
    value = unflatten(deep, lambda i: None)
    for _ in range(MAX_DEPTH):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value is None
    assert tree.MAX_DEPTH == MAX_DEPTH


def test_tree_difference_names_the_first_difference() -> None:
    a = ["d", [[["s", "a"], ["l", [["i", 1], ["i", 2]]]], [["f", "1.5"], ["T", 0]]]]
    assert tree.tree_difference(a, a) is None
    b = json.loads(json.dumps(a))
    b[1][0][1][1][1] = ["i", 3]
    assert tree.tree_difference(a, b) == "a/1"
    c = json.loads(json.dumps(a))
    c[1][0][1][1].append(["n"])
    assert tree.tree_difference(a, c) == "a"
    d = json.loads(json.dumps(a))
    d[1][1][0] = ["f", "2.5"]
    assert tree.tree_difference(a, d) == "<root>"
    assert tree.tree_difference(a, ["l", []]) == "<root>"


def test_manifests_cost_no_more_than_their_chunks(hs: tuple[ckstore.Store, Hostile]) -> None:
    """Validation touches records and tree nodes, never tensor bytes: a manifest of a 1 TiB tensor
    parses without allocating it."""
    doc = {
        "version": 1,
        "tree": ["T", 0],
        "tensors": [
            {
                "path": "big", "dtype": "uint8", "shape": [1 << 40], "nbytes": 1 << 40,
                "chunk_size": 1 << 30, "chunks": ["00" * 16] * 1024,
            }
        ],
    }  # fmt: skip
    import zstandard

    man = Manifest.from_bytes(zstandard.compress(json.dumps(doc).encode()))
    assert man.logical_bytes == 1 << 40


def test_only_ckstore_errors_escape_from_every_reader(hs: tuple[ckstore.Store, Hostile], tmp_path: Path) -> None:
    """A sweep over every tensor's first frame: truncated to each length class, every reader
    raises a CkstoreError (never struct.error, KeyError, MemoryError...)."""
    store, h = hs
    _, doc = h.doc(1, 0, "model_states")
    for t in doc["tensors"]:
        if not t["chunks"]:
            continue
        digest = t["chunks"][0]
        frame = h.frame(digest)
        for cut in (0, 1, 7, 8, 9, len(frame) // 2, len(frame) - 1):
            undo = h.replace_frame(digest, frame[:cut])
            for name, read in readers(store, tmp_path).items():
                try:
                    read()
                except CkstoreError:
                    continue
                if name != "diff":  # diff may decide from digests alone
                    pytest.fail(f"{name} read a truncated frame of {t['path']} without an error")
            undo()
