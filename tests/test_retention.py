"""Retention policies against hand-computed expectations (ties, missing and NaN metrics included)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckstore
from ckstore.cli import main
from ckstore.errors import PolicyError
from ckstore.maintenance.gc import Candidate
from ckstore.retention import (
    AnyOf,
    BestN,
    ByKind,
    EveryNSteps,
    KeepAll,
    LatestN,
    Policy,
    Tagged,
    Within,
    parse_duration,
    policy_from_flags,
    policy_from_json,
    policy_to_json,
)

NOW = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)

#   id  step   kind      val_loss  tags        committed (minutes before NOW)
ROWS = [
    (1, 1000, "recovery", 0.9, (), 100),
    (2, 2000, "recovery", 0.5, ("best",), 90),
    (3, 3000, "epoch", 0.5, (), 80),  # ties with id 2; the newer step ranks first
    (4, 4000, "recovery", None, (), 70),  # no val_loss at all
    (5, 5000, "recovery", 0.7, (), 60),
    (6, 6000, "epoch", math.nan, (), 50),  # NaN cannot be ranked either
    (7, 7000, "recovery", 0.3, (), 40),
    (8, 8000, "recovery", 0.3, (), 30),  # ties with id 7
    (9, 9000, "epoch", 0.8, ("release",), 20),
    (10, 10000, "recovery", 0.6, (), 10),
]
CKPTS = [
    Candidate(
        i,
        "exp",
        step,
        kind,
        NOW - timedelta(minutes=age),
        {} if v is None else {"val_loss": v},
        tags,
    )
    for i, step, kind, v, tags, age in ROWS
]

CASES: list[tuple[Policy, set[int], set[int]]] = [
    # policy, kept ids, of which kept only because a metric is missing
    (LatestN(2), {9, 10}, set()),
    (LatestN(0), set(), set()),
    (LatestN(50), set(range(1, 11)), set()),
    (BestN(1, "val_loss", "min"), {8, 4, 6}, {4, 6}),
    (BestN(2, "val_loss", "min"), {8, 7, 4, 6}, {4, 6}),
    (BestN(3, "val_loss", "min"), {8, 7, 3, 4, 6}, {4, 6}),
    (BestN(4, "val_loss", "min"), {8, 7, 3, 2, 4, 6}, {4, 6}),
    (BestN(1, "val_loss", "max"), {1, 4, 6}, {4, 6}),
    (BestN(2, "val_loss", "max"), {1, 9, 4, 6}, {4, 6}),
    (BestN(0, "val_loss"), {4, 6}, {4, 6}),
    (BestN(1, "accuracy", "max"), set(range(1, 11)), set(range(1, 11))),
    (EveryNSteps(3000), {3, 6, 9}, set()),
    (EveryNSteps(10000), {10}, set()),
    (Within(45 * 60), {7, 8, 9, 10}, set()),
    (Within(0), set(), set()),
    (Tagged(), {2, 9}, set()),
    (Tagged(("release",)), {9}, set()),
    (ByKind("recovery", LatestN(1)), {10}, set()),
    (ByKind("epoch", KeepAll()), {3, 6, 9}, set()),
    (ByKind("epoch", BestN(1, "val_loss")), {3, 6}, {6}),
    (ByKind("recovery", LatestN(1)) | ByKind("epoch", KeepAll()), {3, 6, 9, 10}, set()),
    (LatestN(2) | BestN(1, "val_loss"), {9, 10, 8, 4, 6}, {4, 6}),
    (
        LatestN(2) | BestN(1, "val_loss") | EveryNSteps(5000) | Tagged(),
        {9, 10, 8, 4, 6, 5, 2},
        {4, 6},
    ),
    (KeepAll(), set(range(1, 11)), set()),
]


@pytest.mark.parametrize("policy,kept,unranked", CASES, ids=[p.describe() for p, _, _ in CASES])
def test_policy_selects_hand_computed_checkpoints(
    policy: Policy, kept: set[int], unranked: set[int]
) -> None:
    sel = policy.select(CKPTS, now=NOW)
    assert set(sel.kept) == kept
    assert set(sel.unranked) == unranked
    assert all(sel.reasons[i] for i in sel.kept)  # every kept checkpoint says why
    # the order the checkpoints come in does not matter
    assert policy.select(list(reversed(CKPTS)), now=NOW).kept == sel.kept


@pytest.mark.parametrize(
    "policy", [p for p, _, _ in CASES], ids=[p.describe() for p, _, _ in CASES]
)
def test_policy_json_round_trip(policy: Policy) -> None:
    again = policy_from_json(policy_to_json(policy))
    assert again == policy
    assert again.select(CKPTS, now=NOW) == policy.select(CKPTS, now=NOW)


def test_reasons_name_the_rules() -> None:
    sel = (LatestN(2) | BestN(1, "val_loss") | Tagged() | ByKind("epoch", KeepAll())).select(
        CKPTS, now=NOW
    )
    assert sel.reasons[10] == ("last 2",)
    assert sel.reasons[9] == ("last 2", "tagged release", "kind epoch: all")
    assert sel.reasons[8] == ("best 1 by val_loss (min)",)
    assert sel.reasons[4] == ("no val_loss: best 1 by val_loss (min) cannot rank it",)
    assert sel.unranked[6] == ("val_loss",)
    assert sel.reasons[2] == ("tagged best",)


def test_union_flattens() -> None:
    p = LatestN(1) | BestN(1, "m") | EveryNSteps(10)
    assert isinstance(p, AnyOf) and len(p.rules) == 3
    assert p.describe() == "last 1 + best 1 by m (min) + every 10 steps"


def test_flags_build_the_union() -> None:
    p = policy_from_flags(
        keep_last=2, keep_best=["3:val_loss:min", "1:acc:max"], keep_every=10000, keep_within="7d",
        keep_tagged=True, keep_kind=["recovery:1", "epoch:all"],
    )  # fmt: skip
    assert p == AnyOf(
        (
            LatestN(2),
            BestN(3, "val_loss", "min"),
            BestN(1, "acc", "max"),
            EveryNSteps(10000),
            Within(7 * 86400),
            Tagged(),
            ByKind("recovery", LatestN(1)),
            ByKind("epoch", KeepAll()),
        )
    )
    assert policy_from_flags(keep_last=3) == LatestN(3)
    assert policy_from_flags() is None
    assert policy_from_flags(keep_best=["2:loss"]) == BestN(2, "loss", "min")


def test_keep_best_names_a_metric_holding_colons(tmp_path: Path) -> None:
    """K is read up to the first ':' and the mode after the last, so the metric is the middle."""
    assert policy_from_flags(keep_best=["1:val:loss:min"]) == BestN(1, "val:loss", "min")
    assert policy_from_flags(keep_best=["2:a:b:c:max"]) == BestN(2, "a:b:c", "max")
    assert policy_from_flags(keep_best=["2:val_loss:max"]) == BestN(2, "val_loss", "max")
    with pytest.raises(PolicyError, match="1:val:loss:min"):  # ambiguous: the mode must be written
        policy_from_flags(keep_best=["1:val:loss"])
    with pytest.raises(PolicyError, match="K:METRIC"):
        policy_from_flags(keep_best=["1::min"])

    store = ckstore.open(tmp_path / "store", run="r", chunk_size=64 * 1024)
    for step, loss in ((1, 0.3), (2, 0.1), (3, 0.5), (4, 0.4)):
        store.commit(step, {0: {"m": {"w": torch.full((4,), float(step))}}}, {"val:loss": loss})
    res = CliRunner().invoke(
        main, ["--store", str(tmp_path / "store"), "gc", "--keep-best", "1:val:loss:min"]
    )
    assert res.exit_code == 0, res.output
    assert [c.step for c in store.checkpoints(run="r")] == [2, 4]  # the best, and the latest
    store.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"keep_best": ["3:val_loss:avg"]}, "mode must be 'min' or 'max'"),
        ({"keep_best": ["x:val_loss:min"]}, "K:METRIC:min|max"),
        ({"keep_best": ["3"]}, "K:METRIC:min|max"),
        ({"keep_kind": ["recovery"]}, "KIND:N"),
        ({"keep_kind": ["recovery:some"]}, "KIND:N"),
        ({"keep_within": "7x"}, "invalid duration"),
        ({"keep_last": -1}, "must be an int >= 0"),
        ({"keep_every": 0}, "must be an int >= 1"),
    ],
)
def test_bad_flags_are_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        policy_from_flags(**kwargs)


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("90", 90),
        ("90s", 90),
        ("15m", 900),
        ("12h", 43200),
        ("7d", 604800),
        ("2w", 1209600),
        ("1d12h", 129600),
        (30, 30),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text,match",
    [
        ("{", "not valid JSON"),
        ('{"format": 9, "policy": {"rule": "all"}}', "format 9"),
        ('{"format": 1, "policy": {"rule": "sometimes"}}', "unknown retention rule"),
        ('{"format": 1, "policy": {"rule": "best", "n": 1}}', "lacks field 'metric'"),
        ('{"format": 1, "policy": {"rule": "latest", "n": "2"}}', "int >= 0"),
        # a TypeError before, and a tag name read as its letters ('b', 'e', 's', 't')
        ('{"format": 1, "policy": {"rule": "tagged", "tags": 5}}', "tuple of tag names"),
        ('{"format": 1, "policy": {"rule": "tagged", "tags": "best"}}', "tuple of tag names"),
        ('{"format": 1, "policy": {"rule": "any_of", "rules": 5}}', "'any_of' is malformed"),
    ],
)
def test_malformed_stored_policy(text: str, match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        policy_from_json(text)


def test_gc_names_the_run_whose_stored_policy_is_malformed(store: ckstore.Store) -> None:
    """A damaged stored policy stops gc with the PolicyError naming the run and the commands
    that fix it (a TypeError escaped before), and drops nothing."""
    for step in (1, 2):
        store.commit(step, {0: {"model_states": {"w": torch.zeros(4)}}})
    store.catalog.set_run_policy("exp", '{"format": 1, "policy": {"rule": "any_of", "rules": 5}}')
    with pytest.raises(PolicyError, match="run 'exp' has a malformed stored policy.*ckstore policy clear exp"):
        store.gc()
    assert [c.step for c in store.checkpoints()] == [1, 2]


@pytest.mark.parametrize("flags", [{"keep_best": ["\u00b2:val_loss"]}, {"keep_kind": ["epoch:\u00b2"]}])
def test_flags_with_a_digit_int_cannot_read_are_clear_errors(flags: dict) -> None:
    """'²' is a digit to str.isdigit() but no int: a ValueError escaped before."""
    with pytest.raises(PolicyError, match="invalid --keep-"):
        policy_from_flags(**flags)
