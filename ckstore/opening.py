"""Opening and creating stores: where the catalog is, the store's recorded settings, and the
race-free creation of a new store's config.

    store = ckstore.open("ckpts", run="exp1")                      # a folder + SQLite inside it
    store = ckstore.open("s3://bucket/ckpts", catalog="postgresql+psycopg://db/ckpts")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .blobstore import BlobExistsError, BlobNotFoundError, BlobStore, is_local_url, open_blobstore
from .catalog import Catalog, describe_database_error
from .catalog._engine import check_schema
from .config import CONFIG_KEY, StoreConfig, check_setting_names, check_setting_types
from .errors import AlreadyExistsError, CatalogError, StoreConfigError
from .store import Store
from .urls import check_storable, expand_given, expand_stored, parse, redact, scrub

__all__ = ["open", "init", "read_config", "catalog_url"]


def read_config(blobs: BlobStore) -> StoreConfig | None:
    try:
        data = blobs.read(CONFIG_KEY)
    except BlobNotFoundError:
        return None
    return StoreConfig.from_bytes(data, blobs.url)


def catalog_url(location: str, blobs: BlobStore, config: StoreConfig, catalog: str | None) -> str:
    """The catalog URL to connect to, expanded: ``catalog`` as the user gave it, else the URL the
    store records, under the stricter rule for URLs read from a store (see :mod:`ckstore.urls`)."""
    if catalog:
        return expand_given(catalog)
    if config.catalog:
        return expand_stored(config.catalog, location)
    if not blobs.is_local:
        raise StoreConfigError(
            f"store {location} has no catalog URL recorded; an object-store location needs a shared "
            f"catalog, e.g. `ckstore init {location} --catalog postgresql+psycopg://HOST/DB`"
        )
    return f"sqlite:///{os.path.join(getattr(blobs, 'root'), 'catalog.db')}"


def open(  # noqa: A001 - ckstore.open mirrors the builtin on purpose
    location: str | os.PathLike[str],
    *,
    catalog: str | None = None,
    run: str | None = None,
    create: bool = True,
    workers: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    delta_chain: int = 0,
    delta_memory: int | None = None,
    recycle_bytes: int | None = None,
    **settings: Any,
) -> Store:
    """Open (or create) the store at ``location``: a local path or any fsspec URL.

    ``catalog`` is an SQLAlchemy URL; a local store defaults to SQLite inside its folder, and a
    store remembers the catalog it was created with (an object-store location needs one, e.g.
    PostgreSQL). ``storage_options`` go to fsspec (endpoint, credentials, botocore
    ``config_kwargs``); they are never written anywhere. ``settings`` (``chunk_size``,
    ``pack_size``, ``compression_level``, ``lease_seconds``) apply when the store is created.

    ``delta_chain`` (0: off) makes this store object's commits write a changed chunk as its XOR
    with the same chunk of its previous commit, where that is smaller (15% fewer bytes for a
    model and optimizer state one training step apart; for jobs that checkpoint every step or
    so), through chains of at most that many deltas; ``delta_memory`` bounds the bytes of the
    previous commit kept in memory for it (1 GiB by default). Any ckstore reads deltas.

    ``workers``: the threads this store object hashes, encodes and reads on. By default twice
    the cores the process may run on (4 to 16), or, where a launcher says that several ranks
    share the machine's cores (``LOCAL_WORLD_SIZE``, ``LOCAL_SIZE``, ...), twice each one's share,
    at least 2 (docs/distributed.md, "Threads per rank").

    ``recycle_bytes`` (local folders) bounds the bytes of pack files this store object's gc
    releases that are kept in the store's ``tmp/`` for later commits to write over instead of
    deleted (256 MiB by default; 0: delete them, and let gc delete those already kept). Writing
    over a file costs the disk less than a fresh one; ``ckstore gc`` opens with 0.
    """
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise StoreConfigError(f"workers must be a number of threads (an int >= 1) or None, got {workers!r}")
    if recycle_bytes is not None:
        _check_recycle_bytes(recycle_bytes, _location(location))
    store = _open(_location(location), catalog, run, create, False, workers, storage_options, settings)
    if recycle_bytes is not None and store.blobs.is_local:
        store.blobs.recycle_bytes = recycle_bytes
    if delta_chain or delta_memory is not None:
        try:
            store.write_deltas(delta_chain, delta_memory)
        except BaseException:
            store.close()
            raise
    return store


def _check_recycle_bytes(recycle_bytes: object, location: str) -> None:
    if not isinstance(recycle_bytes, int) or isinstance(recycle_bytes, bool) or recycle_bytes < 0:
        raise StoreConfigError(f"recycle_bytes must be a number of bytes (an int >= 0), got {recycle_bytes!r}")
    if recycle_bytes and not is_local_url(location):
        raise StoreConfigError(
            f"recycle_bytes applies to local folders; {redact(location)} is an object store, which "
            "deletes the packs gc releases"
        )


def _open(
    loc: str,
    catalog: str | None,
    run: str | None,
    create: bool,
    exclusive: bool,
    workers: int | None,
    storage_options: Mapping[str, Any] | None,
    settings: Mapping[str, Any],
) -> Store:
    check_setting_names(settings)
    if catalog is not None and not isinstance(catalog, str):
        raise StoreConfigError(f"catalog must be an SQLAlchemy URL (a string) or None, got {type(catalog).__name__}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise StoreConfigError(
            f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}"
        )
    blobs = open_blobstore(loc, **dict(storage_options or {}))
    hint = f"ckstore --store {loc} db upgrade"
    config = read_config(blobs)
    if config is not None:
        if exclusive:
            raise AlreadyExistsError(f"a ckstore store already exists at {loc}")
        _check_settings(loc, config, settings)
        cat = _existing_catalog(loc, blobs, config, catalog, create, hint)
        return Store(loc, blobs, cat, config, run=run, workers=workers)
    if not create:
        raise StoreConfigError(f"no ckstore store at {loc} (create one with `ckstore init {loc}`)")
    if catalog:
        check_storable(catalog)
    if not blobs.is_local and not catalog:
        raise StoreConfigError(
            f"an object-store location needs a shared catalog: ckstore.open({loc!r}, "
            "catalog='postgresql+psycopg://HOST/DB')"
        )
    new = StoreConfig.new(catalog=catalog, **settings)
    if blobs.is_local and not catalog:  # the folder its SQLite catalog goes in (blobs make theirs on first write)
        os.makedirs(getattr(blobs, "root"), exist_ok=True)
    cat = Catalog(catalog_url(loc, blobs, new, catalog), upgrade_hint=hint)
    try:
        config = _create_config(loc, blobs, cat, new, settings, exclusive)
    except BaseException:
        cat.close()
        raise
    return Store(loc, blobs, cat, config, run=run, workers=workers)


def _existing_catalog(
    loc: str, blobs: BlobStore, config: StoreConfig, catalog: str | None, create: bool, hint: str
) -> Catalog:
    """The catalog of the existing store at ``loc``, its schema checked. A missing (or empty)
    catalog is made afresh only with ``create`` and only where the user named it or it is the
    folder's own SQLite (a lost one, for :meth:`Store.recover` to rebuild); a URL read from the
    store's config, and any catalog opened with ``create=False``, is never created: that is a
    :class:`StoreConfigError` naming the catalog and the store, and nothing is written."""
    url = catalog_url(loc, blobs, config, catalog)
    if create and (catalog or not config.catalog):
        return Catalog(url, upgrade_hint=hint)
    if _missing_sqlite_file(url):
        raise _no_catalog(url, loc, "does not exist")
    cat = Catalog(url, upgrade_hint=hint, check=False)
    try:
        try:
            cat.is_empty()  # reads the tables every schema revision has
        except Exception as e:  # noqa: BLE001 - a missing table is the driver's own error
            if isinstance(e, CatalogError) and cat.dialect != "sqlite":
                raise  # the server is unreachable: that error says so
            if _revision(cat) is None:
                cause = e.__cause__ if isinstance(e, CatalogError) and e.__cause__ is not None else e
                reason = scrub(describe_database_error(cause) or str(cause))
                raise _no_catalog(url, loc, f"has no ckstore schema or cannot be read ({reason})") from e
        check_schema(cat.engine, hint)  # tables there: verifies their revision, creates nothing
    except BaseException:
        cat.close()
        raise
    return cat


def _revision(cat: Catalog) -> str | None:
    """The catalog's schema revision; None when it has none, or cannot be read at all."""
    try:
        return cat.revisions()[0]
    except Exception:  # noqa: BLE001 - a file that is no database, say: the caller names the first error
        return None


