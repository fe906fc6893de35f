"""Byte planes: the compiled kernels and numpy write the same bytes, the documented layout
(``raw[j::k]``), and the kernels check every buffer before they write."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.format import codec, planes

compiled = pytest.mark.skipif(planes._native is None, reason="ckstore's byte-plane kernels are not built")


def test_ci_runs_the_compiled_kernels() -> None:
    """Where the extension is required (CI), this process really uses it: a build that silently
    fell back to numpy fails here."""
    if os.environ.get("CKSTORE_EXTENSION") != "require":
        pytest.skip("CKSTORE_EXTENSION=require is not set")
    assert planes.KERNEL == "compiled"


def _unaligned(data: bytes, offset: int) -> np.ndarray:
    buf = np.zeros(len(data) + offset, dtype=np.uint8)
    buf[offset:] = np.frombuffer(data, dtype=np.uint8)
    return buf[offset:]


@compiled
@settings(max_examples=300, deadline=None)
@given(
    itemsize=st.integers(2, 16),
    count=st.one_of(st.integers(0, 40), st.sampled_from([4095, 4096, 4097, 8191, 20_000])),
    offset=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_compiled_and_numpy_write_the_same_bytes(itemsize: int, count: int, offset: int, seed: int) -> None:
    raw = _unaligned(np.random.default_rng(seed).bytes(itemsize * count), offset)
    got = planes.split(raw, itemsize)
    want = planes.split_numpy(raw, itemsize)
    for j in range(itemsize):
        assert got[j].tobytes() == raw[j::itemsize].tobytes() == want[j].tobytes(), f"plane {j}"
    out = _unaligned(bytes(raw.nbytes), (offset + 3) % 8)
    planes.merge([_unaligned(p.tobytes(), offset) for p in got], out)
    assert out.tobytes() == raw.tobytes()
    out2 = np.zeros(raw.nbytes, dtype=np.uint8)
    planes.merge_numpy(want, out2)
    assert out2.tobytes() == raw.tobytes()


@compiled
def test_large_chunks_of_every_word_size() -> None:
    """The word kernels (2, 4, 8 bytes) over a chunk of the default size, and the byte loop."""
    raw = np.frombuffer(np.random.default_rng(1).bytes(4 << 20), dtype=np.uint8)
    for itemsize in (2, 3, 4, 8, 16):
        n = raw.nbytes - raw.nbytes % itemsize
        got = planes.split(raw[:n], itemsize)
        assert all(got[j].tobytes() == raw[:n][j::itemsize].tobytes() for j in range(itemsize)), itemsize
        out = np.empty(n, dtype=np.uint8)
        planes.merge(got, out)
        assert out.tobytes() == raw[:n].tobytes(), itemsize


@compiled
def test_kernels_refuse_bad_buffers_before_writing() -> None:
    k = planes._native
    dst = bytearray(b"\xaa" * 8)
    cases = [
        (lambda: k.merge([b"abcd", b"efg"], dst), ValueError, "byte plane 1 holds 3 bytes, expected 4"),
        (lambda: k.merge([b"abcd"], dst), ValueError, "2 to 16"),
        (lambda: k.merge([b"a"] * 17, bytearray(17)), ValueError, "2 to 16"),
        (lambda: k.merge([b"abc", b"def"], dst), ValueError, "byte plane 0 holds 3 bytes, expected 4"),
        (lambda: k.merge([b"ab", b"cd"], b"abcd"), BufferError, "not writable"),
        (lambda: k.split(b"abc", [bytearray(1), bytearray(1)]), ValueError, "whole 2-byte elements"),
        (lambda: k.split(b"abcd", [b"xy", bytearray(2)]), BufferError, "not writable"),
        (lambda: k.merge(7, dst), TypeError, "not iterable"),
        (lambda: k.merge([b"ab", 5], bytearray(4)), TypeError, "bytes-like object is required"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
    assert dst == bytearray(b"\xaa" * 8)  # nothing was written
    shared = memoryview(bytearray(range(12)))
    before = bytes(shared)
    with pytest.raises(ValueError, match="must not overlap"):  # a plane inside its own output
        k.merge([shared[0:2], shared[2:4]], shared[2:6])
    with pytest.raises(ValueError, match="must not overlap"):  # two output planes on the same bytes
        k.split(shared[8:12], [shared[0:2], shared[1:3]])
    with pytest.raises(ValueError, match="must not overlap"):  # an output plane over its input
        k.split(shared[0:4], [shared[2:4], shared[4:6]])
    assert bytes(shared) == before


@pytest.mark.parametrize("kernel", ["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.complex128], ids=str)
def test_frames_decode_the_same_whichever_kernel_wrote_them(
    kernel: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame encoded by one kernel decodes to the same bytes through the other: stores written
    with or without the extension read alike."""
    if kernel == "compiled" and planes._native is None:
        pytest.skip("ckstore's byte-plane kernels are not built")
    t = (torch.randn(300_000, dtype=torch.float64) * 0.02).to(dtype)
    raw = memoryview(t.view(torch.uint8).numpy())
    native = planes._native
    if kernel == "numpy":
        monkeypatch.setattr(planes, "_native", None)
    frame = codec.encode(raw, t.element_size())
    blob = b"".join(bytes(p) for p in frame.parts)
    assert frame.codec == codec.CODEC_PLANES
    monkeypatch.setattr(planes, "_native", native if kernel == "numpy" else None)
    out = np.empty(raw.nbytes, dtype=np.uint8)
    codec.decode_into(blob, memoryview(out))
    assert out.tobytes() == raw.tobytes()


