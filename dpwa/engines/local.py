"""``dpwa run -n N``: N nodes on this machine, on ports that no concurrent ``dpwa run -n`` takes.

A port is *reserved* by an exclusive ``flock`` on ``/tmp/dpwa-ports/<port>.lock`` (:func:`lock_dir`), held by the
launcher until its job ends (the kernel drops it when the launcher exits, however it exits), and
checked free by binding it. Ports are drawn at random from below Linux's ephemeral range
(32768-60999), where no outgoing connection is given one, so nothing else takes a reserved port
between the reservation and the node's bind.

A lock file is removed when its port is released (:meth:`PortReservation.release`): unlinked while still
locked, then closed. That opens the classic flock-and-unlink race -- B opens the file, A unlinks and closes
it, B locks the unlinked inode while C creates a new file and locks that: both would hold the port -- so a
lock only counts once the locked descriptor is still the file at the path (same ``st_dev`` and ``st_ino``);
otherwise it is dropped and the path opened again, at most :data:`LOCK_ATTEMPTS` times. A launcher killed
outright leaves its (unlocked) files behind; the next reservation of such a port removes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import random
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dpwa.config import NodeSpec

log = logging.getLogger(__name__)

__all__ = [
    "LOCAL_HOST",
    "LOCK_ATTEMPTS",
    "LOCK_DIR_ENV",
    "PORT_RANGE",
    "PortReservation",
    "local_nodes",
    "lock_dir",
    "reserve_ports",
]

LOCAL_HOST = "127.0.0.1"
LOCK_DIR_ENV = "DPWA_LOCK_DIR"
"""Where the port lock files go, when not ``/tmp/dpwa-ports`` (:func:`lock_dir`)."""
PORT_RANGE = (20000, 32767)
"""Ports ``dpwa run -n`` draws from: below the ephemeral range, above most well-known services."""
LOCK_ATTEMPTS = 8
"""How often :func:`_lock` opens a port's lock file again after the file it locked was removed or replaced."""


def lock_dir() -> Path:
    """One lock file per reserved port, in one directory for every launcher of the machine: ``$DPWA_LOCK_DIR``,
    else ``/tmp/dpwa-ports`` whatever a launcher's TMPDIR (a job's own TMPDIR would hide its locks from the
    others), else ``<tmp>/dpwa-ports`` on a system without /tmp."""
    given = os.environ.get(LOCK_DIR_ENV)
    if given:
        return Path(given)
    return (Path("/tmp") if os.path.isdir("/tmp") else Path(tempfile.gettempdir())) / "dpwa-ports"


class PortReservation:
    """Ports held by this process (one open, exclusively locked file each) until :meth:`release`.

    ``handles`` are (descriptor, path) pairs of the locked files, one per port."""

    def __init__(self, ports: Sequence[int], handles: Sequence[tuple[int, Path]]) -> None:
        self.ports = tuple(ports)
        self._handles = list(handles)

    def release(self) -> None:
        """Remove, unlock and close every lock file (idempotent); the ports are free for other launchers."""
        while self._handles:
            _unlock(*self._handles.pop())

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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


def _lock(port: int, directory: Path) -> tuple[int, Path] | None:
    """(descriptor, path) of ``port``'s lock file, exclusively locked and still the file at the path; None
    when another process holds it (or, after :data:`LOCK_ATTEMPTS` removed files in a row, may hold it)."""
    path = directory / f"{port}.lock"
    for _ in range(LOCK_ATTEMPTS):
        try:
            fd = _open_lock_file(path)
        except PermissionError:  # another user's lock file this user may not open: that port is not ours to take
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                return None
            raise
        if _is_file_at(fd, path):
            return fd, path
        os.close(fd)  # its holder removed it after we opened it: another process may lock the new file
        log.debug("lock file %s was removed or replaced while it was being locked; opening it again", path)
    return None


def _unlock(fd: int, path: Path) -> None:
    """Remove ``path`` while ``fd`` still holds its lock (when it is still that file), then close ``fd``.

    A file another user created stays (a sticky temporary directory lets only its owner remove it)."""
    try:
        if _is_file_at(fd, path):
            os.unlink(path)
    except OSError as err:
        log.debug("cannot remove the lock file %s: %s", path, err)
    finally:
        os.close(fd)


def _bindable(port: int, host: str) -> bool:
    """Whether ``host:port`` can be bound now (False: in use, or a privileged port); OSError when any port would
    fail alike (``host`` is no address of this machine, or does not resolve)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no obstacle
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            if err.errno == errno.EADDRNOTAVAIL:
                raise OSError(err.errno, f"{host} is not an address of this machine") from None
            raise OSError(err.errno, f"cannot bind {host}: {err.strerror or err}") from None  # unresolvable, ...
    return True


def reserve_ports(
    n: int, host: str = LOCAL_HOST, *, port_range: tuple[int, int] = PORT_RANGE, rng: random.Random | None = None
) -> PortReservation:
    """Reserve ``n`` distinct ports of ``port_range`` free on ``host``; OSError when fewer are to be had, or at
    once when ``host`` is not an address of this machine."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    directory = lock_dir()
    directory.mkdir(mode=0o777, exist_ok=True)
    if not os.environ.get(LOCK_DIR_ENV):  # the shared default: one directory for every user's launchers
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o1777)
    lo, hi = port_range
    candidates = list(range(lo, hi + 1))
    (rng or random.Random()).shuffle(candidates)
    ports: list[int] = []
    handles: list[tuple[int, Path]] = []
    try:
        for port in candidates:
            handle = _lock(port, directory)
            if handle is None:
                continue
            handles.append(handle)  # from here on released with the others if anything raises
            if not _bindable(port, host):
                _unlock(*handles.pop())
                continue
            ports.append(port)
            if len(ports) == n:
                return PortReservation(ports, handles)
    except BaseException:
        for handle in handles:
            _unlock(*handle)
        raise
    for handle in handles:
        _unlock(*handle)
    raise OSError(errno.EADDRINUSE, f"only {len(ports)} of {n} ports free in {lo}-{hi} on {host}")


def local_nodes(ports: Sequence[int], host: str = LOCAL_HOST) -> tuple[NodeSpec, ...]:
    """Nodes ``w1..wN`` on ``host`` at ``ports``, as a cluster file would list them."""
    return tuple(NodeSpec(f"w{i + 1}", host, port) for i, port in enumerate(ports))
