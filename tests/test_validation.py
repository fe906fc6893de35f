"""Hostile names and values are refused before the first byte is written, alike on SQLite and
PostgreSQL.

Every refused commit below carries a new tensor beside the bad value, so a check made only after
writing would leave a pack behind: each test proves that no object and no file appeared in the
store, no pending checkpoint is left, and the earlier checkpoint is intact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import bits

import ckstore
from ckstore.errors import InvalidRefError, LayoutError, StoreConfigError, UnsupportedValueError
from ckstore.format.tensorio import MAX_DEPTH, flatten
from ckstore.refs import parse_ref

CHUNK = 64 * 1024
BIG = 2 * CHUNK // 4  # floats: a tensor of two chunks


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def vstore(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ckstore.Store]:
    """A store on each catalog, holding one checkpoint (step 1)."""
    catalog = request.getfixturevalue("pg_catalog_url") if request.param == "postgres" else None
    s = ckstore.open(tmp_path / "store", run="exp", catalog=catalog, chunk_size=CHUNK, pack_size=16 * CHUNK)
    s.commit(1, {0: {"m": {"w": torch.arange(BIG, dtype=torch.float32)}}}, {"loss": 1.0}, tags=["first"])
    yield s
    s.close()


def fresh(seed: int = 0) -> torch.Tensor:
    """A tensor the store does not hold yet (writing it would add a pack)."""
    return torch.randn(BIG, generator=torch.Generator().manual_seed(100 + seed))


def snapshot(store: ckstore.Store) -> tuple[Any, ...]:
    folder = Path(store.location)
    files = sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and not p.name.startswith("catalog.db")
    )
    checkpoints = [(c.id, c.step, c.tags, c.metrics) for c in store.checkpoints()]
    return sorted(i.key for i in store.blobs.list()), files, store.catalog.pending(), checkpoints


def refused(store: ckstore.Store, error: type[Exception], match: str, commit: Callable[[], Any]) -> str:
    """``commit()`` raises ``error`` matching ``match``, and the store is exactly as it was."""
    before = snapshot(store)
    assert len(before[0]) >= 2  # the config and step 1's pack: a listing that can change
    with pytest.raises(error, match=match) as info:
        commit()
    assert snapshot(store) == before
    got = store.checkout(1)[0]["m"]["w"]
    assert bits(got) == bits(torch.arange(BIG, dtype=torch.float32))
    return str(info.value)


def states(**extra: Any) -> dict[int, dict[str, Any]]:
    return {0: {"m": {"w": fresh(), **extra}}}


# -- nesting --------------------------------------------------------------------------------------


def nested(depth: int, leaf: Any) -> Any:
    for i in range(depth):
        leaf = {"k": leaf} if i % 2 else [leaf]
    return leaf


def test_nesting_deeper_than_the_limit_is_refused_naming_the_key(vstore: ckstore.Store) -> None:
    too_deep = nested(MAX_DEPTH, 1.5)  # under key "deep": MAX_DEPTH + 1 levels in all
    msg = refused(vstore, UnsupportedValueError, f"nested deeper than {MAX_DEPTH} levels",
                  lambda: vstore.commit(2, states(deep=too_deep)))  # fmt: skip
    assert "rank 0, m, key 'deep/" in msg
    # far deeper than the interpreter's recursion limit: the same clear error, no RecursionError
    refused(vstore, UnsupportedValueError, "nested deeper", lambda: vstore.commit(2, states(deep=nested(5000, 1))))
    # the limit itself is accepted, and read back as it was
    ok = nested(MAX_DEPTH - 1, torch.ones(2))
    vstore.commit(2, states(deep=ok))
    got = vstore.checkout(2)[0]["m"]["deep"]
    for i in reversed(range(MAX_DEPTH - 1)):
        got = got["k"] if i % 2 else got[0]
    assert torch.equal(got, torch.ones(2))


def test_an_empty_container_at_the_limit_reads_back(vstore: ckstore.Store) -> None:
    """Encoding and decoding draw the line at the same depth: what a commit accepts, checkout reads."""
    edge = nested(MAX_DEPTH - 1, {})  # under key "deep": an empty dict MAX_DEPTH keys down
    vstore.commit(2, states(deep=edge))
    assert vstore.checkout(2)[0]["m"]["deep"] == edge


# -- text that no catalog column or manifest can hold ----------------------------------------------

SURROGATE = "bad\udc80name"
NUL = "bad\x00name"

# (what, how to commit it, the error, what the message names)
BAD_TEXT: list[tuple[str, Callable[[ckstore.Store, str], Any], type[Exception], str]] = [
    ("key", lambda s, t: s.commit(2, states(**{t: 1})), UnsupportedValueError, "dict key"),
    ("nested key", lambda s, t: s.commit(2, states(inner={t: torch.ones(1)})), UnsupportedValueError, "key 'inner'"),
    ("sub_key", lambda s, t: s.commit(2, {0: {"m": {"w": fresh()}, t: {"x": 1}}}), UnsupportedValueError,
     "sub-checkpoint key"),
    ("run", lambda s, t: s.commit(2, states(), run=t), InvalidRefError, "invalid run name"),
    ("tag", lambda s, t: s.commit(2, states(), tags=[t]), InvalidRefError, "invalid tag name"),
    ("kind", lambda s, t: s.commit(2, states(), kind=t), InvalidRefError, "invalid kind name"),
    ("metric", lambda s, t: s.commit(2, states(), {t: 1.0}), StoreConfigError, "metric name"),
]  # fmt: skip


@pytest.mark.parametrize("text", [SURROGATE, NUL], ids=["surrogate", "nul"])
@pytest.mark.parametrize(("what", "commit", "error", "names"), BAD_TEXT, ids=[b[0] for b in BAD_TEXT])
def test_names_with_nul_or_lone_surrogates_are_refused(
    vstore: ckstore.Store, text: str, what: str, commit: Callable[[ckstore.Store, str], Any],
    error: type[Exception], names: str,
) -> None:  # fmt: skip
    msg = refused(vstore, error, names, lambda: commit(vstore, text))
    if what in ("key", "sub_key", "metric", "nested key"):
        assert ("NUL" if text == NUL else "surrogate") in msg, msg


def test_string_values_without_utf8_encoding_are_refused(vstore: ckstore.Store) -> None:
    msg = refused(vstore, UnsupportedValueError, "lone surrogate", lambda: vstore.commit(2, states(note=SURROGATE)))
    assert "key 'note'" in msg and "store it as bytes" in msg
    vstore.commit(2, states(note="ok \x00 inside a value", emoji="\U0001f600"))  # NUL and astral: fine
    assert vstore.checkout(2)[0]["m"]["emoji"] == "\U0001f600"


def test_ints_too_long_for_the_manifest_are_refused(vstore: ckstore.Store) -> None:
    refused(vstore, UnsupportedValueError, "key 'n'.*bits", lambda: vstore.commit(2, states(n=10**5000)))
    refused(vstore, UnsupportedValueError, "dict key", lambda: vstore.commit(2, states(d={10**5000: 1})))
    vstore.commit(2, states(n=10**300))
    assert vstore.checkout(2)[0]["m"]["n"] == 10**300


# (what, commit with a name of n characters, the column's length)
LONG: list[tuple[str, Callable[[ckstore.Store, int], Any], int]] = [
    ("run", lambda s, n: s.commit(2, states(), run="r" * n), 255),
    ("tag", lambda s, n: s.commit(2, states(), tags=["t" * n]), 255),
    ("kind", lambda s, n: s.commit(2, states(), kind="k" * n), 64),
    ("sub_key", lambda s, n: s.commit(2, {0: {"s" * n: {"w": fresh()}}}), 255),
    ("metric", lambda s, n: s.commit(2, states(), {"m" * n: 1.0}), 255),
]


@pytest.mark.parametrize(("what", "commit", "longest"), LONG, ids=[x[0] for x in LONG])
def test_names_longer_than_their_column_are_refused(
    vstore: ckstore.Store, what: str, commit: Callable[[ckstore.Store, int], Any], longest: int
) -> None:
    error: type[Exception] = StoreConfigError if what == "metric" else InvalidRefError
    if what == "sub_key":
        error = UnsupportedValueError
    msg = refused(vstore, error, str(longest), lambda: commit(vstore, longest + 1))
    assert what.replace("_", "-").split("-")[0] in msg.replace("_", "-"), msg
    ck = commit(vstore, longest)  # the longest the column holds is stored, on PostgreSQL too
    assert ck.step == 2


# -- numbers the catalog cannot hold ----------------------------------------------------------------


@pytest.mark.parametrize("rank", [2**31, -1, 10**40], ids=["2**31", "negative", "huge"])
def test_ranks_outside_int32_are_refused(vstore: ckstore.Store, rank: int) -> None:
    refused(vstore, UnsupportedValueError, "ranks below 2\\*\\*31", lambda: vstore.commit(2, {rank: states()[0]}))


def test_the_largest_rank_is_stored(vstore: ckstore.Store) -> None:
    ck = vstore.commit(2, {2**31 - 1: {"m": {"w": torch.ones(2)}}})
    assert ck.ranks == (2**31 - 1,)
    assert torch.equal(vstore.checkout(2)[2**31 - 1]["m"]["w"], torch.ones(2))


@pytest.mark.parametrize("step", [2**63, -1, 10**30, True, 1.0], ids=["2**63", "negative", "huge", "bool", "float"])
def test_steps_outside_int64_are_refused(vstore: ckstore.Store, step: Any) -> None:
    refused(vstore, StoreConfigError, "step must be", lambda: vstore.commit(step, states()))


def test_the_largest_step_is_stored_and_resolved(vstore: ckstore.Store) -> None:
    vstore.commit(2**63 - 1, states())
    assert vstore.resolve(2**63 - 1).step == 2**63 - 1 == vstore.resolve(str(2**63 - 1)).step
    assert vstore.resolve("latest").step == 2**63 - 1


BAD_METRICS: list[tuple[str, Any, str]] = [
    ("tensor of 3", torch.tensor([1.0, 2.0, 3.0]), "single number.*3 elements"),
    ("empty tensor", torch.tensor([]), "single number.*0 elements"),
    ("numpy array", np.array([1.0, 2.0]), "single number.*2 elements"),
    ("10**400", 10**400, "beyond what a float holds"),
    ("inf", math.inf, "must be finite"),
    ("-inf", -math.inf, "must be finite"),
    ("tensor inf", torch.tensor(float("inf")), "must be finite"),
    ("text", "low", "must be a number"),
    ("bool", True, "must be a number"),
    ("complex", torch.tensor(1 + 2j), "must be a number"),
]


@pytest.mark.parametrize(("value", "match"), [b[1:] for b in BAD_METRICS], ids=[b[0] for b in BAD_METRICS])
def test_metrics_that_are_not_one_finite_number_are_refused(vstore: ckstore.Store, value: Any, match: str) -> None:
    msg = refused(vstore, StoreConfigError, match, lambda: vstore.commit(2, states(), {"loss": value}))
    assert "metric 'loss'" in msg


def test_one_element_tensors_numpy_scalars_and_nan_are_metrics(vstore: ckstore.Store) -> None:
    ck = vstore.commit(
        2, states(), {"a": torch.tensor([0.25]), "b": np.float32(0.5), "c": 3, "d": math.nan, "e": 1e308}
    )
    got = vstore.resolve(2).metrics
    assert ck.metrics == got
    assert (got["a"], got["b"], got["c"], got["e"]) == (0.25, 0.5, 3.0, 1e308) and math.isnan(got["d"])


def test_metrics_must_be_a_dict(vstore: ckstore.Store) -> None:
    refused(vstore, StoreConfigError, "metrics must be a dict", lambda: vstore.commit(2, states(), [("loss", 1.0)]))  # type: ignore[arg-type]


# -- tags -----------------------------------------------------------------------------------------


def test_a_string_of_tags_is_refused_not_split(vstore: ckstore.Store) -> None:
    msg = refused(vstore, InvalidRefError, "tags must be a list", lambda: vstore.commit(2, states(), tags="abc"))
    assert "tags=['abc']" in msg
    assert vstore.commit(2, states(), tags=["abc"]).tags == ("abc",)


# -- refs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", ["١٢", "exp@١", "²", "1\u0661"], ids=["arabic", "run-arabic", "superscript", "mixed"])
def test_refs_take_only_ascii_digits(vstore: ckstore.Store, ref: str) -> None:
    vstore.commit(12, states())
    with pytest.raises(InvalidRefError):
        parse_ref(ref)
    with pytest.raises(InvalidRefError):
        vstore.resolve(ref)


@pytest.mark.parametrize("ref", [2**63, str(2**63), "exp@" + "9" * 30, "9" * 5000], ids=["int", "str", "run", "5000"])
def test_huge_steps_in_refs_are_invalid_refs(vstore: ckstore.Store, ref: str | int) -> None:
    with pytest.raises(InvalidRefError, match="below 2\\*\\*63"):
        vstore.resolve(ref)
    from ckstore.cli import main

    res = CliRunner().invoke(main, ["--store", vstore.location, "show", str(ref)])
    assert res.exit_code != 0 and "below 2**63" in res.output and "Traceback" not in res.output


def test_metric_names_in_refs_are_checked(vstore: ckstore.Store) -> None:
    with pytest.raises(InvalidRefError, match="NUL"):
        vstore.resolve("min:lo\x00ss")
    with pytest.raises(InvalidRefError, match="surrogate"):
        vstore.resolve("max:\udcff")
    assert vstore.resolve("min:loss").step == 1


def test_metric_names_holding_at_signs_resolve_with_and_without_a_run(vstore: ckstore.Store) -> None:
    vstore.commit(2, states(), {"val@loss": 0.5, "a:b@c": 3.0})
    vstore.commit(3, states(), {"val@loss": 0.7, "a:b@c": 1.0})
    assert (parse_ref("min:val@loss").run, parse_ref("min:val@loss").value) == (None, "val@loss")
    assert vstore.resolve("min:val@loss").step == 2  # the default run's
    assert vstore.resolve("exp@min:val@loss").step == 2
    assert vstore.resolve("max:a:b@c").step == 2 and vstore.resolve("exp@min:a:b@c").step == 3
    assert vstore.resolve(str(parse_ref("exp@max:val@loss"))).step == 3  # a ref's text reads back


def test_an_empty_kind_is_refused(vstore: ckstore.Store) -> None:
    msg = refused(vstore, InvalidRefError, "kind must not be empty", lambda: vstore.commit(2, states(), kind=""))
    assert "'checkpoint'" in msg
    assert vstore.commit(2, states()).kind == "checkpoint"


def test_names_may_not_end_in_a_newline(vstore: ckstore.Store) -> None:
    refused(vstore, InvalidRefError, "invalid run name", lambda: vstore.commit(2, states(), run="exp\n"))
    refused(vstore, InvalidRefError, "invalid tag name", lambda: vstore.commit(2, states(), tags=["t\n"]))


# -- key paths that read alike ---------------------------------------------------------------------

COLLIDING: list[tuple[str, Any, str, str]] = [
    ("slash", {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}}, "['a/b']", "['a', 'b']"),
    ("int and str", {1: torch.ones(1), "1": 2}, "[1]", "['1']"),
    ("None and str", {None: 1, "None": 2}, "[None]", "['None']"),
    ("bool and str", {True: 1, "True": 2}, "[True]", "['True']"),
    ("float and str", {1.5: 1, "1.5": 2}, "[1.5]", "['1.5']"),
    ("list index", {"l": [torch.ones(1)], "l/0": 3}, "['l', 0]", "['l/0']"),
    ("deep", {"x": {"a": {"b/c": 1}, "a/b": {"c": 2}}}, "['x', 'a', 'b/c']", "['x', 'a/b', 'c']"),
    ("empty dict", {"a/b": {}, "a": {"b": 1}}, "['a/b']", "['a', 'b']"),
]


@pytest.mark.parametrize(("tree", "one", "other"), [c[1:] for c in COLLIDING], ids=[c[0] for c in COLLIDING])
def test_key_paths_that_read_alike_are_refused_naming_both(
    vstore: ckstore.Store, tree: Any, one: str, other: str
) -> None:
    msg = refused(vstore, UnsupportedValueError, "would both read as",
                  lambda: vstore.commit(2, {0: {"m": {"w": fresh()}, "s": tree}}))  # fmt: skip
    assert msg.startswith("rank 0, s, ") and one in msg and other in msg, msg


def test_nan_keys_read_alike() -> None:
    with pytest.raises(UnsupportedValueError, match="would both read as 'nan'"):
        flatten({float("nan"): 1, float("nan"): 2})


def test_keys_that_only_look_alike_are_stored(vstore: ckstore.Store) -> None:
    tree = {
        "a/b": torch.ones(2),  # a slash alone is fine
        "a": {"c": torch.zeros(2)},
        1: "int key",
        "2": "str key",
        "": {"": 5},
        "l": [1, [2]],
        "l/1/1": 3,  # "l/1/0" is the path of the 2 above, not this one
    }
    vstore.commit(2, {0: {"s": tree}})
    got = vstore.checkout(2)[0]["s"]
    assert torch.equal(got["a/b"], torch.ones(2)) and torch.equal(got["a"]["c"], torch.zeros(2))
    assert (got[1], got["2"], got[""], got["l"], got["l/1/1"]) == ("int key", "str key", {"": 5}, [1, [2]], 3)


# -- arguments of checkout, copy and open ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sub_keys": "m"}, StoreConfigError, r"sub_keys must be a list .*; for one pass sub_keys=\['m'\]"),
        ({"sub_keys": [1]}, StoreConfigError, "sub_keys must be sub-checkpoint names"),
        ({"ranks": "0"}, StoreConfigError, "ranks must be a list of ranks"),
        ({"ranks": [0, -1]}, StoreConfigError, r"ranks must be non-negative ints, got -1 in \[0, -1\]"),
        ({"ranks": [True]}, StoreConfigError, "ranks must be non-negative ints, got True"),
        ({"world_layout": 2}, LayoutError, "world_layout must be a ckstore.WorldLayout"),
        ({"world_layout": {"dp": 1}}, LayoutError, "world_layout must be a ckstore.WorldLayout"),
        ({"device": "gpu"}, StoreConfigError, "device must name a torch device .*got 'gpu'"),
    ],
)
def test_checkout_arguments_of_the_wrong_kind_are_refused_naming_them(
    vstore: ckstore.Store, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """A string of sub-checkpoint names is refused, not split into its characters (``"m"`` used
    to check out sub-checkpoint ``m`` by chance, ``"model_states"`` to fail naming letters), and
    a layout, rank or device of the wrong type is named, where they used to fail deep inside."""
    with pytest.raises(error, match=match):
        vstore.checkout(1, **kwargs)
    with pytest.raises(error, match=match):
        vstore.load(vstore.resolve(1), **kwargs)
    assert vstore.checkout(1, sub_keys=["m"], ranks=[0], device="cpu")[0]["m"]["w"].shape == (BIG,)


def test_a_commit_with_a_layout_that_is_none_is_refused(vstore: ckstore.Store) -> None:
    refused(vstore, LayoutError, "world_layout must be a ckstore.WorldLayout", lambda: vstore.commit(2, states(), world_layout=2))  # type: ignore[arg-type]


def test_a_mesh_that_is_no_mapping_is_a_layout_error() -> None:
    for mesh in (5, "dp", [("dp",)]):
        with pytest.raises(LayoutError, match="a world layout is a mesh of named dims"):
            ckstore.WorldLayout(mesh)  # type: ignore[arg-type]


def test_copy_to_something_that_is_no_store_is_refused(vstore: ckstore.Store, tmp_path: Path) -> None:
    with pytest.raises(StoreConfigError, match="copy's dest must be a ckstore.Store"):
        vstore.copy([1], str(tmp_path / "other"))  # type: ignore[arg-type]
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workers": "4"}, r"workers must be a number of threads \(an int >= 1\) or None, got '4'"),
        ({"workers": 0}, "workers must be a number of threads"),
        ({"catalog": 5}, "catalog must be an SQLAlchemy URL"),
        ({"storage_options": [("anon", True)]}, "storage_options must be a dict"),
    ],
)
def test_open_arguments_of_the_wrong_kind_are_refused_naming_them(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(StoreConfigError, match=match):
        ckstore.open(tmp_path / "s", **kwargs)
    assert not (tmp_path / "s").exists()


def test_a_location_that_is_no_path_is_refused() -> None:
    for location in (5, None, ""):
        with pytest.raises(StoreConfigError, match="a store's location is a path or an fsspec URL"):
            ckstore.open(location)  # type: ignore[arg-type]
        with pytest.raises(StoreConfigError, match="a store's location is a path or an fsspec URL"):
            ckstore.init(location)  # type: ignore[arg-type]
