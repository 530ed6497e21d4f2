"""The one object the transport talks to the node through: :class:`NodePort`.

The transport's threads never hold the node itself. The RX thread asks the port what to serve and hands it
membership messages; the TX thread asks it for the layouts and reports every verdict to it; every thread counts
through it. A node passes an object with these methods (a real node its :class:`~dpwa.node.wiring.TransportLink`;
a test may pass a fake).

Which thread calls what, and its contract:

* ``inbox`` (read once, when the transport is built) -- the :class:`~dpwa.node.inbox.PushReceiver` pushes go into,
  or None (pushes are answered ``unsupported``);
* :meth:`NodePort.layouts` (RX, TX) -- ``(wire, local)`` layouts, or None before the node's first publish;
* :meth:`NodePort.serve` (RX) -- the :class:`Reply` to a FETCH;
* :meth:`NodePort.answer_membership` (RX) -- the answer to a JOIN or MEMBERS (None: none), or a PUSH's member news;
* :meth:`NodePort.fetch_done` (TX, or the trainer when it times a fetch out itself) -- a fetch target has its
  verdict, once per target;
* :meth:`NodePort.push_settled` (TX) -- a push was answered: ``delivered`` (ACK) or ``refused`` (ERROR);
* :meth:`NodePort.push_unanswered` (TX) -- a push's deadline, or a SETTLE query's ``retry_s``, passed unanswered;
* :meth:`NodePort.news_for` (TX) -- the member news to piggyback on a request to a peer;
* :meth:`NodePort.count` (any thread) -- add ``n`` to a counter;
* :meth:`NodePort.auth_denied` (ZAP) -- a connection was refused by CURVE authentication.

Every method returns promptly: a port that blocks stalls the thread that called it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq

from dpwa.node import wire
from dpwa.node.inbox import PushReceiver
from dpwa.node.pushes import Push
from dpwa.node.states import PushStatus
from dpwa.node.transport.fetch import FetchJob, FetchTarget
from dpwa.node.wire import Layout, MemberNews

__all__ = ["NodePort", "Reply"]


@dataclass
class Reply:
    """What :meth:`NodePort.serve` returns and the RX thread sends: a header frame, zero-copy payload frames,
    and hooks run while and after sending."""

    header: bytes
    payload: Sequence[memoryview] = ()
    sent: Callable[[zmq.MessageTracker | None], None] | None = None
    """Called once with the send's tracker (None when the reply was dropped)."""
    prepare: Callable[[int], None] | None = None
    """Called with a payload index before that frame is sent (fills a wire buffer chunk by chunk)."""
    stream: bool = False
    """Send the payload as one message per chunk, each tagged with ``req`` and its index."""
    req: int = 0
    lent: Callable[[bool], None] | None = None
    """A shared-memory reply (no payload): called once with whether its header went out."""


class NodePort(Protocol):
    """What the transport's threads call on the node (see the module doc-string for who calls what)."""

    @property
    def inbox(self) -> PushReceiver | None:
        """The inbox the RX thread hands pushes and SETTLEs to; None for a pull-only rule (pushes are answered
        ``unsupported``). Read once, when the transport is built."""
        ...

    def layouts(self) -> tuple[Layout, Layout] | None:
        """``(wire, local)``: the layout replies arrive in (its fingerprint is what peers must match) and the
        layout of the receive buffers; None before the node's first publish."""
        ...

    @property
    def host_id(self) -> str:
        """This node's co-location identity for its FETCHes (dpwa/node/sharedmem.py); "": shared memory off."""
        ...

    def serve(self, request: wire.Fetch, user: str | None) -> Reply:
        """The reply to a valid FETCH (the snapshot, or an ERROR header); called on the RX thread. ``user``: the
        requester's CURVE identity (None without CURVE)."""
        ...

    def rewriting(self) -> bool:
        """The node is rewriting its one snapshot buffer (``transport.memory: low``): a FETCH served now would be
        declined "not ready", so the RX thread holds it back a moment (any thread)."""
        ...

    def give_back(self, release: wire.Release, user: str | None) -> None:
        """A RELEASE: the requester is done with the snapshot lent to its request (RX thread)."""
        ...

    def expire_loans(self, now: float) -> None:
        """End the shared-memory loans whose deadline passed (RX thread, at its ticks)."""
        ...

    def answer_membership(self, message: wire.Push | wire.Join | wire.Members, user: str | None) -> bytes | None:
        """A JOIN or MEMBERS (the answer to send, or None), or a PUSH whose member news to take (None).
        ``user``: the sender's CURVE identity (None without CURVE)."""
        ...

    def fetch_done(self, job: FetchJob, target: FetchTarget) -> None:
        """``target`` of ``job`` has its verdict: count it, feed flow control."""
        ...

    def push_settled(self, push: Push, status: PushStatus, code: str) -> None:
        """``push`` was answered: :attr:`~PushStatus.DELIVERED` or :attr:`~PushStatus.REFUSED` with ``code``."""
        ...

    def push_unanswered(self, push: Push) -> None:
        """``push`` had no answer by its deadline, or a SETTLE query about it went unanswered for ``retry_s``;
        the port marks it :attr:`~PushStatus.UNKNOWN` (the TX thread goes on asking)."""
        ...

    def news_for(self, peer: str) -> MemberNews | None:
        """The member news a request to ``peer`` carries (None: none)."""
        ...

    def count(self, event: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``event`` (any thread)."""
        ...

    def auth_denied(self, address: str) -> None:
        """A connection from ``address`` was refused by CURVE authentication (the ZAP thread)."""
        ...
