"""Import from and export to torch.save files, safetensors files and DCP folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_same, small_model_state

import ckstore
from ckstore.cli import main
from ckstore.errors import StoreConfigError
from ckstore.integrations.files import export_checkpoint, import_checkpoint, read_checkpoint


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_import_then_export_round_trips(store: ckstore.Store, tmp_path: Path, fmt: str) -> None:
    model = small_model_state()["model_states"]
    src = tmp_path / ("in.safetensors" if fmt == "safetensors" else "in.pt" if fmt == "torch" else "in_dcp")
    out = tmp_path / ("out.safetensors" if fmt == "safetensors" else "out.pt" if fmt == "torch" else "out_dcp")
    from ckstore.integrations.files import write_checkpoint

    write_checkpoint(dict(model), str(src), fmt)
    trusted = fmt == "dcp"  # a DCP folder's .metadata is a pickle: only with the trust flag
    ck = import_checkpoint(store, str(src), 10, metrics={"val_loss": 1.0}, allow_pickle=trusted)
    assert ck.kind == "imported" and ck.sub_keys == ("model_states",)
    got = store.checkout(10)[0]["model_states"]
    if fmt != "torch":  # safetensors and DCP files do not keep key order
        got, model = dict(sorted(got.items())), dict(sorted(model.items()))
    assert_same(got, dict(model))
    again = import_checkpoint(store, str(src), 11, allow_pickle=trusted)
    assert again.stored_bytes_added == 0  # the same weights dedup completely
    export_checkpoint(store, 10, str(out), fmt=fmt, sub_key="model_states")
    back = read_checkpoint(str(out), allow_pickle=trusted)
    for k, v in model.items():
        assert torch.equal(back[k], v), k


def test_split_top_level_and_pickle_refusal(store: ckstore.Store, tmp_path: Path) -> None:
    state = small_model_state()
    p = tmp_path / "train.pt"
    torch.save({"model": state["model_states"], "optimizer": state["optim_states"]}, p)
    ck = import_checkpoint(store, str(p), 1, sub_key=None)
    assert ck.sub_keys == ("model", "optimizer")

    torch.save({"w": torch.ones(1), "o": Opaque()}, tmp_path / "obj.pt")
    with pytest.raises(ckstore.UnsupportedValueError, match="allow_pickle"):
        import_checkpoint(store, str(tmp_path / "obj.pt"), 2)


class Opaque:
    pass


def test_export_consolidates_sharded_checkpoint(store: ckstore.Store, tmp_path: Path) -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    layout = ckstore.WorldLayout({"tp": 2})
    store.commit(
        1, {r: {"model_states": {"w": ckstore.Shard(full.chunk(2)[r].clone(), mesh_dim="tp", dim=0)}} for r in range(2)},
        world_layout=layout,
    )  # fmt: skip
    export_checkpoint(store, 1, str(tmp_path / "full.pt"), sub_key="model_states")
    assert torch.equal(torch.load(tmp_path / "full.pt")["w"], full)


def test_cli_import_export(tmp_path: Path) -> None:
    model = small_model_state()["model_states"]
    torch.save(model, tmp_path / "m.pt")
    loc = str(tmp_path / "s")
    r = CliRunner().invoke(main, ["--store", loc, "import", str(tmp_path / "m.pt"), "--run", "base", "--step", "0",
                                  "--metric", "val_loss=0.5", "--tag", "pretrained"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "imported" in r.output
    r = CliRunner().invoke(main, ["--store", loc, "export", "pretrained", str(tmp_path / "o.safetensors"),
                                  "--format", "safetensors", "--sub-key", "model_states"])  # fmt: skip
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    assert_same(load_file(str(tmp_path / "o.safetensors")), dict(sorted(model.items())))
    r = CliRunner().invoke(main, ["--store", loc, "import", str(tmp_path / "m.pt"), "--step", "1", "--run", "base",
                                  "--metric", "oops"])  # fmt: skip
    assert r.exit_code == 2 and "NAME=VALUE" in r.output


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_export_that_cannot_be_written_is_refused_before_reading(
    store: ckstore.Store, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file export into a folder that does not exist, or onto a folder, is refused naming it
    before the checkpoint is read (it was torch's or safetensors' own error after the whole
    checkpoint had been loaded); nothing is written."""
    store.commit(1, {0: small_model_state()})
    loads: list[int] = []
    real_load = store.load
    monkeypatch.setattr(store, "load", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    with pytest.raises(StoreConfigError, match="no folder '.*missing' to write .* into; create it first"):
        export_checkpoint(store, 1, str(tmp_path / "missing" / "out"), fmt=fmt, sub_key="model_states")
    (tmp_path / "adir").mkdir()
    with pytest.raises(StoreConfigError, match=f"is a folder; a {fmt} export writes one file"):
        export_checkpoint(store, 1, str(tmp_path / "adir"), fmt=fmt, sub_key="model_states")
    with pytest.raises(StoreConfigError, match="unknown checkpoint format 'bogus'"):
        export_checkpoint(store, 1, str(tmp_path / "out"), fmt="bogus")
    assert loads == [] and not (tmp_path / "missing").exists() and list((tmp_path / "adir").iterdir()) == []
    export_checkpoint(store, 1, str(tmp_path / "out"), fmt=fmt, sub_key="model_states")
    assert loads == [1] and (tmp_path / "out").stat().st_size > 0
