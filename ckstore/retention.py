"""Retention policies, the public name of :mod:`ckstore.maintenance.retention`.

    from ckstore.retention import BestN, LatestN
    store.set_policy("exp1", LatestN(3) | BestN(2, "val_loss"))
"""

from __future__ import annotations

from .maintenance.retention import *  # noqa: F403
from .maintenance.retention import __all__ as __all__
