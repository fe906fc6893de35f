"""Conformance suites: the contracts every backend must meet, written once as test classes.

* :class:`conformance.blobstore.BlobStoreConformance` — a blob store; a backend's class provides
  the ``blobs`` fixture (tests/test_blobstore_backends.py: local, memory, S3).
* :class:`conformance.store.StoreConformance` — the whole store API on one catalog and blob
  store pair; a backend's class provides the ``spec`` fixture, a :class:`StoreSpec`
  (tests/test_store_backends.py: SQLite, PostgreSQL, S3 + PostgreSQL).

A feature that must behave the same on every backend (gc, fsck, diff, …) writes its own class
here, taking the ``spec`` fixture, and appends it to :data:`STORE_SUITES`; every backend's test
class runs every suite listed.
"""

from __future__ import annotations

from .diff import DiffConformance
from .gc import GcConformance
from .store import StoreConformance, StoreSpec, assert_consistent, sample_states

__all__ = [
    "STORE_SUITES",
    "DiffConformance",
    "GcConformance",
    "StoreConformance",
    "StoreSpec",
    "assert_consistent",
    "sample_states",
]

#: the store suites every backend runs
STORE_SUITES: list[type] = [StoreConformance, GcConformance, DiffConformance]
