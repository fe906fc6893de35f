"""Bounded retries with exponential backoff for requests to remote stores.

One loop, here, retries every request a remote blob store makes; the client libraries under it
(botocore, s3fs) are configured not to retry on their own, so the number of attempts and the
longest wait are known: ``attempts`` tries, each bounded by the backend's timeouts, with
``base_delay * 2**i`` (jittered, at most ``max_delay``) between them.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import BlobStoreError, CkstoreError

__all__ = ["retry", "is_transient"]

T = TypeVar("T")

# HTTP answers worth another try: timeouts, throttling, server errors
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# S3 (and S3-compatible) error codes worth another try
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
# exception classes of botocore, aiohttp, fsspec and ckstore's S3 store that mean "the request did
# not get through"; matched by name so this module imports none of them
_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "WriteTimeoutError",
        "ConnectionClosedError",
        "ProxyConnectionError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ClientConnectorError",
        "ClientOSError",
        "ClientPayloadError",
        "IncompleteRead",
        "ResponseParserError",
        "FSTimeoutError",
    }
)


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is worth retrying."""
    seen: set[int] = set()
    cur: BaseException | None = error
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (ConnectionError, TimeoutError, socket.timeout)):
            return True
        if {c.__name__ for c in type(cur).__mro__} & _TRANSIENT_NAMES:
            return True
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
                return True
        status_code = getattr(cur, "code", None)
        if isinstance(status_code, int) and status_code in _TRANSIENT_STATUS:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _explain(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, PermissionError):
        text += (
            " (check the credentials the store is read with: the environment, ~/.aws or the "
            "fsspec configuration)"
        )
    return text


def retry(
    what: str,
    fn: Callable[[], T],
    *,
    attempts: int,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
) -> T:
    """Call ``fn``; retry transient failures; raise :class:`BlobStoreError` naming ``what``.

    ``FileNotFoundError``, ``FileExistsError`` and ckstore's own errors pass through untouched,
    for the caller to translate with the key it was working on.
    """
    for i in range(attempts):
        try:
            return fn()
        except (FileNotFoundError, FileExistsError, CkstoreError):
            raise
        except Exception as e:  # noqa: BLE001 - fsspec backends raise many kinds
            if not is_transient(e):
                raise BlobStoreError(f"{what} failed: {_explain(e)}") from e
            if i == attempts - 1:
                raise BlobStoreError(
                    f"{what} failed {attempts} times, the last with {_explain(e)}; is the store's "
                    "server reachable?"
                ) from e
            time.sleep(min(max_delay, base_delay * 2**i) * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")
