"""Helpers shared by the tests: bit-exact comparison of state trees and sample states."""

from __future__ import annotations

from typing import Any

import torch


def bits(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Assert two state trees are equal: same container types, key order, dtypes, shapes, bits."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), f"{path}: expected a tensor, got {type(a).__name__}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.is_contiguous(), f"{path}: checkout must hand back contiguous tensors"
        assert bits(a) == bits(b), f"{path}: values differ"
        return
    if isinstance(b, dict):
        assert type(a) is dict, f"{path}: expected dict, got {type(a).__name__}"
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in b:
            assert_same(a[k], b[k], f"{path}/{k}")
        return
    if isinstance(b, (list, tuple)):
        want = list if isinstance(b, list) else tuple
        assert type(a) is want, f"{path}: expected {want.__name__}, got {type(a).__name__}"
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
        return
    if isinstance(b, float) and b != b:
        assert isinstance(a, float) and a != a, f"{path}: expected nan, got {a!r}"
        return
    assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def assert_clean(store: Any) -> None:
    """``gc(grace=0)`` then ``fsck(deep=True)`` find nothing wrong and nothing left over: no
    damage, orphans, temp files, pending commits, trash or unreferenced chunks."""
    store.gc(grace=0)
    report = store.fsck(deep=True, grace=0)
    assert report.ok, [d.describe() for d in report.damage]
    assert report.orphans == () and report.temp_files == () and report.pending == (), report
    assert report.trash == 0 and report.unreferenced_chunks == 0, report


def small_model_state(seed: int = 0, width: int = 64) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width * 2), torch.nn.GELU(), torch.nn.Linear(width * 2, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return {"model_states": model.state_dict(), "optim_states": opt.state_dict()}


ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
] + [
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "uint16",
        "uint32",
        "uint64",
    )
    if hasattr(torch, name)
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator | None = None) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bits (every bit pattern, NaNs included)."""
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def expected_piece(g: torch.Tensor, splits: Any, layout: Any, coords: dict[str, int]) -> torch.Tensor:
    """A target rank's piece of global tensor ``g`` split by ``splits`` ((tensor dim, mesh dim)
    pairs) in ``layout``: torch.chunk nested in mesh order (DTensor's Shard semantics), written
    independently of ckstore's planner."""
    order = [n for n, _ in layout.dims]
    t = g
    for d in range(g.dim()):
        for m in sorted((m for dd, m in splits if dd == d and m in order), key=order.index):
            parts = torch.chunk(t, layout.size(m), d) if t.shape[d] else ()
            c = coords[m]
            t = parts[c] if c < len(parts) else t.narrow(d, t.shape[d], 0)
    return t
