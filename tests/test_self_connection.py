"""A socket connected to itself never keeps a node from binding its port.

On one host, a DEALER reconnecting to a peer that does not listen yet can be handed the peer's port as its own
ephemeral port (cluster ports such as 45000 lie in Linux's ephemeral range, 32768-60999): TCP connects it to
itself. Seen once in about 300 four-node demo runs: w1 could not bind 45000, and the TIME-WAIT the closed
self-connection left kept the port for a minute. dpwa's DEALERs connect from a source bound with SO_REUSEADDR
(:func:`dpwa.node.transport.connect_address`), so neither the live self-connection nor its TIME-WAIT blocks
the bind, and a node that receives its own request back reconnects (:func:`is_own_echo`).
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import free_ports, wait_until, write_cluster

from dpwa.node import wire
from dpwa.node.connection import DpwaConnection
from dpwa.node.transport import connect_address, is_own_echo


def test_connect_address_binds_a_source_for_ip_literals_only() -> None:
    assert connect_address("tcp://127.0.0.1:45000") == "tcp://0.0.0.0:0;127.0.0.1:45000"
    assert connect_address("tcp://localhost:45000") == "tcp://0.0.0.0:0;localhost:45000"
    assert connect_address("tcp://[::1]:45000") == "tcp://[::]:0;[::1]:45000"
    assert connect_address("tcp://node-7.cluster:45000") == "tcp://node-7.cluster:45000"
    assert connect_address("tcp://0.0.0.0:0;127.0.0.1:1") == "tcp://0.0.0.0:0;127.0.0.1:1"
    assert connect_address("inproc://x") == "inproc://x"


def test_own_echo_is_a_request_of_this_node_only() -> None:
    fetch = wire.encode_settle("w1", 3, "query")
    assert is_own_echo(fetch, "w1")
    assert not is_own_echo(fetch, "w2")  # another node's request: a real message
    assert not is_own_echo(wire.encode_ack("w1", 3), "w1")  # an answer, not a request
    assert not is_own_echo(b"DPWA\x01garbage", "w1")
    assert not is_own_echo(b"\x00" * 10, "w1")


def _self_connected(port: int, ctx: zmq.Context) -> zmq.Socket:
    """A DEALER connected to itself on ``port``, as a chance ephemeral pick would make one of dpwa's."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://0.0.0.0:{port};127.0.0.1:{port}")
    return sock


def _connected_to_itself(port: int) -> bool:
    """An established TCP connection from ``port`` to ``port`` in Linux's socket table."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return any(r[1].endswith(f":{port:04X}") and r[2].endswith(f":{port:04X}") and r[3] == "01" for r in rows)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_a_node_binds_beside_a_self_connection_and_after_its_time_wait(tmp_path: Path) -> None:
    """w1's port held by a DEALER connected to itself: w1 still binds and serves; the DEALER closed (its port
    in TIME-WAIT), a second node binds the same port again."""
    ports = free_ports(2)
    ctx = zmq.Context()
    loop = _self_connected(ports[0], ctx)
    try:
        wait_until(lambda: _connected_to_itself(ports[0]), 10, message="the self-connection is up")
        cluster = write_cluster(tmp_path / "c.yaml", ports)
        node = DpwaConnection("w1", cluster, seed=0)  # binds ports[0] beside the self-connection
        node.update_send([np.zeros(4, np.float32)], 1.0)
        node.update_wait(1.0)
        node.close()
        loop.close(linger=0)
        wait_until(lambda: not _connected_to_itself(ports[0]), 10, message="the self-connection closed")
        again = DpwaConnection("w1", cluster, seed=0)
        again.close()
    finally:
        loop.close(linger=0)
        ctx.term()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_without_a_reuse_bound_source_a_self_connection_blocks_the_port(tmp_path: Path) -> None:
    """Why connect_address binds a source: a plain connecting socket (no SO_REUSEADDR) connected to itself
    keeps the node from binding, with a clear error."""
    ports = free_ports(2)
    plain = socket.socket()
    try:
        plain.bind(("127.0.0.1", ports[0]))
        plain.connect(("127.0.0.1", ports[0]))  # TCP's simultaneous open with itself
        assert plain.getpeername() == plain.getsockname()
        with pytest.raises(OSError, match="cannot bind"):
            DpwaConnection("w1", write_cluster(tmp_path / "c.yaml", ports), seed=0)
    finally:
        plain.close()
