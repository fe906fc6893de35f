"""Import from and export to torch.save files, safetensors files and DCP folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_an_export_never_writes_over_the_store_or_an_existing_file(
    store: ckstore.Store, store_path: Path, tmp_path: Path
) -> None:
    """An export into the store's own folder (its catalog, a pack) is refused; an existing file is
    replaced only with overwrite; a failed export leaves the file it would replace as it was and
    no temporary file beside it."""
    store.commit(1, {0: {"m": {"w": torch.arange(4.0)}}})
    store.commit(2, {0: {"m": {"c": torch.ones(2, dtype=torch.complex128)}}})
    catalog = (store_path / "catalog.db").read_bytes()
    for inside in (store_path / "catalog.db", store_path / "packs" / "out.pt", store_path):
        fmt = "dcp" if inside == store_path else "torch"
        with pytest.raises(StoreConfigError, match="inside the store's own folder"):
            export_checkpoint(store, 1, str(inside), fmt=fmt, sub_key="m", overwrite=True)
    (tmp_path / "link").symlink_to(store_path / "catalog.db")
    with pytest.raises(StoreConfigError, match="inside the store's own folder"):
        export_checkpoint(store, 1, str(tmp_path / "link"), sub_key="m", overwrite=True)
    assert (store_path / "catalog.db").read_bytes()[:100] == catalog[:100] and store.resolve(1).step == 1

    out = tmp_path / "out"
    out.mkdir()
    mine = out / "mine.pt"
    mine.write_bytes(b"precious")
    with pytest.raises(ckstore.AlreadyExistsError, match="mine.pt exists; pass overwrite=True"):
        export_checkpoint(store, 1, str(mine), sub_key="m")
    assert mine.read_bytes() == b"precious"
    with pytest.raises(ckstore.UnsupportedValueError, match="complex128"):  # fails while writing
        export_checkpoint(store, 2, str(mine), fmt="safetensors", sub_key="m", overwrite=True)
    assert mine.read_bytes() == b"precious" and _listing(out) == ["mine.pt"]
    export_checkpoint(store, 1, str(mine), sub_key="m", overwrite=True)
    assert torch.equal(torch.load(mine)["w"], torch.arange(4.0)) and _listing(out) == ["mine.pt"]

    loc = str(store_path)
    r = CliRunner().invoke(main, ["--store", loc, "export", "1", str(mine), "--sub-key", "m"])
    assert r.exit_code == 2 and "AlreadyExistsError" in r.output and "--overwrite" in r.output
    r = CliRunner().invoke(main, ["--store", loc, "export", "1", str(store_path / "catalog.db")])
    assert r.exit_code == 2 and "inside the store's own folder" in r.output
    r = CliRunner().invoke(main, ["--store", loc, "export", "1", str(mine), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert torch.equal(torch.load(mine)["m"]["w"], torch.arange(4.0))


def test_an_import_refuses_containers_shared_into_millions_of_values(store: ckstore.Store, tmp_path: Path) -> None:
    """A torch.save file that refers to one container from many places (each place reads as a
    copy: 1.6 KB as 2 million values) is refused naming the file; what ordinary files share still
    imports: tied weights, views of one storage, the one betas tuple of an optimizer's groups."""
    nested: list[Any] = [torch.zeros(1)]
    for _ in range(20):
        nested = [nested, nested]
    torch.save({"w": nested}, tmp_path / "shared.pt")
    with pytest.raises(ckstore.UnsupportedValueError, match="shared.pt refers to the same containers"):
        import_checkpoint(store, str(tmp_path / "shared.pt"), 1)
    assert store.checkpoints() == []

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    opt = torch.optim.AdamW([{"params": [model[0].weight]}, {"params": [model[0].bias, model[1].bias]}])
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    base = torch.arange(12.0)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "views": [base[:6], base[6:], base.view(3, 4).t()]}
    assert state["optim"]["param_groups"][0]["betas"] is state["optim"]["param_groups"][1]["betas"]
    torch.save(state, tmp_path / "ordinary.pt")
    import_checkpoint(store, str(tmp_path / "ordinary.pt"), 2, sub_key=None)
    got = store.checkout(2)[0]
    assert torch.equal(got["model"]["1.weight"], model[0].weight) and torch.equal(got["views"][2], base.view(3, 4).t())


