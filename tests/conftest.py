from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# the conformance suites live outside test_*.py files: show their failed asserts' values too
pytest.register_assert_rewrite("conformance")

import ckstore  # noqa: E402

pytest_plugins = ["services"]  # PostgreSQL and S3 servers (tests/services.py)


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> ckstore.Store:
    s = ckstore.open(store_path, run="exp", chunk_size=64 * 1024, pack_size=1024 * 1024)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CKSTORE_STORE", "CKSTORE_CATALOG", "CKSTORE_RUN"):
        monkeypatch.delenv(name, raising=False)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
