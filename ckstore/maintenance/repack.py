"""Repacking (``ckstore gc --repack``): rewrite packs whose bytes are mostly dead.

gc frees whole packs only, so a pack holding one long-lived chunk (a frozen layer, a small
state) keeps all its dead bytes. :func:`repack` takes the packs whose dead fraction exceeds
``min_dead`` (after gc's sweep), groups them so their live frames fill about one pack each, and
for each group:

1. records a new pack row (random key, no owner), then reads the old packs' live frames,
   verifies each against its digest (decoded and hashed: corruption is never copied), and writes
   them, as stored, into the new pack object (temp file + fsync + rename, or one put);
2. in one transaction under the exclusive gc lock, points the chunk rows at the new pack and
   moves every old pack left without chunk rows to the trash, deletable once the grace period
   has passed (a checkout that planned its reads before the move still reads the old object);
3. a later gc deletes the old objects.

Crash-safe at every point: before step 2 the new pack is an unowned pack without chunk rows,
which the next sweep trashes; after it, the old packs are in the trash. Commits meanwhile are
unaffected: chunk rows keep their ids, so references stay, and no commit adds to an old pack. A
chunk swept by a concurrent gc meanwhile simply is not moved (its frame in the new pack is dead).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np

from ..blobstore import BlobStore
from ..catalog import Catalog, ChunkLocation, NewChunk, RepackCandidate, utcnow
from ..checkout.bases import Bases
from ..errors import ChunkNotFoundError, IntegrityError, PolicyError
from ..format import hashing
from ..format.codec import Frame
from ..format.pack import PackedChunk, PackWriter, new_pack_key

__all__ = ["DEFAULT_MIN_DEAD", "RepackReport", "check_min_dead", "repack"]

#: Rewrite a pack once more than this fraction of its bytes is dead (see docs/benchmarks.md,
#: "Repacking": lower thresholds rewrite many packs for little gain).
DEFAULT_MIN_DEAD = 0.5


def check_min_dead(min_dead: object) -> None:
    """Refuse a ``min_dead`` that is not a fraction in [0, 1)."""
    if isinstance(min_dead, bool) or not isinstance(min_dead, (int, float)) or not 0.0 <= min_dead < 1.0:
        raise PolicyError(f"min_dead must be a fraction in [0, 1), got {min_dead!r}")


@dataclass(frozen=True, slots=True)
class RepackReport:
    packs_rewritten: int  # old packs moved to the trash
    packs_written: int
    chunks_moved: int
    bytes_before: int  # size of the old packs
    bytes_after: int  # size of the new packs
    skipped: int  # groups left as they were (a concurrent gc swept a new pack)
    seconds: float

    @property
    def bytes_reclaimable(self) -> int:
        """What deleting the trashed packs (after the grace period) frees."""
        return self.bytes_before - self.bytes_after


def repack(
    catalog: Catalog,
    blobs: BlobStore,
    *,
    min_dead: float = DEFAULT_MIN_DEAD,
    grace: float,
    pack_size: int,
    dry_run: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> RepackReport:
    """Rewrite the packs whose dead fraction exceeds ``min_dead``; see the module docstring."""
    check_min_dead(min_dead)
    t0 = time.perf_counter()
    cands = catalog.repack_candidates(min_dead)
    groups: list[list[RepackCandidate]] = []
    fill = pack_size
    for c in cands:
        if fill + c.live_bytes > pack_size:
            groups.append([])
            fill = 0
        groups[-1].append(c)
        fill += c.live_bytes
    if dry_run:
        return RepackReport(len(cands), len(groups), sum(c.chunks for c in cands), sum(c.size for c in cands),
                            sum(c.live_bytes for c in cands), 0, time.perf_counter() - t0)  # fmt: skip
    rewritten = written = moved = before = after = skipped = 0
    for n, group in enumerate(groups, 1):
        new_packs: list[tuple[int, int, list[PackedChunk]]] = []

        def on_open() -> tuple[str, int]:
            key = new_pack_key()
            return key, catalog.register_repack(key)

        def on_close(pack_id: int, size: int, chunks: list[PackedChunk], out: list[tuple[int, int, list[PackedChunk]]] = new_packs) -> None:
            out.append((pack_id, size, chunks))

        writer = PackWriter(blobs, pack_size, on_open, on_close)
        bases = Bases(blobs, catalog.chunk_locations)
        try:
            for old in group:
                data = blobs.read(old.key)
                for ch in catalog.live_chunks(old.id):
                    frame = data[ch.offset : ch.offset + ch.length]
                    _verify(frame, ch, old.key, bases)
                    writer.add(ch.digest, Frame(ch.codec, (frame,), len(frame)), ch.raw_size, ch.chain)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        got = catalog.move_chunks(new_packs, [(c.id, c.key) for c in group], utcnow() + timedelta(seconds=grace))
        if got is None:
            skipped += 1
            continue
        rewritten += len(group)
        written += len(new_packs)
        moved += got
        before += sum(c.size for c in group)
        after += sum(size for _, size, _ in new_packs)
        if progress is not None:
            progress("repack", n, len(groups))
    return RepackReport(rewritten, written, moved, before, after, skipped, time.perf_counter() - t0)


def _verify(frame: bytes, c: NewChunk, key: str, bases: Bases) -> None:
    out = np.empty(c.raw_size, dtype=np.uint8)
    try:
        bases.decode(frame, ChunkLocation(key, c.offset, c.length, c.raw_size, c.codec, c.base), out.data)
    except (IntegrityError, ChunkNotFoundError) as e:
        raise IntegrityError(f"chunk {c.digest.hex()} in {key} is corrupt ({e}); run `ckstore fsck --deep`") from e
    if hashing.digest(out.data) != c.digest:
        raise IntegrityError(
            f"chunk {c.digest.hex()} in {key} does not match its digest; nothing was repacked from it. "
            "Run `ckstore fsck --deep`"
        )
