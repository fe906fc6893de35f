"""A TCP proxy in front of a PostgreSQL server that cuts a connection at a transaction's COMMIT,
for the tests.

:class:`PgProxy` is a real socket server on 127.0.0.1 (threads of the test process): each client
connection gets its own connection to the server, and the proxy forwards the bytes both ways,
message by message. It reads the client's side of the wire protocol (version 3: after the
startup packet, every message is one type byte and a 4-byte big-endian length that counts
itself), so it knows the statements of each connection's current transaction: the text of
simple queries (``Q``), of parsed statements (``P``) and of the prepared statements a ``B``
binds. It answers a client's SSL and GSSAPI encryption requests with "no" itself, so the
client goes on in clear text (the server is on loopback).

A test arms a cut with :meth:`PgProxy.cut_commit`: the first transaction on any connection
that ran a statement containing ``marker`` has its connection cut (both sockets shut down and
closed) when the client sends its ``COMMIT`` (a simple query, as psycopg sends it):

* ``when="before"``: the COMMIT is not forwarded; the server sees the connection drop inside
  the transaction and rolls it back;
* ``when="after"``: the COMMIT is forwarded and the server's answer awaited (read to its
  ``ReadyForQuery``), then withheld: the server committed, the client never hears of it.

:attr:`PgProxy.cut` then describes what happened (the transaction's statements, whether the
COMMIT was forwarded, the server's answer), and :attr:`PgProxy.commits` counts the COMMITs
forwarded to the server, on every connection.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

__all__ = ["PgProxy", "Cut"]

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


@dataclass
class Cut:
    """A connection the proxy cut at a COMMIT."""

    when: str  # "before" or "after" the COMMIT was forwarded
    statements: list[str]  # the statements of the transaction whose COMMIT it was
    forwarded: bool  # whether the COMMIT reached the server
    reply: list[tuple[str, bytes]] = field(default_factory=list)  # the server's withheld answer

    @property
    def server_committed(self) -> bool:
        """Whether the server answered the COMMIT with ``CommandComplete "COMMIT"``."""
        return ("C", b"COMMIT\x00") in self.reply


@dataclass
class _Armed:
    marker: str
    when: str


class PgProxy:
    """Forwards 127.0.0.1:``port`` to the PostgreSQL server at ``host``:``port``; see the module
    docstring. Use as a context manager, or call :meth:`close`."""

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._lock = threading.Lock()
        self._armed: _Armed | None = None
        self._sockets: set[socket.socket] = set()
        self._closed = False
        self.cut: Cut | None = None
        self.commits = 0  # COMMITs forwarded to the server
        self.forwarded: list[str] = []  # every statement forwarded to the server, in order
        self.connections = 0  # client connections accepted
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="pg-proxy", daemon=True)
        self._thread.start()

    @classmethod
    def in_front_of(cls, url: str) -> PgProxy:
        """A proxy in front of the server a database URL names."""
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 5432)

    def url(self, url: str) -> str:
        """``url`` (naming the proxied server) with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        user, at, _ = parts.netloc.rpartition("@")
        return urlunsplit(parts._replace(netloc=f"{user}{at}127.0.0.1:{self.port}"))

    def cut_commit(self, marker: str, when: str) -> None:
        """Cut the connection at the COMMIT of the next transaction that ran a statement
        containing ``marker``, ``"before"`` or ``"after"`` forwarding the COMMIT (once)."""
        if when not in ("before", "after"):
            raise ValueError(f"when must be 'before' or 'after', not {when!r}")
        with self._lock:
            self._armed = _Armed(marker, when)
            self.cut = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = list(self._sockets)
        _shut(self._listener)
        for s in socks:  # wakes the connection's thread, which closes its sockets itself
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=10)

    def __enter__(self) -> PgProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the connections -------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    _shut(client)
                    return
                self.connections += 1
            threading.Thread(
                target=self._serve, args=(client,), name="pg-proxy-conn", daemon=True
            ).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self._upstream, timeout=10)
        except OSError:
            _shut(client)
            return
        server.settimeout(None)
        with self._lock:
            self._sockets.update((client, server))
        try:
            _Connection(self, client, server).run()
        except OSError:
            pass  # either side went away
        finally:
            with self._lock:
                self._sockets.difference_update((client, server))
            _shut(client)
            _shut(server)

    def _take_cut(self, statements: list[str]) -> str | None:
        """``"before"``/``"after"`` when a COMMIT closing ``statements`` is to be cut (the cut is
        disarmed then), else None."""
        with self._lock:
            armed = self._armed
            if armed is None or not any(armed.marker in s for s in statements):
                return None
            self._armed = None
            return armed.when


