"""Space accounting: :func:`usage` behind ``ckstore du``.

For the whole store, each run and each checkpoint: logical bytes (what was saved), unique bytes
(raw bytes of the distinct chunks referenced: logical / unique is the dedup ratio), stored bytes
(their compressed size: unique / stored is the compression ratio) and exclusive bytes (stored
bytes of the chunks nothing else references: what dropping it would free). The catalog computes
them with set-based queries (:meth:`ckstore.catalog.Catalog.usage`).

Bytes are chunk bytes. A pack object is deleted once none of its chunks is referenced, so the
blob store may hold more than the referenced chunks (``pack_bytes`` shows how much it holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..blobstore import BlobStore
from ..catalog import Catalog, Usage

__all__ = ["DuReport", "Usage", "usage"]


@dataclass(frozen=True, slots=True)
class DuReport:
    total: Usage
    runs: tuple[Usage, ...]
    checkpoints: tuple[Usage, ...]
    pack_bytes: int  # size of every pack object the catalog records
    garbage_bytes: int  # stored bytes of chunks no checkpoint references (the next gc frees them)
    #: stored bytes of chunks no checkpoint references, kept as the bases of deltas that are
    base_bytes: int = 0
    #: released pack files kept on disk for later commits to write over (a local folder's
    #: ``tmp/*.free``; ``recycle_bytes`` in :func:`ckstore.open`), and their bytes
    recycled_files: int = 0
    recycled_bytes: int = 0


def usage(catalog: Catalog, run: str | None = None, blobs: BlobStore | None = None) -> DuReport:
    """Usage of every run, and of every checkpoint (of ``run`` only, when given); with ``blobs``,
    the released pack files it keeps for reuse too."""
    u = catalog.usage(run)
    total = Usage(
        "(all)",
        sum(r.checkpoints for r in u.runs),
        sum(r.logical_bytes for r in u.runs),
        u.unique_bytes,
        u.stored_bytes,
        u.stored_bytes + u.base_bytes,  # dropping everything frees what checkpoints reference, and bases
    )
    recycled = blobs.recycled() if blobs is not None else (0, 0)
    return DuReport(total, u.runs, u.checkpoints, u.pack_bytes, u.garbage_bytes, u.base_bytes, *recycled)
