"""Every read path verifies digests: a resharded checkout, a diff and an export of a checkpoint
whose pack file has one byte flipped raise IntegrityError naming the tensor, never wrong bytes.

(A plain checkout is covered in test_store.py.) The store is a real local folder; the damage is
one real byte of one real pack file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import random_tensor

import ckstore
from ckstore.errors import IntegrityError
from ckstore.integrations.files import export_checkpoint

TP = ckstore.WorldLayout({"tp": 2})


def _sharded(full: torch.Tensor) -> dict[int, dict[str, dict[str, ckstore.Shard]]]:
    return {r: {"model_states": {"w": ckstore.Shard(full.chunk(2)[r].clone(), mesh_dim="tp", dim=0)}} for r in range(2)}


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[ckstore.Store, torch.Tensor]:
    """Step 1: a tensor sharded over tp=2, alone in its pack, whose pack has one byte flipped;
    step 2: the same tensor with other values, intact."""
    s = ckstore.open(tmp_path / "s", run="exp", chunk_size=64 * 1024, pack_size=4 * 1024 * 1024)
    g = torch.Generator().manual_seed(0)
    full = random_tensor(torch.float32, (256, 128), g)
    s.commit(1, _sharded(full), world_layout=TP)
    (pack,) = [p for p in (tmp_path / "s" / "packs").rglob("*") if p.is_file()]
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(pack, 0o644)
    pack.write_bytes(bytes(data))
    s.commit(2, _sharded(random_tensor(torch.float32, (256, 128), g)), world_layout=TP)
    return s, full


NAMED = r"run 'exp', step 1, .*model_states, key 'w'"


def test_resharded_checkout_verifies_digests(damaged: tuple[ckstore.Store, torch.Tensor]) -> None:
    s, _ = damaged
    with pytest.raises(IntegrityError, match=NAMED):
        s.checkout(1, world_layout=ckstore.WorldLayout.single())
    with pytest.raises(IntegrityError, match=NAMED):
        s.checkout(1, world_layout=ckstore.WorldLayout({"tp": 4}))
    s.checkout(2, world_layout=ckstore.WorldLayout.single())  # the intact step reads fine


def test_diff_verifies_digests(damaged: tuple[ckstore.Store, torch.Tensor]) -> None:
    s, _ = damaged
    with pytest.raises(IntegrityError, match=NAMED):
        s.diff(1, 2)  # different digests: the stats read both sides
    assert not s.diff(2, 2, stats=True).changed


def test_export_verifies_digests(damaged: tuple[ckstore.Store, torch.Tensor], tmp_path: Path) -> None:
    s, _ = damaged
    for fmt, name in (("torch", "out.pt"), ("safetensors", "out.safetensors")):
        with pytest.raises(IntegrityError, match=NAMED):
            export_checkpoint(s, 1, str(tmp_path / name), fmt=fmt, sub_key="model_states")
        assert not (tmp_path / name).exists()  # nothing half-written is left behind
    export_checkpoint(s, 2, str(tmp_path / "ok.pt"), sub_key="model_states")
    assert torch.load(tmp_path / "ok.pt")["w"].shape == (256, 128)
