"""Joining a running cluster (docs/membership.md): where a joining node listens and what it is called.

A joining node is given the address of one member (``dpwa run -n N --join HOST:PORT``, ``DPWA_JOIN`` for a
script using the adapter, or ``join:`` in a file). It listens on a port reserved like ``dpwa run -n``'s
(:mod:`dpwa.engines.local`) on its *advertised address*: ``DPWA_ADVERTISE_ADDR``, else the local address this
host reaches the member from (127.0.0.1 for a member on this machine). It is called ``<host>-<port>``
(this host's short name: unique per listening address), unless a name is given.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping, Sequence

from dpwa.config import JoinAddress, NodeSpec

__all__ = ["ADVERTISE_ENV", "JOIN_ENV", "advertised_address", "joining_host", "joining_name", "joining_nodes"]

JOIN_ENV = "DPWA_JOIN"
"""``[NAME@]HOST:PORT`` of a member: the adapter's node joins that cluster."""
ADVERTISE_ENV = "DPWA_ADVERTISE_ADDR"
"""The address peers reach this host at, when the routed one is not it (NAT, several interfaces)."""


def advertised_address(env: Mapping[str, str], host: str, port: int) -> str:
    """``DPWA_ADVERTISE_ADDR``, else the local address this host reaches ``host:port`` from; OSError when none
    does (no packet is sent: a UDP socket only asks the routing table)."""
    given = env.get(ADVERTISE_ENV)
    if given:
        return given
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
        except OSError as err:
            raise OSError(f"no route to it ({err.strerror or err})") from None
        return str(probe.getsockname()[0])


def joining_name(port: int, hostname: str | None = None) -> str:
    """``<short host name>-<port>``, with characters a node name (and a key file) cannot hold replaced."""
    short = (hostname or socket.gethostname()).split(".")[0]
    short = re.sub(r"[^A-Za-z0-9_-]", "-", short).lstrip("-") or "node"
    return f"{short}-{port}"


def joining_host(join: JoinAddress, env: Mapping[str, str]) -> str:
    """The address the nodes that join the member at ``join`` listen on, and reserve their ports on: the
    advertised one (:func:`advertised_address`; OSError when no route reaches the member)."""
    return advertised_address(env, join.host, join.port)


def joining_nodes(host: str, ports: Sequence[int]) -> tuple[NodeSpec, ...]:
    """The nodes this machine starts to join a cluster: one per port reserved on ``host`` (:func:`joining_host`)."""
    return tuple(NodeSpec(joining_name(port), host, port) for port in ports)
