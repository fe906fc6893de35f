"""What diffs and lineage read of a store: its catalog and blob store, and checkpoint lookups.
:class:`ckstore.Store` is one; so is anything else that provides these."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ..blobstore import BlobStore
from ..catalog import Catalog
from ..format.manifest import Manifest
from ..records import Checkpoint

__all__ = ["StoreView"]


class StoreView(Protocol):
    @property
    def catalog(self) -> Catalog: ...

    @property
    def blobs(self) -> BlobStore: ...

    @property
    def workers(self) -> int:
        """Threads for reading chunks."""
        ...

    @property
    def run(self) -> str | None:
        """The default run of refs that name none."""
        ...

    def resolve(self, ref: str | int = ..., *, run: str | None = ...) -> Checkpoint:
        """The committed checkpoint ``ref`` names (in ``run``, or the default run)."""
        ...

    def manifests(
        self, ckpt: Checkpoint, *, ranks: Iterable[int] | None = ..., sub_keys: Iterable[str] | None = ...
    ) -> dict[tuple[int, str], Manifest]:
        """The manifests of a checkpoint's entries, by ``(rank, sub_key)``."""
        ...
