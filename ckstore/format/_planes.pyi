"""Byte planes in C (``_planes.c``): split and merge for ckstore's byte-plane codec."""

from collections.abc import Sequence

from _typeshed import ReadableBuffer, WriteableBuffer

def split(chunk: ReadableBuffer, planes: Sequence[WriteableBuffer]) -> None:
    """Cut ``chunk`` (n * k bytes) into the k writable ``planes`` of n bytes each:
    ``planes[j][i] = chunk[i * k + j]``. Releases the GIL while it copies."""

def merge(planes: Sequence[ReadableBuffer], chunk: WriteableBuffer) -> None:
    """Interleave the k ``planes`` of n bytes each into the writable ``chunk`` of n * k bytes:
    ``chunk[i * k + j] = planes[j][i]``. Releases the GIL while it copies."""
