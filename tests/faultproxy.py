"""A fault-injecting HTTP proxy in front of an S3-compatible server, for the tests.

:class:`FaultProxy` is a real socket server on 127.0.0.1 (a thread of the test process) that
forwards every request to the upstream server (moto) and records it. A test points a store's
``endpoint_url`` at :attr:`FaultProxy.endpoint` and then

* injects faults: :meth:`FaultProxy.fail` answers the next matching requests with an HTTP error
  (``503 SlowDown``, ``500 InternalError``, ``403 InvalidAccessKeyId``, …) or resets the
  connection, without forwarding them;
* counts: :attr:`FaultProxy.requests` lists every request seen (operation, key, status);
  :meth:`FaultProxy.count` filters them; :attr:`FaultProxy.most_in_flight` is the largest number
  of matching requests ever in flight at once;
* holds requests: :meth:`FaultProxy.hold` keeps matching requests waiting until as many are in
  flight at once as asked, which proves concurrency without measuring time;
* reports when multipart uploads started: moto answers every ``ListMultipartUploads`` with a
  fixed date in 2010; the proxy rewrites each upload's ``Initiated`` to the time it saw the
  upload created (as S3 does), or to a time the test sets with :meth:`FaultProxy.set_started`.

Paths are S3 path-style (``/bucket/key``), which botocore uses for an IP endpoint.
"""

from __future__ import annotations

import http.client
import re
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FaultProxy", "Request", "RESET"]

#: a fault that resets the connection instead of answering
RESET = 0

_ERROR_CODES = {
    403: "InvalidAccessKeyId",
    404: "NoSuchKey",
    429: "TooManyRequests",
    500: "InternalError",
    503: "SlowDown",
}
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection", "expect"}
_OWN = {"server", "date"}  # the proxy's own response sends these


@dataclass(frozen=True, slots=True)
class Request:
    """One request the proxy saw, and what it answered (``0`` for a reset connection)."""

    op: str
    method: str
    bucket: str
    key: str
    query: str
    status: int
    at: float  # when the request arrived (time.monotonic())


def _operation(method: str, key: str, query: dict[str, list[str]]) -> str:
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPart"
        return "PutObject" if key else "CreateBucket"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        return "DeleteObjects" if "delete" in query else "Post"
    if method == "DELETE":
        if "uploadId" in query:
            return "AbortMultipartUpload"
        return "DeleteObject" if key else "DeleteBucket"
    if method == "HEAD":
        return "HeadObject" if key else "HeadBucket"
    if method == "GET":
        if "uploads" in query:
            return "ListMultipartUploads"
        if "uploadId" in query:
            return "ListParts"
        return "GetObject" if key else "ListObjects"
    return method


@dataclass
class _Fault:
    match: Callable[[Request], bool]
    status: int
    code: str
    times: int


@dataclass
class _Hold:
    match: Callable[[Request], bool]
    until: int
    timeout: float
    released: threading.Event = field(default_factory=threading.Event)


def _matcher(op: str | None, key: str | None, query: str | None = None) -> Callable[[Request], bool]:
    def match(r: Request) -> bool:
        return (
            (op is None or r.op == op)
            and (key is None or key in r.key)
            and (query is None or query in r.query.split("&"))
        )

    return match


