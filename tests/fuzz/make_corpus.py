"""Write the fuzz corpus: small inputs every run replays (``python tests/fuzz/make_corpus.py``).

Frames (``*.frame``: an 8-byte chunk header and body), manifests (``*.manifest``: zstd JSON as
the catalog holds it) and packs (``*.pack``). Add an input here when fuzzing finds one that
mattered; keep each file small.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckstore.format import codec, hashing  # noqa: E402
from ckstore.format.tensorio import MAX_DEPTH  # noqa: E402
from fuzz.hostile import chunk_frame, zstd_frame  # noqa: E402

OUT = Path(__file__).parent / "corpus"


def frame_bytes(raw: np.ndarray, itemsize: int) -> bytes:
    f = codec.encode(memoryview(raw), itemsize)
    return b"".join(bytes(p) for p in f.parts)


def manifest(doc: Any) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, separators=(",", ":")).encode())


def main() -> None:
    OUT.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    floats = (rng.standard_normal(4096).astype(np.float32)).view(np.uint8)
    files: dict[str, bytes] = {
        "planes-fp32.frame": frame_bytes(floats, 4),
        "zstd-int8.frame": frame_bytes((np.arange(4096) % 7).astype(np.uint8), 1),
        "raw.frame": frame_bytes(rng.integers(0, 256, 512, dtype=np.uint8), 1),
        "bomb-declares-1GiB.frame": chunk_frame(1, 65536, zstd_frame(1 << 30, 8192)),
        "bomb-declares-1TiB.frame": chunk_frame(1, 65536, zstd_frame(1 << 40, 64)),
        "bomb-undeclared-1GiB.frame": chunk_frame(1, 65536, zstd_frame(None, 8192)),
        "zstd-window-1GiB.frame": chunk_frame(1, 4096, zstd_frame(None, 1, window_log=30)),
        "zstd-two-frames.frame": chunk_frame(1, 131072, zstd_frame(131072, 1) * 2),
        "header-only.frame": struct.pack("<BBHI", 1, 1, 0, 16),
        "planes-table-truncated.frame": chunk_frame(2, 16, b"\x01\x00", itemsize=4, mask=1),
        "planes-table-lies.frame": chunk_frame(2, 16, b"\xff" * 16 + b"x" * 16, itemsize=4, mask=0),
        "planes-bomb-plane.frame": chunk_frame(
            2, 8, struct.pack("<2I", 18, 4) + zstd_frame(1 << 40, 1)[:18] + b"abcd", itemsize=2, mask=1
        ),
        "raw-codec-with-mask.frame": chunk_frame(0, 4, b"abcd", itemsize=1, mask=0x10),
    }
    digest = hashing.digest(floats.data).hex()
    good = {
        "version": 1,
        "tree": ["d", [[["s", "w"], ["T", 0]], [["s", "lr"], ["f", "0.001"]]]],
        "tensors": [
            {"path": "w", "dtype": "float32", "shape": [64, 64], "nbytes": 16384, "chunk_size": 4096,
             "chunks": [digest] * 4},
        ],
    }  # fmt: skip

    def edited(**fields: Any) -> dict[str, Any]:
        doc = json.loads(json.dumps(good))
        doc["tensors"][0].update(fields)
        return doc

    deep: Any = ["n"]
    for _ in range(MAX_DEPTH + 1):
        deep = ["l", [deep]]
    files.update(
        {
            "good.manifest": manifest(good),
            "dtype-float64.manifest": manifest(edited(dtype="float64")),
            "shape-bigger.manifest": manifest(edited(shape=[6400, 64], nbytes=6400 * 64 * 4)),
            "chunk-size-zero.manifest": manifest(edited(chunk_size=0)),
            "tensor-index-99.manifest": manifest({**good, "tree": ["T", 99]}),
            "tree-too-deep.manifest": manifest({**good, "tree": ["d", [[["s", "w"], ["T", 0]], [["s", "x"], deep]]]}),
            "shard-overreach.manifest": manifest(
                edited(shard={"global_shape": [64, 64], "offsets": [32, 0], "splits": [[0, "dp"]]})
            ),
            "declares-1TiB.manifest": zstd_frame(1 << 40, 4),
            "json-nested.manifest": zstandard.compress(b"[" * 100_000),
        }
    )
    pack = bytearray(b"CKPK\x01\x00\x00\x00")
    index = b""
    for name in ("raw.frame", "zstd-int8.frame"):
        f = files[name]
        index += struct.pack("<16sQII", b"\x00" * 16, len(pack), len(f), codec.raw_length(f))
        pack += f
    good_pack = bytes(pack) + index + struct.pack("<I4s", 2, b"CKPI")
    files["good.pack"] = good_pack
    files["count-huge.pack"] = good_pack[:-8] + struct.pack("<I4s", 0xFFFFFFFF, b"CKPI")
    files["entry-outside.pack"] = bytes(pack) + struct.pack("<16sQII", b"\x00" * 16, 1 << 40, 8, 0) + struct.pack(
        "<I4s", 1, b"CKPI"
    )
    for name, data in files.items():
        assert len(data) <= 64 * 1024, name
        (OUT / name).write_bytes(data)
    print(f"wrote {len(files)} files, {sum(map(len, files.values()))} bytes, to {OUT}")


if __name__ == "__main__":
    main()