def test_skip_uses_numpy_and_reads_what_the_kernels_wrote(tmp_path: os.PathLike[str]) -> None:
    """``CKSTORE_EXTENSION=skip`` runs a process on numpy alone, and a store written there checks
    out bit-exact in a process with the kernels (and the other way round)."""
    script = (
        "import sys, torch, ckstore\n"
        "from ckstore.format import planes\n"
        "print(planes.KERNEL)\n"
        "s = ckstore.open(sys.argv[1], run='r')\n"
        "if sys.argv[2] == 'write':\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    s.commit(step=1, rank_states={0: {'m': {'w': torch.randn(70_000, generator=g),"
        " 'h': torch.randn(70_000, generator=g).bfloat16(), 'd': torch.randn(9_000, generator=g).double()}}})\n"
        "else:\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    w, h, d = torch.randn(70_000, generator=g), torch.randn(70_000, generator=g).bfloat16(), torch.randn(9_000, generator=g).double()\n"
        "    m = s.checkout(1)[0]['m']\n"
        "    assert torch.equal(m['w'], w) and torch.equal(m['h'], h) and torch.equal(m['d'], d)\n"
        "s.close()\n"
    )

    def run(where: str, mode: str, env_mode: str) -> str:
        env = {**os.environ, "CKSTORE_EXTENSION": env_mode}
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / where), mode], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run("a", "write", "skip") == "numpy"
    if planes._native is None:
        pytest.skip("ckstore's byte-plane kernels are not built: only the numpy side ran")
    assert run("a", "read", "auto") == "compiled"
    assert run("b", "write", "auto") == "compiled"
    assert run("b", "read", "skip") == "numpy"


def test_version_says_which_kernels_run() -> None:
    """``ckstore --version`` tells a user whether their install has the compiled kernels."""
    for mode, words in (("auto", None), ("skip", "numpy (CKSTORE_EXTENSION=skip)")):
        out = subprocess.run(
            [sys.executable, "-m", "ckstore", "--version"], env={**os.environ, "CKSTORE_EXTENSION": mode},
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert out.startswith("ckstore, version "), out
        want = words or ("compiled kernels" if planes.KERNEL == "compiled" else "numpy (the compiled kernels are not built")
        assert f"byte planes: {want}" in out, out
