"""A store's own settings, kept in ``ckstore.json`` at the root of its blob store.

Recorded once when the store is created, so ``ckstore.open(location)`` needs nothing else. The
catalog URL is kept as given and may refer to an environment variable as its password
(``${PGPASSWORD}``, ``${CKSTORE_…}``); a literal password is refused, so secrets never land in the
store. The rules for catalog URLs live in :mod:`ckstore.urls`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any

from .errors import StoreConfigError
from .urls import check_no_secret, check_storable
from .urls import expand_given as expand

__all__ = [
    "StoreConfig",
    "CONFIG_KEY",
    "FORMAT_VERSION",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PACK_SIZE",
    "MAX_DELTA_CHAIN",
    "SETTINGS",
    "check_setting_names",
    "check_setting_types",
    "check_no_secret",
    "expand",
]

CONFIG_KEY = "ckstore.json"
FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
DEFAULT_PACK_SIZE = 64 * 1024 * 1024
#: the most deltas a reader decodes through to reach a chunk that is no delta (a writer's chains
#: are as long as ``ckstore.open(..., delta_chain=N)`` says, at most this); a longer chain is
#: refused as damaged
MAX_DELTA_CHAIN = 16
#: what ``ckstore.open``/``ckstore.init`` take as a new store's settings (the catalog apart); the
#: format version and creation time are the store's own
SETTINGS = ("chunk_size", "pack_size", "compression_level", "lease_seconds")


def check_setting_names(settings: Mapping[str, Any]) -> None:
    """Refuse a keyword that is no store setting (a misspelt ``chunk_size`` would otherwise be
    ignored where the store exists), naming it and the settings there are."""
    unknown = sorted(k for k in settings if k not in SETTINGS)
    if unknown:
        raise StoreConfigError(
            f"unknown store setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"a new store takes {', '.join(SETTINGS)}"
        )


def check_setting_types(values: Mapping[str, Any]) -> None:
    """Refuse a setting of the wrong type (a str, a bool, a float where an int belongs), naming
    it; the ranges are :meth:`StoreConfig.validate`'s."""
    for name, value in values.items():
        if name in ("format_version", "chunk_size", "pack_size", "compression_level"):
            if not _whole(value):
                raise StoreConfigError(f"{name} must be an int, got {value!r}")
        elif name == "lease_seconds":
            if not (_whole(value) or isinstance(value, float)) or not math.isfinite(value):
                raise StoreConfigError(f"lease_seconds must be a number of seconds, got {value!r}")
        elif name == "created_at" and not isinstance(value, str):
            raise StoreConfigError(f"created_at must be a string, got {value!r}")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        """Check the settings. A catalog URL read back from a store is checked when it is used
        (:func:`ckstore.urls.expand_stored`), so ``--catalog`` still opens a store whose recorded
        URL is refused."""
        check_setting_types(asdict(self))
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
        if self.catalog is not None and not isinstance(self.catalog, str):
            raise StoreConfigError(f"catalog must be a URL string or null, got {type(self.catalog).__name__}")
        return self

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> StoreConfig:
        try:
            obj: dict[str, Any] = json.loads(data)
            known = {k: v for k, v in obj.items() if k in cls.__dataclass_fields__}
            return cls(**known).validate()
        except (ValueError, TypeError, AttributeError) as e:
            raise StoreConfigError(f"{where}/{CONFIG_KEY} is not a valid ckstore config: {e}") from e

    @classmethod
    def new(cls, catalog: str | None = None, **settings: Any) -> StoreConfig:
        check_setting_names(settings)
        given = {k: v for k, v in settings.items() if v is not None}
        if catalog is not None:
            given["catalog"] = catalog
        new = replace(cls(), created_at=datetime.now(timezone.utc).isoformat(), **given).validate()
        if new.catalog:
            check_storable(new.catalog)
        return new
