"""A store's own settings, kept in ``ckstore.json`` at the root of its blob store.

Recorded once when the store is created, so ``ckstore.open(location)`` needs nothing else. The
catalog URL is kept as given and may refer to environment variables (``${PGPASSWORD}``);
a literal password is refused, so secrets never land in the store.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any

from .errors import StoreConfigError

__all__ = [
    "StoreConfig",
    "CONFIG_KEY",
    "FORMAT_VERSION",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PACK_SIZE",
    "check_no_secret",
    "expand",
]

CONFIG_KEY = "ckstore.json"
FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
DEFAULT_PACK_SIZE = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoreConfig:
    format_version: int = FORMAT_VERSION
    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_size: int = DEFAULT_PACK_SIZE
    compression_level: int = 1
    lease_seconds: float = 60.0
    catalog: str | None = None  # None: SQLite file "catalog.db" inside a local store
    created_at: str = ""

    def validate(self) -> StoreConfig:
        if self.format_version != FORMAT_VERSION:
            raise StoreConfigError(
                f"store format version {self.format_version} is not supported by this ckstore (it reads "
                f"version {FORMAT_VERSION}); upgrade ckstore"
            )
        if not 4096 <= self.chunk_size <= 1 << 30:
            raise StoreConfigError(f"chunk_size must be between 4 KiB and 1 GiB, got {self.chunk_size}")
        if self.pack_size < self.chunk_size:
            raise StoreConfigError(f"pack_size ({self.pack_size}) must be at least chunk_size ({self.chunk_size})")
        if not -5 <= self.compression_level <= 22:
            raise StoreConfigError(f"compression_level must be a zstd level (-5..22), got {self.compression_level}")
        if self.lease_seconds <= 0:
            raise StoreConfigError(f"lease_seconds must be positive, got {self.lease_seconds}")
        if self.catalog:
            check_no_secret(self.catalog)
        return self

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> StoreConfig:
        try:
            obj: dict[str, Any] = json.loads(data)
            known = {k: v for k, v in obj.items() if k in cls.__dataclass_fields__}
            return cls(**known).validate()
        except (ValueError, TypeError) as e:
            raise StoreConfigError(f"{where}/{CONFIG_KEY} is not a valid ckstore config: {e}") from e

    @classmethod
    def new(cls, **settings: Any) -> StoreConfig:
        given = {k: v for k, v in settings.items() if v is not None}
        return replace(cls(), created_at=datetime.now(timezone.utc).isoformat(), **given).validate()


_ENV_REF = re.compile(r"^\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)$")


def check_no_secret(url: str) -> None:
    """Refuse a URL with a literal password; ``${VAR}`` references are fine."""
    m = re.match(r"^[a-z0-9+]+://([^/@]*)@", url)
    if not m or ":" not in m.group(1):
        return
    password = m.group(1).split(":", 1)[1]
    if password and not _ENV_REF.match(password):
        raise StoreConfigError(
            "the catalog URL holds a literal password, which ckstore would write into the store's "
            "config; refer to an environment variable instead (postgresql+psycopg://user:${PGPASSWORD}@host/db) "
            "or leave the password out and use ~/.pgpass or PGPASSWORD"
        )


_ANY_ENV_REF = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand(url: str) -> str:
    """``url`` with ``$VAR`` / ``${VAR}`` replaced from the environment; an unset one is an error."""
    missing = [a or b for a, b in _ANY_ENV_REF.findall(url) if (a or b) not in os.environ]
    if missing:
        raise StoreConfigError(
            f"the catalog URL refers to the environment variable {missing[0]}, which is not set; "
            "set it (or pass another catalog URL with --catalog / catalog=)"
        )
    return os.path.expandvars(url)
