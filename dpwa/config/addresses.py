"""Which nodes of a cluster file would bind the same address: pure, no sockets.

Two nodes clash when they name one host and port: the same host (case and a fully qualified name's final dot do
not count), or two spellings of the loopback host (``localhost``, ``127.0.0.1``). The wildcard ``0.0.0.0`` binds
every address of its host, so on a port it clashes with any loopback spelling and any ``127.x.y.z`` (the
addresses known here to be that host's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

__all__ = ["WILDCARD", "address_clashes"]

WILDCARD = "0.0.0.0"
"""The host that binds every address of the machine it runs on."""
_OWN = "every node needs its own host:port"
_LOOPBACK = frozenset({"localhost", "127.0.0.1"})  # spellings of one host


class Addressed(Protocol):
    name: str
    host: str
    port: int


def _is_local(host: str) -> bool:
    """The host is this machine whatever it is called elsewhere: a loopback address or the wildcard."""
    return host in _LOOPBACK or host == WILDCARD or host.startswith("127.")


def address_clashes(nodes: Sequence[Addressed]) -> Iterator[tuple[int, str]]:
    """``(index, reason)`` for each node whose address an earlier node already binds, in order."""
    seen: dict[tuple[str, int], int] = {}
    local: dict[int, list[int]] = {}  # port -> the nodes on a local host there
    for i, node in enumerate(nodes):
        host = node.host.lower().rstrip(".")  # ``example.com.`` is ``example.com``, fully qualified
        address = ("localhost" if host in _LOOPBACK else host, node.port)
        local_host = _is_local(host)
        if address in seen:
            other = nodes[seen[address]]
            yield (
                i,
                (
                    f"duplicate address {node.host}:{node.port} (also {other.name!r} at "
                    f"{other.host}:{other.port}); {_OWN}"
                ),
            )
        elif local_host:
            wild = [j for j in local.get(node.port, []) if host == WILDCARD or nodes[j].host.lower() == WILDCARD]
            if wild:
                other = nodes[wild[0]]
                why = f"{WILDCARD} binds every address of this host, so it clashes with {other.host}:{other.port}"
                yield i, f"duplicate address {node.host}:{node.port}: {why} (also {other.name!r}); {_OWN}"
        seen.setdefault(address, i)
        if local_host:
            local.setdefault(node.port, []).append(i)
