"""The catalog schema: created at head, checked on open, upgraded by `ckstore db upgrade`."""

from __future__ import annotations

from pathlib import Path

import catalog_tools
import pytest
import torch
from alembic import command
from alembic.config import Config
from click.testing import CliRunner
from sqlalchemy import text

import ckstore
from ckstore.catalog._engine import migrations_dir
from ckstore.cli import main


def _cfg(db: Path) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", f"sqlite:///{db}")
    return cfg


def test_fresh_catalog_is_stamped_at_head(store_path: Path) -> None:
    s = ckstore.open(store_path)
    rev, head = s.catalog.revisions()
    assert rev == head
    assert catalog_tools.scalar(store_path / "catalog.db", "SELECT version_num FROM alembic_version") == head


def test_migrations_build_the_same_schema_as_the_models(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    command.upgrade(_cfg(db), "head")
    assert catalog_tools.schema_differences(db) == []


def test_the_delta_index_is_partial_on_a_fresh_and_a_migrated_catalog(tmp_path: Path) -> None:
    """``ix_chunks_base`` holds the delta rows alone, whether the models or the migrations built it
    (autogenerate's comparison does not look at an index's WHERE clause)."""
    fresh = tmp_path / "fresh"
    ckstore.open(fresh).close()
    migrated = tmp_path / "m.db"
    command.upgrade(_cfg(migrated), "head")
    for db in (fresh / "catalog.db", migrated):
        sql = catalog_tools.scalar(db, "SELECT sql FROM sqlite_master WHERE name = 'ix_chunks_base'")
        assert " ".join(sql.split()).endswith("(base) WHERE base IS NOT NULL"), sql


def test_outdated_catalog_names_the_upgrade_command(store_path: Path) -> None:
    s = ckstore.open(store_path, run="r")
    s.commit(1, {0: {"m": {"w": torch.ones(2)}}})
    s.close()
    db = store_path / "catalog.db"
    catalog_tools.set_schema_revision(db, "0000")
    with pytest.raises(ckstore.SchemaVersionError, match="newer ckstore"):
        ckstore.open(store_path)
    catalog_tools.set_schema_revision(db, None)
    with pytest.raises(ckstore.SchemaVersionError, match=rf"ckstore --store {store_path} db upgrade"):
        ckstore.open(store_path)


def test_db_upgrade_from_base(tmp_path: Path) -> None:
    store_path = tmp_path / "s"
    ckstore.open(store_path).close()
    db = store_path / "catalog.db"
    command.downgrade(_cfg(db), "base")
    with pytest.raises(ckstore.SchemaVersionError):
        ckstore.open(store_path)
    res = CliRunner().invoke(main, ["--store", str(store_path), "db", "upgrade"])
    assert res.exit_code == 0, res.output
    assert "upgraded" in res.output
    s = ckstore.open(store_path, run="r")
    s.commit(1, {0: {"m": {"w": torch.ones(2)}}})
    res = CliRunner().invoke(main, ["--store", str(store_path), "db", "upgrade"])
    assert "already at schema revision" in res.output


def test_a_catalog_of_revision_0001_with_checkpoints_upgrades_to_delta_chunks(tmp_path: Path) -> None:
    store_path = tmp_path / "s"
    s = ckstore.open(store_path, run="r", chunk_size=64 * 1024)
    w = torch.randn(40_000)
    s.commit(1, {0: {"m": {"w": w}}})
    s.close()
    db = store_path / "catalog.db"
    command.downgrade(_cfg(db), "0001")  # the schema before delta chunks, its rows kept
    assert catalog_tools.scalar(db, "SELECT version_num FROM alembic_version") == "0001"
    with pytest.raises(ckstore.SchemaVersionError, match="needs 0002"):
        ckstore.open(store_path)
    res = CliRunner().invoke(main, ["--store", str(store_path), "db", "upgrade"])
    assert res.exit_code == 0, res.output
    s = ckstore.open(store_path, run="r", delta_chain=2)
    assert torch.equal(s.checkout(1)[0]["m"]["w"], w)
    s.commit(1, {0: {"m": {"w": w}}}, replace=True)  # the store object's base for step 2
    w2 = w + 1e-4
    s.commit(2, {0: {"m": {"w": w2}}})
    assert catalog_tools.scalar(db, "SELECT count(*) FROM chunks WHERE codec = 3") > 0
    assert torch.equal(s.checkout(2)[0]["m"]["w"], w2)
    assert s.fsck(deep=True).ok


def test_a_postgresql_catalog_of_revision_0001_upgrades_to_delta_chunks(tmp_path: Path, pg_catalog_url: str) -> None:
    store_path = tmp_path / "s"
    s = ckstore.open(store_path, run="r", catalog=pg_catalog_url, chunk_size=64 * 1024)
    w = torch.randn(40_000)
    s.commit(1, {0: {"m": {"w": w}}})
    s.close()
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", pg_catalog_url.replace("%", "%%"))
    command.downgrade(cfg, "0001")
    with pytest.raises(ckstore.SchemaVersionError, match="needs 0002"):
        ckstore.open(store_path)
    res = CliRunner().invoke(main, ["--store", str(store_path), "db", "upgrade"])
    assert res.exit_code == 0, res.output
    s = ckstore.open(store_path, run="r", delta_chain=2)
    s.commit(1, {0: {"m": {"w": w}}}, replace=True)
    s.commit(2, {0: {"m": {"w": w + 1e-4}}})
    with s.catalog.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM chunks WHERE codec = 3")).scalar()
    assert torch.equal(s.checkout(2)[0]["m"]["w"], w + 1e-4)
    assert s.fsck(deep=True).ok
    s.close()
