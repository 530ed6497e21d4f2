"""The transport: the only owner of a node's ZeroMQ context and sockets, split by role.

* ``sockets`` -- socket options, addresses, the self-connection check, :class:`PortInUseError`;
* ``protocol`` -- :class:`NodePort`, the one object the transport talks to the node through, and :class:`Reply`;
* ``fetch`` -- :class:`FetchJob` and :class:`FetchTarget`: one fetch and its verdicts;
* ``headers`` -- the FETCH and PUSH headers the TX thread sends, with their fallbacks;
* ``rx`` -- :class:`RxServer`, the RX thread: the bound ROUTER (serves, takes pushes and membership messages);
* ``tx`` -- :class:`TxFetcher`, the TX thread: one DEALER per peer (fetches, pushes, SETTLEs);
* ``control`` -- :class:`ControlPlane`: short-lived DEALERs for JOIN and MEMBERS, on the trainer's thread.

:class:`Transport` puts them together for one node: it creates the context, starts CURVE (its ZAP handler must
be bound before the ROUTER), binds the RX server, builds the TX client and the control plane, and stops and
closes all of it in the right order. The node hands it one :class:`NodePort` and talks to its peers only through
it. Tests and tools may pass a wrapping transport instead (a subclass whose :meth:`Transport.make_rx` /
:meth:`Transport.make_tx` return threads that drop, delay or fail on purpose): the node takes a transport
factory as an argument.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import zmq

from dpwa.node.pushes import Push
from dpwa.node.timeouts import Timeouts
from dpwa.node.transport.control import ControlPlane
from dpwa.node.transport.fetch import LATE_DETAIL, NOT_A_MEMBER, VERDICT_SLACK_S, FetchJob, FetchTarget
from dpwa.node.transport.protocol import NodePort, Reply
from dpwa.node.transport.rx import RxServer
from dpwa.node.transport.sockets import (
    HEARTBEAT_MS,
    HEARTBEAT_TIMEOUT_MS,
    MAX_REQUEST_BYTES,
    REPLY_QUEUE_MESSAGES,
    PortInUseError,
    bind_endpoint,
    common_options,
    connect_address,
    is_own_echo,
    push_send_hwm,
    tune_data_socket,
)
from dpwa.node.transport.tx import MAX_MESSAGES_PER_WAKE, TxFetcher
from dpwa.security.curve import NodeSecurity, warn_if_exposed

__all__ = [
    "HEARTBEAT_MS",
    "HEARTBEAT_TIMEOUT_MS",
    "LATE_DETAIL",
    "MAX_MESSAGES_PER_WAKE",
    "MAX_REQUEST_BYTES",
    "NOT_A_MEMBER",
    "REPLY_QUEUE_MESSAGES",
    "VERDICT_SLACK_S",
    "ControlPlane",
    "FetchJob",
    "FetchTarget",
    "NodePort",
    "PortInUseError",
    "Reply",
    "RxServer",
    "SecurityFactory",
    "Transport",
    "TransportFactory",
    "TxFetcher",
    "bind_endpoint",
    "common_options",
    "connect_address",
    "is_own_echo",
    "push_send_hwm",
    "tune_data_socket",
]

log = logging.getLogger(__name__)

SecurityFactory = Callable[[zmq.Context, Callable[[str], None]], NodeSecurity]
"""Starts a node's CURVE security in the transport's context: ``factory(ctx, on_denied)`` reads the keys and starts
the ZAP handler, which reports each refused connection's address to ``on_denied``."""


