"""Packs: many chunk frames in one blob-store object.

Packing keeps a commit of thousands of small tensors to a handful of objects. A pack's key is
random (``packs/3f/3fa9…``), never derived from its content: a chunk written again after gc
dropped it lands in a new pack, so a commit and a concurrent gc never race on one key.

Pack bytes::

    "CKPK" u8 version=1 u8[3] zero          header, 8 bytes
    frame*                                   chunk frames (see ckstore.format.codec)
    index                                    32 bytes a chunk: digest[16] u64 offset u32 length u32 raw_len
    u32 chunk_count  "CKPI"                  footer, 8 bytes

The catalog holds each chunk's offset and length, so reads never need the index; it is there so
``ckstore fsck`` can check a pack against the catalog and a lost catalog can be rebuilt.
"""

from __future__ import annotations

import struct
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, wait
from contextlib import ExitStack
from typing import Any, NamedTuple

from .._crash import crash_point
from .._threads import TaskGroup
from ..blobstore import BlobStore
from ..errors import IntegrityError
from .codec import CODEC_DELTA, HEADER_SIZE, Frame, delta_base, max_frame_length

__all__ = ["PackWriter", "PackedChunk", "new_pack_key", "read_index", "PACK_HEADER", "PACK_PREFIX"]

PACK_MAGIC = b"CKPK"
PACK_VERSION = 1
PACK_HEADER = PACK_MAGIC + bytes([PACK_VERSION, 0, 0, 0])
INDEX_MAGIC = b"CKPI"
_INDEX_ENTRY = struct.Struct("<16sQII")
_FOOTER = struct.Struct("<I4s")


# frames shorter than this are gathered in memory and written _BUFFER bytes at a time
_SMALL_FRAME = 64 * 1024
_BUFFER = 1 << 20

#: Every pack key starts with this; readers refuse catalog rows naming any other key.
PACK_PREFIX = "packs/"


def new_pack_key() -> str:
    h = uuid.uuid4().hex
    return f"{PACK_PREFIX}{h[:2]}/{h}"


class PackedChunk(NamedTuple):
    """One chunk's frame in a pack (a tuple: one is made per chunk a commit writes)."""

    digest: bytes
    offset: int
    length: int
    raw_size: int
    codec: int
    base: bytes | None = None  # a delta's base chunk (codec 3)
    chain: int | None = None  # a delta's depth: its base's plus one


class PackWriter:
    """Appends chunk frames to packs of about ``target_size`` bytes.

    ``on_open() -> (key, pack_id)`` runs before a pack's object is written: the caller records
    the pack in the catalog first (or takes a key recorded for it in advance).
    ``on_close(pack_id, size, chunks)`` runs once the object is durable. :attr:`sealed` lists
    every pack finished so far, ``(pack_id, size, chunks)`` in the order they were filled,
    whether or not it is durable yet.

    A blob store whose ``write_concurrency`` is above one (object stores, where each upload
    waits on the network) gets that many finished packs uploading in the background while the
    next one fills; ``on_close`` then runs on those threads. :meth:`close` returns once every
    pack is written and recorded, and raises the first failure; :meth:`close_later` returns
    as soon as the last pack is finished, with a function that waits for that.
    """

    def __init__(
        self,
        blobs: BlobStore,
        target_size: int,
        on_open: Callable[[], tuple[str, Any]],
        on_close: Callable[[Any, int, list[PackedChunk]], None],
    ) -> None:
        self.blobs = blobs
        self.target_size = target_size
        self._on_open = on_open
        self._on_close = on_close
        self._stack: ExitStack | None = None
        self._w: Any = None
        self._pack_id: Any = None
        self._chunks: list[PackedChunk] = []
        self._pos = 0
        self.packs_written = 0
        self._inflight = max(1, int(getattr(blobs, "write_concurrency", 1)))
        self._pool: TaskGroup | None = None
        self._uploads: list[Future[None]] = []
        self._count_lock = threading.Lock()
        self._buf = bytearray()  # small frames not written yet, at most about _BUFFER bytes
        self.sealed: list[tuple[Any, int, list[PackedChunk]]] = []

    def add(self, digest: bytes, frame: Frame, raw_size: int, chain: int | None = None) -> None:
        """Append one chunk's frame; ``chain``: a delta frame's depth (its base's plus one)."""
        if self._w is None:
            # a pack that starts with a large frame is filled up to the target by large frames
            # (a commit writes its small chunks first, into packs of their own)
            self._open(self.target_size if frame.length >= _SMALL_FRAME else 0)
        if frame.length < _SMALL_FRAME:  # gathered, so thousands of tiny chunks are a few writes
            for part in frame.parts:
                self._buf += part
            if len(self._buf) >= _BUFFER:
                self._flush()
        else:
            self._flush()
            for part in frame.parts:
                self._w.write(part)
            crash_point("pack.mid")
        base = delta_base(frame.parts[0]) if frame.codec == CODEC_DELTA else None
        self._chunks.append(PackedChunk(digest, self._pos, frame.length, raw_size, frame.codec, base, chain))
        self._pos += frame.length
        if self._pos >= self.target_size:
            self._finish()

    def seal(self) -> None:
        """Finish the pack being filled (if any) without waiting for it to be written: the next
        chunk starts a new pack. :meth:`close` waits for every pack."""
        if self._w is not None:
            self._finish()

    def close(self) -> None:
        self.close_later()()

    def close_later(self) -> Callable[[], None]:
        """Finish the last pack and return without waiting for the packs still being made
        durable (a local pack's fdatasync and rename, an object store's uploads): returns the
        function that waits for them, runs their ``on_close``, and raises the first failure.
        Every pack is in :attr:`sealed` once this returns. The caller may record the packs'
        chunks meanwhile, but must not make them visible before that function has returned;
        :meth:`abort` instead lets them end and leaves what they wrote to gc."""
        if self._w is not None:
            self._finish()

        def settle() -> None:
            self._settle(len(self._uploads))
            self._shutdown()

        return settle

    def abort(self) -> None:
        self._buf = bytearray()
        if self._stack is not None:
            stack, self._stack, self._w = self._stack, None, None
            try:
                raise RuntimeError("pack aborted")
            except RuntimeError as e:
                stack.__exit__(type(e), e, e.__traceback__)
        if self._uploads:  # let uploads in flight end; what they wrote is garbage for gc
            wait(self._uploads)
            self._uploads = []
        self._shutdown()

    def _settle(self, n: int) -> None:
        """Wait for the ``n`` oldest background uploads; raise the first failure."""
        for _ in range(n):
            self._uploads.pop(0).result()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _open(self, size_hint: int) -> None:
        key, self._pack_id = self._on_open()
        crash_point("pack.registered")
        self._stack = ExitStack()
        self._w = self._stack.enter_context(self.blobs.writer(key, size_hint))
        self._buf = bytearray(PACK_HEADER)
        self._pos = len(PACK_HEADER)
        self._chunks = []

    def _finish(self) -> None:
        assert self._stack is not None
        if self._uploads:  # a failed upload fails the commit now; else wait for a free slot
            for fut in self._uploads:
                if fut.done() and fut.exception() is not None:
                    fut.result()
            self._settle(max(0, len(self._uploads) - self._inflight + 1))
        self._flush()
        index = b"".join(_INDEX_ENTRY.pack(c.digest, c.offset, c.length, c.raw_size) for c in self._chunks)
        self._w.write(index)
        self._w.write(_FOOTER.pack(len(self._chunks), INDEX_MAGIC))
        size = self._pos + len(index) + _FOOTER.size
        stack, self._stack, self._w = self._stack, None, None
        chunks, self._chunks = self._chunks, []
        self.sealed.append((self._pack_id, size, chunks))
        if self._inflight == 1:
            self._complete(stack, self._pack_id, size, chunks)
            return
        if self._pool is None:
            self._pool = TaskGroup("pack", self._inflight)
        self._uploads.append(self._pool.submit(self._complete, stack, self._pack_id, size, chunks))

    def _flush(self) -> None:
        """Write the gathered small frames (and the pack's header) to the pack's object."""
        if self._buf:
            self._w.write(self._buf)
            self._buf = bytearray()
            crash_point("pack.mid")

    def _complete(self, stack: ExitStack, pack_id: Any, size: int, chunks: list[PackedChunk]) -> None:
        stack.close()  # the object becomes visible (and durable) here
        crash_point("pack.durable")
        with self._count_lock:
            self.packs_written += 1
        self._on_close(pack_id, size, chunks)


