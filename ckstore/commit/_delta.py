"""Delta chunks on commit: each changed chunk XORed against the same chunk of the previous commit.

A chunk of a tensor one training step later differs from the one before mostly in its low
mantissa bytes: stored as the XOR of the two (codec 3, :func:`ckstore.format.codec.encode_delta`)
it takes 15% fewer bytes, measured on a real model and optimizer state one step apart (under 3%
ten steps apart; docs/benchmarks.md, "The delta codec question"). So deltas are for jobs that
checkpoint every step or so, and are off unless a store is opened with ``delta_chain``.

:class:`DeltaCache` keeps, per store object, a copy of the raw bytes of every chunk the previous
commit through it held (up to a memory budget), by place: rank, sub-checkpoint, tensor path and
chunk index. The next commit XORs a changed chunk against the cached bytes of its place, when
the catalog still has that chunk (the commit's claim references it, so gc keeps it) and its chain
of deltas is shorter than ``delta_chain``: a checkout decodes at most ``delta_chain`` deltas
through to a whole chunk. A delta is kept only when it is smaller than the whole chunk: weighed
against the whole frame that started its chain, or against the whole chunk encoded too when
that does not settle it (:func:`encode`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..format import codec

__all__ = ["DeltaCache", "DeltaPlan", "DEFAULT_DELTA_MEMORY"]

#: the most bytes of chunks a store object keeps to write deltas against (``delta_memory``)
DEFAULT_DELTA_MEMORY = 1 << 30
#: a delta frame this much smaller than the raw chunk is kept without encoding the whole chunk
#: too (a whole fp32 chunk of weights takes ~84% of raw, bf16 ~67%)
_CLEARLY_SMALLER = 0.6
#: a delta this much smaller than the estimated whole frame is kept without encoding the whole
#: chunk to compare (the estimate errs by a few percent: a delta must save more than that)
_MUCH_SMALLER = 0.95
#: chunks shorter than this are not tried as deltas: a few hundred bytes saved at best, for a
#: base claimed and read on checkout
_MIN_DELTA = 4096

Place = tuple[int, str, str, int]  # rank, sub-checkpoint key, tensor path, chunk index


@dataclass(frozen=True, slots=True)
class DeltaPlan:
    """What one rank's commit may write as deltas: ``bases``, each changed chunk's candidate base
    (digest to digest), and after the claim ``usable``, the bases the catalog has with their
    chain depth (a delta on one of them is one deeper)."""

    bases: Mapping[bytes, bytes]
    usable: Mapping[bytes, int]
    cache: DeltaCache
    #: filled while writing: for each chunk written, the length its whole frame has or would
    #: have had (a delta's: its base's estimate), which the next commit's deltas are weighed by
    wholes: dict[bytes, int] = field(default_factory=dict)


class DeltaCache:
    """The raw bytes of the previous commit's chunks, by place (see the module docstring)."""

    def __init__(self, chain: int, memory: int = DEFAULT_DELTA_MEMORY) -> None:
        self.chain = chain
        self.memory = memory
        self._lock = threading.Lock()
        self._places: dict[Place, tuple[bytes, np.ndarray]] = {}
        self._by_digest: dict[bytes, np.ndarray] = {}
        self._depth: dict[bytes, int] = {}  # chain depth of the cached chunks this process wrote
        self._whole: dict[bytes, int] = {}  # their whole frames' lengths, where known

    def candidates(self, places: Sequence[tuple[Place, bytes, int]]) -> dict[bytes, bytes]:
        """``{digest: base digest}`` for the chunks (``(place, digest, length)``) whose place
        held other bytes of the same length in the previous commit (and not at the end of a chain
        already, as far as this process knows)."""
        out: dict[bytes, bytes] = {}
        with self._lock:
            for place, d, n in places:
                held = self._places.get(place)
                if held is None or held[0] == d or held[1].nbytes != n or n < _MIN_DELTA:
                    continue
                if self._depth.get(held[0], 0) < self.chain:
                    out.setdefault(d, held[0])
        return out

    def base(self, digest: bytes) -> memoryview | None:
        """The cached raw bytes of chunk ``digest`` (None when they are no longer cached)."""
        with self._lock:
            a = self._by_digest.get(digest)
        return None if a is None else a.data

    def whole(self, digest: bytes) -> int | None:
        """The length of the whole frame of cached chunk ``digest`` (of the chain's first chunk,
        for a delta), where this process wrote it."""
        with self._lock:
            return self._whole.get(digest)

    def remember(
        self, chunks: Sequence[tuple[Place, bytes, memoryview]], depths: Mapping[bytes, int], wholes: Mapping[bytes, int]
    ) -> None:
        """Once a commit wrote its chunks: keep a copy of each chunk ``(place, digest, raw bytes)`` of it, in place
        of the previous commit's, as far as the memory budget goes; an unchanged chunk is not
        copied again. Never written into in place: a commit in flight may be XORing against a
        buffer this replaces. ``depths``: the chain depth of the chunks the commit wrote itself;
        ``wholes``: their whole frames' lengths (see :attr:`DeltaPlan.wholes`)."""
        with self._lock:
            old = self._places
            places: dict[Place, tuple[bytes, np.ndarray]] = {}
            used = 0
            for place, d, raw in chunks:
                n = raw.nbytes
                if used + n > self.memory:
                    continue
                held = old.pop(place, None)
                if held is not None and held[0] == d:
                    places[place] = held
                else:
                    places[place] = (d, np.frombuffer(raw, dtype=np.uint8).copy())
                used += n
            self._places = places
            self._by_digest = {d: a for d, a in places.values()}
            self._depth = {d: k for d in self._by_digest if (k := depths.get(d, self._depth.get(d, 0)))}
            self._whole = {d: n for d in self._by_digest if (n := wholes.get(d, self._whole.get(d, 0)))}

    def clear(self) -> None:
        """Forget every chunk (after a failed commit: its chunks may not be stored)."""
        with self._lock:
            self._places, self._by_digest, self._depth, self._whole = {}, {}, {}, {}


def encode(
    raw: memoryview, itemsize: int, level: int, digest: bytes, base: bytes, plan: DeltaPlan
) -> tuple[codec.Frame, int | None]:
    """The frame to store for changed chunk ``digest`` with candidate ``base``, and its chain
    depth (None: a whole chunk): a delta when the base is usable and the delta is the smaller
    frame. The whole frame's length is estimated by the whole frame that started the base's
    chain (successive states of a tensor compress alike); without an estimate, or when the
    delta saves little against it, the chunk is encoded whole too and the smaller kept."""
    depth = plan.usable.get(base)
    held = plan.cache.base(base) if depth is not None else None
    if held is None or depth is None:
        whole = codec.encode(raw, itemsize, level)
        plan.wholes[digest] = whole.length
        return whole, None
    delta = codec.encode_delta(raw, held, base, itemsize, level)
    estimate = plan.cache.whole(base)
    if delta.length <= _CLEARLY_SMALLER * raw.nbytes or (estimate and delta.length <= _MUCH_SMALLER * estimate):
        if estimate:
            plan.wholes[digest] = estimate
        return delta, depth + 1
    whole = codec.encode(raw, itemsize, level)
    plan.wholes[digest] = whole.length
    return (delta, depth + 1) if delta.length < whole.length else (whole, None)
