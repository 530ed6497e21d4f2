"""The RX thread: a bound ROUTER that serves FETCH requests and takes PUSH, SETTLE, JOIN and MEMBERS messages.

:class:`RxServer` answers every FETCH with what the node's :meth:`~dpwa.node.transport.protocol.NodePort.serve`
returns -- the latest snapshot, zero-copy -- so a slow or vanished requester only fills its own queue. A requester
that asks for it gets the reply streamed: the header, then one message per chunk (``dpwa.node.wire``), so it can
take chunk *i* while the next ones are still on the wire. Pushes (whole, or a header and then tagged chunks) and
SETTLEs go to the node's inbox, JOIN and MEMBERS to the node's membership; each is answered at once (ACK / ERROR /
MEMBERS) or not at all. A small answer that finds the requester's queue full is dropped and counted.

The thread polls at most :data:`~dpwa.utils.socket_thread.POLL_MS` ms at a time (10 ms with an inbox, whose
stalled pushes it expires); ``stop()`` ends it within that. A bug that raises ends the thread with the exception
in ``failure`` (the node raises it in the trainer's next call).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import zmq

from dpwa.node import wire
from dpwa.node.frames import discard_rest
from dpwa.node.transport.protocol import NodePort, Reply
from dpwa.node.transport.sockets import (
    MAX_REQUEST_BYTES,
    REPLY_QUEUE_MESSAGES,
    PortInUseError,
    common_options,
    tune_data_socket,
    user_id,
)
from dpwa.node.wire import CHUNK_BYTES, ErrorCode, Kind, WireError
from dpwa.utils.socket_thread import POLL_MS, SocketThread

__all__ = ["EXPIRE_EVERY_S", "HOLD_S", "MAX_HELD", "Reply", "RxServer"]

log = logging.getLogger(__name__)

EXPIRE_EVERY_S = 0.01
"""How often (seconds, at most) the RX thread frees the inbox slots of pushes that stalled."""
HOLD_S = 0.2
"""Longest the RX thread holds back a FETCH that came while the node rewrites its one snapshot buffer
(``transport.memory: low``) before it serves it anyway (declined "not ready" if the rewrite still goes on)."""
MAX_HELD = 64
"""Most FETCHes held back at once (a header each); one more is served at once."""
HELD_POLL_MS = 1
"""How long the RX thread polls while it holds a FETCH back."""


class RxServer(SocketThread):
    """Binds a ROUTER at ``endpoint`` (in the constructor: a busy port raises :class:`PortInUseError` there) and,
    once started, answers what arrives on it through ``port`` (:class:`~dpwa.node.transport.protocol.NodePort`).

    With ``port.inbox`` it also takes PUSH messages (header, then tagged chunks) and SETTLEs into that
    inbox and answers them (ACK / ERROR); without, it answers both with ERROR ``unsupported``, and
    its frames stay limited to a request's size. ``setup(sock)`` runs before the bind (a CURVE server's
    options, :meth:`dpwa.security.curve.NodeSecurity.server`). A failure (DpwaConnection raises it in the
    trainer's next call) means the node no longer serves."""

    failure_message = "RX thread failed: this node no longer serves its peers"

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        port: NodePort,
        *,
        node: str = "-",
        name: str = "dpwa-rx",
        sndhwm: int = REPLY_QUEUE_MESSAGES,
        setup: Callable[[zmq.Socket], None] | None = None,
        chunk: int = CHUNK_BYTES,
    ) -> None:
        super().__init__(ctx.socket(zmq.ROUTER), name=name)
        self._port = port
        self._pushes = port.inbox
        self._node = node
        self._next_tick = 0.0
        self._held_fetches: deque[tuple[bytes, wire.Fetch, str | None, float]] = deque()
        """FETCHes held back while the node rewrites its one snapshot: (identity, header, user, serve by)."""
        common_options(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.RCVHWM, 64)
        # A push's chunk frames are up to a chunk; a node that takes no pushes keeps a request's limit.
        limit = max(MAX_REQUEST_BYTES, chunk) if self._pushes is not None else MAX_REQUEST_BYTES
        self._sock.setsockopt(zmq.MAXMSGSIZE, limit)
        tune_data_socket(self._sock)
        try:
            if setup is not None:  # must precede bind
                setup(self._sock)
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:  # taken since `dpwa run` checked it (dpwa.launcher.ports), or no launcher
                raise PortInUseError(f"node {node}: cannot bind {endpoint}: the port is already in use") from None
            raise OSError(f"cannot bind {endpoint}: {exc}") from exc
        self.endpoint = endpoint
        """The endpoint the ROUTER is bound to."""

    def _poll_ms(self) -> int:
        """1 ms while a FETCH is held back, 10 ms with an inbox (its stalled pushes expire on time), else POLL_MS."""
        if self._held_fetches:
            return HELD_POLL_MS
        return 10 if self._pushes is not None else POLL_MS

    def _tick(self) -> None:
        """Serve the held-back FETCHes once the rewrite ended (or they were held :data:`HOLD_S`); expire pushes that
        stalled and shared-memory loans past their deadline (every :data:`EXPIRE_EVERY_S` at most)."""
        now = time.monotonic()
        if self._held_fetches:
            rewriting = self._port.rewriting()
            while self._held_fetches and (not rewriting or self._held_fetches[0][3] <= now):
                identity, header, user, _ = self._held_fetches.popleft()
                self._serve(self._sock, identity, header, user)
        if now < self._next_tick:
            return
        self._next_tick = now + EXPIRE_EVERY_S
        if self._pushes is not None:
            self._pushes.expire(now)
        self._port.expire_loans(now)

    def _answer(self, sock: zmq.Socket, identity: bytes, frame: bytes | None) -> None:
        """Send a small answer (ACK / ERROR) to ``identity``; a full or vanished queue drops it (counted)."""
        if frame is None:
            return
        try:
            sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            self._port.count("answers_dropped", 1)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._port.count("answers_dropped", 1)

    def _handle_one(self, sock: zmq.Socket) -> None:
        """One message from a requester: a FETCH (served), a PUSH, SETTLE, JOIN or MEMBERS (answered), or
        anything else (dropped, counted ``requests_rejected``)."""
        identity = sock.recv(zmq.NOBLOCK)
        if not sock.get(zmq.RCVMORE):
            self._port.count("requests_rejected", 1)
            return
        head = sock.recv(zmq.NOBLOCK, copy=False)
        if sock.get(zmq.RCVMORE):
            self._framed_message(sock, identity, head)
            return
        try:
            header = wire.decode_message(head.buffer)
            if header.kind not in (Kind.FETCH, Kind.PUSH, Kind.SETTLE, Kind.JOIN, Kind.MEMBERS, Kind.RELEASE):
                raise WireError(
                    "header", f"expected FETCH, PUSH, SETTLE, JOIN, MEMBERS or RELEASE, got {header.kind.name}"
                )
        except WireError as exc:
            log.debug("dropping bad request: %s", exc)
            self._port.count("requests_rejected", 1)
            return
        if header.kind in (Kind.JOIN, Kind.MEMBERS):
            self._answer(sock, identity, self._membership(header, user_id(head)))
            return
        if header.kind is Kind.RELEASE:
            self._port.give_back(header, user_id(head))
            return
        if header.kind is not Kind.FETCH:
            self._push_message(sock, identity, header, head)
            return
        if len(self._held_fetches) < MAX_HELD and self._port.rewriting():
            self._held_fetches.append((identity, header, user_id(head), time.monotonic() + HOLD_S))
            self._port.count("fetches_held", 1)
            return
        self._serve(sock, identity, header, user_id(head))

    def _serve(self, sock: zmq.Socket, identity: bytes, header: wire.Fetch, user: str | None) -> None:
        """Answer a FETCH (:meth:`NodePort.serve`): the snapshot, zero-copy, or a shared-memory loan, or an ERROR."""
        try:
            reply = self._port.serve(header, user)
        except Exception:  # pragma: no cover - a bug in a rule's on_serve must not kill the server
            log.exception("serving %s failed", header.node)
            self._port.count("requests_failed", 1)
            return
        frames: list[zmq.Frame] = []
        went = False
        try:
            if reply.payload and reply.stream:
                self._send_stream(sock, identity, reply, frames)
            else:
                self._send_single(sock, identity, reply, frames)
            went = True
            if reply.payload:
                self._port.count("served", 1)
                self._port.count("bytes_out", sum(mv.nbytes for mv in reply.payload))
            elif reply.lent is not None:
                self._port.count("served", 1)
                self._port.count("shm_served", 1)
        except zmq.Again:
            self._port.count("serve_dropped", 1)  # requester's queue full: it will time out and retry
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._port.count("serve_dropped", 1)  # requester vanished
        finally:
            if reply.lent is not None:
                reply.lent(went)
            if reply.sent is not None:
                reply.sent(zmq.MessageTracker(*frames) if frames else None)

    def _framed_message(self, sock: zmq.Socket, identity: bytes, head: zmq.Frame) -> None:
        """A message with a payload frame after ``head``: a streamed push's chunk, or a whole push."""
        tag = wire.decode_chunk_tag(head.buffer)
        if tag is not None and self._pushes is not None:
            self._answer(sock, identity, self._pushes.chunk(identity, tag[0], tag[1], sock))
            return
        if tag is None:
            try:
                header = wire.decode_message(head.buffer)
            except WireError:
                header = None
            if header is not None and header.kind is Kind.PUSH:
                self._push_message(sock, identity, header, head, whole=True)
                return
        discard_rest(sock)
        self._port.count("push_stale_chunks" if tag is not None else "requests_rejected", 1)

    def _push_message(
        self,
        sock: zmq.Socket,
        identity: bytes,
        header: wire.Push | wire.Settle,
        head: zmq.Frame,
        *,
        whole: bool = False,
    ) -> None:
        """A PUSH (``whole``: its payload frame is next on ``sock``) or a SETTLE: hand it to the inbox and
        send its answer."""
        if self._pushes is None:
            if whole:
                discard_rest(sock)
            self._port.count("pushes_unsupported", 1)
            answer = wire.encode_error(
                self._node, header.req, ErrorCode.UNSUPPORTED, "this node's rule takes no pushes"
            )
            self._answer(sock, identity, answer)
            return
        user = user_id(head)
        if header.kind is Kind.PUSH:
            self._membership(header, user)  # the member news it carries
        if whole:
            self._answer(sock, identity, self._pushes.whole(identity, header, user, sock))
        elif header.kind is Kind.PUSH:
            self._answer(sock, identity, self._pushes.begin(identity, header, user))
        else:
            self._answer(sock, identity, self._pushes.settle(identity, header, user))

    def _membership(self, header: wire.Push | wire.Join | wire.Members, user: str | None) -> bytes | None:
        """:meth:`NodePort.answer_membership`, guarded: a bug in the membership code is logged and counted
        (``requests_failed``) and answered with nothing, never kills the server."""
        try:
            return self._port.answer_membership(header, user)
        except Exception:  # pragma: no cover - a bug, not a network fault
            log.exception("the membership news of a %s from %s failed", header.kind.name, header.node)
            self._port.count("requests_failed", 1)
            return None

    def _payload_frame(self, reply: Reply, index: int, frames: list[zmq.Frame]) -> zmq.Frame:
        if reply.prepare is not None:
            reply.prepare(index)
        frame = zmq.Frame(reply.payload[index], copy=False, track=True)
        frames.append(frame)
        return frame

    def _send_single(self, sock: zmq.Socket, identity: bytes, reply: Reply, frames: list[zmq.Frame]) -> None:
        """The header and every payload frame in one multipart message (ZeroMQ delivers it whole)."""
        sock.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
        if not reply.payload:
            sock.send(reply.header, zmq.NOBLOCK)
            return
        sock.send(reply.header, zmq.SNDMORE | zmq.NOBLOCK)
        last = len(reply.payload) - 1
        for i in range(last + 1):
            frame = self._payload_frame(reply, i, frames)
            sock.send(frame, (zmq.SNDMORE if i < last else 0) | zmq.NOBLOCK, copy=False)

    def _send_stream(self, sock: zmq.Socket, identity: bytes, reply: Reply, frames: list[zmq.Frame]) -> None:
        """The header alone, then one ``[tag, chunk]`` message per chunk: the requester takes each as it lands.

        A full queue after the header leaves the reply cut short: the requester times out (counted as dropped).
        """
        sock.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
        head = zmq.Frame(reply.header, track=True)
        sock.send(head, zmq.NOBLOCK, copy=False)
        frames.append(head)  # from here on the reply counts as sent: the requester holds its header
        for i in range(len(reply.payload)):
            frame = self._payload_frame(reply, i, frames)
            sock.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(wire.encode_chunk_tag(reply.req, i), zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(frame, zmq.NOBLOCK, copy=False)
