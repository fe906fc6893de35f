"""Records: what a lost catalog is rebuilt from, kept in the blob store beside the packs.

Every commit writes one *checkpoint record* (run, step, kind, times, metrics, tags at commit
time, world layout, parent, every entry's manifest, and where each chunk it needs was stored)
under ``records/checkpoints/``, durable before the catalog makes the checkpoint visible. Later
changes that matter to a rebuild (tags, untags, deletes, forks, retention policies) are
*events*, small immutable objects under ``records/events/`` whose keys sort by time.

A record's key is derived from the checkpoint's identity — run, step and the time its commit
began, which the catalog keeps as ``created_at`` and a rebuilt catalog restores — so gc and
fsck can tell from the catalog alone which record belongs to which checkpoint.

Bytes: zstd-compressed JSON ``{"version": 1, "type": "checkpoint" | "event", …}``;
``docs/format.md`` shows both. Everything read is untrusted: :func:`decode` checks every field
(names, steps, times, metrics, layout, manifests, digests, pack keys) and bounds the
decompressed size before it builds anything, and raises :class:`IntegrityError` naming what is
wrong.
"""

from __future__ import annotations

import base64
import json
import math
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple

import zstandard

from ..errors import CkstoreError, IntegrityError, UnsupportedValueError
from ..layout import WorldLayout
from ..refs import check_name
from . import hashing, zjson
from .manifest import MAX_MANIFEST_BYTES, Manifest

__all__ = [
    "RECORD_VERSION",
    "RECORDS_PREFIX",
    "CHECKPOINTS_PREFIX",
    "EVENTS_PREFIX",
    "EVENT_KINDS",
    "Identity",
    "ChunkHint",
    "CheckpointRecord",
    "Event",
    "checkpoint_key",
    "decode",
]

RECORD_VERSION = 1
RECORDS_PREFIX = "records/"
CHECKPOINTS_PREFIX = "records/checkpoints/"
EVENTS_PREFIX = "records/events/"
#: the events a rebuild replays, in key (time) order
EVENT_KINDS = ("tag", "untag", "delete", "fork", "policy")
_MAX_RECORD_BYTES = 4 * MAX_MANIFEST_BYTES
_MAX_STEP = 2**63 - 1
_MAX_RANK = 2**31 - 1


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat(timespec="microseconds")


@dataclass(frozen=True, slots=True)
class Identity:
    """A checkpoint as records name it: run, step, and when its commit began (``created_at``)."""

    run: str
    step: int
    created_at: datetime

    @property
    def ref(self) -> str:
        return f"{self.run}@{self.step}"

    @property
    def token(self) -> str:
        return f"{self.run}\0{self.step}\0{_iso(self.created_at)}"

    def to_json(self) -> list[Any]:
        return [self.run, self.step, _iso(self.created_at)]

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Identity:
        if not isinstance(obj, list) or len(obj) != 3:
            raise IntegrityError(f"{where}: a checkpoint identity is [run, step, created_at], got {_short(obj)}")
        return cls(_name("run", obj[0], where), _step(obj[1], where), _time(obj[2], where))


def checkpoint_key(ident: Identity) -> str:
    """The key of the record of checkpoint ``ident``."""
    h = hashing.digest(ident.token.encode()).hex()
    return f"{CHECKPOINTS_PREFIX}{h[:2]}/{h}"


class ChunkHint(NamedTuple):
    """Where a chunk was stored when the record was written (a pack's own index is the truth;
    a hint gives the codec and saves reading frame headers). A tuple: a record holds one per
    chunk."""

    digest: bytes
    pack: str
    offset: int
    length: int
    raw_size: int
    codec: int


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    ident: Identity
    kind: str
    committed_at: datetime
    run_created_at: datetime
    world_layout: WorldLayout
    metrics: dict[str, float]  # NaN for none
    tags: tuple[str, ...]
    parent: Identity | None
    logical_bytes: int
    stored_bytes_added: int
    entries: tuple[tuple[int, str, bytes, int], ...]  # (rank, sub_key, manifest bytes, logical bytes)
    chunks: tuple[ChunkHint, ...]

    @property
    def key(self) -> str:
        return checkpoint_key(self.ident)

    def to_bytes(self) -> bytes:
        obj = {
            "version": RECORD_VERSION,
            "type": "checkpoint",
            "checkpoint": self.ident.to_json(),
            "kind": self.kind,
            "committed_at": _iso(self.committed_at),
            "run_created_at": _iso(self.run_created_at),
            "world_layout": self.world_layout.to_json(),
            "metrics": {k: None if math.isnan(v) else v for k, v in self.metrics.items()},
            "tags": list(self.tags),
            "parent": self.parent.to_json() if self.parent else None,
            "logical_bytes": self.logical_bytes,
            "stored_bytes_added": self.stored_bytes_added,
            "entries": [[r, k, base64.b64encode(m).decode(), n] for r, k, m, n in self.entries],
        }
        # its chunks' locations (one per chunk: 100,000 for as many tiny tensors) are written a
        # batch at a time, never all as lists at once (see ckstore.format.zjson)
        doc = zjson.Document(_MAX_RECORD_BYTES, _too_long)
        head = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        doc.add(head[:-1] + b',"chunks":[')
        doc.add_items((c.digest.hex(), c.pack, c.offset, c.length, c.raw_size, c.codec) for c in self.chunks)
        doc.add(b"]}")
        return doc.compressed()


