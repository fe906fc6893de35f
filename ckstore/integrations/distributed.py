"""Collective commit and checkout over torch.distributed.

Each rank chunks, hashes and writes its own chunks straight to the shared blob store; rank 0
alone talks to the catalog after gathering the other ranks' manifests.
"""

from __future__ import annotations

from typing import Any

__all__ = ["active_group", "group_rank", "commit_collective"]


def active_group(process_group: Any = None) -> Any:
    """The process group a call should be collective over, or None for a single-process call."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise RuntimeError("process_group was given but torch.distributed is not initialized")
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if process_group is None and dist.get_world_size(group) == 1:
        return None
    return group


def group_rank(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_rank(group))


def commit_collective(store: Any, group: Any, step: int, rank_states: Any, metrics: Any, **kw: Any) -> Any:
    raise NotImplementedError("collective commit is not implemented yet")
