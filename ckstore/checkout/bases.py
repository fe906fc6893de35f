"""Decoding delta chunks: the raw bytes of the bases a delta frame (codec 3) decodes against.

A delta's frame names its base by digest; the catalog's row for the delta names the same base.
:class:`Bases` reads each base's frame, decodes it (through its own base, when it is a delta
too), and verifies it against its digest before any delta is decoded against it, so a damaged
base is reported as such and never yields wrong bytes. Chains longer than
:data:`~ckstore.config.MAX_DELTA_CHAIN` are refused as damaged.

Every reader of chunks decodes through this: checkout, fsck, repack's and copy's verification.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..blobstore import BlobNotFoundError, BlobStore
from ..catalog import ChunkLocation
from ..config import MAX_DELTA_CHAIN
from ..errors import ChunkNotFoundError, IntegrityError
from ..format import codec, hashing
from ..format.pack import PACK_HEADER, PACK_PREFIX

__all__ = ["Bases", "Locate"]

#: the catalog's locations of chunks by digest (absent: the catalog has no such chunk)
Locate = Callable[[list[bytes]], Mapping[bytes, ChunkLocation]]


class Bases:
    """Decodes frames whose chunks may be deltas, reading their bases from ``blobs``.

    ``known``: locations already read from the catalog (a checkout's: every chunk its checkpoint
    references, bases included); any other base is looked up with ``locate``, one catalog query
    per level of chain for a batch (:meth:`prefetch`) or per base otherwise. Thread-safe: bases
    are decoded by whichever thread needs them, into memory of its own.
    """

    def __init__(self, blobs: BlobStore, locate: Locate, known: Mapping[bytes, ChunkLocation] | None = None) -> None:
        self.blobs = blobs
        self.locate = locate
        self.known: dict[bytes, ChunkLocation] = dict(known or {})

    def prefetch(self, locs: Mapping[bytes, ChunkLocation]) -> None:
        """Look up, level by level, the bases of the deltas among ``locs`` that are not known yet."""
        wanted = {loc.base for loc in locs.values() if loc.base is not None}
        for _ in range(MAX_DELTA_CHAIN):
            todo = [d for d in wanted if d not in self.known and d not in locs]
            if not todo:
                return
            found = self.locate(todo)
            self.known.update(found)
            wanted = {loc.base for loc in found.values() if loc.base is not None}

    def decode(self, frame: memoryview | bytes, loc: ChunkLocation, dest: memoryview) -> None:
        """Decode one chunk's ``frame`` into ``dest``; a delta's bases are read and verified
        first. Raises :class:`IntegrityError` for a malformed frame or a damaged base and
        :class:`ChunkNotFoundError` for a missing one; the caller verifies the chunk's digest."""
        base = codec.delta_base(frame)
        if base != loc.base:
            raise IntegrityError(
                f"its frame names base {base.hex() if base else 'none'}, the catalog "
                f"{loc.base.hex() if loc.base else 'none'}"
            )
        if base is None:
            codec.decode_into(frame, dest)
            return
        codec.decode_into(frame, dest, base=self.raw(base, memoryview(dest).nbytes, 1))

    def raw(self, digest: bytes, size: int, depth: int) -> memoryview:
        """The verified raw bytes of base chunk ``digest``, which must be ``size`` bytes long."""
        what = f"base chunk {digest.hex()}"
        if depth > MAX_DELTA_CHAIN:
            raise IntegrityError(f"{what} is more than {MAX_DELTA_CHAIN} deltas deep; the catalog is damaged")
        loc = self.known.get(digest)
        if loc is None:
            loc = self.locate([digest]).get(digest)
            if loc is None:
                raise ChunkNotFoundError(f"{what} is not in the catalog; the store is damaged (run `ckstore fsck`)")
            self.known[digest] = loc
        if loc.raw_size != size:
            raise IntegrityError(f"{what} holds {loc.raw_size} raw bytes, its delta {size}")
        if loc.offset < len(PACK_HEADER) or not codec.HEADER_SIZE <= loc.length <= codec.max_frame_length(size):
            raise IntegrityError(f"the catalog places the {loc.length}-byte frame of {what} at byte {loc.offset}")
        if not loc.pack_key.startswith(PACK_PREFIX):
            raise IntegrityError(f"the catalog places {what} in {loc.pack_key[:100]!r}, outside {PACK_PREFIX}")
        try:
            frame = memoryview(self.blobs.read(loc.pack_key, loc.offset, loc.offset + loc.length))
        except BlobNotFoundError as e:
            raise ChunkNotFoundError(f"pack {loc.pack_key} holding {what} is missing from the blob store") from e
        if frame.nbytes != loc.length:
            raise IntegrityError(f"pack {loc.pack_key} ends inside the frame of {what}")
        out = np.empty(size, dtype=np.uint8)
        try:
            below = codec.delta_base(frame)
            if below != loc.base:
                raise IntegrityError("its frame and the catalog name different bases")
            base = self.raw(below, size, depth + 1) if below is not None else None
            codec.decode_into(frame, out.data, base=base)
        except IntegrityError as e:
            raise IntegrityError(f"{what} is corrupt: {e}") from e
        if hashing.digest(out.data) != digest:
            raise IntegrityError(f"{what} does not match its digest; the stored bytes are corrupt")
        return out.data
