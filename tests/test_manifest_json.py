"""Manifests are JSON written through orjson, which writes the bytes json writes, and through json
where orjson refuses (ints past 64 bits); json reads them."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import pytest
import torch
import zstandard
from helpers import assert_same
from hypothesis import given, settings
from hypothesis import strategies as st

import ckstore
from ckstore.format.manifest import Manifest, manifest_bytes, tensor_json

#: text json and orjson must write alike: escapes, quotes, non-ASCII, separators of every kind
AWKWARD = ["", 'q"uote', "back\\slash", "tab\tnew\nline\r", "\x00\x01\x1f\x7f", "é ü 漢字 🚀", "\u2028\u2029", "/"]


def _json_bytes(tree: Any, tensors: list[dict[str, Any]]) -> bytes:
    doc = {"version": 1, "tree": tree, "tensors": tensors}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _raw(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data)


def test_a_manifest_is_the_bytes_json_writes() -> None:
    tree = ["d", [[["s", s], ["s", s]] for s in AWKWARD] + [[["s", "t"], ["T", 0]], [["i", 7], ["f", "nan"]]]]
    tensors = [tensor_json("w\n\u2028é", "float32", (2, 3), 24, 1 << 20, [bytes(range(16))], None)]
    written = _raw(manifest_bytes(tree, tensors))
    assert written == _json_bytes(tree, tensors)
    assert written == orjson.dumps({"version": 1, "tree": tree, "tensors": tensors})  # orjson wrote it


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)  # (no lone surrogates)
_SCALARS = st.one_of(
    st.builds(lambda s: ["s", s], _TEXT), st.builds(lambda i: ["i", i], st.integers(-(2**63), 2**64 - 1)),
    st.builds(lambda b: ["b", b], st.booleans()), st.just(["n"]),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(_SCALARS, lambda kids: st.builds(lambda xs: ["l", xs], st.lists(kids, max_size=4)), max_leaves=20),
    _TEXT,
)
def test_any_tree_orjson_writes_is_the_bytes_json_writes(tree: Any, path: str) -> None:
    tensors = [tensor_json(path, "float32", (1,), 4, 1 << 20, [bytes(16)], None)]
    assert _raw(manifest_bytes(tree, tensors)) == _json_bytes(tree, tensors)


@pytest.mark.parametrize("big", [2**64, -(2**63) - 1, 10**20, -(10**30), 2**13_999])
def test_ints_past_64_bits_are_written_by_json_and_read_exactly(big: int) -> None:
    tree = ["l", [["i", big], ["i", -1], ["T", 0]]]
    tensors = [tensor_json("w", "uint8", (1,), 1, 1 << 20, [bytes(16)], None)]
    with pytest.raises(TypeError):  # what orjson refuses to write
        orjson.dumps(tree)
    raw = _raw(manifest_bytes(tree, tensors))
    assert raw == _json_bytes(tree, tensors)
    back = Manifest.from_bytes(zstandard.compress(raw)).tree
    assert back == tree and type(back[1][0][1]) is int


def test_state_of_awkward_values_round_trips(store: ckstore.Store) -> None:
    state = {
        "text": {f"{s.replace(chr(0), '')}{i}": s for i, s in enumerate(AWKWARD)},  # (no key may hold a NUL)
        "ints": [2**64, -(2**70), 2**63 - 1, 2**63 + 1, 10**19, -(2**63), 12345],
        "floats": (math.inf, -0.0, 1e-5, 5e-324),
        "w": torch.arange(6, dtype=torch.float32),
    }
    store.commit(1, {0: {"model_states": state}})
    assert_same(store.checkout(1)[0]["model_states"], state)
