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
        self.given: Mapping[bytes, ChunkLocation] = known or {}  # (not copied: a checkout's may be large)
        self.known: dict[bytes, ChunkLocation] = {}  # bases looked up since

    def prefetch(self, locs: Mapping[bytes, ChunkLocation]) -> None:
        """Look up, level by level, the bases of the deltas among ``locs`` that are not known yet."""
        wanted = {loc.base for loc in locs.values() if loc.base is not None}
        for _ in range(MAX_DELTA_CHAIN):
            todo = [d for d in wanted if d not in self.known and d not in self.given and d not in locs]
            if not todo:
                return
            found = self.locate(todo)
            self.known.update(found)
            wanted = {loc.base for loc in found.values() if loc.base is not None}

    def decode(self, frame: memoryview | bytes, loc: ChunkLocation, dest: memoryview) -> None:
        """Decode one chunk's ``frame`` into ``dest``; a delta's bases are read and verified
        first. Raises :class:`IntegrityError` for a malformed frame or a damaged base and
        :class:`ChunkNotFoundError` for a missing one; the caller verifies the chunk's digest.

        A chain decodes in place: its whole chunk into ``dest``, then each delta above it XORed
        in (one scratch buffer for the chain), each level verified against its digest."""
        base = codec.delta_base(frame)
        if base != loc.base:
            raise IntegrityError(
                f"its frame names base {base.hex() if base else 'none'}, the catalog "
                f"{loc.base.hex() if loc.base else 'none'}"
            )
        if base is None:
            codec.decode_into(frame, dest)
            return
        size = memoryview(dest).nbytes
        chain = [(base, self._frame(base, size))]  # the bases, from the nearest down
        while (below := codec.delta_base(chain[-1][1])) is not None:
            if len(chain) >= MAX_DELTA_CHAIN:
                raise IntegrityError(
                    f"base chunk {chain[-1][0].hex()} is more than {MAX_DELTA_CHAIN} deltas deep; the catalog is damaged"
                )
            chain.append((below, self._frame(below, size)))
        out = np.frombuffer(dest, dtype=np.uint8)
        scratch = np.empty(size, dtype=np.uint8)
        for i in range(len(chain) - 1, -1, -1):
            digest, data = chain[i]
            try:
                if i == len(chain) - 1:
                    codec.decode_into(data, out.data)
                else:
                    codec.apply_delta(data, out.data, scratch.data)
            except IntegrityError as e:
                raise IntegrityError(f"base chunk {digest.hex()} is corrupt: {e}") from e
            if hashing.digest(out.data) != digest:
                raise IntegrityError(f"base chunk {digest.hex()} does not match its digest; the stored bytes are corrupt")
        codec.apply_delta(frame, out.data, scratch.data)

    def _frame(self, digest: bytes, size: int) -> memoryview:
        """The stored frame of base chunk ``digest``, which must decode to ``size`` bytes; its
        catalog row checked against the frame and the pack's bounds before anything is read."""
        what = f"base chunk {digest.hex()}"
        loc = self.given.get(digest) or self.known.get(digest)
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
        try:
            below = codec.delta_base(frame)
        except IntegrityError as e:
            raise IntegrityError(f"{what} is corrupt: {e}") from e
        if below != loc.base:
            raise IntegrityError(f"{what} is corrupt: its frame and the catalog name different bases")
        return frame
