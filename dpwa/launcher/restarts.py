"""``dpwa run --restart-failed N``: start a failed node again, on its own name and port, at most N times.

A node *failed* when it exited with a non-zero status or was killed by a signal the launcher did
not send (a child the supervisor stopped is never restarted).  :meth:`Restarter.handle` is told of
every exit; a failure with restarts left is scheduled instead of failing the run.  :meth:`Restarter.tick`
(called from the launcher's watch loop, which keeps handling signals meanwhile) starts a scheduled
node once its port can be bound again -- a killed process's listening socket is usually gone at
once -- or gives up on it after ``port_wait_s`` (the node then counts as failed).  The restarted
process gets ``DPWA_RESUME=1`` and ``DPWA_BOOTSTRAP=peer``: it resumes from its checkpoint, if it has
one, and copies a peer's model before its first step (:meth:`dpwa.adapters.pytorch.DpwaPyTorchAdapter.restore`).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import socket
import time
from collections.abc import Callable, Mapping

from dpwa.launcher.supervisor import Child

log = logging.getLogger(__name__)

__all__ = ["ENV_BOOTSTRAP", "ENV_RESUME", "PORT_WAIT_S", "Restarter", "port_is_free", "resume_env"]

ENV_RESUME = "DPWA_RESUME"
ENV_BOOTSTRAP = "DPWA_BOOTSTRAP"
PORT_WAIT_S = 30.0
"""How long a failed node's port may stay busy before its restart is given up."""


def resume_env() -> dict[str, str]:
    """The variables that make a node resume from its checkpoint and bootstrap from a peer."""
    return {ENV_RESUME: "1", ENV_BOOTSTRAP: "peer"}


@functools.lru_cache(maxsize=1024)
def _address(host: str) -> str | None:
    """``host`` resolved as IPv4 once (the supervision loop asks every 100 ms); None when it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def port_is_free(host: str, port: int) -> bool:
    """False when ``host:port`` (IPv4, resolved) is in use now (binding it, with SO_REUSEADDR as ZeroMQ binds, fails
    with EADDRINUSE); any other failure (a host that does not resolve, an address not on this machine) is not a busy
    port: the node's own start reports it."""
    address = _address(host)
    if address is None:
        return True
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as err:
            return err.errno != errno.EADDRINUSE
    return True


@dataclasses.dataclass
class _Pending:
    name: str
    deadline: float
    exit: str


class Restarter:
    """Restarts failed nodes up to ``limit`` times each (see the module doc-string).

    ``start(name)`` starts node ``name`` again (the launcher's job: same command, ``resume_env()``
    added, log appended); ``addresses`` maps each node's name to its (host, port).
    """

    def __init__(
        self,
        limit: int,
        addresses: Mapping[str, tuple[str, int]],
        start: Callable[[str], object],
        *,
        port_wait_s: float = PORT_WAIT_S,
        port_free: Callable[[str, int], bool] = port_is_free,
        gone: Callable[[str], bool] = lambda name: True,
    ) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self.addresses = dict(addresses)
        self._start = start
        self._port_wait_s = port_wait_s
        self._port_free = port_free
        self._gone = gone
        """Whether nothing of a failed node's process (its helpers) still runs: a restart waits for that too."""
        self.counts: dict[str, int] = {name: 0 for name in self.addresses}
        self.pending: dict[str, _Pending] = {}

    def handle(self, child: Child) -> bool:
        """``child`` just exited: True when a restart is scheduled (the exit is then not a failure of the run)."""
        if child.state != "failed" or child.name not in self.addresses:
            return False
        if self.counts[child.name] >= self.limit:
            if self.limit:
                log.info("%s failed (%s) and has used its %d restart(s)", child.name, child.describe_exit(), self.limit)
            return False
        self.pending[child.name] = _Pending(child.name, time.monotonic() + self._port_wait_s, child.describe_exit())
        return True

    def tick(self) -> list[str]:
        """Start the scheduled restarts whose port is free; return the names given up on (port still busy)."""
        gave_up = []
        for name, pending in list(self.pending.items()):
            host, port = self.addresses[name]
            if self._gone(name) and self._port_free(host, port):
                del self.pending[name]
                self.counts[name] += 1
                log.info("restarting %s (%s): restart %d of %d", name, pending.exit, self.counts[name], self.limit)
                try:
                    self._start(name)
                except OSError as err:  # fork failed, log not writable: this node is given up, the run goes on
                    log.error("cannot restart %s: %s", name, err)
                    gave_up.append(name)
            elif time.monotonic() >= pending.deadline:
                del self.pending[name]
                gave_up.append(name)
                why = f"port {host}:{port} still in use" if self._gone(name) else "processes of its group still run"
                log.info("not restarting %s: %s after %.0f s", name, why, self._port_wait_s)
        return gave_up
