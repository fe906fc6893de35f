"""The checkout executor: runs a :class:`~ckstore.checkout.readplan.ReadPlan` against the blob store.

Chunks are fetched with coalesced range reads (one request for neighbouring chunks of a pack),
in parallel threads (from a local store each into a buffer the thread keeps for the checkout);
zstd and xxhash release the GIL. Each chunk is decoded straight into the target tensor's memory
when the plan wants the whole chunk there, verified against its digest, and copied to any other
place that needs the same bytes. Staging buffers (for pieces that are not contiguous in the
target) live only until their box copies are done.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._threads import TaskGroup
from ..blobstore import BlobNotFoundError, BlobStore
from ..catalog import ChunkLocation
from ..errors import BlobStoreError, ChunkNotFoundError, IntegrityError
from ..format import codec, hashing
from ..format.pack import PACK_HEADER, PACK_PREFIX
from ..format.tensorio import byte_view, dtype_from_name, empty_tensor
from .bases import Bases
from .readplan import ChunkCopy, ReadPlan

__all__ = ["execute_plan", "allocate_targets", "locate_plan", "COALESCE_GAP", "COALESCE_SMALL", "COALESCE_WASTE", "COALESCE_MAX", "LOCAL_READ_MAX"]

# Neighbouring chunks of a pack are fetched in one request when the bytes between them are few:
# at most COALESCE_GAP, and either under COALESCE_SMALL or under 1/COALESCE_WASTE of the bytes the
# request really needs, so a checkout reading every fourth chunk does not fetch the other three.
COALESCE_GAP = 256 * 1024
COALESCE_SMALL = 4 * 1024
COALESCE_WASTE = 8
COALESCE_MAX = 32 * 1024 * 1024
#: The longest read from a store that reads into buffers (local files): each read thread keeps a
#: buffer that long while reads are left, so a checkout's peak stays what it was with 32 MiB
#: reads into fresh buffers; from the page cache 16 MiB reads also decoded faster (fewer fresh
#: pages), and from the disk within 3% of 32 MiB ones (docs/benchmarks.md, "Byte planes")
LOCAL_READ_MAX = 16 * 1024 * 1024
#: The kernel copies a read's bytes from the page cache a page at a time with ``rep movsb``, which
#: on some CPUs runs ~10x slower when the destination lies a few bytes past the source within a
#: page (measured on this project's AMD EPYC machines: 506 against 44 µs for 875,000 bytes when
#: the buffer's address minus the file offset is 8, 16 or 24 modulo 4096). A fresh buffer from
#: the allocator sits 16 bytes past a page boundary and a pack's first chunk 8 bytes into its
#: file, so the first read of every pack in a process's first checkout (a resume) hit it; reads
#: land where buffer address and file offset agree modulo the page size instead.
_PAGE = 4096


@dataclass(slots=True)
class _Read:
    key: str
    start: int
    end: int
    chunks: list[tuple[bytes, ChunkLocation]]


def _coalesce(digests: Sequence[bytes], locs: dict[bytes, ChunkLocation], max_read: int = COALESCE_MAX) -> list[_Read]:
    by_pack: dict[str, list[tuple[bytes, ChunkLocation]]] = defaultdict(list)
    for d in digests:
        loc = locs[d]
        by_pack[loc.pack_key].append((d, loc))
    reads: list[_Read] = []
    for key, items in by_pack.items():
        items.sort(key=lambda x: x[1].offset)
        cur: _Read | None = None
        useful = 0
        for d, loc in items:
            end = loc.offset + loc.length
            gap = loc.offset - cur.end if cur is not None else 0
            if (
                cur is not None
                and gap <= COALESCE_GAP
                and (gap <= COALESCE_SMALL or gap * COALESCE_WASTE <= useful + loc.length)
                and end - cur.start <= max_read
            ):
                cur.end = max(cur.end, end)
                cur.chunks.append((d, loc))
                useful += loc.length
            else:
                cur = _Read(key, loc.offset, end, [(d, loc)])
                reads.append(cur)
                useful = loc.length
    reads.sort(key=lambda r: (r.key, r.start))
    return reads


def execute_plan(
    plan: ReadPlan,
    blobs: BlobStore,
    locate: Callable[[list[bytes]], dict[bytes, ChunkLocation]],
    *,
    where: str,
    workers: int,
    progress: Callable[[int], None] | None = None,
    pin_memory: bool = False,
    tensors: list[torch.Tensor | None] | None = None,
    locs: dict[bytes, ChunkLocation] | None = None,
) -> list[torch.Tensor | None]:
    """Fill every buffer of ``plan``; returns the target tensors by buffer index (staging: None).

    ``where`` names the checkpoint ("run 'exp1', step 100") in error messages. With
    ``pin_memory`` target tensors are allocated in pinned memory, ready for asynchronous copies
    to an accelerator. ``tensors``: the targets, from :func:`allocate_targets` (allocated here
    when None); ``locs``: the chunks' checked locations, from :func:`locate_plan` (looked up
    here when None). A caller that allocates the targets itself locates the chunks first, so a
    damaged catalog is refused before anything is allocated.
    """
    if locs is None:
        locs = locate_plan(plan, locate, where)
    bases = Bases(blobs, locate, locs)
    if any(locs[c.digest].base is not None for c in plan.copies):
        bases.prefetch(locs)  # the bases of deltas, read and decoded as their deltas need them
    if tensors is None:
        tensors = allocate_targets(plan, pin_memory=pin_memory, where=where)
    # by buffer index (a list: a dict of 100,000 views added 5 MiB to a checkout's peak); they
    # point into ``tensors``, which outlive them: every task that writes through them ends
    # before the pool's block does
    views: list[Any] = [None if t is None else _target_view(t) for t in tensors]  # (None: a staging buffer)

    # one unit for everything landing in target tensors, one per staging buffer
    units: dict[int | None, list[ChunkCopy]] = defaultdict(list)
    for c in plan.copies:
        units[c.buffer if plan.buffers[c.buffer].staging else None].append(c)
    boxes_by_src = defaultdict(list)
    for bx in plan.boxes:
        boxes_by_src[bx.src].append(bx)

    lock = threading.Lock()
    # each worker reads into one buffer of its own, grown to its longest read and kept while
    # reads are left to start: faulting in fresh pages for every read cost as much as copying
    # them (the 87 MiB fp32 checkout from the page cache: 54.5–56.8 against 57.9–67.4 ms,
    # docs/benchmarks.md); a blob store that can only return bytes (object stores) hands those
    # over, not copied again. Each read lands at the place in its buffer whose address matches
    # its offset in the file modulo the page size (see _PAGE).
    scratch = threading.local()

    def read(rd: _Read) -> memoryview:
        n = rd.end - rd.start
        if not blobs.reads_into:
            return memoryview(blobs.read(rd.key, rd.start, rd.end))
        buf: memoryview | None = getattr(scratch, "buf", None)
        if buf is None or buf.nbytes < n + _PAGE:
            scratch.buf = None  # the old one goes before the new one is allocated
            a = np.empty(n + _PAGE, dtype=np.uint8)
            buf = scratch.buf = a.data
            scratch.addr = a.ctypes.data
        at = (rd.start - scratch.addr) % _PAGE
        view = buf[at : at + n]
        blobs.read_into(rd.key, rd.start, view)
        return view

    with TaskGroup("read", workers) as pool:
        for unit, copies in units.items():
            local_views = views
            staged: torch.Tensor | None = None
            if unit is not None:
                sb = plan.buffers[unit]
                staged = empty_tensor(dtype_from_name(sb.dtype), sb.shape)
                local_views = list(views)
                local_views[unit] = byte_view(staged)
            # each chunk's copies: the copy itself when it is the only one (most chunks), a list
            # when several places need its bytes (a list per chunk: 13 MiB at 100,000 chunks)
            by_digest: dict[bytes, ChunkCopy | list[ChunkCopy]] = {}
            for c in copies:
                got = by_digest.get(c.digest)
                if got is None:
                    by_digest[c.digest] = c
                elif isinstance(got, list):
                    got.append(c)
                else:
                    by_digest[c.digest] = [got, c]
            longest = LOCAL_READ_MAX if blobs.reads_into else COALESCE_MAX
            reads = _coalesce(list(by_digest), locs, _max_read(by_digest, locs, workers, longest))
            unstarted = [len(reads)]

            def run(
                rd: _Read, lv: list[Any] = local_views, bd: dict[bytes, ChunkCopy | list[ChunkCopy]] = by_digest,
                unstarted: list[int] = unstarted,
            ) -> None:
                with lock:
                    unstarted[0] -= 1
                try:
                    data = read(rd)
                except BlobNotFoundError as e:
                    c = _copies(bd[rd.chunks[0][0]])[0]
                    raise ChunkNotFoundError(
                        f"{where}, {c.source}: pack {rd.key} holding chunk {rd.chunks[0][0].hex()} is "
                        "missing from the blob store; the checkpoint is damaged (run `ckstore fsck`)"
                    ) from e
                except BlobStoreError as e:
                    c = _copies(bd[rd.chunks[0][0]])[0]
                    raise BlobStoreError(f"{where}, {c.source}: {e}") from e
                done = 0
                for d, loc in rd.chunks:
                    frame = data[loc.offset - rd.start : loc.offset - rd.start + loc.length]
                    cs = _copies(bd[d])
                    _deliver(d, frame, loc, cs, lv, where, bases)
                    done += sum(c.src_stop - c.src_start for c in cs)
                del data
                if not unstarted[0]:  # no read left for this thread: its buffer goes now, not at the end
                    scratch.buf = None
                if progress is not None:
                    with lock:
                        progress(done)

            # when every read has a thread of its own, the caller runs the first one itself
            # instead of waiting for a thread to wake for it (from the page cache, a checkout of
            # 16 bytes, one read: 0.45 against 0.59 ms; of 4 MiB, 3–4 reads: 2.44–2.51 against
            # 2.63 ms); with more reads than threads it only waits, as its Python would compete
            # for the GIL with the workers' (a checkout of an Adam state's 7,200 chunks took 9%
            # longer with the caller taking reads beside its threads)
            mine = reads[0] if reads and len(reads) <= workers else None
            futures = [pool.submit(run, rd) for rd in (reads[1:] if mine is not None else reads)]
            try:
                if mine is not None:
                    run(mine)
                for fut in futures:
                    fut.result()
            except BaseException:
                for fut in futures:  # fail fast: reads not started yet never start
                    fut.cancel()
                raise
            if staged is not None:
                for bx in boxes_by_src.get(unit, ()):  # type: ignore[arg-type]
                    dst = tensors[bx.dst]
                    assert dst is not None
                    src_sl = tuple(slice(a, b) for a, b in bx.src_box)
                    dst_sl = tuple(slice(a, b) for a, b in bx.dst_box)
                    dst[dst_sl] = staged[src_sl]
    return tensors


def _target_view(t: torch.Tensor) -> Any:
    """A writable view of a target tensor's bytes. A fresh contiguous CPU tensor's memory is viewed
    through a ctypes array at its address (1.4 against 3.9 µs through numpy: a checkout of
    100,000 tiny tensors makes one view of each), which holds no reference to the tensor: the
    caller keeps the tensor alive while the view is used."""
    n = t.nbytes
    if n == 0 or not t.is_cpu or not t.is_contiguous():
        return byte_view(t)
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


#: Target ranges at least this long are faulted in with one call before a chunk is decoded into
#: them (see :func:`_prefault`)
PREFAULT_MIN = 256 * 1024
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>: Linux 5.14 and later
_UNLOADED: Any = object()
_libc: Any = _UNLOADED


def _prefault(view: memoryview) -> bool:
    """Fault in the pages under ``view`` (a chunk's place in a target tensor) with one
    ``madvise(MADV_POPULATE_WRITE)``, when its memory is fresh; True when it did.

    A fresh tensor's pages are otherwise faulted in one 4 KiB page at a time as the chunk is
    decoded into it; on this project's machines a fault costs ~4 µs (13 MiB of fresh memory
    touched in 13.4 ms), and one call for the whole range does the same work for less: a
    process's first checkout (a resume) of 1 GiB from the page cache took 0.85 s against
    1.16 s (docs/benchmarks.md, "Fresh pages faulted in at once"). Memory the allocator recycled,
    as in a job that checks out again and again, has its pages in already: ``mincore`` on the
    range's first page tells, and such a range is left alone (populating it again would walk its
    page tables for nothing). Elsewhere than Linux, or on a kernel without the call, it does
    nothing.
    """
    global _libc
    if _libc is _UNLOADED:
        _libc = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
                _libc = lib
            except (OSError, AttributeError):  # no such symbols in this libc
                pass
    lib = _libc
    if lib is None or view.readonly:
        return False
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    page = mmap.PAGESIZE
    start = (addr + page - 1) & -page
    end = (addr + view.nbytes) & -page
    if end - start < PREFAULT_MIN:
        return False
    resident = ctypes.c_ubyte(0)
    if lib.mincore(start, page, ctypes.byref(resident)) != 0 or resident.value & 1:
        return False
    if lib.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:  # a kernel before 5.14: the decode faults pages in
        _libc = None
    return False


def _copies(got: ChunkCopy | list[ChunkCopy]) -> Sequence[ChunkCopy]:
    return got if isinstance(got, list) else (got,)


def locate_plan(
    plan: ReadPlan, locate: Callable[[list[bytes]], dict[bytes, ChunkLocation]], where: str
) -> dict[bytes, ChunkLocation]:
    """The locations of every chunk ``plan`` reads, each checked against the manifest (see
    :func:`_check_location`): what a checkout does before it allocates anything."""
    try:
        locs = locate(list(dict.fromkeys(c.digest for c in plan.copies)))
    except IntegrityError as e:  # a chunk row changed outside ckstore
        raise IntegrityError(f"{where}: {e}") from e
    for c in plan.copies:
        _check_location(c, locs.get(c.digest), where)
    return locs


def allocate_targets(plan: ReadPlan, *, pin_memory: bool = False, where: str = "") -> list[torch.Tensor | None]:
    """The (unfilled) target tensors of ``plan``'s buffers, by buffer index (staging: None).

    A tensor that cannot be allocated is an :class:`IntegrityError` naming it (``where``: the
    checkpoint): its manifest declares more than this machine holds."""
    tensors: list[torch.Tensor | None] = [None] * len(plan.buffers)
    dtypes: dict[str, torch.dtype] = {}
    i = 0
    try:
        for i, buf in enumerate(plan.buffers):
            if not buf.staging:
                dt = dtypes.get(buf.dtype)
                if dt is None:
                    dt = dtypes[buf.dtype] = dtype_from_name(buf.dtype)
                tensors[i] = empty_tensor(dt, buf.shape, pin_memory=pin_memory)
    except (RuntimeError, MemoryError) as e:
        buf = plan.buffers[i]
        at = f"{where}, " if where else ""
        raise IntegrityError(
            f"{at}{_buffer_source(plan, i)}: cannot allocate {buf.nbytes} bytes ({buf.dtype} of shape "
            f"{list(buf.shape)}) for it: {str(e).splitlines()[0][:200]}; free memory, check out fewer ranks or "
            "sub-checkpoints, or, if the checkpoint cannot be that large, its manifest is damaged (run "
            "`ckstore fsck`)"
        ) from e
    return tensors


def _buffer_source(plan: ReadPlan, i: int) -> str:
    """The stored tensor that buffer ``i`` of ``plan`` receives, for an error message."""
    for c in plan.copies:
        if c.buffer == i:
            return c.source
    for e in plan.entries:
        if i in e.buffers:
            return f"{e.source}, tensor {e.buffers.index(i)}"
    return f"tensor buffer {i}"


def _max_read(digests: Iterable[bytes], locs: dict[bytes, ChunkLocation], workers: int, cap: int = COALESCE_MAX) -> int:
    """The longest coalesced read for these chunks: up to ``cap``, but short enough
    that there are about two reads per worker, so that decoding (the bulk of a checkout from
    the page cache) runs on every worker even when the whole checkpoint sits in one pack."""
    total = sum(locs[d].length for d in digests)
    return max(COALESCE_SMALL, min(cap, total // max(1, 2 * workers)))


def _check_location(c: ChunkCopy, loc: ChunkLocation | None, where: str) -> None:
    """Refuse a catalog row that disagrees with the manifest before anything is read or allocated."""
    if loc is None:
        raise ChunkNotFoundError(
            f"{where}, {c.source}: chunk {c.digest.hex()} is not in the catalog; the checkpoint is "
            "damaged (run `ckstore fsck`)"
        )
    problem = None
    if loc.raw_size != c.raw_size:
        problem = f"the catalog records {loc.raw_size} raw bytes for it, the manifest {c.raw_size}"
    elif loc.offset < len(PACK_HEADER) or not codec.HEADER_SIZE <= loc.length <= codec.max_frame_length(c.raw_size):
        problem = f"the catalog places its {loc.length}-byte frame at byte {loc.offset} of its pack"
    elif not loc.pack_key.startswith(PACK_PREFIX):
        problem = f"the catalog places it in {loc.pack_key[:100]!r}, outside {PACK_PREFIX}"
    if problem is not None:
        raise IntegrityError(
            f"{where}, {c.source}: chunk {c.digest.hex()}: {problem}; the catalog is damaged (run `ckstore fsck --deep`)"
        )


def _deliver(
    digest: bytes,
    frame: memoryview,
    loc: ChunkLocation,
    copies: Sequence[ChunkCopy],
    views: list[Any],
    where: str,
    bases: Bases,
) -> None:
    raw_size = loc.raw_size
    whole = next((c for c in copies if c.src_start == 0 and c.src_stop == raw_size), None)
    decoded: memoryview
    if whole is not None:  # decoded in place (views: memoryviews, or numpy arrays of staging buffers)
        target = views[whole.buffer][whole.dst_offset : whole.dst_offset + raw_size]
        decoded = target if isinstance(target, memoryview) else target.data
        if raw_size >= PREFAULT_MIN:
            _prefault(decoded)
    else:
        decoded = np.empty(raw_size, dtype=np.uint8).data
    try:
        if loc.base is None:  # (a delta's frame refuses to decode without its base)
            codec.decode_into(frame, decoded)
        else:
            bases.decode(frame, loc, decoded)
    except IntegrityError as e:
        raise IntegrityError(f"{where}, {copies[0].source}: chunk {digest.hex()} is corrupt: {e}") from e
    except ChunkNotFoundError as e:
        raise ChunkNotFoundError(f"{where}, {copies[0].source}: chunk {digest.hex()} is a delta: {e}") from e
    if hashing.digest(decoded) != digest:
        raise IntegrityError(
            f"{where}, {copies[0].source}: chunk {digest.hex()} does not match its digest; the stored "
            "bytes are corrupt (run `ckstore fsck --deep`)"
        )
    for c in copies:
        if c is whole:
            continue
        views[c.buffer][c.dst_offset : c.dst_offset + (c.src_stop - c.src_start)] = decoded[c.src_start : c.src_stop]