def test_an_import_refuses_a_tensor_that_views_more_than_its_storage(store: ckstore.Store, tmp_path: Path) -> None:
    """A zero-stride expand (4 bytes of storage that read as 8 GiB) is refused naming the file and
    the key, before anything is allocated for it; a view within its storage imports."""
    torch.save({"w": torch.zeros(1).expand(2**31), "ok": torch.arange(6.0).expand(2, 6)[:1]}, tmp_path / "expanded.pt")
    for call in (
        lambda: read_checkpoint(str(tmp_path / "expanded.pt")),
        lambda: import_checkpoint(store, str(tmp_path / "expanded.pt"), 1),
    ):
        with pytest.raises(ckstore.UnsupportedValueError, match=r"expanded.pt: key 'w' is a tensor .* over a storage of 4 bytes"):
            call()
    assert store.checkpoints() == []
    torch.save({"ok": torch.arange(6.0).expand(2, 6)[:1]}, tmp_path / "view.pt")
    import_checkpoint(store, str(tmp_path / "view.pt"), 1)
    assert torch.equal(store.checkout(1)[0]["model_states"]["ok"], torch.arange(6.0)[None])


def test_export_rank_of_an_unsharded_checkpoint(store: ckstore.Store, tmp_path: Path) -> None:
    """An unsharded checkpoint of several ranks exports the rank asked for (it was rank 0's state,
    consolidated), and a rank it does not have is refused naming those it has; a sharded one is
    consolidated, and refuses a rank."""
    store.commit(1, {r: {"m": {"w": torch.full((2,), float(r))}} for r in range(2)})
    export_checkpoint(store, 1, str(tmp_path / "r1.pt"), rank=1, sub_key="m")
    assert torch.equal(torch.load(tmp_path / "r1.pt")["w"], torch.ones(2))
    with pytest.raises(ckstore.CheckpointNotFoundError, match=r"saved by ranks \[0, 1\], not rank 5"):
        export_checkpoint(store, 1, str(tmp_path / "r5.pt"), rank=5, sub_key="m")
    r = CliRunner().invoke(main, ["--store", str(store.location), "export", "1", str(tmp_path / "c1.pt"), "--rank", "1"])
    assert r.exit_code == 0, r.output
    assert torch.equal(torch.load(tmp_path / "c1.pt")["m"]["w"], torch.ones(2))
    assert not (tmp_path / "r5.pt").exists()

    full = torch.arange(8.0)
    store.commit(
        2, {r: {"m": {"w": ckstore.Shard(full.chunk(2)[r].clone(), mesh_dim="tp", dim=0)}} for r in range(2)},
        world_layout=ckstore.WorldLayout({"tp": 2}),
    )  # fmt: skip
    with pytest.raises(StoreConfigError, match="is sharded: an export consolidates"):
        export_checkpoint(store, 2, str(tmp_path / "s1.pt"), rank=1, sub_key="m")
    export_checkpoint(store, 2, str(tmp_path / "s.pt"), sub_key="m")
    assert torch.equal(torch.load(tmp_path / "s.pt")["w"], full)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_safetensors_export_drops_no_value(store: ckstore.Store, tmp_path: Path) -> None:
    """Tensors whose safetensors names would be the same, a None, and a dtype safetensors has no
    code for (complex128, complex32) are refused naming the key; nothing is written."""
    cases = {
        "keys 'a.b' and 'a/b' would both be the tensor 'a.b'": {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}},
        "key 'n' holds None": {"w": torch.ones(1), "n": None},
        "key 'c' is a complex128 tensor": {"c": torch.ones(2, dtype=torch.complex128)},
        "key 'c' is a complex32 tensor": {"c": torch.ones(2, dtype=torch.complex32)},
    }
    for step, (message, state) in enumerate(cases.items()):
        store.commit(step, {0: {"m": state}})
        with pytest.raises(ckstore.UnsupportedValueError, match=message):
            export_checkpoint(store, step, str(tmp_path / "out.safetensors"), fmt="safetensors", sub_key="m")
        assert _listing(tmp_path) == ["store"]


