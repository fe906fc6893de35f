"""Retention policies: which checkpoints of a run to keep.

A policy is a tiny frozen value with one method, :meth:`Policy.select`, that looks at a run's
committed checkpoints and returns the ids it keeps, each with the reasons why. Policies compose
by union: ``LatestN(2) | BestN(3, "val_loss") | EveryNSteps(10_000) | Tagged()`` keeps whatever
any of them keeps. :func:`ckstore.maintenance.gc` drops what no rule keeps, except that the latest checkpoint
of a run is always kept.

Rules
-----
``LatestN(n)``          the ``n`` highest steps.
``BestN(n, metric, mode)``
                        the ``n`` best by ``metric`` (``"min"`` or ``"max"``). Equal values are
                        ranked newest step first, so ``n`` checkpoints are kept even when a metric
                        plateaus, and the kept one is the one ``min:METRIC`` resolves to. A
                        checkpoint without the metric (or with NaN) cannot be ranked: it is kept,
                        and :attr:`Selection.unranked` says so.
``EveryNSteps(n)``      every step divisible by ``n``.
``Within(seconds)``     committed within the last ``seconds``.
``Tagged(tags=())``     carrying any tag (or one of ``tags``).
``ByKind(kind, rule)``  ``rule`` applied to the checkpoints of one kind only: keep the newest
                        ``recovery`` checkpoint with ``ByKind("recovery", LatestN(1))`` and every
                        ``epoch`` one with ``ByKind("epoch", KeepAll())``.
``KeepAll()``           everything.
``AnyOf(rules)``        the union of ``rules``.

A policy is stored for a run as JSON (:func:`policy_to_json`, :func:`policy_from_json`) and
built from command-line flags by :func:`policy_from_flags`.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from ..errors import PolicyError

__all__ = [
    "AnyOf",
    "BestN",
    "ByKind",
    "CheckpointInfo",
    "EveryNSteps",
    "KeepAll",
    "LatestN",
    "Policy",
    "Selection",
    "Tagged",
    "Within",
    "format_duration",
    "parse_duration",
    "policy_from_flags",
    "policy_from_json",
    "policy_to_json",
]

POLICY_FORMAT = 1


class CheckpointInfo(Protocol):
    """What a policy looks at; :class:`ckstore.Checkpoint` has all of it."""

    @property
    def id(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def committed_at(self) -> datetime | None: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...
    @property
    def tags(self) -> Sequence[str]: ...


@dataclass(frozen=True, slots=True)
class Selection:
    """What a policy keeps: ``{checkpoint id: reasons}``, and which of those it kept only
    because a metric a rule ranks by is missing (``{id: metric names}``)."""

    reasons: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    unranked: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def kept(self) -> frozenset[int]:
        return frozenset(self.reasons)

    def __or__(self, other: Selection) -> Selection:
        reasons = {k: tuple(v) for k, v in self.reasons.items()}
        for k, v in other.reasons.items():
            reasons[k] = tuple(dict.fromkeys(reasons.get(k, ()) + tuple(v)))
        unranked = {k: tuple(v) for k, v in self.unranked.items()}
        for k, v in other.unranked.items():
            unranked[k] = tuple(dict.fromkeys(unranked.get(k, ()) + tuple(v)))
        return Selection(reasons, unranked)


def _keep(items: Iterable[CheckpointInfo], reason: str) -> Selection:
    return Selection({c.id: (reason,) for c in items})


def _newest_first(items: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    return sorted(
        items,
        key=lambda c: (c.step, c.committed_at or datetime.max.replace(tzinfo=timezone.utc), c.id),
        reverse=True,
    )


def _check_count(what: str, n: object, minimum: int = 0) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < minimum:
        raise PolicyError(f"{what} must be an int >= {minimum}, got {n!r}")
    return n


class Policy(ABC):
    """A retention rule. Subclasses are frozen dataclasses; ``a | b`` is their union."""

    __slots__ = ()

    @abstractmethod
    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        """The checkpoints (of one run) this rule keeps, and why. ``now`` defaults to the clock."""

    @abstractmethod
    def describe(self) -> str:
        """A short human description, as in ``last 2 + best 1 by val_loss (min)``."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]: ...

    def __or__(self, other: Policy) -> AnyOf:
        left = self.rules if isinstance(self, AnyOf) else (self,)
        right = other.rules if isinstance(other, AnyOf) else (other,)
        return AnyOf(left + right)

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True, slots=True)
class LatestN(Policy):
    """Keep the ``n`` highest steps."""

    n: int

    def __post_init__(self) -> None:
        _check_count("LatestN.n (--keep-last)", self.n)

    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        return _keep(_newest_first(checkpoints)[: self.n], self.describe())

    def describe(self) -> str:
        return f"last {self.n}"

    def to_json(self) -> dict[str, Any]:
        return {"rule": "latest", "n": self.n}


