"""``dpwa run -n N``: N nodes on this machine, on ports that no concurrent ``dpwa run -n`` takes.

A port is *reserved* by an exclusive ``flock`` on ``<tmp>/dpwa-ports/<port>.lock``, held by the
launcher until its job ends (the kernel drops it when the launcher exits, however it exits), and
checked free by binding it. Ports are drawn at random from below Linux's ephemeral range
(32768-60999), where no outgoing connection is given one, so nothing else takes a reserved port
between the reservation and the node's bind. The lock files stay (empty): removing one while
another launcher has it open would let two launchers lock different files for one port.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dpwa.config import NodeSpec

__all__ = ["LOCAL_HOST", "PORT_RANGE", "PortReservation", "local_nodes", "lock_dir", "reserve_ports"]

LOCAL_HOST = "127.0.0.1"
PORT_RANGE = (20000, 32767)
"""Ports ``dpwa run -n`` draws from: below the ephemeral range, above most well-known services."""


def lock_dir() -> Path:
    """``<tmp>/dpwa-ports``: one lock file per reserved port (shared by every user's launchers)."""
    return Path(tempfile.gettempdir()) / "dpwa-ports"


class PortReservation:
    """Ports held by this process (one open, exclusively locked file each) until :meth:`release`."""

    def __init__(self, ports: Sequence[int], handles: Sequence[int]) -> None:
        self.ports = tuple(ports)
        self._handles = list(handles)

    def release(self) -> None:
        """Unlock and close every lock file (idempotent); the ports are free for other launchers."""
        while self._handles:
            os.close(self._handles.pop())

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock(port: int, directory: Path) -> int | None:
    """An open descriptor of ``port``'s lock file, exclusively locked; None when another process holds it."""
    fd = os.open(directory / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return None
        raise
    return fd


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no obstacle
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def reserve_ports(
    n: int, host: str = LOCAL_HOST, *, port_range: tuple[int, int] = PORT_RANGE, rng: random.Random | None = None
) -> PortReservation:
    """Reserve ``n`` distinct ports of ``port_range`` free on ``host``; OSError when fewer are to be had."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    directory = lock_dir()
    directory.mkdir(mode=0o777, exist_ok=True)
    with contextlib.suppress(OSError):  # one directory for every user's launchers
        os.chmod(directory, 0o1777)
    lo, hi = port_range
    candidates = list(range(lo, hi + 1))
    (rng or random.Random()).shuffle(candidates)
    ports: list[int] = []
    handles: list[int] = []
    try:
        for port in candidates:
            fd = _lock(port, directory)
            if fd is None:
                continue
            if not _bindable(port, host):
                os.close(fd)
                continue
            ports.append(port)
            handles.append(fd)
            if len(ports) == n:
                return PortReservation(ports, handles)
    except BaseException:
        for fd in handles:
            os.close(fd)
        raise
    for fd in handles:
        os.close(fd)
    raise OSError(errno.EADDRINUSE, f"only {len(ports)} of {n} ports free in {lo}-{hi} on {host}")


def local_nodes(ports: Sequence[int], host: str = LOCAL_HOST) -> tuple[NodeSpec, ...]:
    """Nodes ``w1..wN`` on ``host`` at ``ports``, as a cluster file would list them."""
    return tuple(NodeSpec(f"w{i + 1}", host, port) for i, port in enumerate(ports))
