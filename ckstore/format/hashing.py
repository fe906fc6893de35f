"""Content digests: xxh3-128 of a chunk's raw bytes."""

from __future__ import annotations

import xxhash

__all__ = ["DIGEST_SIZE", "digest", "to_hex", "from_hex"]

DIGEST_SIZE = 16


def digest(data: memoryview | bytes) -> bytes:
    """The 16-byte xxh3-128 digest of ``data`` (releases the GIL while hashing)."""
    return xxhash.xxh3_128_digest(data)


def to_hex(d: bytes) -> str:
    return d.hex()


def from_hex(s: str) -> bytes:
    d = bytes.fromhex(s)
    if len(d) != DIGEST_SIZE:
        raise ValueError(f"a chunk digest is {DIGEST_SIZE} bytes, got {len(d)}: {s!r}")
    return d
