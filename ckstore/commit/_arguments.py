"""The arguments of a commit, checked before anything is written.

Every name and number a commit records must fit the catalog as it is, on SQLite and PostgreSQL
alike: names within their column lengths and free of NUL characters and lone surrogates, steps
in a signed 64-bit integer, metrics finite numbers (or NaN, which records "no value"). A value
that does not fit raises an error naming it, before the pending checkpoint is opened.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRefError, StoreConfigError
from ..refs import MAX_KIND, MAX_STEP, check_label, check_name

__all__ = ["CommitArguments", "check_arguments", "check_metrics"]


@dataclass(frozen=True, slots=True)
class CommitArguments:
    run: str
    step: int
    kind: str
    metrics: dict[str, float]
    tags: tuple[str, ...]


def check_arguments(
    run: str | None, step: object, metrics: object, tags: object, kind: object
) -> CommitArguments:
    """The checked arguments of a commit into ``run`` (the store's default run when None)."""
    if run is None:
        raise StoreConfigError(
            "commit needs a run: open the store with ckstore.open(location, run='NAME') or pass run='NAME'"
        )
    check_name("run", run)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        shown = f"an int of {step.bit_length()} bits" if isinstance(step, int) and step.bit_length() > 80 else repr(step)
        raise StoreConfigError(f"step must be a non-negative int below 2**63, got {shown}")
    if not isinstance(kind, str):
        raise InvalidRefError(f"kind must be a string, got {type(kind).__name__}")
    if not kind:
        raise InvalidRefError(
            "kind must not be empty: retention rules select checkpoints by kind; leave kind out for "
            "the default 'checkpoint', or name one such as 'recovery'"
        )
    check_name("kind", kind, MAX_KIND)
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
        raise InvalidRefError(
            f"tags must be a list of tag names, got {type(tags).__name__} {tags!r}"
            + (f"; for one tag pass tags=[{tags!r}]" if isinstance(tags, str) else "")
        )
    clean_tags = tuple(check_name("tag", t) for t in tags)
    return CommitArguments(run, step, kind, check_metrics(metrics), clean_tags)


def check_metrics(metrics: object) -> dict[str, float]:
    """``{name: float}`` for a commit's metrics: one-element tensors and numpy scalars are read
    with ``.item()``; infinities and numbers beyond a float are refused, NaN records no value."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise StoreConfigError(f"metrics must be a dict {{name: number}}, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        try:
            check_label("metric name", k)
        except InvalidRefError as e:
            raise StoreConfigError(str(e)) from None
        out[k] = _metric_value(k, v)
    return out


def _metric_value(name: str, v: Any) -> float:
    numel = getattr(v, "numel", None) or getattr(v, "size", None)
    if hasattr(v, "item") and callable(v.item):
        count = numel() if callable(numel) else numel
        if isinstance(count, int) and count != 1:
            raise StoreConfigError(f"metric {name!r} must be a single number, got a {type(v).__name__} of {count} elements")
        try:
            v = v.item()
        except (ValueError, RuntimeError) as e:
            raise StoreConfigError(f"metric {name!r} must be a single number, got {type(v).__name__}: {e}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise StoreConfigError(f"metric {name!r} must be a number, got {type(v).__name__} {str(v)[:60]}")
    try:
        value = float(v)
    except OverflowError:
        raise StoreConfigError(f"metric {name!r} is an int of {int(v).bit_length()} bits, beyond what a float holds") from None
    if math.isinf(value):
        raise StoreConfigError(f"metric {name!r} is {value}; metrics must be finite (NaN records no value)")
    return value
