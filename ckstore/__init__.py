"""ckstore: a content-addressed checkpoint store for PyTorch training.

    import ckstore
    store = ckstore.open("ckpts", run="exp1")
    store.commit(100, {0: {"model_states": model.state_dict()}}, metrics={"val_loss": 0.31})
    states = store.checkout("latest")
"""

from __future__ import annotations

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
from .opening import init, open
from .records import Checkpoint, RunInfo
from .store import Store

__version__ = "0.1.0"

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
