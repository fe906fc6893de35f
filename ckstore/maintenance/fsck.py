"""Consistency checks of a store: :func:`check` behind ``ckstore fsck``.

* every pack that holds chunk rows has a key under ``packs/``, exists and is long enough for
  them (``deep``: its header and index agree with the catalog, and every chunk is read, decoded
  and hashed against its digest);
* every committed checkpoint's catalog rows read as its record (a row changed outside ckstore,
  such as a world layout that is not JSON or a column holding a value of another type, is
  damage);
* every digest a committed checkpoint's manifests list is a chunk that checkpoint references in
  the catalog (what gc relies on to keep it);
* objects under ``packs/`` that no pack row or trash row knows are orphans, and pending
  checkpoints whose owner is gone are abandoned commits.

Damage is mapped back through the manifests to run, step, rank, sub-checkpoint key and tensor.
``repair`` removes only orphans (older than the grace), stale temp files and abandoned commits;
it never touches a chunk a checkpoint references.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..blobstore import BlobNotFoundError, BlobStore
from ..catalog import Catalog, CheckpointId, ChunkSpan, PackExtent, Survey, utcnow
from ..config import MAX_DELTA_CHAIN
from ..errors import BlobStoreError, ChunkNotFoundError, IntegrityError
from ..format.manifest import MAX_CHUNK_SIZE, Manifest, TensorRecord, check_pieces
from .gc import (
    PACK_PREFIX,
    Progress,
    Reaped,
    check_grace,
    find_orphans,
    judge_pending,
    list_packs,
    reap_abandoned,
    remove_temp_files,
    stale_temp_files,
)
from .recover import RecordCheck, check_records

__all__ = ["Damage", "FsckReport", "PendingCommit", "check"]


@dataclass(frozen=True, slots=True)
class Damage:
    """One thing a committed checkpoint needs that is missing or corrupt."""

    run: str
    step: int  # (-1 when the checkpoint's step itself is damaged: the problem names it)
    rank: int  # (-1 when the damage is in the checkpoint's own rows, not one rank's)
    sub_key: str
    path: str  # tensor path in the state dict ("" when the whole entry is unreadable)
    chunk: str  # digest, hex ("" when not about one chunk)
    pack: str  # pack key holding the chunk ("" when the catalog has no row for it)
    problem: str

    @property
    def ref(self) -> str:
        return f"{self.run}@{self.step}"

    def describe(self) -> str:
        where = f"{self.ref} rank {self.rank} {self.sub_key}" if self.rank >= 0 else self.ref
        if self.path:
            where += f" {self.path}"
        if self.chunk:
            where += f" chunk {self.chunk}"
        return f"{where}: {self.problem}"


@dataclass(frozen=True, slots=True)
class PendingCommit:
    run: str
    step: int
    owner: str
    heartbeat_age: float  # seconds
    abandoned: str | None  # why gc would reap it, or None while it may be live


@dataclass(frozen=True, slots=True)
class FsckReport:
    deep: bool
    checkpoints: int
    packs: int
    chunks: int
    bytes_read: int
    damage: tuple[Damage, ...]
    damaged_unused_chunks: int  # damaged chunks no committed checkpoint uses (gc frees them)
    orphans: tuple[tuple[str, int], ...]  # (key, size) of objects the catalog does not know
    #: stale temp files of unfinished writes (older than the grace), and recycled pack files beyond
    #: the store's bound (a local folder's ``tmp/*.free``)
    temp_files: tuple[str, ...]
    pending: tuple[PendingCommit, ...]
    trash: int  # objects gc has yet to delete
    unreferenced_chunks: int  # chunk rows no checkpoint references (gc frees them)
    unreferenced_bytes: int
    repaired_orphans: tuple[str, ...]
    repaired_pending: tuple[Reaped, ...]
    repaired_temp_files: int
    seconds: float
    records: RecordCheck | None = None  # catalog against the blob store's records


    @property
    def ok(self) -> bool:
        return not self.damage

    @property
    def damaged_checkpoints(self) -> list[str]:
        return list(dict.fromkeys(d.ref for d in self.damage))


def _verify_pack(
    blobs: BlobStore, key: str, chunks: Sequence[ChunkSpan], catalog: Catalog
) -> tuple[dict[bytes, str], int]:
    """Read one pack and check every chunk row of it: ``({digest: problem}, bytes read)``. A
    delta is decoded against its bases, read and verified from wherever they are stored."""
    import numpy as np  # --deep only: a shallow check needs no decoder

    from ..catalog import ChunkLocation
    from ..checkout.bases import Bases
    from ..format import codec, hashing
    from ..format.pack import PACK_HEADER, read_index_at

    bases = Bases(blobs, catalog.chunk_locations)

    try:
        data = memoryview(blobs.read(key))
    except BlobNotFoundError:
        return {c.digest: f"pack object {key} is missing" for c in chunks}, 0
    except BlobStoreError as e:
        return {c.digest: f"pack object {key} cannot be read: {e}" for c in chunks}, 0
    # the pack's header and index, which ``ckstore recover`` rebuilds the catalog from, must list
    # every chunk as the catalog places it
    index_problem = None
    try:
        index = set(read_index_at(lambda start, stop: bytes(data[start:stop]), len(data)))
    except IntegrityError as e:
        index = set()
        index_problem = f"pack object {key} has a damaged header or index ({e}); `ckstore recover` cannot read it"
    bad: dict[bytes, str] = {}
    for c in chunks:
        d = c.digest
        end = c.offset + c.length
        # the bounds checkout puts on a chunk's location (checkout.executor._check_location)
        if c.offset < len(PACK_HEADER) or not codec.HEADER_SIZE <= c.length <= codec.max_frame_length(c.raw_size):
            bad[d] = (
                f"the catalog places its {c.length}-byte frame at byte {c.offset} of pack {key}; the catalog is damaged"
            )
            continue
        if end > len(data):
            bad[d] = f"pack object {key} is {len(data)} bytes, the chunk ends at byte {end}"
            continue
        try:
            frame = data[int(c.offset) : end]
            if codec.raw_length(frame) != int(c.raw_size) or int(c.raw_size) > MAX_CHUNK_SIZE:
                raise IntegrityError(f"its header holds {codec.raw_length(frame)} raw bytes, the catalog {c.raw_size}")
            out = np.empty(int(c.raw_size), dtype=np.uint8)
            bases.decode(frame, ChunkLocation(key, c.offset, c.length, c.raw_size, 0, c.base), out.data)
        except IntegrityError as e:
            bad[d] = f"chunk frame in {key} at byte {c.offset} is corrupt: {e}"
            continue
        except ChunkNotFoundError as e:
            bad[d] = f"delta chunk in {key} at byte {c.offset} cannot be decoded: {e}"
            continue
        if hashing.digest(out.data) != d:
            bad[d] = f"chunk in {key} at byte {c.offset} does not match its digest (corrupt bytes)"
        elif index_problem is not None:
            bad[d] = index_problem
        elif (d, c.offset, c.length, c.raw_size) not in index:
            bad[d] = (
                f"the index of pack object {key} does not list the chunk as the catalog places it (at byte "
                f"{c.offset}, {c.length} bytes for {c.raw_size} raw bytes); the pack or the catalog is damaged"
            )
    return bad, len(data)


def _deep(
    catalog: Catalog,
    blobs: BlobStore,
    packs: Sequence[PackExtent],
    workers: int,
    progress: Progress | None,
) -> tuple[dict[bytes, tuple[str, str]], int, int]:
    bad: dict[bytes, tuple[str, str]] = {}
    total_read = 0
    checked = 0

    def one(p: PackExtent) -> tuple[PackExtent, dict[bytes, str], int, int]:
        with catalog.snapshot() as survey:
            rows = survey.pack_chunks(p.id)
        found, n = _verify_pack(blobs, p.key, rows, catalog)
        if found and not blobs.exists(p.key):
            with catalog.snapshot() as survey:  # swept by a gc running meanwhile: not damage
                if not survey.existing_packs([p.id]):
                    return p, {}, n, 0
        return p, found, n, len(rows)

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="ckstore-fsck") as pool:
        for i, (p, found, n, nrows) in enumerate(pool.map(one, packs)):
            total_read += n
            checked += nrows
            for d, why in found.items():
                bad[d] = (p.key, why)
            if progress is not None:
                progress("read", i + 1, len(packs))
    return bad, total_read, checked


def _shallow(
    catalog: Catalog,
    survey: Survey,
    blobs: BlobStore,
    packs: Sequence[PackExtent],
    listing: Mapping[str, tuple[int, float | None]],
) -> dict[bytes, tuple[str, str]]:
    """Chunks whose pack object is missing, or too short for them.

    The listing is older than the catalog snapshot, so a pack missing from it is looked up again
    (a commit may have written it since), and a flagged pack whose row a gc running meanwhile has
    removed is not damage (gc deletes rows before objects).
    """
    flagged: list[tuple[PackExtent, int | None, str]] = []  # (pack, chunks ending past, problem)
    for p in packs:
        if not _pack_key(p.key):
            why = f"the catalog names pack object {str(p.key)[:100]!r}, outside {PACK_PREFIX}; the catalog is damaged"
            flagged.append((p, None, why))
        elif p.key not in listing:
            try:
                missing = not blobs.exists(p.key)
            except BlobStoreError as e:  # a key the blob store refuses (a damaged catalog)
                flagged.append((p, None, f"pack object {p.key[:100]!r} cannot be looked up: {e}"))
                continue
            if missing:
                flagged.append((p, None, f"pack object {p.key} is missing"))
        elif listing[p.key][0] < p.end:
            size = listing[p.key][0]
            flagged.append((p, size, f"pack object {p.key} is {size} bytes, shorter than its chunks need ({p.end})"))
    if not flagged:
        return {}
    with catalog.snapshot() as fresh:
        still = fresh.existing_packs(p.id for p, _, _ in flagged)
    bad: dict[bytes, tuple[str, str]] = {}
    for p, past, why in flagged:
        if p.id in still:
            for c in survey.pack_chunks(p.id, ending_past=past):
                bad[c.digest] = (p.key, why)
    return bad


def _pack_key(key: object) -> bool:
    """Whether ``key`` (from the catalog) can name a pack: checkout reads no other."""
    return isinstance(key, str) and key.startswith(PACK_PREFIX)


def _chains(survey: Survey, ckpt_id: int) -> dict[bytes, bytes | None]:
    """Digest -> base (None: no delta) of every delta chunk a checkpoint references and of every
    chunk row down their chains; a base the catalog has no row for is left out."""
    rows: dict[bytes, bytes | None] = dict(survey.delta_bases(ckpt_id))
    level = {b for b in rows.values() if b is not None}
    for _ in range(MAX_DELTA_CHAIN):
        todo = [b for b in level if b not in rows]
        if not todo:
            break
        found = survey.chunk_bases(todo)
        rows.update(found)
        level = {b for b in found.values() if b is not None}
    return rows


def _chain_problem(
    d: bytes, rows: Mapping[bytes, bytes | None], bad: Mapping[bytes, tuple[str, str]]
) -> tuple[str, str, bytes] | None:
    """What keeps delta ``d`` of a checkpoint from decoding, down its chain of bases: ``(pack key,
    problem, base)``, or None when every base has a chunk row and is undamaged."""
    at = d
    for _ in range(MAX_DELTA_CHAIN + 1):  # a chain of MAX_DELTA_CHAIN deltas ends on its whole chunk's row
        b = rows.get(at)
        if b is None:
            return None
        if b in bad:
            key, why = bad[b]
            return key, f"its delta base chunk {b.hex()} is damaged: {why}", b
        if b not in rows:
            return "", f"its delta base chunk {b.hex()} is not in the catalog (gc took it, or the catalog is damaged)", b
        at = b
    return "", f"its chain of delta bases is longer than {MAX_DELTA_CHAIN}", at


def _walk_manifests(
    survey: Survey, ckpts: Sequence[CheckpointId], bad: Mapping[bytes, tuple[str, str]]
) -> tuple[list[Damage], set[bytes]]:
    """Damage per (checkpoint, rank, key, tensor, chunk), and the damaged digests in use."""
    damage: list[Damage] = []
    used_bad: set[bytes] = set()
    for ck in ckpts:
        refs = survey.referenced_chunks(ck.id)
        chains = _chains(survey, ck.id)
        pieces: dict[tuple[str, str], tuple[int, list[TensorRecord]]] = {}
        try:
            entries = survey.entries(ck.id)
        except IntegrityError as err:  # a row of another type: the checkpoint's entries do not read
            damage.append(Damage(ck.run, ck.step, -1, "", "", "", "", str(err)))
            continue
        for rank, sub_key, raw in entries:
            try:
                man = Manifest.from_bytes(raw, f"{ck.run}@{ck.step} rank {rank} {sub_key}")
            except IntegrityError as err:
                damage.append(Damage(ck.run, ck.step, rank, sub_key, "", "", "", str(err)))
                continue
            for t in man.tensors:
                if t.shard is not None and t.nbytes:
                    pieces.setdefault((sub_key, t.path), (rank, []))[1].append(t)
            for t in man.tensors:
                for i, d in enumerate(t.chunks):
                    span = t.chunk_span(i)
                    if d in refs and type(refs[d]) is int and refs[d] != span[1] - span[0]:
                        damage.append(
                            Damage(
                                ck.run, ck.step, rank, sub_key, t.path, d.hex(), "",
                                f"the manifest needs {span[1] - span[0]} raw bytes of chunk {i}, the catalog "
                                f"records {refs[d]}",
                            )
                        )  # fmt: skip
                for d in dict.fromkeys(t.chunks):
                    if d in bad:
                        used_bad.add(d)
                        key, why = bad[d]
                        damage.append(Damage(ck.run, ck.step, rank, sub_key, t.path, d.hex(), key, why))
                    elif isinstance(row := refs.get(d), str):  # its row is corrupt
                        damage.append(Damage(ck.run, ck.step, rank, sub_key, t.path, d.hex(), "", row))
                    elif d not in refs:
                        damage.append(
                            Damage(
                                ck.run, ck.step, rank, sub_key, t.path, d.hex(), "",
                                "the catalog has no reference from this checkpoint to the chunk, so nothing "
                                "protects it from gc (and it may already be gone)",
                            )
                        )  # fmt: skip
                    elif chains.get(d) is not None and (chain := _chain_problem(d, chains, bad)) is not None:
                        key, why, base = chain
                        if base in bad:
                            used_bad.add(base)
                        damage.append(Damage(ck.run, ck.step, rank, sub_key, t.path, d.hex(), key, why))
        for (sub_key, path), (rank, recs) in pieces.items():
            try:
                check_pieces(recs, f"{sub_key}, key {path!r}")
            except IntegrityError as err:
                damage.append(Damage(ck.run, ck.step, rank, sub_key, path, "", "", str(err)))
    return damage, used_bad


def check(
    catalog: Catalog,
    blobs: BlobStore,
    *,
    deep: bool = False,
    repair: bool = False,
    grace: float | None = None,
    workers: int = 2,
    progress: Progress | None = None,
) -> FsckReport:
    grace = check_grace(grace)
    t0 = time.perf_counter()
    now = utcnow()
    cutoff = time.time() - grace
    listing = list_packs(blobs, progress)  # before the catalog read: an unknown object is an orphan

    with catalog.snapshot() as survey:
        packs = survey.packs_in_use()
        orphans = tuple((k, listing[k][0]) for k in find_orphans(survey, listing, None))
        trash = len(survey.trash_keys())
        unref_n, unref_b = survey.unreferenced_chunks()
        pend = []
        for p in survey.pending():
            verdict = judge_pending(p, grace, now)
            age = (now - p.heartbeat_at).total_seconds()
            pend.append(PendingCommit(p.run, p.step, p.owner, age, verdict and verdict[0]))
        bad = _shallow(catalog, survey, blobs, packs, listing)
        chunks = sum(p.chunks for p in packs)
        bytes_read = 0
        if deep:
            readable = [p for p in packs if _pack_key(p.key) and p.key in listing]
            more, bytes_read, _ = _deep(catalog, blobs, readable, workers, progress)
            for d, v in more.items():
                bad.setdefault(d, v)
        ckpts = survey.committed()
        damage = [
            Damage(run, -1 if step is None else step, -1, "", "", "", "", why)
            for run, step, why in survey.corrupt_records()
        ]
        found, used_bad = _walk_manifests(survey, ckpts, bad)
        damage += found

    temps = tuple(stale_temp_files(blobs, cutoff, catalog))
    fixed_orphans: tuple[str, ...] = ()
    fixed_pending: tuple[Reaped, ...] = ()
    fixed_temps = 0
    if repair:
        old = [k for k, _ in orphans if (mtime := listing[k][1]) is not None and mtime < cutoff]
        blobs.delete(old)
        fixed_orphans = tuple(old)
        with catalog.gc_transaction(exclusive=False) as txn:
            fixed_pending = tuple(reap_abandoned(txn, grace, utcnow()))
        fixed_temps = remove_temp_files(blobs, temps)
    return FsckReport(
        deep=deep,
        checkpoints=len(ckpts),
        packs=len(packs),
        chunks=chunks,
        bytes_read=bytes_read,
        damage=tuple(damage),
        damaged_unused_chunks=len(set(bad) - used_bad),
        orphans=orphans,
        temp_files=temps,
        pending=tuple(pend),
        trash=trash,
        unreferenced_chunks=int(unref_n),
        unreferenced_bytes=int(unref_b),
        repaired_orphans=fixed_orphans,
        repaired_pending=fixed_pending,
        repaired_temp_files=fixed_temps,
        seconds=time.perf_counter() - t0,
        records=check_records(catalog, blobs, cutoff=cutoff, deep=deep),
    )