@dataclass(frozen=True, slots=True)
class Event:
    """A change after commit: ``tag``/``untag`` (``name``, ``target`` for a tag), ``delete``
    (``target``), ``fork`` (``target``: the parent, ``parent_ref``), ``policy`` (``policy``
    JSON or None)."""

    kind: str
    at: datetime
    run: str
    run_created_at: datetime
    name: str | None = None
    target: Identity | None = None
    parent_ref: str | None = None
    policy: str | None = None

    def new_key(self) -> str:
        """A fresh key for this event; keys sort by time (then at random)."""
        ns = int(self.at.timestamp() * 1_000_000) * 1000 + time.perf_counter_ns() % 1000
        return f"{EVENTS_PREFIX}{ns:020d}-{uuid.uuid4().hex}"

    def to_bytes(self) -> bytes:
        return _encode(
            {
                "version": RECORD_VERSION,
                "type": "event",
                "event": self.kind,
                "at": _iso(self.at),
                "run": self.run,
                "run_created_at": _iso(self.run_created_at),
                "name": self.name,
                "target": self.target.to_json() if self.target else None,
                "parent_ref": self.parent_ref,
                "policy": self.policy,
            }
        )


def decode(data: bytes, where: str) -> CheckpointRecord | Event:
    """Parse and check a record or event object (``where`` names it in errors)."""
    obj = _load(data, where)
    if not isinstance(obj, dict) or obj.get("version") != RECORD_VERSION:
        version = obj.get("version") if isinstance(obj, dict) else None
        raise IntegrityError(f"{where}: record version {_short(version)} is not one this ckstore reads ({RECORD_VERSION})")
    try:
        if obj.get("type") == "checkpoint":
            return _checkpoint(obj, where)
        if obj.get("type") == "event":
            return _event(obj, where)
    except IntegrityError:
        raise
    except (CkstoreError, ValueError, TypeError, KeyError) as e:
        raise IntegrityError(f"{where}: {e}") from e
    raise IntegrityError(f"{where}: unknown record type {_short(obj.get('type'))}")


# -- decoding -------------------------------------------------------------------------------------
def _checkpoint(obj: dict[str, Any], where: str) -> CheckpointRecord:
    ident = Identity.from_json(obj["checkpoint"], where)
    where = f"{where} ({ident.ref})"
    metrics_obj = obj["metrics"]
    if not isinstance(metrics_obj, dict):
        raise IntegrityError(f"{where}: metrics must be an object")
    metrics: dict[str, float] = {}
    for k, v in metrics_obj.items():
        if not isinstance(k, str) or not k or len(k) > 255:
            raise IntegrityError(f"{where}: bad metric name {_short(k)}")
        if v is None:
            metrics[k] = math.nan
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            metrics[k] = float(v)
        else:
            raise IntegrityError(f"{where}: metric {k!r} is {_short(v)}, not a finite number")
    tags = obj["tags"]
    if not isinstance(tags, list):
        raise IntegrityError(f"{where}: tags must be a list")
    entries = []
    for e in _list(obj["entries"], "entries", where):
        if not isinstance(e, list) or len(e) != 4:
            raise IntegrityError(f"{where}: an entry is [rank, sub_key, manifest, bytes], got {_short(e)}")
        rank, sub_key, manifest_b64, nbytes = e
        if not _int(rank) or not 0 <= rank <= _MAX_RANK or not isinstance(sub_key, str) or not sub_key:
            raise IntegrityError(f"{where}: bad entry rank/sub_key {_short(rank)}, {_short(sub_key)}")
        manifest = base64.b64decode(_str(manifest_b64, "manifest", where), validate=True)
        Manifest.from_bytes(manifest, f"{where}, rank {rank}, {sub_key}: ")  # checked like any manifest
        entries.append((rank, sub_key, manifest, _count(nbytes, "entry bytes", where)))
    chunks = []
    for c in _list(obj["chunks"], "chunks", where):
        if not isinstance(c, list) or len(c) != 6:
            raise IntegrityError(f"{where}: a chunk is [digest, pack, offset, length, raw, codec], got {_short(c)}")
        pack = _str(c[1], "pack key", where)
        if not pack.startswith("packs/") or ".." in pack.split("/"):
            raise IntegrityError(f"{where}: chunk location names {pack!r}, not a pack")
        chunks.append(
            ChunkHint(
                hashing.from_hex(_str(c[0], "digest", where)), pack, _count(c[2], "offset", where),
                _count(c[3], "length", where), _count(c[4], "raw size", where), _count(c[5], "codec", where),
            )
        )  # fmt: skip
    parent = obj["parent"]
    return CheckpointRecord(
        ident=ident,
        kind=_name("kind", obj["kind"], where),
        committed_at=_time(obj["committed_at"], where),
        run_created_at=_time(obj["run_created_at"], where),
        world_layout=WorldLayout.from_json(obj["world_layout"]),
        metrics=metrics,
        tags=tuple(_name("tag", t, where) for t in tags),
        parent=None if parent is None else Identity.from_json(parent, where),
        logical_bytes=_count(obj["logical_bytes"], "logical_bytes", where),
        stored_bytes_added=_count(obj["stored_bytes_added"], "stored_bytes_added", where),
        entries=tuple(entries),
        chunks=tuple(chunks),
    )


