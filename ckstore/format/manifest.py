"""Manifests: what one entry ``(checkpoint, rank, sub_key)`` holds.

A manifest is the state dict's tree with every tensor replaced by a reference into a list of
:class:`TensorRecord` s. Each record names the tensor's dtype, shape, chunk digests and, for a
shard of a larger tensor, where it sits in the global tensor. Manifests are stored in the catalog
as zstd-compressed JSON; ``docs/format.md`` shows one.

Tree nodes are JSON arrays tagged by their first element::

    ["T", i]            tensor i of the manifest's tensor list
    ["d", [[k, v], …]]  dict (keys are tagged scalars), in insertion order
    ["l", [v, …]]       list
    ["t", [v, …]]       tuple
    ["n"] ["b", x] ["i", x] ["f", "repr"] ["s", x] ["y", "base64"]
                        None, bool, int, float (repr keeps nan, inf and every bit), str, bytes
    ["P", "base64"]     a pickled object (only with the caller's opt-in on both commit and checkout)

Manifests come from the catalog, so they are untrusted. :meth:`Manifest.from_bytes` is the one
way in, and it refuses (:class:`IntegrityError`, naming ``where``) any manifest that is not
self-consistent before anything is allocated for it: known dtype; ``itemsize × prod(shape) ==
nbytes``; one chunk per ``chunk_size`` bytes (so every chunk's span is contiguous and within
``chunk_size``); shard offsets inside the global shape; a valid tree (see
:mod:`ckstore.format.tree`). Its cost is linear in the number of chunks and tree nodes, never
in tensor bytes. The chunks' raw lengths recorded in the catalog are checked against
:meth:`TensorRecord.chunk_span` where chunks are read.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import math
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import zstandard

from ..errors import IntegrityError, UnsupportedValueError
from . import tree as tree_format
from . import zjson
from .dtypes import STORED_ITEMSIZES, stored_itemsize

__all__ = [
    "ShardSpec",
    "TensorRecord",
    "Manifest",
    "tensor_json",
    "manifest_bytes",
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_CHUNK_SIZE",
    "MAX_NDIM",
    "DIGEST_SIZE",
    "check_pieces",
    "overlap",
]

MANIFEST_VERSION = 1
#: The largest manifest (as uncompressed JSON) ckstore writes or reads.
MAX_MANIFEST_BYTES = 256 << 20
#: The largest chunk a manifest may declare (the store setting's upper bound).
MAX_CHUNK_SIZE = 1 << 30
#: The most dimensions a stored tensor may have.
MAX_NDIM = 64
#: Every dim of a shape (and every shard offset) is below this: torch's sizes are signed 64-bit,
#: and a shape holding a 0 says nothing about its other dims' sizes
DIM_LIMIT = 1 << 63
DIGEST_SIZE = 16  # xxh3-128
#: each stored dtype's name (the one string every record of it shares) and element size
_DTYPES: dict[str, tuple[str, int]] = {name: (name, size) for name, size in STORED_ITEMSIZES.items()}


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Where a stored tensor sits inside its global tensor.

    ``splits`` lists ``(tensor_dim, mesh_dim)`` pairs in mesh order: which mesh dims cut which
    tensor dims. ``offsets`` are the shard's start in every tensor dim of ``global_shape``.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    splits: tuple[tuple[int, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "splits": [[d, m] for d, m in self.splits],
        }

    @classmethod
    def from_json(cls, obj: Any, ndim: int | None = None, where: str = "") -> ShardSpec:
        """Parse and check a shard spec of a tensor with ``ndim`` dimensions."""
        if not isinstance(obj, dict):
            raise IntegrityError(f"{where}shard is {_short(obj)}, not an object")
        gshape = _ints(_field(obj, "global_shape", list, where), f"{where}shard global_shape")
        offsets = _ints(_field(obj, "offsets", list, where), f"{where}shard offsets")
        n = len(gshape) if ndim is None else ndim
        if len(gshape) != n or len(offsets) != n:
            raise IntegrityError(
                f"{where}shard of a {n}-dim tensor has a {len(gshape)}-dim global shape and {len(offsets)} offsets"
            )
        splits = []
        for pair in _field(obj, "splits", list, where):
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or not _is_int(pair[0])
                or not 0 <= pair[0] < max(n, 1)
                or not isinstance(pair[1], str)
                or not pair[1]
            ):
                raise IntegrityError(f"{where}shard split {_short(pair)} is not [tensor dim, mesh dim name]")
            splits.append((int(pair[0]), pair[1]))
        if len(set(splits)) != len(splits) or len({m for _, m in splits}) != len(splits):
            raise IntegrityError(f"{where}shard splits {splits} name a mesh dim twice")
        return cls(tuple(gshape), tuple(offsets), tuple(splits))


def tensor_json(
    path: str, dtype: str, shape: Sequence[int], nbytes: int, chunk_size: int, chunks: Sequence[bytes],
    shard: ShardSpec | None,
) -> dict[str, Any]:
    """A tensor record as its manifest holds it (:meth:`TensorRecord.to_json`); commits build it
    straight from what they staged, without a record object per tensor."""
    obj: dict[str, Any] = {
        "path": path,
        "dtype": dtype,
        "shape": list(shape),
        "nbytes": nbytes,
        "chunk_size": chunk_size,
        "chunks": [c.hex() for c in chunks],
    }
    if shard is not None:
        obj["shard"] = shard.to_json()
    return obj


class TensorRecord(NamedTuple):
    """One stored tensor: its raw bytes are the concatenation of ``chunks``. A tuple: a manifest
    of 100,000 tensors makes as many, and a tuple is made in a third of the time of a frozen
    dataclass."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunk_size: int
    chunks: tuple[bytes, ...]
    shard: ShardSpec | None = None

    def chunk_span(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of chunk ``i`` within the tensor's raw bytes."""
        start = i * self.chunk_size
        return start, min(self.nbytes, start + self.chunk_size)

    def to_json(self) -> dict[str, Any]:
        return tensor_json(self.path, self.dtype, self.shape, self.nbytes, self.chunk_size, self.chunks, self.shard)

    @classmethod
    def from_json(cls, obj: Any, where: str = "") -> TensorRecord:
        """Parse one record and check it is self-consistent (see the module docstring).

        A record of exact JSON types without a shard is checked inline (100,000 records: 1.3
        against 4.0 µs each); any other, or one that fails a check there, goes through
        :meth:`_checked`, which names what is wrong (or accepts what the inline checks were too
        strict for). Records share their dtype's name (one string, not one per record)."""
        if type(obj) is not dict or "shard" in obj:
            return cls._checked(obj, where)
        try:
            path, dtype, shape = obj["path"], obj["dtype"], obj["shape"]
            nbytes, chunk_size, hexes = obj["nbytes"], obj["chunk_size"], obj["chunks"]
            dtype, n = _DTYPES[dtype]
        except (KeyError, TypeError):  # a field missing, a dtype unknown or not a string
            return cls._checked(obj, where)
        if (
            type(path) is not str
            or type(shape) is not list
            or len(shape) > MAX_NDIM
            or type(nbytes) is not int
            or type(chunk_size) is not int
            or not 0 < chunk_size <= MAX_CHUNK_SIZE
            or type(hexes) is not list
            or len(hexes) != -(-nbytes // chunk_size)
        ):
            return cls._checked(obj, where)
        for x in shape:
            if type(x) is not int or x < 0:
                return cls._checked(obj, where)
            n *= x
        # (dims of a non-empty tensor are below nbytes, which its chunk count bounds; a 0 lets the
        # others be anything)
        if n != nbytes or (not n and any(x >= DIM_LIMIT for x in shape)):
            return cls._checked(obj, where)
        try:
            if len(hexes) == 1:  # most tensors
                h = hexes[0]
                d = bytes.fromhex(h)
                if len(d) != DIGEST_SIZE or len(h) != 2 * DIGEST_SIZE:
                    return cls._checked(obj, where)
                return cls(path, dtype, tuple(shape), nbytes, chunk_size, (d,))
            chunks = tuple(map(bytes.fromhex, hexes))
        except (TypeError, ValueError):
            return cls._checked(obj, where)
        if any(len(d) != DIGEST_SIZE for d in chunks) or sum(map(len, hexes)) != 2 * DIGEST_SIZE * len(hexes):
            return cls._checked(obj, where)
        return cls(path, dtype, tuple(shape), nbytes, chunk_size, chunks)

    @classmethod
    def _checked(cls, obj: Any, where: str) -> TensorRecord:
        if not isinstance(obj, dict):
            raise IntegrityError(f"{where}a tensor record is {_short(obj)}, not an object")
        path = _field(obj, "path", str, where)
        where = f"{where}key {path[:200]!r}: "
        dtype = _field(obj, "dtype", str, where)
        try:
            item = stored_itemsize(dtype)
        except IntegrityError as e:
            raise IntegrityError(f"{where}{e}") from None
        dtype = _DTYPES[dtype][0]
        shape = _ints(_field(obj, "shape", list, where), f"{where}shape")
        if len(shape) > MAX_NDIM:
            raise IntegrityError(f"{where}a tensor of {len(shape)} dims (at most {MAX_NDIM})")
        nbytes = _field(obj, "nbytes", int, where)
        if nbytes != item * math.prod(shape):
            raise IntegrityError(
                f"{where}nbytes {nbytes} is not {dtype} ({item} bytes) times shape {shape} "
                f"({item * math.prod(shape)} bytes)"
            )
        chunk_size = _field(obj, "chunk_size", int, where)
        if not 0 < chunk_size <= MAX_CHUNK_SIZE:
            raise IntegrityError(f"{where}chunk_size {chunk_size} is outside 1..{MAX_CHUNK_SIZE}")
        hexes = _field(obj, "chunks", list, where)
        if len(hexes) != -(-nbytes // chunk_size):
            raise IntegrityError(
                f"{where}{len(hexes)} chunks listed, but {nbytes} bytes in chunks of {chunk_size} "
                f"need {-(-nbytes // chunk_size)}"
            )
        chunks = tuple(_digest(h, where) for h in hexes)
        shard_obj = obj.get("shard")
        shard = None
        if shard_obj is not None:
            shard = ShardSpec.from_json(shard_obj, len(shape), where)
            for d, (o, n, g) in enumerate(zip(shard.offsets, shape, shard.global_shape)):
                if o + n > g:
                    raise IntegrityError(
                        f"{where}shard of shape {shape} at offsets {list(shard.offsets)} reaches past "
                        f"global shape {list(shard.global_shape)} in dim {d}"
                    )
        return cls(path, dtype, tuple(shape), nbytes, chunk_size, chunks, shard)


@dataclass(frozen=True, slots=True)
class Manifest:
    tree: Any
    tensors: tuple[TensorRecord, ...] = field(default=())

    @property
    def logical_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def digests(self) -> set[bytes]:
        return {d for t in self.tensors for d in t.chunks}

    def to_bytes(self) -> bytes:
        return manifest_bytes(self.tree, (t.to_json() for t in self.tensors))

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "") -> Manifest:
        """Parse and validate a manifest read from the catalog.

        ``where`` ("run 'x', step 3, rank 0, model_states") prefixes every error. Raises
        :class:`IntegrityError` for any manifest that is unreadable or not self-consistent.

        A manifest as ckstore writes it (its version first) becomes records one tensor record
        at a time, so its records' JSON objects never all exist at once (100,000 tensors: a
        peak of 80 against 113 MiB of Python objects); any other JSON is parsed whole.
        """
        where = f"{where}: " if where else "a manifest in the catalog: "
        text = _load_text(data, where)
        try:
            parsed = _stream(text, where)
        except IntegrityError:  # a record refused
            raise
        except (ValueError, StopIteration, RecursionError):
            parsed = None  # not JSON as ckstore writes it: the whole parse below names the problem
        if parsed is None:
            parsed = _whole(text, where)
        del text
        tree, records = parsed
        tree_format.check_tree(tree, len(records), where)
        return cls(tree, records)


def manifest_bytes(tree: Any, tensors: Iterable[dict[str, Any]]) -> bytes:
    """A manifest as the catalog stores it (:meth:`Manifest.to_bytes`), from its tree and its
    tensors' records (:func:`tensor_json`), which may come from a generator: they are written
    as JSON a batch at a time and compressed as a stream (:class:`~ckstore.format.zjson.Document`),
    never all objects at once (100,000 tensors: the write phase's peak 67 MiB lower,
    docs/benchmarks.md, "Memory of many-tensor commits and checkouts")."""
    doc = zjson.Document(MAX_MANIFEST_BYTES, _too_long)
    doc.add(b'{"version":%d,"tree":' % MANIFEST_VERSION)
    doc.add(zjson.dumps(tree))
    doc.add(b',"tensors":[')
    doc.add_items(tensors)
    doc.add(b"]}")
    return doc.compressed()


def _too_long(limit: int) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"the manifest of this state dict is more than {limit} bytes of JSON, the most ckstore "
        "reads back; split it into several sub-checkpoints"
    )


_local = threading.local()
#: a manifest of unknown decompressed size is streamed in reads of this many bytes
_READ = 1 << 20


def _load_text(data: bytes, where: str) -> str:
    """Decompress (never past :data:`MAX_MANIFEST_BYTES`, whatever the frame declares) and
    decode, as ``json.loads`` decodes bytes.

    A frame that declares its size (every manifest ckstore writes) is decompressed in one call
    into exactly that many bytes, once the size is checked: 6 µs for a small manifest, against
    45 µs streamed into a buffer of the largest size allowed. Any other is streamed, a megabyte
    at a time, up to that size."""
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    try:
        declared = zstandard.frame_content_size(data)
        if declared > MAX_MANIFEST_BYTES:
            raise IntegrityError(
                f"{where}the manifest declares {declared} bytes, more than the {MAX_MANIFEST_BYTES} "
                "ckstore writes; it is corrupt"
            )
        if declared >= 0:
            raw = d.decompress(data, max_output_size=max(declared, 1))
            if len(raw) != declared:
                raise IntegrityError(f"{where}the manifest declares {declared} bytes and holds {len(raw)}")
        else:
            reader = d.stream_reader(data, read_across_frames=True)
            parts, got = [], 0
            while got <= MAX_MANIFEST_BYTES:  # read() may return less than asked before the end
                more = reader.read(min(_READ, MAX_MANIFEST_BYTES + 1 - got))
                if not more:
                    break
                parts.append(more)
                got += len(more)
            raw = b"".join(parts)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{where}the manifest does not decompress: {e}") from e
    if len(raw) > MAX_MANIFEST_BYTES:
        raise IntegrityError(f"{where}the manifest decompresses to more than {MAX_MANIFEST_BYTES} bytes")
    try:
        # the bytes are dropped once decoded (json.loads(raw) held both through the parse: 15.6
        # MiB more at 100,000 tensors' records). Not orjson: it reads an int past 64 bits as a
        # float, and telling such a manifest apart first costs more than orjson saves (9.7
        # against 6.3 ms for 7,200 tensors' records)
        return raw.decode(json.detect_encoding(raw), "surrogatepass")
    except ValueError as e:
        raise IntegrityError(f"{where}the manifest is not valid JSON: {str(e)[:200]}") from e


#: JSON's whitespace from a position on; it matches everywhere (at worst the empty string)
_WS = cast("Callable[[str, int], re.Match[str]]", re.compile(r"[ \t\n\r]*").match)
_SPACE = frozenset(" \t\n\r")
#: the scanners json.loads runs (in C where it can): one JSON value, one string's rest (typeshed
#: lacks both)
_scan: Callable[[str, int], tuple[Any, int]] = cast(Any, json.scanner).make_scanner(json.JSONDecoder())
_scanstring: Callable[[str, int], tuple[str, int]] = cast(Any, json.decoder).scanstring


def _stream(text: str, where: str) -> tuple[Any, tuple[TensorRecord, ...]] | None:
    """The tree and records of a manifest whose ``version`` (the one this reads) comes before
    its ``tensors``, as ckstore writes them, parsed value by value: each tensor record's JSON
    object goes once it is a record. None for any other object (the caller parses it whole);
    raises ``ValueError`` or ``StopIteration`` where the text is not JSON."""
    skip = _WS
    i = skip(text, 0).end()
    if text[i : i + 1] != "{":
        return None
    fields: dict[str, Any] = {}
    i = skip(text, i + 1).end()
    more = text[i : i + 1] != "}"
    if not more:
        i += 1
    while more:
        if text[i : i + 1] != '"':
            raise ValueError("a key expected")
        key, i = _scanstring(text, i + 1)
        i = skip(text, i).end()
        if text[i : i + 1] != ":":
            raise ValueError("':' expected")
        i = skip(text, i + 1).end()
        if key == "tensors" and fields.get("version") == MANIFEST_VERSION and text[i : i + 1] == "[":
            built: list[TensorRecord] = []
            add, record, scan = built.append, TensorRecord.from_json, _scan
            i = skip(text, i + 1).end()
            if text[i : i + 1] == "]":
                i += 1
            else:
                while True:  # ckstore writes no whitespace between records: the skips seldom run
                    obj, i = scan(text, i)
                    add(record(obj, where))
                    c = text[i : i + 1]
                    if c in _SPACE:
                        i = skip(text, i).end()
                        c = text[i : i + 1]
                    i += 1
                    if c == ",":
                        if text[i : i + 1] in _SPACE:
                            i = skip(text, i).end()
                    elif c == "]":
                        break
                    else:
                        raise ValueError("',' or ']' expected")
            obj = None
            fields[key] = tuple(built)
            del built
        else:
            fields[key], i = _scan(text, i)
        i = skip(text, i).end()
        c, i = text[i : i + 1], i + 1
        if c == ",":
            i = skip(text, i).end()
        elif c == "}":
            more = False
        else:
            raise ValueError("',' or '}' expected")
    if skip(text, i).end() != len(text):
        raise ValueError("extra data")
    if fields.get("version") != MANIFEST_VERSION or type(fields.get("tensors")) is not tuple or "tree" not in fields:
        return None
    return fields["tree"], fields["tensors"]


def _whole(text: str, where: str) -> tuple[Any, tuple[TensorRecord, ...]]:
    """The tree and records of a manifest parsed whole, checked field by field."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise IntegrityError(f"{where}the manifest is not valid JSON: {str(e)[:200]}") from e
    if not isinstance(doc, dict):
        raise IntegrityError(f"{where}the manifest is not a JSON object")
    if doc.get("version") != MANIFEST_VERSION:
        raise IntegrityError(
            f"{where}manifest format version {_short(doc.get('version'))} is not supported by this "
            f"ckstore (it reads version {MANIFEST_VERSION}); upgrade ckstore"
        )
    items = _field(doc, "tensors", list, where)
    built = []
    for i, obj in enumerate(items):  # each record's JSON object goes once it is a record
        built.append(TensorRecord.from_json(obj, where))
        items[i] = None
    records = tuple(built)
    del built
    if "tree" not in doc:
        raise IntegrityError(f"{where}the manifest has no tree")
    return doc["tree"], records


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _field(obj: dict[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in obj:
        raise IntegrityError(f"{where}the manifest lacks field {name!r}")
    x = obj[name]
    if not isinstance(x, kind) or (kind is int and isinstance(x, bool)):
        raise IntegrityError(f"{where}field {name!r} is {_short(x)}, not {kind.__name__}")
    return x


def _ints(xs: list[Any], what: str) -> list[int]:
    if not all(_is_int(x) and 0 <= x < DIM_LIMIT for x in xs):
        raise IntegrityError(f"{what} {_short(xs)} is not a list of non-negative integers below 2**63")
    return xs


def _digest(h: Any, where: str) -> bytes:
    if not isinstance(h, str) or len(h) != 2 * DIGEST_SIZE:
        raise IntegrityError(f"{where}chunk digest {_short(h)} is not {2 * DIGEST_SIZE} hex digits")
    try:
        d = bytes.fromhex(h)
    except ValueError:
        d = b""
    if len(d) != DIGEST_SIZE:
        raise IntegrityError(f"{where}chunk digest {_short(h)} is not hex")
    return d


def check_pieces(records: Sequence[TensorRecord], what: str) -> None:
    """Refuse stored pieces of one global tensor that disagree or overlap.

    Manifests are validated one by one when parsed; this checks what only their union shows:
    the pieces of a sharded tensor share its dtype and global shape, and pieces at different
    places never overlap (so counting the elements they cover proves a box is filled). Replicas
    (same offsets and shape) are one piece (see :func:`overlap`).
    """
    if not records:
        return
    first = records[0]
    assert first.shard is not None
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], None] = {}
    for rec in records:
        assert rec.shard is not None
        if rec.dtype != first.dtype or rec.shard.global_shape != first.shard.global_shape:
            raise IntegrityError(
                f"{what}: its stored pieces disagree: {first.dtype} of global shape "
                f"{list(first.shard.global_shape)} and {rec.dtype} of global shape {list(rec.shard.global_shape)}"
            )
        boxes[(rec.shard.offsets, rec.shape)] = None
    clash = overlap(list(boxes))
    if clash is not None:
        (aoff, ashape), (off, shape) = clash
        raise IntegrityError(
            f"{what}: stored pieces of shape {list(ashape)} at {list(aoff)} and of shape "
            f"{list(shape)} at {list(off)} overlap; the checkpoint's manifests are corrupt"
        )


PieceBox = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) of a piece


def overlap(boxes: Sequence[PieceBox]) -> tuple[PieceBox, PieceBox] | None:
    """Two distinct boxes of ``boxes`` that overlap (the one placed first along the sweep dim
    first), or None. Cost: a sweep along the dim the boxes split most, comparing only boxes
    that overlap along it."""
    if len(boxes) < 2:
        return None
    d = max(range(len(boxes[0][0])), key=lambda i: len({o[i] for o, _ in boxes}))
    active: list[PieceBox] = []
    for off, shape in sorted(boxes, key=lambda b: b[0][d]):
        active = [a for a in active if a[0][d] + a[1][d] > off[d]]
        for aoff, ashape in active:
            if all(max(o, ao) < min(o + n, ao + an) for o, n, ao, an in zip(off, shape, aoff, ashape)):
                return (aoff, ashape), (off, shape)
        active.append((off, shape))
    return None