@dataclass(frozen=True, slots=True)
class BestN(Policy):
    """Keep the ``n`` best by ``metric`` (``mode`` ``"min"`` or ``"max"``); ties go to the newer step."""

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _check_count("BestN.n (--keep-best)", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise PolicyError(f"BestN needs a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise PolicyError(f"BestN mode must be 'min' or 'max', got {self.mode!r}")

    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        ranked, unranked = [], []
        for c in checkpoints:
            v = c.metrics.get(self.metric)
            if v is None or math.isnan(v):
                unranked.append(c)
            else:
                ranked.append(c)
        sign = 1.0 if self.mode == "min" else -1.0
        ranked.sort(key=lambda c: (sign * c.metrics[self.metric], -c.step, -c.id))
        why = self.describe()
        missing = f"no {self.metric}: {why} cannot rank it"
        return Selection(
            {**{c.id: (why,) for c in ranked[: self.n]}, **{c.id: (missing,) for c in unranked}},
            {c.id: (self.metric,) for c in unranked},
        )

    def describe(self) -> str:
        return f"best {self.n} by {self.metric} ({self.mode})"

    def to_json(self) -> dict[str, Any]:
        return {"rule": "best", "n": self.n, "metric": self.metric, "mode": self.mode}


@dataclass(frozen=True, slots=True)
class EveryNSteps(Policy):
    """Keep every step divisible by ``n``."""

    n: int

    def __post_init__(self) -> None:
        _check_count("EveryNSteps.n (--keep-every)", self.n, 1)

    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        return _keep((c for c in checkpoints if c.step % self.n == 0), self.describe())

    def describe(self) -> str:
        return f"every {self.n} steps"

    def to_json(self) -> dict[str, Any]:
        return {"rule": "every", "n": self.n}


@dataclass(frozen=True, slots=True)
class Within(Policy):
    """Keep checkpoints committed within the last ``seconds``."""

    seconds: float

    def __post_init__(self) -> None:
        if (
            isinstance(self.seconds, bool)
            or not isinstance(self.seconds, (int, float))
            or not self.seconds >= 0
        ):
            raise PolicyError(
                f"Within.seconds (--keep-within) must be a duration >= 0, got {self.seconds!r}"
            )

    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        t = now or datetime.now(timezone.utc)
        why = self.describe()
        return _keep(
            (
                c
                for c in checkpoints
                if c.committed_at is None or (t - c.committed_at).total_seconds() <= self.seconds
            ),
            why,
        )

    def describe(self) -> str:
        return f"within {format_duration(self.seconds)}"

    def to_json(self) -> dict[str, Any]:
        return {"rule": "within", "seconds": self.seconds}


@dataclass(frozen=True, slots=True)
class Tagged(Policy):
    """Keep tagged checkpoints: any tag, or only the tags named."""

    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.tags, str) or not isinstance(self.tags, (tuple, list, set, frozenset)) or not all(
            isinstance(t, str) and t for t in self.tags
        ):
            raise PolicyError(f"Tagged.tags must be a tuple of tag names, got {self.tags!r}")
        object.__setattr__(self, "tags", tuple(self.tags))

    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        want = set(self.tags)
        out: dict[int, tuple[str, ...]] = {}
        for c in checkpoints:
            hit = [t for t in c.tags if not want or t in want]
            if hit:
                out[c.id] = (f"tagged {', '.join(hit)}",)
        return Selection(out)

    def describe(self) -> str:
        return "tagged" if not self.tags else f"tagged {', '.join(self.tags)}"

    def to_json(self) -> dict[str, Any]:
        return {"rule": "tagged", "tags": list(self.tags)}


@dataclass(frozen=True, slots=True)
class KeepAll(Policy):
    """Keep everything."""

    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        return _keep(checkpoints, "all")

    def describe(self) -> str:
        return "all"

    def to_json(self) -> dict[str, Any]:
        return {"rule": "all"}


@dataclass(frozen=True, slots=True)
class ByKind(Policy):
    """Apply ``policy`` to the checkpoints of one ``kind`` only (other kinds: not kept by this rule)."""

    kind: str
    policy: Policy

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise PolicyError(f"ByKind needs a checkpoint kind, got {self.kind!r}")
        if not isinstance(self.policy, Policy):
            raise PolicyError(f"ByKind({self.kind!r}, ...) needs a policy, got {self.policy!r}")

    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        inner = self.policy.select([c for c in checkpoints if c.kind == self.kind], now=now)
        prefix = f"kind {self.kind}: "
        return Selection(
            {k: tuple(prefix + r for r in v) for k, v in inner.reasons.items()}, inner.unranked
        )

    def describe(self) -> str:
        return f"kind {self.kind}: {self.policy.describe()}"

    def to_json(self) -> dict[str, Any]:
        return {"rule": "kind", "kind": self.kind, "policy": self.policy.to_json()}


@dataclass(frozen=True, slots=True)
class AnyOf(Policy):
    """Keep what any of ``rules`` keeps."""

    rules: tuple[Policy, ...]

    def __post_init__(self) -> None:
        rules = tuple(self.rules)
        if not rules or not all(isinstance(r, Policy) for r in rules):
            raise PolicyError(f"AnyOf needs one or more policies, got {self.rules!r}")
        object.__setattr__(self, "rules", rules)

    def select(
        self, checkpoints: Sequence[CheckpointInfo], *, now: datetime | None = None
    ) -> Selection:
        out = Selection()
        for r in self.rules:
            out = out | r.select(checkpoints, now=now)
        return out

    def describe(self) -> str:
        return " + ".join(r.describe() for r in self.rules)

    def to_json(self) -> dict[str, Any]:
        return {"rule": "any_of", "rules": [r.to_json() for r in self.rules]}


# -- JSON -------------------------------------------------------------------------------------
def policy_to_json(policy: Policy) -> str:
    """The text stored in the catalog for a run's policy."""
    return json.dumps({"format": POLICY_FORMAT, "policy": policy.to_json()}, separators=(",", ":"))


def _from_obj(obj: Any) -> Policy:
    if not isinstance(obj, dict) or "rule" not in obj:
        raise PolicyError(f"not a retention rule: {obj!r}")
    rule = obj["rule"]
    try:
        if rule == "latest":
            return LatestN(obj["n"])
        if rule == "best":
            return BestN(obj["n"], obj["metric"], obj.get("mode", "min"))
        if rule == "every":
            return EveryNSteps(obj["n"])
        if rule == "within":
            return Within(obj["seconds"])
        if rule == "tagged":
            return Tagged(obj.get("tags", ()))
        if rule == "all":
            return KeepAll()
        if rule == "kind":
            return ByKind(obj["kind"], _from_obj(obj["policy"]))
        if rule == "any_of":
            return AnyOf(tuple(_from_obj(r) for r in obj["rules"]))
    except KeyError as e:
        raise PolicyError(f"retention rule {rule!r} lacks field {e.args[0]!r}: {obj!r}") from e
    except TypeError as e:  # a field of the wrong type, as in {"rule": "any_of", "rules": 5}
        raise PolicyError(f"retention rule {rule!r} is malformed ({e}): {obj!r}") from e
    raise PolicyError(f"unknown retention rule {rule!r}")


def policy_from_json(text: str | Mapping[str, Any]) -> Policy:
    """Parse a stored policy (the JSON text, or its parsed object)."""
    try:
        doc = json.loads(text) if isinstance(text, str) else dict(text)
    except ValueError as e:
        raise PolicyError(f"a stored retention policy is not valid JSON: {e}") from e
    if isinstance(doc, dict) and "format" in doc:
        if doc["format"] != POLICY_FORMAT:
            raise PolicyError(
                f"retention policy format {doc['format']} is not supported by this ckstore (it reads "
                f"format {POLICY_FORMAT}); upgrade ckstore"
            )
        doc = doc.get("policy")
    return _from_obj(doc)


# -- command-line flags -------------------------------------------------------------------------
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")


def parse_duration(text: str | float) -> float:
    """Seconds in ``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` or a sum such as ``1d12h``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise PolicyError(f"a duration must be >= 0, got {text!r}")
        return float(text)
    s = str(text).strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION.match(s, pos)
        if m is None or not m.group(0):
            raise PolicyError(
                f"invalid duration {text!r}: use e.g. 3600, 90s, 15m, 12h, 7d or 1d12h"
            )
        total += float(m.group(1)) * _UNITS[m.group(2) or "s"]
        pos = m.end()
    if not s:
        raise PolicyError("empty duration: use e.g. 3600, 90s, 15m, 12h, 7d or 1d12h")
    return total


def format_duration(seconds: float) -> str:
    if seconds and seconds % 86400 == 0:
        return f"{seconds / 86400:g}d"
    if seconds and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


def _parse_best(spec: str) -> BestN:
    """``K:METRIC:min|max`` (or ``K:METRIC``, for min). K is read up to the first ``:`` and the
    mode after the last, so a metric name may hold ``:`` (``1:val:loss:min``) when the mode is
    written out."""
    count, _, rest = spec.partition(":")
    metric, sep, mode = rest.rpartition(":")
    if not sep:
        metric, mode = rest, "min"
    if not count.isdecimal() or not metric:
        raise PolicyError(
            f"invalid --keep-best {spec!r}: expected K:METRIC:min|max, e.g. 3:val_loss:min"
        )
    if mode not in ("min", "max"):
        raise PolicyError(
            f"invalid --keep-best {spec!r}: the mode must be 'min' or 'max', got {mode!r}; a metric "
            f"name holding ':' needs the mode written out, as in {count}:{rest}:min"
        )
    return BestN(int(count), metric, mode)


def _parse_kind(spec: str) -> ByKind:
    kind, sep, n = spec.rpartition(":")
    if not sep or not kind or not (n.isdecimal() or n == "all"):
        raise PolicyError(
            f"invalid --keep-kind {spec!r}: expected KIND:N or KIND:all, e.g. recovery:1"
        )
    return ByKind(kind, KeepAll() if n == "all" else LatestN(int(n)))


def policy_from_flags(
    *,
    keep_last: int | None = None,
    keep_best: Sequence[str] = (),
    keep_every: int | None = None,
    keep_within: str | None = None,
    keep_tagged: bool = False,
    keep_kind: Sequence[str] = (),
) -> Policy | None:
    """The policy the ``--keep-*`` flags describe (their union), or None when none is given."""
    rules: list[Policy] = []
    if keep_last is not None:
        rules.append(LatestN(keep_last))
    rules += [_parse_best(b) for b in keep_best]
    if keep_every is not None:
        rules.append(EveryNSteps(keep_every))
    if keep_within is not None:
        rules.append(Within(parse_duration(keep_within)))
    if keep_tagged:
        rules.append(Tagged())
    rules += [_parse_kind(k) for k in keep_kind]
    if not rules:
        return None
    return rules[0] if len(rules) == 1 else AnyOf(tuple(rules))
