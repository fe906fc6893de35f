"""Refs: ways to name a checkpoint.

``latest``, a step number, a tag, ``min:METRIC`` or ``max:METRIC``, each optionally prefixed by
``RUN@``. A bare run name is not a ref on its own; commands that accept a run where a ref is
expected say so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidRefError

__all__ = ["Ref", "parse_ref", "check_name"]

_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.\-/+=]*$")


@dataclass(frozen=True, slots=True)
class Ref:
    run: str | None
    kind: str  # "latest" | "step" | "tag" | "min" | "max"
    value: str | int | None = None

    def __str__(self) -> str:
        if self.kind == "latest":
            body = "latest"
        elif self.kind in ("min", "max"):
            body = f"{self.kind}:{self.value}"
        else:
            body = str(self.value)
        return f"{self.run}@{body}" if self.run else body


def check_name(what: str, name: str) -> str:
    """Validate a run or tag name, raising an error that says what is allowed."""
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > 255:
        raise InvalidRefError(
            f"invalid {what} name {name!r}: use letters, digits and . _ - / + = (no '@' or ':', "
            "at most 255 characters)"
        )
    if what == "tag" and (name == "latest" or name.isdigit()):
        raise InvalidRefError(f"invalid tag name {name!r}: it would read as a step or 'latest'")
    return name


def parse_ref(ref: str | int | Ref) -> Ref:
    if isinstance(ref, Ref):
        return ref
    if isinstance(ref, bool):
        raise InvalidRefError(f"invalid ref {ref!r}")
    if isinstance(ref, int):
        if ref < 0:
            raise InvalidRefError(f"invalid ref {ref!r}: steps are non-negative")
        return Ref(None, "step", ref)
    if not isinstance(ref, str) or not ref.strip():
        raise InvalidRefError(f"invalid ref {ref!r}: expected latest, a step, a tag, min:METRIC or max:METRIC")
    text = ref.strip()
    run: str | None = None
    if "@" in text:
        run, _, text = text.partition("@")
        check_name("run", run)
        if not text:
            raise InvalidRefError(f"invalid ref {ref!r}: nothing after '@' (try {run}@latest)")
    if text == "latest":
        return Ref(run, "latest")
    if text.isdigit():
        return Ref(run, "step", int(text))
    if text.startswith(("min:", "max:")):
        kind, _, metric = text.partition(":")
        if not metric:
            raise InvalidRefError(f"invalid ref {ref!r}: name the metric, as in {kind}:val_loss")
        return Ref(run, kind, metric)
    if ":" in text:
        raise InvalidRefError(
            f"invalid ref {ref!r}: expected latest, a step, a tag, min:METRIC or max:METRIC"
        )
    check_name("tag", text)
    return Ref(run, "tag", text)
