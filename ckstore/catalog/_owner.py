"""Who is committing: the identity a pending checkpoint records, and whether that committer is
still alive."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

__all__ = ["Owner", "mark_live"]

# nonces of the commits this process has in flight: a pending row of this very process whose
# nonce is not here belongs to a commit that failed without cleaning up (the catalog was down)
_LIVE_NONCES: set[str] = set()
_LIVE_LOCK = threading.Lock()


def mark_live(nonce: str, alive: bool) -> None:
    with _LIVE_LOCK:
        (_LIVE_NONCES.add if alive else _LIVE_NONCES.discard)(nonce)


_OWN_START: tuple[int, str] | None = None  # this process's pid and start time, read once per pid


def _own_start(pid: int) -> str:
    """:func:`_proc_start` of this process (``pid``): it never changes, and a forked child, whose
    pid differs, reads its own."""
    global _OWN_START
    known = _OWN_START
    if known is None or known[0] != pid:
        known = _OWN_START = (pid, _proc_start(pid))
    return known[1]


def _proc_start(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return "0"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who is committing: host, pid, the pid's start time (against pid reuse) and a nonce."""

    host: str
    pid: int
    start: str
    nonce: str

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _own_start(pid), os.urandom(4).hex())

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}:{self.start}:{self.nonce}"

    @classmethod
    def parse(cls, s: str) -> Owner:
        host, pid, start, nonce = s.rsplit(":", 3)
        return cls(host, int(pid), start, nonce)

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}"

    def alive_here(self) -> bool | None:
        """True/False when the owner ran on this host; None when it ran elsewhere."""
        if self.host != socket.gethostname():
            return None
        if self.pid == os.getpid() and self.start == _own_start(self.pid):
            with _LIVE_LOCK:
                return self.nonce in _LIVE_NONCES
        if not os.path.exists(f"/proc/{self.pid}"):
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return _proc_start(self.pid) == self.start
