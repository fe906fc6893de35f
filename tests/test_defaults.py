"""The defaults the docs state, compared with the documented values (not the code's constants)."""

from __future__ import annotations

from pathlib import Path

import ckstore
from ckstore.catalog._engine import PG_CONNECT_DEFAULTS

MiB = 1024 * 1024


def test_a_new_store_has_the_documented_settings(tmp_path: Path) -> None:
    s = ckstore.open(tmp_path / "s")
    # docs/benchmarks.md: "The default chunk size, 4 MiB"; docs/backends.md: "4 × 64 MiB with the
    # default pack size"
    assert (s.config.chunk_size, s.config.pack_size) == (4 * MiB, 64 * MiB)
    s.close()
    again = ckstore.open(tmp_path / "s")  # recorded, so every later open agrees
    assert (again.config.chunk_size, again.config.pack_size) == (4 * MiB, 64 * MiB)


def test_postgres_connections_have_the_documented_connect_timeout() -> None:
    # docs/backends.md: "Connections start from PG_CONNECT_DEFAULTS (connect timeout 10 s, TCP
    # keepalives ...)"
    assert PG_CONNECT_DEFAULTS["connect_timeout"] == 10 and PG_CONNECT_DEFAULTS["keepalives"] == 1