def read_index(data: bytes) -> list[tuple[bytes, int, int, int]]:
    """Parse a whole pack's index: ``[(digest, offset, length, raw_len), …]`` (see
    :func:`read_index_at`)."""
    return read_index_at(lambda start, end: bytes(data[start:end]), len(data))


def read_index_at(read: Callable[[int, int], bytes], size: int) -> list[tuple[bytes, int, int, int]]:
    """Parse the index of a pack of ``size`` bytes, reading only its header and its tail through
    ``read(start, end)``: ``[(digest, offset, length, raw_len), …]``.

    Every count and span is checked against the pack's own length before anything is built:
    each frame lies between the header and the index, and is no longer than a frame of its raw
    length can be. Raises :class:`IntegrityError` naming what is wrong.
    """
    if size < len(PACK_HEADER) + _FOOTER.size:
        raise IntegrityError("not a ckstore pack (bad header)")
    head = read(0, len(PACK_HEADER))
    if head[:4] != PACK_MAGIC:
        raise IntegrityError("not a ckstore pack (bad header)")
    if head[4:8] != PACK_HEADER[4:]:
        raise IntegrityError(f"pack format version {head[4]} is not supported by this ckstore (it reads {PACK_VERSION})")
    count, magic = _FOOTER.unpack(read(size - _FOOTER.size, size))
    if magic != INDEX_MAGIC:
        raise IntegrityError("pack footer is damaged")
    room = size - _FOOTER.size - len(PACK_HEADER)
    if count * _INDEX_ENTRY.size > room:
        raise IntegrityError(f"pack index claims {count} chunks, more than a pack of {size} bytes can hold")
    start = size - _FOOTER.size - count * _INDEX_ENTRY.size
    tail = read(start, size - _FOOTER.size) if count else b""
    out = []
    for i in range(count):
        digest, offset, length, raw_len = _INDEX_ENTRY.unpack_from(tail, i * _INDEX_ENTRY.size)
        if offset < len(PACK_HEADER) or offset + length > start:
            raise IntegrityError(
                f"pack index entry {i} spans bytes [{offset}, {offset + length}), outside the frames "
                f"[{len(PACK_HEADER)}, {start})"
            )
        if not HEADER_SIZE <= length <= max_frame_length(raw_len):
            raise IntegrityError(f"pack index entry {i} has a {length}-byte frame for {raw_len} raw bytes")
        out.append((digest, offset, length, raw_len))
    return out
