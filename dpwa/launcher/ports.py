"""Is a node's port free here? Checked by ``dpwa validate`` and ``dpwa run`` before any process starts.

A node's RX server binds ``tcp://<host's IPv4 address>:<port>`` with ZeroMQ, which sets ``SO_REUSEADDR``
(:func:`dpwa.node.transport.bind_endpoint`). :func:`busy_ports` binds each port the same way, for an instant:
a port that another process listens on (or has bound) fails with ``EADDRINUSE``, exactly as the node's
bind would, while a port left in TIME-WAIT by an earlier run does not.

Only ``EADDRINUSE`` is reported. A host that does not resolve, or an address this machine does not have,
is not this machine's to check (the node, if started anyway, says why it cannot bind). The check is a
snapshot: a process may still take the port between the check and the node's bind, and then the node
fails with one clear line (:class:`dpwa.node.transport.PortInUseError`).

Ports the launcher reserves itself (``dpwa run -n``, :mod:`dpwa.engines.local`) and ports an engine derives
(SLURM's ``base_port + SLURM_LOCALID``) are not checked here: :mod:`dpwa.cli.run` passes only the nodes a
cluster file lists.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
from collections.abc import Callable, Iterable

from dpwa.config import ClusterConfig, NodeSpec

log = logging.getLogger(__name__)

__all__ = ["BusyPort", "busy_ports", "busy_ports_message", "port_in_use"]


@dataclasses.dataclass(frozen=True)
class BusyPort:
    """A node whose port is taken: its spec and the IPv4 address its server would bind."""

    node: NodeSpec
    address: str

    def describe(self) -> str:
        """``node w2: port 45001 on localhost (127.0.0.1) is already in use`` (the address when it differs)."""
        where = self.node.host if self.address == self.node.host else f"{self.node.host} ({self.address})"
        return f"node {self.node.name}: port {self.node.port} on {where} is already in use"


def port_in_use(host: str, port: int) -> tuple[bool, str | None]:
    """(in use, address): whether binding ``host:port`` as a node binds it fails with ``EADDRINUSE``.

    ``address`` is ``host``'s IPv4 address (``socket.gethostbyname``, as the node resolves it), None when
    ``host`` does not resolve (then the port is not in use as far as this machine can tell). Any other
    bind error (an address not of this machine, a privileged port) is not "in use": False.
    """
    try:
        address = socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return False, None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME-WAIT is no obstacle
        try:
            sock.bind((address, port))
        except OSError as err:
            log.debug("binding %s:%d (%s): %s", host, port, address, err)
            return err.errno == errno.EADDRINUSE, address
    return False, address


def busy_ports(nodes: Iterable[NodeSpec], *, is_local: Callable[[str], bool]) -> list[BusyPort]:
    """The ``nodes`` whose host ``is_local`` (:class:`dpwa.launcher.placement.LocalHosts`) and whose port is
    in use on this machine, in order. Nodes on other hosts are not checked."""
    busy = []
    for node in nodes:
        if not is_local(node.host):
            continue
        in_use, address = port_in_use(node.host, node.port)
        if in_use and address is not None:
            busy.append(BusyPort(node, address))
    return busy


def busy_ports_message(config: ClusterConfig, busy: Iterable[BusyPort]) -> str:
    """One line for the user: ``FILE:LINE: nodes[I].port: node w2: port 45001 on 127.0.0.1 is already in use``,
    further busy nodes joined with ``; `` (an empty string when ``busy`` is empty)."""
    index = {node.name: i for i, node in enumerate(config.nodes)}
    problems = list(busy)
    if not problems:
        return ""
    first, rest = problems[0], problems[1:]
    message = str(config.error(f"nodes[{index.get(first.node.name, 0)}].port", first.describe()))
    return "; ".join([message, *(p.describe() for p in rest)])
