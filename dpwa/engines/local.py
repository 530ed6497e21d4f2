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
import logging
import os
import random
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dpwa.config import NodeSpec
from dpwa.utils.lockfile import HeldLocks, lock_file, unlock_file

log = logging.getLogger(__name__)

__all__ = [
    "LOCAL_HOST",
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


def lock_dir() -> Path:
    """One lock file per reserved port, in one directory for every launcher of the machine: ``$DPWA_LOCK_DIR``,
    else ``/tmp/dpwa-ports`` whatever a launcher's TMPDIR (a job's own TMPDIR would hide its locks from the
    others), else ``<tmp>/dpwa-ports`` on a system without /tmp."""
    given = os.environ.get(LOCK_DIR_ENV)
    if given:
        return Path(given)
    return (Path("/tmp") if os.path.isdir("/tmp") else Path(tempfile.gettempdir())) / "dpwa-ports"


class PortReservation(HeldLocks):
    """Ports held by this process (one open, exclusively locked file each) until :meth:`release`.

    ``handles`` are (descriptor, path) pairs of the locked files, one per port."""

    def __init__(self, ports: Sequence[int], handles: Sequence[tuple[int, Path]]) -> None:
        super().__init__(handles)
        self.ports = tuple(ports)


def _lock(port: int, directory: Path) -> tuple[int, Path] | None:
    """(descriptor, path) of ``port``'s lock file, exclusively locked (:func:`dpwa.utils.lockfile.lock_file`);
    None when another process holds it."""
    path = directory / f"{port}.lock"
    fd = lock_file(path)
    return None if fd is None else (fd, path)


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
                unlock_file(*handles.pop())
                continue
            ports.append(port)
            if len(ports) == n:
                return PortReservation(ports, handles)
    except BaseException:
        for handle in handles:
            unlock_file(*handle)
        raise
    for handle in handles:
        unlock_file(*handle)
    raise OSError(errno.EADDRINUSE, f"only {len(ports)} of {n} ports free in {lo}-{hi} on {host}")


def local_nodes(ports: Sequence[int], host: str = LOCAL_HOST) -> tuple[NodeSpec, ...]:
    """Nodes ``w1..wN`` on ``host`` at ``ports``, as a cluster file would list them."""
    return tuple(NodeSpec(f"w{i + 1}", host, port) for i, port in enumerate(ports))
