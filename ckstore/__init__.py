"""ckstore: a content-addressed checkpoint store for PyTorch training.

    import ckstore
    store = ckstore.open("ckpts", run="exp1")
    store.commit(100, {0: {"model_states": model.state_dict()}}, metrics={"val_loss": 0.31})
    states = store.checkout("latest")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    AlreadyExistsError,
    BlobStoreError,
    CatalogError,
    CheckpointNotFoundError,
    ChunkNotFoundError,
    CkstoreError,
    CommitAbandonedError,
    CommitInProgressError,
    DistributedCommitError,
    IntegrityError,
    InvalidRefError,
    LayoutError,
    NotFoundError,
    PolicyError,
    ProtectedCheckpointError,
    SchemaVersionError,
    StoreConfigError,
    UnsupportedValueError,
)
from .layout import Shard, WorldLayout
from .records import Checkpoint, RunInfo

if TYPE_CHECKING:
    from .opening import init, open
    from .store import Store

__version__ = "0.1.0"

# ``open``, ``init`` and ``Store`` pull in the catalog (SQLAlchemy) and are loaded on first use,
# so that ``import ckstore`` (and a CLI command that needs no catalog) stays light; torch is
# imported only by the modules that touch tensors.
_LAZY = {"open": ".opening", "init": ".opening", "Store": ".store"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "open",
    "init",
    "Store",
    "Checkpoint",
    "RunInfo",
    "WorldLayout",
    "Shard",
    "CkstoreError",
    "NotFoundError",
    "CheckpointNotFoundError",
    "ChunkNotFoundError",
    "AlreadyExistsError",
    "CommitInProgressError",
    "CommitAbandonedError",
    "IntegrityError",
    "UnsupportedValueError",
    "SchemaVersionError",
    "StoreConfigError",
    "CatalogError",
    "BlobStoreError",
    "InvalidRefError",
    "LayoutError",
    "DistributedCommitError",
    "PolicyError",
    "ProtectedCheckpointError",
    "__version__",
]
