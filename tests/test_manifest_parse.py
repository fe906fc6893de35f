"""The fast paths of manifest parsing decide exactly as the checked paths they stand in front of.

A tensor record of exact JSON types is checked inline (``TensorRecord.from_json``), a tree walked
without key paths (``tree.check_tree``, ``tree.rebuild(..., tensor=)``), and a manifest as
ckstore writes it parsed one record at a time (``Manifest.from_bytes``); anything they are unsure
of goes to the full, checked path. Each test generates valid and damaged inputs and asserts the
two paths accept the same inputs, build the same values and raise the same errors, and that the
fast path really ran (a count of its outcomes)."""

from __future__ import annotations

import copy
import json
from collections import Counter
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckstore.errors import IntegrityError
from ckstore.format import manifest as manifest_mod
from ckstore.format import tree as tree_mod
from ckstore.format.manifest import Manifest, TensorRecord, tensor_json
from ckstore.format.tensorio import unflatten

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

_JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 1 << 31), st.just(1 << 40), st.floats(allow_nan=False),
    st.text(max_size=6), st.just("0" * 32), st.just("00" * 15 + "0 "), st.just(" " + "00" * 16),
    st.just("AB" * 16), st.just("zz" * 16), st.lists(st.integers(-1, 5), max_size=3), st.just({}),
    st.sampled_from(["float32", "bfloat16", "uint8", "float", "qint8", "float99"]),
)  # fmt: skip
_FIELDS = ["path", "dtype", "shape", "nbytes", "chunk_size", "chunks", "shard", "extra"]


