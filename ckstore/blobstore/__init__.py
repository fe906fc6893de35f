"""The blob store: immutable bytes under opaque keys, on a local folder or any fsspec file system.

The contract every backend keeps is written once, on :class:`BlobStore` (``_base``). One module
per backend: ``_local`` (a folder, temp file + fsync + rename) and ``_fsspec`` (object stores:
single puts or multipart uploads, conditional writes); ``_retry`` is the bounded retry loop.
A folder's recycled pack files are ``_recycle``; the file locks and removals both use, ``_fileops``.
"""

from __future__ import annotations

from typing import Any

from ..errors import StoreConfigError
from ._base import (
    OWNED_PREFIXES,
    BlobExistsError,
    BlobInfo,
    BlobNotFoundError,
    BlobStats,
    BlobStore,
    NotOwnedError,
)
from ._fsspec import S3_CONFIG_DEFAULTS, FsspecBlobStore
from ._local import LocalBlobStore

__all__ = [
    "BlobNotFoundError",
    "BlobExistsError",
    "NotOwnedError",
    "OWNED_PREFIXES",
    "BlobInfo",
    "BlobStats",
    "BlobStore",
    "LocalBlobStore",
    "FsspecBlobStore",
    "S3_CONFIG_DEFAULTS",
    "open_blobstore",
    "is_local_url",
]


def is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def open_blobstore(url: str, **storage_options: Any) -> BlobStore:
    """The blob store for a local path or fsspec URL.

    A local path (or ``file://`` URL) is a :class:`LocalBlobStore`, which suits shared file
    systems mounted on every node too; any other URL is a :class:`FsspecBlobStore` with
    ``storage_options``.
    """
    if is_local_url(url):
        if storage_options:
            raise StoreConfigError(f"storage options apply to object stores, not to the local folder {url}")
        path = url[len("file://") :] if url.startswith("file://") else url
        return LocalBlobStore(path)
    return FsspecBlobStore(url, **storage_options)

