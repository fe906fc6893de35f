"""Where tensors come from and go to: ``checkout(device=...)`` and the staging of GPU tensors
through pinned host memory (README, "Using it").

What runs without a GPU runs everywhere (``device="cpu"``, the staging functions on host
tensors); the CUDA path runs only where CUDA is present, and is skipped with that reason
elsewhere (a hardware condition, not a missing service).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ALL_DTYPES, assert_same, bits, random_tensor

import ckstore
from ckstore.format.tensorio import stage_tensors, to_device


def _state(device: str = "cpu") -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": random_tensor(dt, (33, 17), g) for i, dt in enumerate(ALL_DTYPES)}
    tensors["scalar"] = torch.tensor(1.5)
    tensors["empty"] = torch.empty(0, 4)
    tensors["strided"] = random_tensor(torch.float32, (40, 30), g).t()
    return {0: {"model_states": {k: v.to(device) for k, v in tensors.items()}}}


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_checkout_onto_the_cpu(store: ckstore.Store, device: object) -> None:
    state = _state()
    store.commit(1, state)
    out = store.checkout(1, device=device)
    assert all(t.device.type == "cpu" for t in out[0]["model_states"].values())
    assert_same(out[0]["model_states"], {k: v.contiguous() for k, v in state[0]["model_states"].items()})
    assert_same(store.checkout(1, device=device, world_layout=ckstore.WorldLayout.single()), out)


def test_host_staging_hands_back_the_tensors_bytes() -> None:
    """The staging step a GPU commit goes through, on host tensors: contiguous host tensors whose
    raw bytes are the tensors' bytes; to_device onto the CPU keeps every bit."""
    tensors = list(_state()[0]["model_states"].values())
    staged = stage_tensors(tensors)
    assert len(staged) == len(tensors)
    for t, (host, raw) in zip(tensors, staged):
        assert host.device.type == "cpu" and host.is_contiguous() and not host.is_pinned()
        assert bytes(raw) == bits(t) == bits(host)
    moved = to_device([*tensors, None], torch.device("cpu"))
    assert moved[-1] is None
    for a, t in zip(moved[:-1], tensors):
        assert a is not None and a.device.type == "cpu" and bits(a) == bits(t)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is false)")


@needs_cuda
def test_gpu_tensors_commit_through_pinned_staging_and_check_out_onto_the_gpu(tmp_path: Path) -> None:
    s = ckstore.open(tmp_path / "s", run="gpu", chunk_size=64 * 1024)
    cpu = _state()
    gpu = _state("cuda")
    staged = stage_tensors(list(gpu[0]["model_states"].values()))
    assert all(host.is_pinned() and not host.is_cuda for host, _ in staged if host.numel())  # pinned host copies
    assert [bytes(raw) for _, raw in staged] == [bits(t) for t in cpu[0]["model_states"].values()]
    s.commit(1, gpu)
    out = s.checkout(1, device="cuda")
    assert all(t.is_cuda for t in out[0]["model_states"].values())
    assert_same({k: v.cpu() for k, v in out[0]["model_states"].items()},
                {k: v.contiguous() for k, v in cpu[0]["model_states"].items()})  # fmt: skip
    # the same bytes as a commit of the CPU copies: same digests, nothing new stored
    assert s.commit(2, cpu).stored_bytes_added == 0
