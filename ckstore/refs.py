"""Refs: ways to name a checkpoint.

``latest``, a step number, a tag, ``min:METRIC`` or ``max:METRIC``, each optionally prefixed by
``RUN@``. A bare run name is not a ref on its own; commands that accept a run where a ref is
expected say so.

Run and tag names hold no ``@`` or ``:``, but a metric name may hold both: the ``RUN@`` prefix
ends at the first ``@``, unless the ref starts with ``min:`` or ``max:`` (no run name does), so
``min:val@loss`` and ``exp@min:val@loss`` both name metric ``val@loss``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidRefError

__all__ = ["Ref", "parse_ref", "check_name", "check_label", "text_problem", "MAX_NAME", "MAX_KIND", "MAX_STEP"]

_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.\-/+=]*")

#: The longest run, tag, sub-checkpoint or metric name, and the longest kind: the catalog's
#: column lengths (``ckstore.catalog._schema``), so a name the catalog cannot hold is refused first.
MAX_NAME = 255
MAX_KIND = 64
#: Steps are stored as signed 64-bit integers.
MAX_STEP = 2**63 - 1


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


def check_name(what: str, name: str, max_length: int = MAX_NAME) -> str:
    """Validate a run, tag or kind name (ASCII letters, digits and ``. _ - / + =``), raising an
    error that says what is allowed."""
    if not isinstance(name, str) or len(name) > max_length or not _NAME.fullmatch(name):
        raise InvalidRefError(
            f"invalid {what} name {name!r}: use letters, digits and . _ - / + = (no '@' or ':', "
            f"at most {max_length} characters)"
        )
    if what == "tag" and (name == "latest" or name.isdigit()):
        raise InvalidRefError(f"invalid tag name {name!r}: it would read as a step or 'latest'")
    return name


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored as a name (a NUL character, or a lone surrogate that has no
    UTF-8 encoding), or None."""
    if "\x00" in text:
        return "it contains a NUL character"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"it contains a lone surrogate {text[e.start]!r} (at character {e.start}), which has no UTF-8 encoding"
    return None


def check_label(what: str, text: object, max_length: int = MAX_NAME) -> str:
    """Validate a free-form name (a metric or sub-checkpoint name): any non-empty text of at most
    ``max_length`` characters without NUL characters or lone surrogates."""
    if not isinstance(text, str) or not text:
        raise InvalidRefError(f"{what} must be a non-empty string, got {text!r}")
    if len(text) > max_length:
        raise InvalidRefError(f"{what} {text[:40]!r}… is {len(text)} characters long; at most {max_length} are allowed")
    problem = text_problem(text)
    if problem is not None:
        raise InvalidRefError(f"{what} {text!r} is refused: {problem}")
    return text


def _step(ref: object, step: int | str) -> int:
    # a string of digits is measured before int() reads it (int() refuses over 4300 digits)
    if isinstance(step, str) and len(step.lstrip("0")) > len(str(MAX_STEP)) or int(step) > MAX_STEP:
        raise InvalidRefError(f"invalid ref {str(ref)[:40]!r}: steps are below 2**63")
    return int(step)


def parse_ref(ref: str | int | Ref) -> Ref:
    if isinstance(ref, Ref):
        return ref
    if isinstance(ref, bool):
        raise InvalidRefError(f"invalid ref {ref!r}")
    if isinstance(ref, int):
        if ref < 0:
            raise InvalidRefError(f"invalid ref {ref!r}: steps are non-negative")
        return Ref(None, "step", _step(ref, ref))
    if not isinstance(ref, str) or not ref.strip():
        raise InvalidRefError(f"invalid ref {ref!r}: expected latest, a step, a tag, min:METRIC or max:METRIC")
    text = ref.strip()
    run: str | None = None
    if "@" in text and not text.startswith(("min:", "max:")):
        run, _, text = text.partition("@")
        check_name("run", run)
        if not text:
            raise InvalidRefError(f"invalid ref {ref!r}: nothing after '@' (try {run}@latest)")
    if text == "latest":
        return Ref(run, "latest")
    if text.isascii() and text.isdigit():  # ASCII only: int() also reads "١٢" as 12
        return Ref(run, "step", _step(ref, text))
    if text.startswith(("min:", "max:")):
        kind, _, metric = text.partition(":")
        if not metric:
            raise InvalidRefError(f"invalid ref {ref!r}: name the metric, as in {kind}:val_loss")
        return Ref(run, kind, check_label("metric name", metric))
    if ":" in text:
        raise InvalidRefError(
            f"invalid ref {ref!r}: expected latest, a step, a tag, min:METRIC or max:METRIC"
        )
    check_name("tag", text)
    return Ref(run, "tag", text)
