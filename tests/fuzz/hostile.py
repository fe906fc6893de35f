"""A small real store on disk, and the ways a hostile writer of its blobs or catalog edits it.

Edits go where an attacker (or a broken disk) would put them: bytes into the real pack files,
rows of the real SQLite catalog through a separate connection. Every edit returns an undo.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zstandard

import ckstore
from ckstore.layout import Shard, WorldLayout

LAYOUT = WorldLayout({"dp": 2})
CHUNK = 64 * 1024


def rank_state(step: int, rank: int) -> dict[str, Any]:
    """Tensors of every codec (byte planes, zstd, raw), a sharded one, nested plain values."""
    g = torch.Generator().manual_seed(step * 10 + rank)
    shared = torch.Generator().manual_seed(step)
    return {
        "model_states": {
            "w": torch.randn(128, 160, generator=shared) * 0.02,  # fp32: byte planes, 2 chunks
            "codes": (torch.arange(80_000) % 7).to(torch.int8),  # zstd, 2 chunks, the same in every step
            "noise": torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g),  # raw
            "emb": Shard(torch.randn(16, 64, generator=g), mesh_dim="dp", dim=0),
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
        },
        "optim_states": {
            "state": {0: {"step": step, "exp_avg": torch.randn(32, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "name": "all", "flag": None}],
        },
    }


def build(path: Path) -> ckstore.Store:
    """A store with steps 1 and 2 of a two-rank run ``exp`` (world layout ``dp=2``)."""
    store = ckstore.open(path, run="exp", chunk_size=CHUNK, pack_size=1024 * 1024)
    for step in (1, 2):
        store.commit(step, {r: rank_state(step, r) for r in (0, 1)}, world_layout=LAYOUT)
    return store


class Hostile:
    """Edits of one store's catalog file and pack files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = path / "catalog.db"

    def _sql(self, query: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        con = sqlite3.connect(self.db, timeout=30)
        try:
            with con:
                return list(con.execute(query, args))
        finally:
            con.close()

    # -- manifests --
    def entry(self, step: int, rank: int, sub_key: str) -> tuple[int, bytes]:
        (row,) = self._sql(
            "SELECT e.id, e.manifest FROM entries e JOIN checkpoints c ON c.id = e.checkpoint_id "
            "WHERE c.step = ? AND e.rank = ? AND e.sub_key = ?",
            (step, rank, sub_key),
        )
        return int(row[0]), bytes(row[1])

    def entries(self) -> list[tuple[int, bytes]]:
        return [(int(i), bytes(m)) for i, m in self._sql("SELECT id, manifest FROM entries ORDER BY id")]

    def set_manifest_bytes(self, entry_id: int, data: bytes) -> Callable[[], None]:
        (old,) = self._sql("SELECT manifest FROM entries WHERE id = ?", (entry_id,))
        self._sql("UPDATE entries SET manifest = ? WHERE id = ?", (data, entry_id))
        return lambda: self._sql("UPDATE entries SET manifest = ? WHERE id = ?", (old[0], entry_id)) and None

    def doc(self, step: int, rank: int, sub_key: str) -> tuple[int, dict[str, Any]]:
        entry_id, data = self.entry(step, rank, sub_key)
        return entry_id, json.loads(zstandard.ZstdDecompressor().decompress(data))

    def set_doc(self, entry_id: int, doc: Any) -> Callable[[], None]:
        raw = json.dumps(doc, separators=(",", ":")).encode()
        return self.set_manifest_bytes(entry_id, zstandard.ZstdCompressor(level=3).compress(raw))

    def edit_doc(self, step: int, rank: int, sub_key: str, edit: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        entry_id, doc = self.doc(step, rank, sub_key)
        edit(doc)
        return self.set_doc(entry_id, doc)

    # -- chunks and packs --
    def chunk(self, digest_hex: str) -> tuple[int, str, int, int, int]:
        """``(chunk id, pack key, offset, length, raw_size)``."""
        (row,) = self._sql(
            "SELECT k.id, p.key, k.offset, k.length, k.raw_size FROM chunks k JOIN packs p ON p.id = k.pack_id "
            "WHERE k.digest = ?",
            (bytes.fromhex(digest_hex),),
        )
        return int(row[0]), str(row[1]), int(row[2]), int(row[3]), int(row[4])

    def frame(self, digest_hex: str) -> bytes:
        _, key, offset, length, _ = self.chunk(digest_hex)
        with open(self.path / key, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def set_chunk_row(self, digest_hex: str, **fields: Any) -> Callable[[], None]:
        cid = self.chunk(digest_hex)[0]
        names = list(fields)
        (old,) = self._sql(f"SELECT {', '.join(names)} FROM chunks WHERE id = ?", (cid,))
        sets = ", ".join(f"{n} = ?" for n in names)
        self._sql(f"UPDATE chunks SET {sets} WHERE id = ?", (*fields.values(), cid))
        return lambda: self._sql(f"UPDATE chunks SET {sets} WHERE id = ?", (*old, cid)) and None

    def set_pack_key(self, digest_hex: str, key: str) -> Callable[[], None]:
        (pack_id,) = self._sql("SELECT pack_id FROM chunks WHERE digest = ?", (bytes.fromhex(digest_hex),))[0]
        (old,) = self._sql("SELECT key FROM packs WHERE id = ?", (pack_id,))[0]
        self._sql("UPDATE packs SET key = ? WHERE id = ?", (key, pack_id))
        return lambda: self._sql("UPDATE packs SET key = ? WHERE id = ?", (old, pack_id)) and None

    def write_pack(self, key: str, offset: int, data: bytes) -> Callable[[], None]:
        """Overwrite bytes of a pack file in place."""
        p = self.path / key
        old = p.read_bytes()
        with open(p, "r+b") as f:
            f.seek(offset)
            f.write(data)
        return lambda: p.write_bytes(old)

    def replace_frame(self, digest_hex: str, frame: bytes) -> Callable[[], None]:
        """Append ``frame`` to the chunk's pack and point its catalog row at it."""
        _, key, _, _, _ = self.chunk(digest_hex)
        p = self.path / key
        old = p.read_bytes()
        p.write_bytes(old + frame)
        undo_row = self.set_chunk_row(digest_hex, offset=len(old), length=len(frame))

        def undo() -> None:
            undo_row()
            p.write_bytes(old)

        return undo

    def packs(self) -> list[str]:
        return [str(k) for (k,) in self._sql("SELECT key FROM packs ORDER BY id")]


def tensor_record(doc: dict[str, Any], path: str) -> dict[str, Any]:
    return next(t for t in doc["tensors"] if t["path"] == path)


# -- crafted zstd frames ----------------------------------------------------------------------


def zstd_frame(declared: int | None, blocks: int, *, window_log: int = 17, byte: int = 0) -> bytes:
    """A zstd frame of ``blocks`` RLE blocks of 128 KiB (4 bytes each), declaring ``declared``
    bytes of content (None: no content size). Real zstd: a 1 GiB bomb is 8192 blocks, 32 KiB."""
    if declared is None:
        head = bytes([0x00, (window_log - 10) << 3])
    else:
        head = bytes([0xC0, (window_log - 10) << 3]) + struct.pack("<Q", declared)
    out = bytearray(b"\x28\xb5\x2f\xfd" + head)
    size = 128 * 1024
    for i in range(blocks):
        last = 1 if i == blocks - 1 else 0
        out += (last | (1 << 1) | (size << 3)).to_bytes(3, "little") + bytes([byte])
    return bytes(out)


def chunk_frame(codec: int, raw_len: int, body: bytes, itemsize: int = 1, mask: int = 0) -> bytes:
    """A ckstore chunk frame: the 8-byte header (see ckstore.format.codec) and ``body``."""
    return struct.pack("<BBHI", codec, itemsize, mask, raw_len) + body
