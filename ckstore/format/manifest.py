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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import zstandard

from ..errors import IntegrityError

__all__ = ["ShardSpec", "TensorRecord", "Manifest", "MANIFEST_VERSION"]

MANIFEST_VERSION = 1


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
    def from_json(cls, obj: dict[str, Any]) -> ShardSpec:
        return cls(
            tuple(int(x) for x in obj["global_shape"]),
            tuple(int(x) for x in obj["offsets"]),
            tuple((int(d), str(m)) for d, m in obj["splits"]),
        )


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One stored tensor: its raw bytes are the concatenation of ``chunks``."""

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
        obj: dict[str, Any] = {
            "path": self.path,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "chunk_size": self.chunk_size,
            "chunks": [c.hex() for c in self.chunks],
        }
        if self.shard is not None:
            obj["shard"] = self.shard.to_json()
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TensorRecord:
        shard = obj.get("shard")
        return cls(
            path=str(obj["path"]),
            dtype=str(obj["dtype"]),
            shape=tuple(int(x) for x in obj["shape"]),
            nbytes=int(obj["nbytes"]),
            chunk_size=int(obj["chunk_size"]),
            chunks=tuple(bytes.fromhex(c) for c in obj["chunks"]),
            shard=ShardSpec.from_json(shard) if shard else None,
        )


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
        doc = {
            "version": MANIFEST_VERSION,
            "tree": self.tree,
            "tensors": [t.to_json() for t in self.tensors],
        }
        raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
        return zstandard.ZstdCompressor(level=3).compress(raw)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            doc = json.loads(zstandard.ZstdDecompressor().decompress(data))
        except (zstandard.ZstdError, ValueError) as e:
            raise IntegrityError(f"a manifest in the catalog is unreadable: {e}") from e
        if doc.get("version") != MANIFEST_VERSION:
            raise IntegrityError(
                f"manifest format version {doc.get('version')} is not supported by this ckstore "
                f"(it reads version {MANIFEST_VERSION}); upgrade ckstore"
            )
        return cls(doc["tree"], tuple(TensorRecord.from_json(t) for t in doc["tensors"]))
