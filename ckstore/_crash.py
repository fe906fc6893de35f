"""Deterministic kill points in the commit protocol, for crash tests.

``CKSTORE_CRASH_AT=<point>`` (or ``<point>:<rank>``) in a process's environment makes it kill
itself with SIGKILL when a commit reaches that point (on that rank only: the process's ``RANK``
environment variable, as torchrun sets it, 0 when unset). The variable is read once, when ckstore
is imported; unset, :func:`crash_point` costs one comparison. Just before the kill the process
writes ``ckstore crash point: <point>`` to its standard error, so a test can prove where it died.
An unknown point name is an error at import: a misspelt test must not pass by never crashing.

The points, in the order a commit reaches them (docs/reliability.md, "Kill points"):

``stage``, ``declare``, ``hash``, ``plan_writes``, ``write``, ``finish``
    the commit protocol's phases (:mod:`ckstore.commit.protocol`): at the end of ``stage`` and
    ``declare``, before the collective that ends ``hash``, ``plan_writes`` and ``write``, and at
    the start of ``finish``
``pack.registered``
    a pack's catalog row is recorded (or its key taken), its object not yet opened
``pack.mid``
    a pack's object has its header and at least one chunk frame written, not yet complete
    (small frames are gathered and written about a megabyte at a time)
``pack.durable``
    a pack's object is complete and durable (renamed / put), its chunk rows not yet committed
    (rank 0's last pack is made durable while ``finish``'s transaction inserts its chunk rows,
    so this point may come after ``write``, ``finish`` or ``pack.chunks_recorded``)
``pack.chunks_recorded``
    every pack's chunk rows are inserted (rank 0, in ``finish``, inside the transaction that
    makes the checkpoint visible, not yet committed), the record not yet written
``record.written``
    the checkpoint's record is written to the blob store (on a worker thread while that
    transaction runs, or first when it names many chunks; its bytes made durable while the
    packs are, the object in place only after every pack is durable); the checkpoint not yet
    visible
``finish.transaction``
    inside the transaction that makes the checkpoint visible, before its COMMIT
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "crash_point"]

POINTS = (
    "stage",
    "declare",
    "hash",
    "plan_writes",
    "pack.registered",
    "pack.mid",
    "pack.durable",
    "write",
    "finish",
    "pack.chunks_recorded",
    "record.written",
    "finish.transaction",
)

_VARIABLE = "CKSTORE_CRASH_AT"


def _armed(spec: str, rank: str) -> str | None:
    """The point this process dies at, from ``CKSTORE_CRASH_AT`` and ``RANK``; None if none."""
    if not spec:
        return None
    name, sep, want = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{_VARIABLE}={spec!r} names no crash point; the points are {', '.join(POINTS)}")
    if not sep:
        return name
    if not want.isdigit():
        raise ValueError(f"{_VARIABLE}={spec!r}: the rank after ':' must be a number")
    return name if int(want) == int(rank or "0") else None


_AT = _armed(os.environ.get(_VARIABLE, ""), os.environ.get("RANK", ""))


def crash_point(name: str) -> None:
    """Die here (SIGKILL) when ``CKSTORE_CRASH_AT`` names this point for this process."""
    if name == _AT:
        os.write(2, f"ckstore crash point: {name}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