def _missing_sqlite_file(url: str) -> bool:
    """Whether ``url`` is an SQLite file that does not exist or is empty (connecting would make it)."""
    parsed = parse(url)
    path = parsed.database
    if not parsed.drivername.startswith("sqlite") or not path or path == ":memory:" or "uri" in parsed.query:
        return False
    return not os.path.isfile(path) or os.path.getsize(path) == 0


def _no_catalog(url: str, loc: str, what: str) -> StoreConfigError:
    return StoreConfigError(
        f"the catalog {redact(url)} of store {loc} {what}; opening an existing store never creates "
        f"its catalog. If it was lost, rebuild it from the store: `ckstore --store {loc} recover` "
        "(with --catalog URL for another database); if the store's config names the wrong one, "
        "pass the right one with --catalog (catalog= in Python)"
    )


def _check_settings(loc: str, config: StoreConfig, settings: Mapping[str, Any]) -> None:
    check_setting_types({k: v for k, v in settings.items() if v is not None})
    changed = {k: v for k, v in settings.items() if v is not None and getattr(config, k) != v}
    if changed:
        raise StoreConfigError(
            f"store {loc} was created with {', '.join(f'{k}={getattr(config, k)!r}' for k in changed)}; "
            "these settings are fixed when a store is created"
        )


def _create_config(
    loc: str, blobs: BlobStore, cat: Catalog, new: StoreConfig, settings: Mapping[str, Any], exclusive: bool
) -> StoreConfig:
    """Write a new store's config, exclusively: when another process created the store first,
    its config wins (and must agree with ``settings``), or ``init`` fails."""

    def raced() -> StoreConfig | None:
        other = read_config(blobs)
        if other is not None:
            if exclusive:
                raise AlreadyExistsError(f"a ckstore store already exists at {loc}")
            _check_settings(loc, other, settings)
        return other

    if new.catalog and not cat.is_empty():
        other = raced()
        if other is not None:
            return other
        raise StoreConfigError(
            f"catalog {redact(cat.url)} already records another store's checkpoints; every store needs a "
            "catalog of its own (a new database, or a PostgreSQL schema via "
            "?options=-csearch_path%3DNAME)"
        )
    try:
        blobs.put(CONFIG_KEY, new.to_bytes(), exclusive=True)
        return new
    except BlobExistsError:
        other = raced()
        if other is None:  # pragma: no cover - the winner's object vanished again
            raise
        return other


def init(
    location: str | os.PathLike[str],
    *,
    catalog: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **settings: Any,
) -> Store:
    """Create a store (an error if one exists at ``location``)."""
    return _open(_location(location), catalog, None, True, True, None, storage_options, settings)


def _location(location: object) -> str:
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str) or not location:
        raise StoreConfigError(f"a store's location is a path or an fsspec URL (a string), got {location!r}")
    return location