def test_a_dcp_export_that_fails_is_one_error_and_leaves_nothing(store: ckstore.Store, tmp_path: Path) -> None:
    """DCP's own failure (a BaseException) is a StoreConfigError naming the cause, on the command
    line one line with status 2 rather than a traceback; a file is no dcp destination."""
    store.commit(1, {0: {"m": {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}}})  # one DCP key twice
    with pytest.raises(StoreConfigError, match="cannot write .* as a Distributed Checkpoint: ValueError: duplicated flatten key"):
        export_checkpoint(store, 1, str(tmp_path / "out"), fmt="dcp")
    assert _listing(tmp_path) == ["store"]
    r = CliRunner().invoke(main, ["--store", str(store.location), "export", "1", str(tmp_path / "out"), "--format", "dcp"])
    assert r.exit_code == 2 and "StoreConfigError: cannot write" in r.output and "Traceback" not in r.output
    assert _listing(tmp_path) == ["store"]
    (tmp_path / "file").write_bytes(b"x")
    store.commit(2, {0: {"m": {"w": torch.ones(1)}}})
    with pytest.raises(StoreConfigError, match="file is a file; a dcp export writes a folder"):
        export_checkpoint(store, 2, str(tmp_path / "file"), fmt="dcp", overwrite=True)
    assert (tmp_path / "file").read_bytes() == b"x"
    (tmp_path / "empty").mkdir()
    export_checkpoint(store, 2, str(tmp_path / "empty"), fmt="dcp")
    assert torch.equal(read_checkpoint(str(tmp_path / "empty"), allow_pickle=True)["m"]["w"], torch.ones(1))
    with pytest.raises(ckstore.AlreadyExistsError, match="is not empty; pass overwrite=True"):
        export_checkpoint(store, 2, str(tmp_path / "empty"), fmt="dcp")


def test_an_import_of_a_file_that_is_no_pickle_says_so(store: ckstore.Store, tmp_path: Path) -> None:
    """Bytes that are no torch.save file are "cannot read ... as a torch.save file", not a file of
    Python objects to trust with --allow-pickle (which only a file of objects hears)."""
    (tmp_path / "random.pt").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "text.pt").write_text("hello world\n")
    for name in ("random.pt", "text.pt"):
        with pytest.raises(StoreConfigError, match=f"cannot read .*{name} as a torch.save file") as e:
            import_checkpoint(store, str(tmp_path / name), 1)
        assert "allow_pickle" not in str(e.value) and "weights_only" not in str(e.value)
    torch.save({"o": Opaque()}, tmp_path / "obj.pt")
    with pytest.raises(ckstore.UnsupportedValueError, match=r"holds Python objects .*\(--allow-pickle\)"):
        import_checkpoint(store, str(tmp_path / "obj.pt"), 1)


def test_a_failed_import_leaves_no_new_store(tmp_path: Path) -> None:
    """`ckstore import` into a store it creates removes that store again when the import fails; an
    existing store is kept. --split with --sub-key is refused rather than --sub-key ignored."""
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    new = tmp_path / "new" / "store"
    r = CliRunner().invoke(main, ["--store", str(new), "import", str(tmp_path / "bad.pt"), "--step", "1"])
    assert r.exit_code == 2 and not (tmp_path / "new").exists()
    torch.save({"dt": torch.float32}, tmp_path / "dtype.pt")  # refused by the commit, after the store was made
    r = CliRunner().invoke(main, ["--store", str(new), "import", str(tmp_path / "dtype.pt"), "--step", "1", "--run", "r"])
    assert r.exit_code == 2 and "torch.dtype" in r.output
    assert not (tmp_path / "new").exists()

    torch.save({"model": {"w": torch.ones(1)}, "optim": {"s": torch.zeros(1)}}, tmp_path / "ok.pt")
    r = CliRunner().invoke(main, ["--store", str(new), "import", str(tmp_path / "ok.pt"), "--step", "1", "--run", "r"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["--store", str(new), "import", str(tmp_path / "bad.pt"), "--step", "2", "--run", "r"])
    assert r.exit_code == 2 and (new / "ckstore.json").is_file()
    r = CliRunner().invoke(
        main, ["--store", str(new), "import", str(tmp_path / "ok.pt"), "--step", "3", "--run", "r", "--split", "--sub-key", "x"]
    )
    assert r.exit_code == 2 and "--split" in r.output and "--sub-key" in r.output
    with ckstore.open(new, run="r") as s:
        assert [c.step for c in s.checkpoints()] == [1]
        assert s.resolve(1).sub_keys == ("model_states",)