class _Connection:
    """One client connection and its server connection."""

    def __init__(self, proxy: PgProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.prepared: dict[str, str] = {}  # statement name -> text, as the client parsed them
        self.statements: list[str] = []  # the current transaction's
        self.from_server = bytearray()

    def run(self) -> None:
        self._startup()
        from_client = bytearray()
        while True:
            ready, _, _ = select.select([self.client, self.server], [], [])
            if self.client in ready:
                data = self.client.recv(65536)
                if not data:
                    return
                from_client += data
                for kind, body, raw in _messages(from_client):
                    if not self._from_client(kind, body, raw):
                        return  # cut
            if self.server in ready:
                data = self.server.recv(65536)
                if not data:
                    return
                self.client.sendall(data)

    def _startup(self) -> None:
        """Answer encryption requests with "no"; forward the startup packet."""
        while True:
            head = _recv_exactly(self.client, 8)
            length, code = struct.unpack("!ii", head)
            rest = _recv_exactly(self.client, length - 8)
            if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                self.client.sendall(b"N")
                continue
            self.server.sendall(head + rest)
            return

    def _from_client(self, kind: str, body: bytes, raw: bytes) -> bool:
        """Forward one client message, or cut the connection at it (False)."""
        text = _statement(kind, body, self.prepared)
        if text is not None:
            word = text.strip().rstrip(";").strip().upper()
            if kind == "Q" and word == "COMMIT":
                when = self.proxy._take_cut(self.statements)
                if when is not None:
                    self._cut(when, raw)
                    return False
                self._count_commit()
            if word in ("COMMIT", "ROLLBACK"):
                self.statements = []
            else:
                self.statements.append(text)
            with self.proxy._lock:
                self.proxy.forwarded.append(text)
        self.server.sendall(raw)
        return True

    def _count_commit(self) -> None:
        with self.proxy._lock:
            self.proxy.commits += 1

    def _cut(self, when: str, commit: bytes) -> None:
        cut = Cut(when, list(self.statements), forwarded=when == "after")
        if when == "after":
            self.server.sendall(commit)
            self._count_commit()
            cut.reply = self._server_reply()
        with self.proxy._lock:  # recorded before the client can see the connection drop
            self.proxy.cut = cut
        _shut(self.client)
        _shut(self.server)

    def _server_reply(self) -> list[tuple[str, bytes]]:
        """The server's messages up to its next ReadyForQuery, read and not forwarded."""
        buf = bytearray()
        reply: list[tuple[str, bytes]] = []
        while True:
            data = self.server.recv(65536)
            if not data:
                return reply
            buf += data
            for kind, body, _ in _messages(buf):
                reply.append((kind, body))
                if kind == "Z":
                    return reply


def _messages(buf: bytearray) -> list[tuple[str, bytes, bytes]]:
    """Take every complete message off the front of ``buf``: ``(type, body, raw bytes)``."""
    out = []
    while len(buf) >= 5:
        (length,) = struct.unpack_from("!i", buf, 1)
        if len(buf) < 1 + length:
            break
        raw = bytes(buf[: 1 + length])
        del buf[: 1 + length]
        out.append((chr(raw[0]), raw[5:], raw))
    return out


def _cstring(body: bytes, at: int) -> tuple[str, int]:
    end = body.index(b"\x00", at)
    return body[at:end].decode("utf-8", "replace"), end + 1


def _statement(kind: str, body: bytes, prepared: dict[str, str]) -> str | None:
    """The statement text a client message runs or prepares (None for other messages)."""
    if kind == "Q":
        return _cstring(body, 0)[0]
    if kind == "P":
        name, at = _cstring(body, 0)
        text, _ = _cstring(body, at)
        if name:
            prepared[name] = text
        return text
    if kind == "B":
        _portal, at = _cstring(body, 0)
        name, _ = _cstring(body, at)
        return prepared.get(name) if name else None  # the unnamed statement was seen at its P
    return None


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise OSError("connection closed during startup")
        buf += data
    return bytes(buf)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