class Transport:
    """Every socket and transport thread of node ``name``: the RX server bound at ``endpoint``, the TX client
    fetching from and pushing to ``peers`` (name -> tcp:// endpoint), and the control plane.

    ``port``: the node (:class:`NodePort`); ``timeouts``: its time limits (``exchange_s`` is the TX client's
    SETTLE retry, ``control_reconnect_ms`` the control sockets' reconnect interval, ``thread_join_s`` how long
    :meth:`close` waits for each thread); ``security``: CURVE (None: plain TCP). The constructor binds: a busy
    port raises :class:`PortInUseError`, a bad key :class:`~dpwa.security.keyfiles.KeyFileError`, with nothing
    left running. The threads start at :meth:`start`; :meth:`stop` then :meth:`close` end them and free the port.
    """

    def __init__(
        self,
        name: str,
        endpoint: str,
        peers: Mapping[str, str],
        port: NodePort,
        timeouts: Timeouts,
        *,
        security: SecurityFactory | None = None,
    ) -> None:
        self.name = name
        self.timeouts = timeouts
        self.ctx = zmq.Context(io_threads=1)
        self.security: NodeSecurity | None = None
        """The node's CURVE keys and ZAP handler (None without CURVE)."""
        try:
            if security is not None:  # reads the keys and starts the ZAP handler: before the ROUTER binds
                self.security = security(self.ctx, port.auth_denied)
            self.rx = self.make_rx(endpoint, port)
        except BaseException:  # a busy port, a missing key: stop what started, then raise
            self._abandon()
            raise
        warn_if_exposed(name, self.rx.endpoint, curve=self.security is not None)
        try:
            self.tx = self.make_tx(dict(peers), port)
        except BaseException:  # the RX server is bound but never ran: close its socket too
            self.rx.close_socket()
            self._abandon()
            raise
        client = self.security.client if self.security is not None else None
        self.control = ControlPlane(self.ctx, name, port, setup=client, reconnect_ms=timeouts.control_reconnect_ms)

    def _abandon(self) -> None:
        """Construction failed: stop the ZAP handler (if it started) and end the context."""
        if self.security is not None:
            self.security.stop()
        self.ctx.term()

    def make_rx(self, endpoint: str, port: NodePort) -> RxServer:
        """The RX server, bound at ``endpoint`` (not started). A wrapping transport overrides this."""
        return RxServer(
            self.ctx,
            endpoint,
            port,
            node=self.name,
            name=f"dpwa-rx-{self.name}",
            setup=self.security.server if self.security is not None else None,
        )

    def make_tx(self, peers: dict[str, str], port: NodePort) -> TxFetcher:
        """The TX client (not started); it pushes when the node takes pushes (``port.inbox``: push and exchange
        rules). A wrapping transport overrides this."""
        return TxFetcher(
            self.ctx,
            self.name,
            peers,
            port,
            name=f"dpwa-tx-{self.name}",
            setup=self.security.client if self.security is not None else None,
            pushes=port.inbox is not None,
            retry_s=self.timeouts.exchange_s,
        )

    @property
    def endpoint(self) -> str:
        """The tcp:// endpoint the RX server is bound to."""
        return self.rx.endpoint

    def start(self) -> None:
        """Start the RX and TX threads (once)."""
        self.rx.start()
        self.tx.start()

    def submit(self, job: FetchJob) -> None:
        """Hand a fetch job to the TX thread (any thread); its verdicts go to ``port.fetch_done``."""
        self.tx.submit(job)

    def submit_release(self, peer: str, req: int) -> None:
        """Give back the snapshot ``peer`` lent (shared memory) to request ``req``: a RELEASE from the TX thread."""
        self.tx.submit_release(peer, req)

    def submit_push(self, push: Push) -> None:
        """Hand a push (already in the node's ledger) to the TX thread; its verdict goes to ``port.push_settled``."""
        self.tx.submit_push(push)

    def set_peer(self, peer: str, endpoint: str | None) -> None:
        """Fetch from and push to ``peer`` at ``endpoint`` from now on (None: it is gone)."""
        self.tx.set_peer(peer, endpoint)

    def threads(self) -> dict[str, RxServer | TxFetcher]:
        """The transport's threads by role, ``"tx"`` first (the one a trainer depends on at once)."""
        return {"tx": self.tx, "rx": self.rx}

    def failures(self) -> dict[str, BaseException]:
        """Role -> the exception that ended that thread, for each thread that died of a bug."""
        return {role: thread.failure for role, thread in self.threads().items() if thread.failure is not None}

    def owns(self, thread: threading.Thread) -> bool:
        """True when ``thread`` is one of the transport's threads."""
        return thread in (self.rx, self.tx)

    def stop(self) -> None:
        """Ask both threads to end (each is woken at once); returns at once."""
        self.rx.stop()
        self.tx.stop()

    def close(self) -> bool:
        """After :meth:`stop`: join both threads (at most ``timeouts.thread_join_s`` seconds each), stop the ZAP
        thread, end the context (the port is free). False, with the context left open and an error logged, when
        a thread did not stop."""
        self.rx.join(timeout=self.timeouts.thread_join_s)
        self.tx.join(timeout=self.timeouts.thread_join_s)
        self.tx.close_waker()
        if self.rx.is_alive() or self.tx.is_alive():  # pragma: no cover - a stuck thread is a bug
            log.error("node %s: a dpwa thread did not stop; leaving its context open", self.name)
            return False
        if self.security is not None and not self.security.stop():  # only now: the ROUTER is closed
            log.error("node %s: the ZAP thread did not stop; leaving its context open", self.name)  # pragma: no cover
            return False
        self.ctx.term()
        return True


class TransportFactory(Protocol):
    """What builds a node's transport: called like :class:`Transport` (the default); tests and tools may pass a
    wrapping transport (a subclass, or a ``functools.partial`` of one with its own arguments bound)."""

    def __call__(
        self,
        name: str,
        endpoint: str,
        peers: Mapping[str, str],
        port: NodePort,
        timeouts: Timeouts,
        *,
        security: SecurityFactory | None = None,
    ) -> Transport: ...
