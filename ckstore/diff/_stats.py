"""The torch-touching half of diffs: streaming comparison statistics over windows of two tensors.

Windows of the same global tensor are fed in order; sums are kept in float64 (complex128 for
complex tensors), so the result matches computing on the whole tensors up to rounding. Integer
tensors of one dtype are also compared exactly: which elements differ and the largest difference
are computed in integer arithmetic (float64 cannot tell 2**53 from 2**53 + 1), and
:meth:`Accumulator.within` decides a tolerance from that exact difference.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Accumulator"]


class Accumulator:
    """Running comparison of tensor ``a`` against tensor ``b``, one window at a time.

    Elements count as equal when they compare equal or are both NaN; ``bits_equal`` tracks
    whether every window had the same dtype and the same raw bytes.
    """

    def __init__(self, *, stats: bool) -> None:
        self.stats = stats
        self.bits_equal = True
        self.numel = 0
        self.changed = 0
        self.max_abs = 0.0
        self.ss_a = 0.0
        self.ss_b = 0.0
        self.ss_d = 0.0
        self.dot = 0.0
        self.max_abs_exact: int | None = None  # integer tensors of one dtype: the exact max |b - a|

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Compare one window; ``a`` and ``b`` hold the same elements of the two tensors."""
        import numpy as np
        import torch  # here, not at import: ``ckstore.diff.lineage`` (fork) needs no torch

        from ..format.tensorio import byte_view

        n = a.numel()
        self.numel += n
        if n == 0:
            return
        same = a.dtype == b.dtype and bool(np.array_equal(byte_view(a), byte_view(b)))
        if not same:
            self.bits_equal = False
        if not self.stats:
            return
        wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
        x = a.reshape(-1).to(wide)
        if same:
            ss = _dot(x, x)
            self.ss_a += ss
            self.ss_b += ss
            self.dot += ss
            return
        y = b.reshape(-1).to(wide)
        d = y - x
        if bool(torch.isnan(d).any()):
            # NaNs (or inf - inf): elements equal as values, NaN with NaN included, differ by 0
            eq = (x == y) | (torch.isnan(x) & torch.isnan(y))
            d = torch.where(eq, torch.zeros((), dtype=wide), d)
            self.changed += n - int(eq.sum())
        elif a.dtype == b.dtype and not (a.is_floating_point() or a.is_complex()):
            self.changed += int(torch.count_nonzero(a != b))  # integers past 2**53 stay exact
            exact = _int_abs_diff(a.reshape(-1).numpy(), b.reshape(-1).numpy())
            self.max_abs_exact = max(self.max_abs_exact or 0, int(exact.max()))
            d = torch.from_numpy(exact.astype(np.float64))
        else:
            self.changed += int(torch.count_nonzero(d))
        ad = d.abs()
        m = float(ad.max())
        self.max_abs = (
            math.nan if math.isnan(m) or math.isnan(self.max_abs) else max(self.max_abs, m)
        )
        self.ss_d += _dot(ad, ad)
        self.ss_a += _dot(x, x)
        self.ss_b += _dot(y, y)
        self.dot += _dot(x, y)

    def within(self, tolerance: float) -> bool:
        """Whether no element of ``b`` is further than ``tolerance`` from ``a``: decided on the
        exact difference for integer tensors (an int and a float compare exactly in Python)."""
        biggest = self.max_abs_exact if self.max_abs_exact is not None else self.max_abs
        return biggest <= tolerance

    def result(self) -> dict[str, Any]:
        """The statistics as keyword arguments of :class:`ckstore.diff.TensorStats`."""
        na, nb, nd = math.sqrt(self.ss_a), math.sqrt(self.ss_b), math.sqrt(self.ss_d)
        if na > 0:
            rel = nd / na
        else:
            rel = 0.0 if nd == 0 else math.inf
        cos = self.dot / (na * nb) if na > 0 and nb > 0 else math.nan
        if math.isfinite(cos):
            cos = max(-1.0, min(1.0, cos))
        return {
            "numel": self.numel,
            "changed": self.changed,
            "max_abs_diff": self.max_abs,
            "rel_l2": rel,
            "cosine": cos,
            "norm_a": na,
            "norm_b": nb,
        }


def _int_abs_diff(x: Any, y: Any) -> Any:
    """``|y - x|`` of two integer (or bool) numpy arrays of one dtype, exactly, as uint64: the
    larger minus the smaller, which wraps modulo 2**64 to the true difference (below 2**64)."""
    import numpy as np

    wide = np.uint64 if x.dtype.kind == "u" else np.int64
    x, y = x.astype(wide), y.astype(wide)
    return np.maximum(x, y).astype(np.uint64) - np.minimum(x, y).astype(np.uint64)


def _dot(x: torch.Tensor, y: torch.Tensor) -> float:
    """The real part of ``sum(conj(x) * y)``, accumulated in float64."""
    import torch

    if x.is_complex():
        return float(torch.vdot(x, y).real)
    return float(torch.dot(x, y))
