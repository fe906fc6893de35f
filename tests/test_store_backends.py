"""Every store suite on every catalog and blob store pair."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from conformance import STORE_SUITES, StoreSpec
from services import AzuriteEmulator, GcsEmulator, S3Server


class TestSQLite(*STORE_SUITES):  # type: ignore[misc]
    """A local folder with its SQLite catalog file inside."""

    @pytest.fixture
    def spec(self, tmp_path: Path) -> StoreSpec:
        return StoreSpec(str(tmp_path / "store"))


@pytest.mark.postgres
class TestPostgres(*STORE_SUITES):  # type: ignore[misc]
    """A local (or shared) folder with a PostgreSQL catalog."""

    @pytest.fixture
    def spec(self, tmp_path: Path, pg_catalog_url: str) -> StoreSpec:
        return StoreSpec(str(tmp_path / "store"), pg_catalog_url)


@pytest.mark.postgres
@pytest.mark.s3
class TestS3Postgres(*STORE_SUITES):  # type: ignore[misc]
    """An S3 bucket with a PostgreSQL catalog: the shared, multi-node setup."""

    @pytest.fixture
    def spec(self, s3_server: S3Server, s3_bucket: str, pg_catalog_url: str) -> StoreSpec:
        return StoreSpec(f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}", pg_catalog_url, s3_server.storage_options())


@pytest.mark.postgres
@pytest.mark.gcs
class TestGcsPostgres(*STORE_SUITES):  # type: ignore[misc]
    """A Google Cloud Storage bucket (its emulator) with a PostgreSQL catalog."""

    @pytest.fixture
    def spec(self, gcs_emulator: GcsEmulator, gcs_bucket: str, pg_catalog_url: str) -> StoreSpec:
        return StoreSpec(f"gs://{gcs_bucket}/{uuid.uuid4().hex[:8]}", pg_catalog_url, gcs_emulator.storage_options())


@pytest.mark.postgres
@pytest.mark.azure
class TestAzurePostgres(*STORE_SUITES):  # type: ignore[misc]
    """An Azure Blob Storage container (Azurite) with a PostgreSQL catalog."""

    @pytest.fixture
    def spec(self, azurite: AzuriteEmulator, az_container: str, pg_catalog_url: str) -> StoreSpec:
        return StoreSpec(f"az://{az_container}/{uuid.uuid4().hex[:8]}", pg_catalog_url, azurite.storage_options())


class TestMemory(*STORE_SUITES):  # type: ignore[misc]
    """fsspec's in-memory file system with a SQLite catalog: a whole store inside one process."""

    @pytest.fixture
    def spec(self, tmp_path: Path) -> StoreSpec:
        return StoreSpec(f"memory://ckstore-{uuid.uuid4().hex[:12]}/store", f"sqlite:///{tmp_path / 'catalog.db'}")
