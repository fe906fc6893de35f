"""Dtype names as manifests record them, and their element sizes, without importing torch.

Reading a manifest (``show``, ``fsck``, ``diff`` of digests, checkout planning) validates every
tensor record's dtype and size; this table lets that run in a process that never imports torch.
It lists every dtype torch has that ckstore stores, by its canonical name (``str(dtype)`` without
``torch.``); quantized dtypes are refused at commit, so never stored. A test keeps the table equal
to the installed torch's dtypes. A name a user's older torch lacks passes here and is refused,
naming the dtype, when a checkout builds the tensor
(:func:`ckstore.format.tensorio.dtype_from_name`).
"""

from __future__ import annotations

from ..errors import IntegrityError

__all__ = ["STORED_ITEMSIZES", "stored_itemsize"]

STORED_ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bits16": 2,
    # sub-byte integers: torch stores each element in one byte
    "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
    "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1, "uint6": 1, "uint7": 1,
}  # fmt: skip


def stored_itemsize(name: str) -> int:
    """The element size of dtype ``name`` as a manifest records it.

    Raises :class:`IntegrityError` unless ``name`` is the canonical name of a dtype ckstore stores.
    """
    size = STORED_ITEMSIZES.get(name)
    if size is None:
        raise IntegrityError(f"dtype {name[:40]!r} is not a dtype ckstore stores")
    return size
