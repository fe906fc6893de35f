"""File operations a local folder's writes, its stale-temp sweep and its recycled pack files
share: ``flock`` that says when a file system has none, the check that a name still holds an open
file, and the removal of a file only while holding its lock."""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable

__all__ = ["fsync_dir", "lock", "same_file", "unlink", "with_lock"]


def lock(fd: int, *, wait: bool) -> bool:
    """Take an exclusive ``flock`` on ``fd``: True when held, False on a file system without
    locks; raises :class:`BlockingIOError` when another holds it and ``wait`` is False."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF):
            return False
        raise
    return True


def same_file(path: str, fd: int) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def with_lock(path: str, action: Callable[[], None]) -> bool:
    """Run ``action`` holding ``path``'s lock, if no live writer holds it and ``path`` still names
    the file locked; returns whether it ran."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except PermissionError:  # another user's file: a read-only descriptor locks it too (flock)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
    except OSError:  # gone, a link (ELOOP) or a folder (EISDIR): not a temp file to remove
        return False
    try:
        try:
            lock(fd, wait=False)
        except BlockingIOError:
            return False  # a live writer holds it
        if not same_file(path, fd):
            return False
        try:
            action()
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    """Remove ``path``; a file already gone is no error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