def _event(obj: dict[str, Any], where: str) -> Event:
    kind = obj["event"]
    if kind not in EVENT_KINDS:
        raise IntegrityError(f"{where}: unknown event {_short(kind)}")
    target = obj["target"]
    name, parent_ref, policy = obj["name"], obj["parent_ref"], obj["policy"]
    ev = Event(
        kind=kind,
        at=_time(obj["at"], where),
        run=_name("run", obj["run"], where),
        run_created_at=_time(obj["run_created_at"], where),
        name=None if name is None else _name("tag", name, where),
        target=None if target is None else Identity.from_json(target, where),
        parent_ref=None if parent_ref is None else _str(parent_ref, "parent_ref", where),
        policy=None if policy is None else _str(policy, "policy", where),
    )
    needs = {"tag": ("name", "target"), "untag": ("name",), "delete": ("target",), "fork": ("target", "parent_ref")}
    for f in needs.get(kind, ()):
        if getattr(ev, f) is None:
            raise IntegrityError(f"{where}: a {kind} event needs {f}")
    return ev


def _too_long(limit: int) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"this checkpoint's record would be more than {limit} bytes of JSON, the most ckstore reads "
        "back; commit its state as several sub-checkpoints or fewer, larger tensors"
    )


def _encode(obj: dict[str, Any]) -> bytes:
    raw = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return zstandard.ZstdCompressor(level=3).compress(raw)


def _load(data: bytes, where: str) -> Any:
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            raw = reader.read(_MAX_RECORD_BYTES + 1)
            while len(raw) <= _MAX_RECORD_BYTES:
                more = reader.read(_MAX_RECORD_BYTES + 1 - len(raw))
                if not more:
                    break
                raw += more
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{where}: not a ckstore record ({e})") from e
    if len(raw) > _MAX_RECORD_BYTES:
        raise IntegrityError(f"{where}: the record decompresses to more than {_MAX_RECORD_BYTES} bytes")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise IntegrityError(f"{where}: the record is not valid JSON ({e})") from e


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _count(x: Any, what: str, where: str) -> int:
    if not _int(x) or not 0 <= x <= _MAX_STEP:
        raise IntegrityError(f"{where}: {what} is {_short(x)}, not a count")
    return int(x)


def _step(x: Any, where: str) -> int:
    return _count(x, "step", where)


def _str(x: Any, what: str, where: str) -> str:
    if not isinstance(x, str) or len(x) > 1 << 20:
        raise IntegrityError(f"{where}: {what} is {_short(x)}, not a string")
    return x


def _list(x: Any, what: str, where: str) -> list[Any]:
    if not isinstance(x, list):
        raise IntegrityError(f"{where}: {what} must be a list")
    return x


def _name(what: str, x: Any, where: str) -> str:
    if not isinstance(x, str):
        raise IntegrityError(f"{where}: {what} name is {_short(x)}, not a string")
    try:
        return check_name(what, x)
    except CkstoreError as e:
        raise IntegrityError(f"{where}: {e}") from e


def _time(x: Any, where: str) -> datetime:
    if not isinstance(x, str):
        raise IntegrityError(f"{where}: a time is {_short(x)}, not text")
    try:
        t = datetime.fromisoformat(x)
    except ValueError as e:
        raise IntegrityError(f"{where}: bad time {_short(x)}") from e
    if t.tzinfo is None:
        raise IntegrityError(f"{where}: time {x!r} has no time zone")
    return t.astimezone(timezone.utc)