def _valid_record(n: int, dtype: str, chunk: int) -> dict[str, Any]:
    size = {"float32": 4, "bfloat16": 2, "uint8": 1}[dtype]
    nbytes = n * size
    chunks = [bytes([i]) * 16 for i in range(-(-nbytes // chunk))]
    return tensor_json(f"t.{n}", dtype, (n,), nbytes, chunk, chunks, None)


@st.composite
def records(draw: st.DrawFn) -> Any:
    obj: Any = _valid_record(
        draw(st.integers(0, 40)), draw(st.sampled_from(["float32", "bfloat16", "uint8"])), draw(st.sampled_from([4, 16, 64]))
    )
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(_FIELDS))
        how = draw(st.sampled_from(["set", "drop", "list-item", "digest"]))
        if how == "digest" and isinstance(obj.get("chunks"), list) and obj["chunks"]:
            at = draw(st.integers(0, len(obj["chunks"]) - 1))
            h = obj["chunks"][at]
            obj["chunks"][at] = draw(st.sampled_from([h.upper(), " " + h, h + "\n", h[:2] + " " + h[2:], h[:-2], h + "00", h[:31] + "g"]))
        elif how == "drop":
            obj.pop(name, None)
        elif how == "list-item" and isinstance(obj.get(name), list) and obj[name]:
            obj[name][draw(st.integers(0, len(obj[name]) - 1))] = draw(_JSON_VALUES)
        else:
            obj[name] = draw(_JSON_VALUES)
    if draw(st.integers(0, 30)) == 0:
        obj = draw(_JSON_VALUES)  # not an object at all
    return obj


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except IntegrityError as e:
        return "error", str(e)


RECORDS: Counter[str] = Counter()


@SETTINGS
@given(records())
def test_a_record_parses_as_its_checked_path_parses_it(obj: Any) -> None:
    fast = _outcome(TensorRecord.from_json, copy.deepcopy(obj), "at: ")
    checked = _outcome(TensorRecord._checked, copy.deepcopy(obj), "at: ")
    assert fast == checked
    RECORDS[fast[0]] += 1


def test_records_of_both_kinds_were_generated() -> None:
    # the property above saw valid records and refused ones (run in file order, after it)
    assert RECORDS["ok"] >= 50 and RECORDS["error"] >= 50, RECORDS


def test_records_share_their_dtype_name() -> None:
    a = TensorRecord.from_json(json.loads(json.dumps(_valid_record(3, "float32", 16))))
    b = TensorRecord._checked(json.loads(json.dumps(_valid_record(5, "float32", 16))), "")
    assert a.dtype is b.dtype


@pytest.mark.parametrize(
    "shape,ok",
    [
        ([(1 << 63) - 1, 0], True),
        ([1 << 63, 0], False),
        ([0, 1 << 70], False),
        ([3, 0, 1 << 64], False),
    ],
)
def test_a_dim_past_signed_64_bits_is_refused_on_both_paths(shape: list[int], ok: bool) -> None:
    """A shape holding a 0 has no bytes whatever its other dims say; a dim of 2**63 or more is
    still refused (torch cannot make it), by the inline checks and the checked path alike, and a
    shard's global shape and offsets are bounded the same way."""
    obj = tensor_json("t", "float32", shape, 0, 16, [], None)
    fast = _outcome(TensorRecord.from_json, copy.deepcopy(obj), "at: ")
    assert fast == _outcome(TensorRecord._checked, copy.deepcopy(obj), "at: ")
    assert fast[0] == ("ok" if ok else "error")
    if not ok:
        assert "below 2**63" in fast[1]
    sharded = {**obj, "shape": [0], "shard": {"global_shape": [shape[-1]], "offsets": [0], "splits": []}}
    assert _outcome(TensorRecord.from_json, sharded, "at: ")[0] == ("ok" if shape[-1] < 1 << 63 else "error")


_KEYS = st.one_of(
    st.builds(lambda s: ["s", s], st.sampled_from(["a", "b", "1", ""])), st.builds(lambda i: ["i", i], st.integers(0, 2)),
    st.builds(lambda b: ["b", b], st.booleans()), st.sampled_from([["f", "1.0"], ["f", "nan"], ["n"], ["y", "AA=="], ["s"], 7, ["i", True], ["s", 1], ["i", "7"], ["", 1]]),
)  # fmt: skip
_LEAVES = st.one_of(
    st.builds(lambda s: ["s", s], st.text(max_size=3)), st.builds(lambda i: ["i", i], st.integers(-2, 2)),
    st.sampled_from([
        ["n"], ["b", True], ["f", "2.5"], ["f", "inf"], ["f", "pi"], ["y", "AAE="], ["y", "!!"], ["i", "7"], ["i", True],
        ["s", 1], ["n", 1], ["Q", 1], [], [5], "x", ["P", "AA=="], ["T", True], ["T", "0"], ["T", -1], ["l"], ["d", {}],
    ]),  # fmt: skip
)


@st.composite
def trees(draw: st.DrawFn) -> tuple[Any, int]:
    """A tree with ``n`` tensor nodes ``["T", 0..n-1]`` in shuffled places, then sometimes damaged."""
    n = draw(st.integers(0, 6))
    order = draw(st.permutations(range(n)))
    leaves = [["T", i] for i in order] + draw(st.lists(_LEAVES, max_size=4))
    leaves = draw(st.permutations(leaves))

    def container(kids: list[Any]) -> Any:
        tag = draw(st.sampled_from("dlt"))
        if tag == "d":
            return ["d", [[draw(_KEYS), k] for k in kids]]
        return [tag, kids]

    def build(items: list[Any]) -> Any:
        if not items:
            return container([])
        if len(items) == 1:
            return items[0] if draw(st.booleans()) else container(items)
        groups = draw(st.integers(1, min(4, len(items))))
        if groups == 1:  # a container of the items themselves
            return container(items)
        cuts = sorted(draw(st.lists(st.integers(1, len(items) - 1), min_size=groups - 1, max_size=groups - 1, unique=True)))
        parts = [items[a:b] for a, b in zip([0, *cuts], [*cuts, len(items)])]
        return container([build(p) for p in parts])

    tree = build(leaves)
    if draw(st.integers(0, 4)) == 0:  # a tensor used twice, or one missing
        tree = ["l", [tree, ["T", draw(st.integers(0, 7))]]]
    return tree, max(0, n + draw(st.sampled_from([0, 0, 0, 1, -1])))


def _check(tree: Any, n: int) -> None:
    tree_mod.check_tree(tree, n, "at: ")


def _check_full(tree: Any, n: int) -> None:
    passes = tree_mod._passes
    tree_mod._passes = lambda tree, n: False  # type: ignore[assignment]
    try:
        tree_mod.check_tree(tree, n, "at: ")
    finally:
        tree_mod._passes = passes


TREES: Counter[str] = Counter()


@SETTINGS
@given(trees())
def test_a_tree_is_checked_as_its_full_walk_checks_it(case: tuple[Any, int]) -> None:
    tree, n = case
    fast, full = _outcome(_check, tree, n), _outcome(_check_full, tree, n)
    assert fast == full
    passed = tree_mod._passes(tree, n)
    assert not passed or full[0] == "ok"  # the fast walk never accepts what the full one refuses
    TREES["fast" if passed else full[0]] += 1


def test_trees_of_every_kind_were_generated() -> None:
    assert TREES["fast"] >= 50 and TREES["error"] >= 50, TREES


REBUILT: Counter[str] = Counter()


@SETTINGS
@given(trees(), st.booleans())
def test_a_tree_rebuilds_as_its_full_walk_rebuilds_it(case: tuple[Any, int], allow_pickle: bool) -> None:
    tree, _ = case
    calls: list[int] = []

    def tensor_at(i: int) -> Any:
        calls.append(i)
        return ("tensor", i)

    def run(fn: Any) -> tuple[str, Any]:
        calls.clear()
        try:
            return "ok", (repr(fn()), list(calls))  # repr: a NaN equals itself only as text
        except (IntegrityError, TypeError) as e:  # UnsupportedValueError (a pickle) is a TypeError
            return type(e).__name__, str(e)
        except Exception as e:  # what the pickled payloads of generated trees raise when loaded
            return "load", type(e).__name__

    fast = run(lambda: unflatten(tree, tensor_at, allow_pickle=allow_pickle, where="at: "))
    plain = tree_mod._plain
    tree_mod._plain = lambda node, depth, tensor: (_ for _ in ()).throw(tree_mod._Irregular())  # type: ignore[assignment]
    try:
        full = run(lambda: unflatten(tree, tensor_at, allow_pickle=allow_pickle, where="at: "))
    finally:
        tree_mod._plain = plain
    assert fast == full  # the same values, keys in the same order, tensors fetched in the same order
    REBUILT[fast[0]] += 1


def test_rebuilt_trees_of_every_kind_were_generated() -> None:
    assert REBUILT["ok"] >= 50 and REBUILT["IntegrityError"] >= 20, REBUILT


def test_a_tree_at_the_depth_limit_rebuilds_on_both_walks() -> None:
    deep: Any = ["T", 0]
    for _ in range(tree_mod.MAX_DEPTH):
        deep = ["d", [[["s", "k"], deep]]]
    assert tree_mod._passes(deep, 1)
    assert tree_mod._plain(deep, 0, lambda i: "leaf") is not None
    too_deep = ["l", [deep]]
    assert not tree_mod._passes(too_deep, 1)
    with pytest.raises(IntegrityError, match="deeper than"):
        tree_mod.check_tree(too_deep, 1)


# -- whole manifests ------------------------------------------------------------------------------


def _doc_text(tree: Any, recs: list[Any], order: list[str], space: str, extra: dict[str, Any]) -> str:
    fields = {"version": 1, "tree": tree, "tensors": recs, **extra}
    sep = (f"{space},{space}", f"{space}:{space}")
    return space + "{" + space + f"{sep[0]}".join(
        json.dumps(k) + sep[1] + json.dumps(fields[k], separators=sep) for k in order if k in fields
    ) + space + "}" + space


@st.composite
def manifests(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(0, 4))
    recs: list[Any] = [_valid_record(i + 1, "float32", 16) for i in range(n)]
    if n and draw(st.integers(0, 3)) == 0:
        recs[draw(st.integers(0, n - 1))] = draw(records())
    tree = ["d", [[["s", f"k{i}"], ["T", i]] for i in range(n)]]
    order = draw(st.permutations(["version", "tree", "tensors"]))
    if draw(st.integers(0, 5)) == 0:
        order = order[: draw(st.integers(0, 2))]
    extra = draw(st.sampled_from([{}, {"note": [1, {"a": None}]}, {"version": 2}, {"tensors": {}}]))
    text = _doc_text(tree, recs, [*order, *extra], draw(st.sampled_from(["", " ", "\n\t"])), extra)
    damage = draw(st.sampled_from(["none", "none", "none", "cut", "byte"]))
    if damage == "cut" and text:
        text = text[: draw(st.integers(0, len(text) - 1))]
    elif damage == "byte" and text:
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + draw(st.sampled_from(list('{}[],:"x 0'))) + text[at + 1 :]
    return zstandard.compress(text.encode())


def _parse_whole(data: bytes) -> Manifest:
    stream = manifest_mod._stream
    manifest_mod._stream = lambda text, where: None  # type: ignore[assignment]
    try:
        return Manifest.from_bytes(data, "m")
    finally:
        manifest_mod._stream = stream


MANIFESTS: Counter[str] = Counter()


@SETTINGS
@given(manifests())
def test_a_manifest_parses_as_its_whole_parse_does(data: bytes) -> None:
    fast, whole = _outcome(Manifest.from_bytes, data, "m"), _outcome(_parse_whole, data)
    if fast[0] == "error" and whole[0] == "error":
        # a record refused while streaming is refused before a syntax error further on is seen:
        # both are errors naming the manifest, which need not be the same one
        assert fast[1].startswith("m: ") and whole[1].startswith("m: ")
        text = zstandard.decompress(data).decode(errors="replace")
        try:
            json.loads(text)
        except ValueError:
            MANIFESTS["error, not JSON"] += 1
            return
    assert fast == whole
    streamed = _outcome(manifest_mod._stream, zstandard.decompress(data).decode(), "m: ") if fast[0] == "ok" else None
    MANIFESTS["streamed" if streamed and streamed[1] is not None else fast[0]] += 1


def test_manifests_of_every_kind_were_generated() -> None:
    assert MANIFESTS["streamed"] >= 50 and MANIFESTS["error"] >= 30 and MANIFESTS["ok"] >= 5, MANIFESTS
