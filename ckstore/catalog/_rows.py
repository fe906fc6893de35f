"""Row-level building blocks of the catalog: table handles, time and batching helpers, the
identity of a committer, and the small value types the commit protocol passes around."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ._schema import Base, CheckpointRow, Chunk, ChunkRef, Entry, Metric, Pack, Run, Tag, Trash

__all__ = [
    "C", "E", "P", "K", "R", "M", "T", "RUNS", "TRASH", "TABLES",
    "utcnow", "aware", "batches", "Owner", "NewChunk", "ChunkLocation", "mark_live",
]  # fmt: skip

_BATCH = 500

_TABLES = Base.metadata.tables
C = _TABLES[CheckpointRow.__tablename__]
E = _TABLES[Entry.__tablename__]
P = _TABLES[Pack.__tablename__]
K = _TABLES[Chunk.__tablename__]
R = _TABLES[ChunkRef.__tablename__]
M = _TABLES[Metric.__tablename__]
T = _TABLES[Tag.__tablename__]
RUNS = _TABLES[Run.__tablename__]
TRASH = _TABLES[Trash.__tablename__]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def aware(dt: datetime | None) -> datetime | None:
    if dt is None:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def batches(items: Sequence[Any], n: int = _BATCH) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]



# Re-exported for modules that run set-based statements (gc, fsck, du).
TABLES = {"checkpoints": C, "entries": E, "packs": P, "chunks": K, "chunk_refs": R, "metrics": M, "tags": T, "runs": RUNS, "trash": TRASH}


# nonces of the commits this process has in flight: a pending row of this very process whose
# nonce is not here belongs to a commit that failed without cleaning up (the catalog was down)
_LIVE_NONCES: set[str] = set()
_LIVE_LOCK = threading.Lock()


def mark_live(nonce: str, alive: bool) -> None:
    with _LIVE_LOCK:
        (_LIVE_NONCES.add if alive else _LIVE_NONCES.discard)(nonce)


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
        return cls(socket.gethostname(), pid, _proc_start(pid), os.urandom(4).hex())

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
        if self.pid == os.getpid() and self.start == _proc_start(self.pid):
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


@dataclass(frozen=True, slots=True)
class NewChunk:
    digest: bytes
    offset: int
    length: int
    raw_size: int
    codec: int


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    pack_key: str
    offset: int
    length: int
    raw_size: int
    codec: int


