"""The errors ckstore raises.

Every error derives from :class:`CkstoreError`, and mixes in the built-in exception whose
meaning it shares, so ``except FileNotFoundError`` still catches a missing chunk. Messages
name the run, step, rank, key and what to do next wherever those are known.
"""

from __future__ import annotations

__all__ = [
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
    "OUTCOME_UNKNOWN",
]

#: The words an error uses when a checkpoint may have become visible after all: the catalog's
#: COMMIT was sent and its answer lost. A failed collective commit whose rank 0 reports them does
#: not claim that nothing was committed.
OUTCOME_UNKNOWN = "may or may not have been committed"


class CkstoreError(Exception):
    """Root of every error ckstore raises."""


class NotFoundError(CkstoreError, LookupError):
    """Something named does not exist."""


class CheckpointNotFoundError(NotFoundError):
    """No committed checkpoint matches a ref."""


class ChunkNotFoundError(CkstoreError, FileNotFoundError):
    """A chunk the catalog references is missing from the blob store."""


class AlreadyExistsError(CkstoreError, FileExistsError):
    """A checkpoint, tag or run already exists and replacing it was not asked for."""


class CommitInProgressError(CkstoreError):
    """Another live process is committing the same ``(run, step)``."""


class CommitAbandonedError(CkstoreError):
    """A commit in flight lost its claim (garbage collection took it over as abandoned)."""


class IntegrityError(CkstoreError, ValueError):
    """Stored bytes do not match their digest, or stored data is malformed."""


class UnsupportedValueError(CkstoreError, TypeError):
    """A state dict holds a value ckstore cannot store without an explicit opt-in."""


class SchemaVersionError(CkstoreError):
    """The catalog's schema is older or newer than this ckstore."""


class StoreConfigError(CkstoreError, ValueError):
    """A store location, catalog URL or store setting is wrong."""


class CatalogError(CkstoreError):
    """The catalog database failed (connection lost, server restarted, …)."""


class BlobStoreError(CkstoreError, OSError):
    """The blob store failed to read or write an object."""


class InvalidRefError(CkstoreError, ValueError):
    """A checkpoint ref cannot be parsed."""


class LayoutError(CkstoreError, ValueError):
    """A world layout or sharding declaration is inconsistent."""


class DistributedCommitError(CkstoreError):
    """A collective commit or checkout failed on at least one rank."""


class PolicyError(CkstoreError, ValueError):
    """A retention policy (given in Python, on the command line or stored for a run) is malformed."""


class ProtectedCheckpointError(CkstoreError):
    """An explicit delete was refused because the checkpoint is tagged (pass force to delete it)."""
