"""How a node is wired to its transport: the one object the transport's threads hold, and the transport itself.

The transport (:mod:`dpwa.node.transport`) talks to the node through a
:class:`~dpwa.node.transport.NodePort`. :class:`TransportLink` is that port for a real node: each call goes to the
node's method for that role (:class:`Wired` lists them), plus the node's member news and counters. The threads
hold the link, never the node's other attributes.

:func:`open_transport` builds the node's transport with the factory the node was given (the real
:class:`~dpwa.node.transport.Transport`, or a wrapping one from a test), bound at the node's address, with CURVE
as the cluster file sets it (:func:`curve_security`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dpwa.config import ClusterConfig, NodeSpec
from dpwa.node import wire
from dpwa.node.inbox import PushReceiver
from dpwa.node.loans import Loans
from dpwa.node.membership import Membership
from dpwa.node.pushes import Push
from dpwa.node.snapshots import SnapshotPool
from dpwa.node.states import PushStatus
from dpwa.node.stats import NodeStats
from dpwa.node.timeouts import Timeouts
from dpwa.node.transport import (
    FetchJob,
    FetchTarget,
    Reply,
    SecurityFactory,
    Transport,
    TransportFactory,
    bind_endpoint,
)
from dpwa.node.wire import Layout, MemberNews
from dpwa.security.curve import NodeSecurity

__all__ = ["TransportLink", "Wired", "curve_security", "open_transport", "raise_if_dead"]


class Wired(Protocol):
    """What the link and the transport use of the node (:class:`dpwa.node.core.Node` is one)."""

    name: str
    config: ClusterConfig
    timeouts: Timeouts
    inbox: PushReceiver | None
    membership: Membership
    stats: NodeStats

    def layouts(self) -> tuple[Layout, Layout] | None: ...

    host_id: str
    loans: Loans

    pool: SnapshotPool | None

    def serve(self, request: wire.Fetch, user: str | None) -> Reply: ...

    def give_back(self, release: wire.Release, user: str | None) -> None: ...

    def answer_membership(self, header: wire.Push | wire.Join | wire.Members, user: str | None) -> bytes | None: ...

    def fetch_done(self, job: FetchJob, target: FetchTarget) -> None: ...

    def push_settled(self, push: Push, status: PushStatus, code: str) -> None: ...

    def push_unanswered(self, push: Push) -> None: ...

    def auth_denied(self, address: str) -> None: ...


class TransportLink:
    """``node`` as its transport sees it: a :class:`~dpwa.node.transport.NodePort` (see there for which thread
    calls what); every method returns promptly."""

    def __init__(self, node: Wired) -> None:
        self._node = node

    @property
    def inbox(self) -> PushReceiver | None:
        return self._node.inbox

    def layouts(self) -> tuple[Layout, Layout] | None:
        return self._node.layouts()

    @property
    def host_id(self) -> str:
        return self._node.host_id

    def serve(self, request: wire.Fetch, user: str | None) -> Reply:
        return self._node.serve(request, user)

    def rewriting(self) -> bool:
        pool = self._node.pool
        return pool is not None and pool.rewriting

    def give_back(self, release: wire.Release, user: str | None) -> None:
        self._node.give_back(release, user)

    def expire_loans(self, now: float) -> None:
        self._node.loans.expire(now)

    def answer_membership(self, message: wire.Push | wire.Join | wire.Members, user: str | None) -> bytes | None:
        return self._node.answer_membership(message, user)

    def fetch_done(self, job: FetchJob, target: FetchTarget) -> None:
        self._node.fetch_done(job, target)

    def push_settled(self, push: Push, status: PushStatus, code: str) -> None:
        self._node.push_settled(push, status, code)

    def push_unanswered(self, push: Push) -> None:
        self._node.push_unanswered(push)

    def news_for(self, peer: str) -> MemberNews | None:
        return self._node.membership.news_for(peer)

    def count(self, event: str, n: int = 1) -> None:
        self._node.stats.add(event, n)

    def auth_denied(self, address: str) -> None:
        self._node.auth_denied(address)


def curve_security(name: str, config: ClusterConfig) -> SecurityFactory | None:
    """Node ``name``'s CURVE security as ``config`` sets it (None without ``security.curve``). The transport calls
    it with its context before its ROUTER binds: the keys are read (KeyFileError) and the ZAP handler started."""
    if not config.security.curve:
        return None
    return lambda ctx, on_denied: NodeSecurity(
        name, config.check_secret_key(name), config.public_key_files(), ctx, on_denied, keys_dir=config.security.keys
    )


def open_transport(node: Wired, factory: TransportFactory, me: NodeSpec, peers: Sequence[NodeSpec]) -> Transport:
    """``node``'s transport from ``factory``, bound at ``me``'s address (not started), fetching from ``peers``.
    Raises what binding raises (:class:`~dpwa.node.transport.PortInUseError`, a key file error) with nothing left
    running."""
    return factory(
        node.name,
        bind_endpoint(me.host, me.port),
        {p.name: p.endpoint for p in peers},
        TransportLink(node),
        node.timeouts,
        security=curve_security(node.name, node.config),
    )


def raise_if_dead(transport: Transport, name: str, join_s: float) -> None:
    """Raise RuntimeError, the original exception chained, when node ``name``'s RX or TX thread died of a bug.

    The dead thread is joined first (it is only closing its sockets; at most ``join_s``), so once the trainer has
    seen the death, the node's statistics report the thread as ended too.
    """
    for role, thread, lost in (("TX", transport.tx, "fetch from"), ("RX", transport.rx, "serve")):
        if thread.failure is not None:
            thread.join(timeout=join_s)
            raise RuntimeError(
                f"node {name}: the {role} thread died of {thread.failure!r}, so the node can no longer "
                f"{lost} its peers (traceback in the log); close the connection"
            ) from thread.failure
