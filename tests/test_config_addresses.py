"""dpwa.config.addresses: which nodes of a cluster file would bind an address another node binds."""

from __future__ import annotations

import socket

import pytest

from dpwa.config import NodeSpec
from dpwa.config.addresses import address_clashes


def clashes(*addresses: str) -> list[int]:
    nodes = [NodeSpec(f"w{i}", a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for i, a in enumerate(addresses)]
    return [i for i, _ in address_clashes(nodes)]


@pytest.mark.parametrize(
    ("addresses", "clashing"),
    [
        (("localhost:5000", "LOCALHOST:5000"), [1]),
        (("127.0.0.1:5000", "localhost:5000"), [1]),
        (("0.0.0.0:5000", "127.0.0.2:5000"), [1]),  # the wildcard first
        (("127.0.0.2:5000", "0.0.0.0:5000"), [1]),  # the wildcard last
        (("0.0.0.0:5000", "0.0.0.0:5000", "localhost:5000"), [1, 2]),
        (("127.0.0.1:5000", "127.0.0.2:5000"), []),  # two loopback addresses: each binds on its own
        (("0.0.0.0:5000", "localhost:5001"), []),  # another port
        (("hosta:5000", "hostb:5000", "0.0.0.0:5000"), []),  # other machines' names are not known to be this one
    ],
)
def test_clashing_addresses(addresses: tuple[str, ...], clashing: list[int]) -> None:
    assert clashes(*addresses) == clashing


def test_what_is_refused_is_what_the_kernel_refuses() -> None:
    """The wildcard beside a loopback address on one port: the second bind fails (EADDRINUSE), as the check says;
    two loopback addresses on one port both bind."""
    with socket.socket() as first:
        first.bind(("127.0.0.1", 0))
        port = first.getsockname()[1]
        with socket.socket() as wildcard, pytest.raises(OSError):
            wildcard.bind(("0.0.0.0", port))
            wildcard.listen()
        assert clashes(f"127.0.0.1:{port}", f"0.0.0.0:{port}") == [1]
        with socket.socket() as other_loopback:
            other_loopback.bind(("127.0.0.2", port))
        assert clashes(f"127.0.0.1:{port}", f"127.0.0.2:{port}") == []
