"""Lock files: one file per thing held (a port, a node of a run directory), locked with ``flock`` by the one
process that holds it, removed when it lets go -- with no window in which two processes both believe they hold it.

A process that opened the file just before its holder removed it would lock an inode no longer at the path, while a
third process creates and locks a new file there: :func:`lock_file` checks, once locked, that its descriptor is still
the file at the path, and opens it again if not. :func:`unlock_file` removes the path while the lock is held.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["LOCK_ATTEMPTS", "HeldLocks", "lock_file", "unlock_file"]

log = logging.getLogger(__name__)

LOCK_ATTEMPTS = 8
"""How often :func:`lock_file` opens a lock file again after the file it locked was removed or replaced."""


def lock_file(path: Path) -> int | None:
    """A descriptor of ``path`` (created if need be), exclusively locked and still the file at the path; None when
    another process holds it (or, after :data:`LOCK_ATTEMPTS` removed files in a row, may hold it), or when it is
    another user's file this user may not open. Never blocks."""
    for _ in range(LOCK_ATTEMPTS):
        try:
            fd = _open_lock_file(path)
        except PermissionError:  # another user's lock file this user may not open: not ours to take
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                return None
            raise
        if _is_file_at(fd, path):
            return fd
        os.close(fd)  # its holder removed it after we opened it: another process may lock the new file
        log.debug("lock file %s was removed or replaced while it was being locked; opening it again", path)
    return None


def unlock_file(fd: int, path: Path) -> None:
    """Remove ``path`` while ``fd`` still holds its lock (when it is still that file), then close ``fd``.

    A file another user created stays (a sticky temporary directory lets only its owner remove it)."""
    try:
        if _is_file_at(fd, path):
            os.unlink(path)
    except OSError as err:
        log.debug("cannot remove the lock file %s: %s", path, err)
    finally:
        os.close(fd)


def _open_lock_file(path: Path) -> int:
    """Open (creating it if need be) a lock file, read-only: ``flock`` needs no more, so a lock file another user's
    launcher left behind (mode 0644 under the usual umask) can still be locked."""
    return os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)


def _is_file_at(fd: int, path: Path) -> bool:
    """True when ``fd`` is the file ``path`` names now (not removed, not replaced by another file)."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


class HeldLocks:
    """Lock files held by this process (``handles``: (descriptor, path) pairs of :func:`lock_file`) until
    :meth:`release`, or the end of a ``with`` block."""

    def __init__(self, handles: Sequence[tuple[int, Path]]) -> None:
        self._handles = list(handles)

    def release(self) -> None:
        """Remove, unlock and close every lock file (idempotent): what they held is free for other processes."""
        while self._handles:
            unlock_file(*self._handles.pop())

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
