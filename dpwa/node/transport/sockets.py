"""Socket options and addresses shared by every ZeroMQ socket a node opens (no threads, no sockets kept).

* :func:`common_options` -- LINGER 0 and ZMTP heartbeats: every socket of a node gets them;
* :func:`tune_data_socket` -- the one place for options of sockets that carry payloads;
* :func:`push_send_hwm` -- the send queue a pushing DEALER needs;
* :func:`connect_address` and :func:`is_own_echo` -- connecting to a peer on the same host without ever
  keeping a connection of a socket to itself;
* :func:`bind_endpoint` and :class:`PortInUseError` -- the address the RX server binds, and its one-line
  error when the port is taken.
"""

from __future__ import annotations

import errno
import socket

import zmq

from dpwa.node import wire
from dpwa.node.wire import Kind, WireError

__all__ = [
    "HEARTBEAT_MS",
    "HEARTBEAT_TIMEOUT_MS",
    "MAX_REQUEST_BYTES",
    "OWN_REQUESTS",
    "REPLY_QUEUE_MESSAGES",
    "PortInUseError",
    "bind_endpoint",
    "common_options",
    "connect_address",
    "is_own_echo",
    "push_send_hwm",
    "tune_data_socket",
    "user_id",
]

HEARTBEAT_MS = 1000
"""ZMTP heartbeat interval of every socket, in ms."""
HEARTBEAT_TIMEOUT_MS = 5000
"""A connection silent this long (ms) is dropped by ZeroMQ; also the heartbeat TTL a socket asks of its peer."""
MAX_REQUEST_BYTES = wire.MAX_HEADER_BYTES
"""The largest frame the RX ROUTER takes from a node that takes no pushes (its ZMQ_MAXMSGSIZE)."""
REPLY_QUEUE_MESSAGES = 1 << 15
"""Messages the RX ROUTER queues per requester before it drops a reply (its SNDHWM). Set once, before it binds:
libzmq forwards an HWM change to the pipe of every connection, and a connection being torn down at that moment
(a peer closing a socket) gets it after its pipe was freed -- a crash of the I/O thread. A streamed reply needs
its chunks + 1 messages: one of up to 128 GiB fits; a requester that stops reading holds at most this many."""

OWN_REQUESTS = frozenset({Kind.FETCH, Kind.PUSH, Kind.SETTLE, Kind.JOIN, Kind.MEMBERS})
"""Kinds a node sends on its DEALERs: one coming back to the same node means the socket is connected to itself."""


def common_options(sock: zmq.Socket) -> None:
    """Options every socket of a node gets: LINGER 0 (closing never waits) and ZMTP heartbeats
    (:data:`HEARTBEAT_MS`, :data:`HEARTBEAT_TIMEOUT_MS`), so a vanished peer's connection is dropped."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def tune_data_socket(sock: zmq.Socket) -> None:
    """Options of every socket that carries payloads (RX ROUTER, TX DEALER, and the bench's raw sockets).

    Deliberately none today: fixed SO_SNDBUF/SO_RCVBUF of 256 KiB to 4 MiB measured no
    faster than Linux's buffer autotuning on loopback (``dpwa bench exchange``), and
    setting them turns autotuning off. This is the one place to add such options, so
    that the benchmark's raw-pyzmq reference always gets the same ones.
    """


def push_send_hwm(chunks: int, others: int = 4) -> int:
    """SNDHWM of a pushing DEALER: room for one streamed push (a header and ``chunks`` messages) and ``others``.

    libzmq's writer learns that its reader took messages only every ``(hwm + 1) // 2`` messages, so
    right after a push that the receiver took whole it may still count up to half the mark as queued.
    Twice the need is what always fits: a push cut short by a full queue would wait a whole
    ``timeout_ms`` for its SETTLE."""
    return 2 * (chunks + 1 + others)


def is_own_echo(head: bytes, node: str) -> bool:
    """True when ``head`` (a message's first frame) is a request this node sent: its socket reached itself."""
    if len(head) > wire.MAX_HEADER_BYTES or head[:4] != wire.MAGIC:
        return False
    try:
        header = wire.decode_message(head)
    except WireError:
        return False
    return header.node == node and header.kind in OWN_REQUESTS


def connect_address(endpoint: str) -> str:
    """The address a DEALER connects to ``endpoint`` with: for an IP literal, from a source bound with
    SO_REUSEADDR (``tcp://0.0.0.0:0;HOST:PORT``, libzmq's source-address form).

    Why: a peer on the same host that is not listening yet can be reached while the connecting socket is given
    that very port as its ephemeral one (the cluster's ports lie in the ephemeral range): TCP connects it to
    itself. Its port, and the TIME-WAIT it leaves for a minute once closed, would keep the peer from binding,
    unless the socket was bound with SO_REUSEADDR -- as a source-bound one is. A node that gets its own
    request back (:func:`is_own_echo`) drops that connection and connects again."""
    if not endpoint.startswith("tcp://") or ";" in endpoint:
        return endpoint
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if host.startswith("["):
        return f"tcp://[::]:0;{endpoint[len('tcp://') :]}"
    if host == "localhost" or (host.count(".") == 3 and host.replace(".", "").isdigit()):
        return f"tcp://0.0.0.0:0;{endpoint[len('tcp://') :]}"
    return endpoint


def bind_endpoint(host: str, port: int) -> str:
    """The tcp:// endpoint to bind for ``host``: its resolved IPv4 address (OSError naming the host if it does
    not resolve)."""
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise OSError(f"cannot resolve host {host!r} to bind: {exc}") from exc
    return f"tcp://{address}:{port}"


def user_id(frame: zmq.Frame) -> str | None:
    """The CURVE identity ZAP gave the connection ``frame`` came on (None without CURVE)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


class PortInUseError(OSError):
    """The RX server's port is already in use by another process (``errno`` is ``EADDRINUSE``).

    ``str()`` is one line naming the node, the endpoint and the cause; it is raised without the ZeroMQ
    error chained to it, so a node that does not catch it shows a short traceback ending in that line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(errno.EADDRINUSE, message)

    def __str__(self) -> str:
        return str(self.strerror)
