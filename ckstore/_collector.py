"""Pauses of Python's cyclic garbage collector around work that makes many long-lived objects.

A commit or a checkout of many tensors makes a few long-lived objects per tensor (leaves, staged
views, manifest records, the tensors and dicts of the state it hands back). Left running, the
collector scans the whole heap each time the survivors reach a quarter of it: a few full
collections, each as slow as the heap is large, per call (measured on 20,000 tiny tensors: 487
collections, 17% of a commit; 758 collections, 38% of a checkout). PyTorch's DCP pauses it for
the same reason while it walks state dicts.

Who pauses it: a blocking commit and a checkout for their whole length (the caller waits for
them anyway; what they leave for the collector is collected after them); an asynchronous commit
only around its per-tensor work (flattening, staging, manifests), so that the training thread,
which goes on meanwhile, keeps its collector otherwise. Pauses nest and may overlap across
threads: the collector is enabled again when the last one ends, if it was enabled when the first
began (a program that disabled it itself keeps it disabled).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


class _CollectorPause:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._resume = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._resume:
                    gc.enable()


#: ``with collector_paused(): ...`` or ``@collector_paused()``
collector_paused = _CollectorPause()
