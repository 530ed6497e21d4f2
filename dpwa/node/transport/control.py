"""The control plane: short-lived DEALERs for membership messages (JOIN, MEMBERS) to one member each.

A node joining a running cluster sends a JOIN to one member and waits for its MEMBERS answer
(:meth:`ControlPlane.join`); a node waiting for its peers at start-up, or announcing that it leaves, sends each
member a MEMBERS message and waits for their answers (:meth:`ControlPlane.ask`). The node builds every message and
reads every answer (the membership decisions are its own); this module only opens, connects, polls and closes
the sockets. Each socket has the data sockets' options, takes no frame larger than a header (an answer is one),
and retries a connection every ``reconnect_ms`` ms while the member is not listening yet.

Two network facts are handled here: a socket that reached its own node (a peer on this host not listening yet,
:func:`~dpwa.node.transport.sockets.connect_address`) gets the node's own request back; it reconnects and sends
again. And a member whose address refuses the connection (a dead node on a live host) is not waited for when the
caller asks so, as a socket monitor reports it.

Called on the trainer's thread only; every wait is bounded by the caller's deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from dpwa.node import wire
from dpwa.node.transport.protocol import NodePort
from dpwa.node.transport.sockets import common_options, connect_address, is_own_echo

__all__ = ["UNREACHABLE_EVENTS", "ControlPlane"]

log = logging.getLogger(__name__)

T = TypeVar("T")

UNREACHABLE_EVENTS = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
"""Socket monitor events that say a member cannot be told (refused, or not letting this node in)."""
POLL_S = 0.1
"""The longest one poll of :meth:`ControlPlane.ask` sleeps, in seconds."""


class ControlPlane:
    """Opens the control DEALERs of node ``node`` in ``ctx``; ``setup(sock, member)`` runs on each before it
    connects (a CURVE client's options); ``port.count`` counts ``self_connections``."""

    def __init__(
        self,
        ctx: zmq.Context,
        node: str,
        port: NodePort,
        *,
        setup: Callable[[zmq.Socket, str], None] | None = None,
        reconnect_ms: int = 10,
    ) -> None:
        self._ctx = ctx
        self._node = node
        self._port = port
        self._setup = setup
        self._reconnect_ms = reconnect_ms

    def socket(self) -> zmq.Socket:
        """A DEALER for membership messages to one member: the data sockets' options, frames no larger than a
        header, and a retry every ``reconnect_ms`` ms while the member is not listening yet (ZeroMQ's default,
        100 ms, would start nodes that wait for each other that far apart). Not connected; the caller closes it."""
        sock = self._ctx.socket(zmq.DEALER)
        common_options(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, self._reconnect_ms)
        return sock

    def join(
        self,
        member: str,
        endpoint: str,
        request: Callable[[], tuple[int, bytes]],
        answer: Callable[[list[bytes], int], T | None],
        *,
        retry_s: float,
        timeout_s: float,
    ) -> T | None:
        """Send ``request()`` -- ``(req, JOIN bytes)``, a new one every ``retry_s`` seconds -- to the member at
        ``endpoint`` (``member``: its name, for the CURVE set-up) until ``answer(frames, req)`` returns something
        for a message that came back, and return that; None when nothing did within ``timeout_s`` seconds.
        ``answer`` may raise (a refusal): the socket is closed and the exception propagates."""
        sock = self.socket()
        deadline = time.monotonic() + timeout_s
        try:
            if self._setup is not None:
                self._setup(sock, member)
            sock.connect(connect_address(endpoint))
            while True:
                req, message = request()
                try:
                    sock.send(message, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected yet: ask again after retry_s
                until = min(deadline, time.monotonic() + retry_s)
                while (left := until - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    result = answer(sock.recv_multipart(zmq.NOBLOCK), req)
                    if result is not None:
                        return result
                if time.monotonic() >= deadline:
                    return None
        finally:
            sock.close(linger=0)

    def ask(
        self,
        members: Sequence[tuple[str, str]],
        message: Callable[[str], bytes],
        deadline: float,
        *,
        refused_ends: bool,
    ) -> set[str]:
        """Send each member ``(name, endpoint)`` of ``members`` the bytes ``message(name)`` on a control socket of
        its own and wait until ``deadline`` (time.monotonic seconds) for their answers (answers are not read
        further); ``refused_ends``: a member whose connection is refused (a socket monitor says so) is not waited
        for. A member that cannot even be sent to is not waited for either. The names that answered."""
        socks: dict[zmq.Socket, tuple[str, str]] = {}
        monitors: dict[zmq.Socket, zmq.Socket] = {}  # monitor -> its DEALER
        try:
            waiting = self._send_all(members, message, socks, monitors if refused_ends else None)
            return self._answers(socks, monitors, waiting, message, deadline)
        finally:
            for sock in socks:
                if refused_ends:
                    sock.disable_monitor()
                sock.close(linger=0)
            for monitor in monitors:
                monitor.close(linger=0)

    def _send_all(
        self,
        members: Sequence[tuple[str, str]],
        message: Callable[[str], bytes],
        socks: dict[zmq.Socket, tuple[str, str]],
        monitors: dict[zmq.Socket, zmq.Socket] | None,
    ) -> set[zmq.Socket]:
        """Open, monitor (when ``monitors`` is given), connect and send to each member; fill ``socks`` and
        ``monitors`` as it goes (the caller closes them) and return the sockets whose message went out."""
        sent: set[zmq.Socket] = set()
        for name, endpoint in members:
            try:
                sock = self.socket()
            except zmq.ZMQError as exc:  # out of sockets (a very large table): the rest learn by gossip
                log.warning("node %s: reached %d of %d members: %s", self._node, len(socks), len(members), exc)
                break
            socks[sock] = (name, endpoint)
            if monitors is not None:
                try:
                    monitors[sock.get_monitor_socket(UNREACHABLE_EVENTS)] = sock
                except zmq.ZMQError:
                    pass  # unmonitored: waited for until the deadline
            try:
                if self._setup is not None:
                    self._setup(sock, name)
                sock.connect(connect_address(endpoint))
                sock.send(message(name), zmq.NOBLOCK)
            except (zmq.ZMQError, KeyError, OSError, ValueError):
                continue  # not even sent to: not waited for
            sent.add(sock)
        return sent

    def _answers(
        self,
        socks: dict[zmq.Socket, tuple[str, str]],
        monitors: dict[zmq.Socket, zmq.Socket],
        waiting: set[zmq.Socket],
        message: Callable[[str], bytes],
        deadline: float,
    ) -> set[str]:
        """Poll ``socks`` and ``monitors`` until every socket of ``waiting`` has an answer, its connection was
        refused, or ``deadline`` passed; the names that answered."""
        answered: set[str] = set()
        poller = zmq.Poller()
        for sock in [*socks, *monitors]:
            poller.register(sock, zmq.POLLIN)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(min(left, POLL_S) * 1000) + 1):
                if sock in monitors:  # the member's address refused the connection: nobody there
                    recv_monitor_message(sock, zmq.NOBLOCK)
                    waiting.discard(monitors[sock])
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                name, endpoint = socks[sock]
                if frames and is_own_echo(frames[0], self._node):  # connected to itself: not an answer
                    self._port.count("self_connections", 1)
                    sock.disconnect(connect_address(endpoint))  # then try again
                    sock.connect(connect_address(endpoint))
                    sock.send(message(name), zmq.NOBLOCK)
                    continue
                if sock in waiting:
                    waiting.discard(sock)
                    answered.add(name)
        return answered