class FaultProxy:
    """Forwards to ``upstream`` (``http://host:port``); see the module docstring."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Condition()
        self._faults: list[_Fault] = []
        self._holds: list[_Hold] = []
        self._in_flight: dict[int, int] = {}  # id(hold) -> requests in flight
        self._most: dict[int, int] = {}
        self._started: dict[str, float] = {}
        self.requests: list[Request] = []
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        with self._lock:
            for h in self._holds:
                h.released.set()
            self._lock.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what a test sets up ------------------------------------------------------------------
    def fail(self, status: int, *, op: str | None = None, key: str | None = None, query: str | None = None,
             times: int = 1, code: str | None = None) -> None:  # fmt: skip
        """Answer the next ``times`` requests of ``op`` (on a key containing ``key``, with
        ``query`` among their query parameters, e.g. ``"partNumber=2"``) with ``status`` and an
        S3 error ``code``, or reset their connection (``status=RESET``)."""
        match = _matcher(op, key, query)
        with self._lock:
            self._faults.append(_Fault(match, status, code or _ERROR_CODES.get(status, "Error"), times))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    @contextmanager
    def hold(self, until: int, *, op: str | None = None, key: str | None = None,
             timeout: float = 120.0) -> Iterator[Callable[[], int]]:  # fmt: skip
        """Keep matching requests waiting until ``until`` of them are in flight at once, then let
        every one through. Yields a function giving the most ever in flight at once. (``timeout``
        only keeps a broken client from hanging the test: the test then fails on the count.)"""
        h = _Hold(_matcher(op, key), until, timeout)
        with self._lock:
            self._holds.append(h)
            self._in_flight[id(h)] = 0
            self._most[id(h)] = 0
        try:
            yield lambda: self._most[id(h)]
        finally:
            with self._lock:
                h.released.set()
                self._holds.remove(h)
                self._lock.notify_all()

    def set_started(self, upload_id: str, when: float) -> None:
        """Report multipart upload ``upload_id`` as started at ``when`` (a Unix time)."""
        with self._lock:
            self._started[upload_id] = when

    def count(self, op: str | None = None, key: str | None = None, status: int | None = None) -> int:
        match = _matcher(op, key)
        with self._lock:
            return sum(1 for r in self.requests if match(r) and (status is None or r.status == status))

    def seen(self, op: str | None = None, key: str | None = None) -> list[Request]:
        match = _matcher(op, key)
        with self._lock:
            return [r for r in self.requests if match(r)]

    # -- what the handler calls -----------------------------------------------------------------
    def _fault_for(self, req: Request) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.times > 0 and f.match(req):
                    f.times -= 1
                    return f
        return None

    def _enter_holds(self, req: Request) -> list[_Hold]:
        with self._lock:
            mine = [h for h in self._holds if h.match(req)]
            for h in mine:
                self._in_flight[id(h)] += 1
                self._most[id(h)] = max(self._most[id(h)], self._in_flight[id(h)])
                if self._in_flight[id(h)] >= h.until:
                    h.released.set()
            self._lock.notify_all()
        for h in mine:
            h.released.wait(h.timeout)
        return mine

    def _leave_holds(self, holds: list[_Hold]) -> None:
        with self._lock:
            for h in holds:
                if id(h) in self._in_flight:
                    self._in_flight[id(h)] -= 1

    def _record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def _rewrite(self, op: str, body: bytes, sent_at: float) -> bytes:
        if op == "CreateMultipartUpload":
            m = re.search(rb"<UploadId>([^<]+)</UploadId>", body)
            if m:
                with self._lock:
                    self._started.setdefault(m.group(1).decode(), sent_at)
            return body
        if op != "ListMultipartUploads":
            return body

        def one(m: re.Match[bytes]) -> bytes:
            upload = m.group(0)
            uid = re.search(rb"<UploadId>([^<]+)</UploadId>", upload)
            with self._lock:
                when = self._started.get(uid.group(1).decode()) if uid else None
            if when is None:
                return upload
            stamp = datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z").encode()
            return re.sub(rb"<Initiated>[^<]*</Initiated>", b"<Initiated>" + stamp + b"</Initiated>", upload)

        return re.sub(rb"<Upload>.*?</Upload>", one, body, flags=re.S)


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        proxy = self.owner
        url = urlsplit(self.path)
        path = unquote(url.path).lstrip("/")
        bucket, _, key = path.partition("/")
        query = parse_qs(url.query, keep_blank_values=True)
        op = _operation(self.command, key, query)
        body = self._body()
        arrived = time.monotonic()
        probe = Request(op, self.command, bucket, key, url.query, -1, arrived)
        fault = proxy._fault_for(probe)
        if fault is not None:
            proxy._record(Request(op, self.command, bucket, key, url.query, fault.status, arrived))
            if fault.status == RESET:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            err = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code>'
                f"<Message>injected by the test proxy</Message><RequestId>proxy</RequestId></Error>"
            ).encode()
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(err) if self.command != "HEAD" else 0))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(err)
            return
        holds = proxy._enter_holds(probe)
        try:
            sent_at = time.time()
            conn = http.client.HTTPConnection(*proxy._upstream, timeout=300)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP | _OWN]
                status = resp.status
            finally:
                conn.close()
        finally:
            proxy._leave_holds(holds)
        data = proxy._rewrite(op, data, sent_at)
        proxy._record(Request(op, self.command, bucket, key, url.query, status, arrived))
        self.send_response(status)
        for k, v in out_headers:
            if k.lower() == "content-length" and self.command != "HEAD":
                continue
            self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
