"""The catalog: what was saved, where its chunks live, and which checkpoints use them.

The catalog knows nothing of bytes. It records runs, checkpoints (pending while a commit is in
flight, then committed), entries with their manifests, packs, chunks, the chunks each checkpoint
references, metrics and tags. Every SQL statement of ckstore lives in this package; the rest of
ckstore calls :class:`Catalog`'s named methods.

Call order of a commit (one process, or rank 0 of a distributed commit)::

    begin_checkpoint  →  claim_and_register  →  (every rank writes its packs)
                      →  finish_checkpoint(packs, record)   (or abort_checkpoint on failure)

``claim_and_register`` references the chunks the catalog has and, in the same transaction,
records every pack the commit may write (an upper bound); a single process, which hashes its
chunks before it opens its pending checkpoint, does both in one ``begin_and_claim``.
``finish_checkpoint`` then records every written pack's chunk rows, drops the rows of the packs
left unwritten, hands what the checkpoint's record needs to the commit's ``record`` hook (which
writes the record, while the transaction goes on or at once; durable before its COMMIT) and
makes the checkpoint visible, in one transaction. Commits that stream their chunks (DCP's storage writer, imports) record each pack
as they go: ``claim_chunks`` → (``register_pack`` → write the pack → ``add_chunks``)* → (the
record is written) → ``finish_checkpoint``. Only ``finish_checkpoint`` waits for the disk; the
transactions before it do not, and it makes them durable with it (see ``write_txn`` in
``_engine``).

``heartbeat`` may be called from another thread at any time in between. Every method is safe to
call from many processes at once; ``docs/format.md`` explains why garbage collection running at
the same time never deletes a chunk a commit relies on.

Maintenance reads one snapshot through :meth:`Catalog.snapshot` (a :class:`Survey`) and gc
writes through :meth:`Catalog.gc_transaction` (a :class:`GcTransaction`).

The parts of :class:`Catalog`, one module each: ``_access`` (engine, transactions, schema),
``_runs`` (runs, policies, lineage, tags), ``_commit`` (the commit protocol), ``_queries``
(records, refs, listings), ``_survey`` and ``_gc`` (maintenance), ``_usage`` (space accounting).
"""

from __future__ import annotations

from ._commit import CommitMixin
from ._engine import describe_database_error, redact
from ._gc import Candidate, GcMixin, GcTransaction, Swept
from ._owner import Owner
from ._queries import CheckoutRows, CorruptRowWarning
from ._records import Ident, RecordFacts, RecordsMixin, RestoredChunk
from ._repack import RepackCandidate, RepackMixin
from ._rows import ChunkLocation, ChunkRow, NewChunk, Pending, aware, utcnow
from ._survey import CheckpointId, ChunkSpan, PackExtent, Survey
from ._usage import StoreUsage, Usage, UsageMixin

__all__ = [
    "describe_database_error",
    "Candidate",
    "Catalog",
    "CheckpointId",
    "CheckoutRows",
    "ChunkLocation",
    "ChunkSpan",
    "CorruptRowWarning",
    "GcTransaction",
    "Ident",
    "RecordFacts",
    "RestoredChunk",
    "RepackCandidate",
    "ChunkRow",
    "NewChunk",
    "Owner",
    "PackExtent",
    "Pending",
    "StoreUsage",
    "Survey",
    "Swept",
    "Usage",
    "aware",
    "redact",
    "utcnow",
]


class Catalog(CommitMixin, GcMixin, UsageMixin, RecordsMixin, RepackMixin):
    """The SQL catalog of one store (SQLite or PostgreSQL)."""
