"""Fakes for the tests: a peer that is not a node, and a transport that injects faults into a real node.

* :class:`FakePeer` -- a ROUTER bound where a node expects a peer, answering its FETCH requests;
* :class:`Faults` and :class:`FaultyTransport` -- a node built with ``transport=faults.factory`` runs the real
  transport, except that its RX server loses or delays pushes and ACKs and its threads call the test's hooks at
  chosen points (to die or stall there). Production classes carry no test hooks: the faults live here.

Imported like conftest (``from fakes import FakePeer``): tests/ is on sys.path.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable

import zmq

from dpwa.node import wire
from dpwa.node.frames import discard_rest
from dpwa.node.inbox import PushReceiver
from dpwa.node.transport import FetchJob, NodePort, RxServer, Transport, TxFetcher

Messages = list[list[bytes]]
"""The messages a peer sends back for one request, in order; each is a list of frames."""


class FakePeer:
    """A ROUTER bound on 127.0.0.1:``port``; a thread answers each FETCH with the messages ``respond`` builds.

    ``respond(header)`` gets the decoded FETCH header and returns the reply messages (none: no answer); it may be
    replaced at any time. Every request header is kept in ``requests``, in arrival order. ``close`` stops the thread,
    closes the socket without lingering and ends the context: no thread or bound port is left.
    """

    def __init__(
        self,
        port: int,
        respond: Callable[[wire.Message], Messages] = lambda header: [],
        *,
        thread_name: str | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.respond = respond
        self.requests: list[wire.Message] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=thread_name)
        self._thread.start()

    def replies(self, header: wire.Message) -> Messages:
        """The messages that answer ``header``: what ``respond`` builds (a subclass may adapt it)."""
        return self.respond(header)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                identity, frame = self.sock.recv_multipart()
                header = wire.decode_message(frame)
                self.requests.append(header)
                for message in self.replies(header):
                    self.sock.send_multipart([identity, *message])

    def close(self) -> None:
        """Stop answering and release the port."""
        self._stop.set()
        self._thread.join(2)
        self.sock.close(linger=0)
        self.ctx.term()


# --------------------------------------------------------------------------- fault injection through the transport


class Faults:
    """What a :class:`FaultyTransport` does wrong, changeable at any time from the test's thread.

    * ``drop(kind)``: called with ``"push"`` for every push header that arrives (True: ignore it, as if lost on
      the wire; its chunks then arrive as strays) and with ``"ack"`` for the ACK of every push taken whole (True:
      the receiver took the push, the sender never hears);
    * ``ack_delay_s``: hold every such ACK this long (a slow receiver); the RX thread sends it when it is due;
    * ``before[point]``: called on the dpwa thread just before the named step runs (it may raise, to kill the
      thread, or block, to stall it): ``"tx.start"`` (a fetch job is started), ``"tx.receive"`` (a peer's socket
      is read), ``"tx.header"`` (a reply's header is taken), ``"tx.close"`` (the dying thread closes its sockets),
      ``"rx.handle"`` (a request is read).

    ``counts`` counts what was done (``pushes_dropped``, ``acks_dropped``, ``acks_delayed``); ``transport`` is the
    transport built with these faults (the latest one).
    """

    def __init__(self, drop: Callable[[str], bool] | None = None, ack_delay_s: float = 0.0) -> None:
        self.drop = drop
        self.ack_delay_s = ack_delay_s
        self.before: dict[str, Callable[..., None]] = {}
        self.counts: Counter[str] = Counter()
        self.transport: FaultyTransport | None = None

    @property
    def factory(self) -> Callable[..., Transport]:
        """The transport factory a node takes (``DpwaConnection(..., transport=faults.factory)``)."""
        return functools.partial(FaultyTransport, faults=self)

    def hit(self, point: str, *args: object) -> None:
        """Run the hook of ``point``, if one is set."""
        hook = self.before.get(point)
        if hook is not None:
            hook(*args)

    def dropped(self, kind: str) -> bool:
        """True when ``drop`` says to lose this ``kind`` (counted)."""
        if self.drop is not None and self.drop(kind):
            self.counts["pushes_dropped" if kind == "push" else "acks_dropped"] += 1
            return True
        return False


class FaultyInbox:
    """The node's inbox as a :class:`FaultyRxServer` hands it pushes: drops push headers and drops or holds the
    ACK of a push taken whole; everything else goes to the real inbox."""

    def __init__(self, inbox: PushReceiver, faults: Faults) -> None:
        self._inbox = inbox
        self._faults = faults
        self._held: list[tuple[float, bytes, bytes]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> object:
        return getattr(self._inbox, name)

    def begin(self, identity: bytes, header: wire.Push, user: str | None) -> bytes | None:
        if self._faults.dropped("push"):
            return None
        return self._ack(identity, self._inbox.begin(identity, header, user))  # a push through shared memory: whole

    def whole(self, identity: bytes, header: wire.Push, user: str | None, sock: zmq.Socket) -> bytes | None:
        if self._faults.dropped("push"):
            discard_rest(sock)
            return None
        return self._ack(identity, self._inbox.whole(identity, header, user, sock))

    def chunk(self, identity: bytes, seq: int, index: int, sock: zmq.Socket) -> bytes | None:
        return self._ack(identity, self._inbox.chunk(identity, seq, index, sock))

    def _ack(self, identity: bytes, answer: bytes | None) -> bytes | None:
        """``answer`` as sent: an ACK may be lost or held back; anything else goes as it is."""
        if answer is None or wire.decode_message(answer).kind is not wire.Kind.ACK:
            return answer
        if self._faults.dropped("ack"):
            return None
        if self._faults.ack_delay_s > 0:
            self._faults.counts["acks_delayed"] += 1
            with self._lock:
                self._held.append((time.monotonic() + self._faults.ack_delay_s, identity, answer))
            return None
        return answer

    def due(self, now: float) -> list[tuple[bytes, bytes]]:
        """The held ACKs due by ``now``: ``(identity, frame)`` pairs, taken out."""
        with self._lock:
            due = [(identity, frame) for at, identity, frame in self._held if at <= now]
            self._held = [held for held in self._held if held[0] > now]
        return due


class _FaultyPort:
    """The node's port as the faulty RX server sees it: the same, but its inbox is a :class:`FaultyInbox`."""

    def __init__(self, port: NodePort, inbox: FaultyInbox | None) -> None:
        self._port = port
        self.inbox = inbox

    def __getattr__(self, name: str) -> object:
        return getattr(self._port, name)


class FaultyRxServer(RxServer):
    """The RX server with :class:`Faults`: pushes and ACKs lost or delayed, a hook before each request."""

    def __init__(self, ctx: zmq.Context, endpoint: str, port: NodePort, *, faults: Faults, **kwargs: object) -> None:
        self._faults = faults
        self._inbox = FaultyInbox(port.inbox, faults) if port.inbox is not None else None
        super().__init__(ctx, endpoint, _FaultyPort(port, self._inbox), **kwargs)  # type: ignore[arg-type]

    def _handle_one(self, sock: zmq.Socket) -> None:
        self._faults.hit("rx.handle")
        super()._handle_one(sock)

    def _tick(self) -> None:
        super()._tick()
        if self._inbox is not None:
            for identity, frame in self._inbox.due(time.monotonic()):
                self._answer(self._sock, identity, frame)


class FaultyTxFetcher(TxFetcher):
    """The TX client with :class:`Faults`: a hook before starting a job, reading a socket, taking a reply's
    header, and closing its sockets."""

    def __init__(self, *args: object, faults: Faults, **kwargs: object) -> None:
        self._faults = faults
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _start(self, poller: zmq.Poller, job: FetchJob) -> None:
        self._faults.hit("tx.start")
        super()._start(poller, job)

    def _receive(self, *args: object) -> None:
        self._faults.hit("tx.receive")
        super()._receive(*args)  # type: ignore[arg-type]

    def _header_message(self, *args: object) -> None:
        self._faults.hit("tx.header")
        super()._header_message(*args)  # type: ignore[arg-type]

    def _close_sockets(self) -> None:
        self._faults.hit("tx.close")
        super()._close_sockets()


class FaultyTransport(Transport):
    """The real transport with a :class:`FaultyRxServer` and a :class:`FaultyTxFetcher` that do what ``faults``
    says; build nodes with ``transport=faults.factory``."""

    def __init__(self, *args: object, faults: Faults, **kwargs: object) -> None:
        self.faults = faults
        faults.transport = self
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def make_rx(self, endpoint: str, port: NodePort) -> RxServer:
        return FaultyRxServer(
            self.ctx,
            endpoint,
            port,
            faults=self.faults,
            node=self.name,
            name=f"dpwa-rx-{self.name}",
            setup=self.security.server if self.security is not None else None,
        )

    def make_tx(self, peers: dict[str, str], port: NodePort) -> TxFetcher:
        return FaultyTxFetcher(
            self.ctx,
            self.name,
            peers,
            port,
            faults=self.faults,
            name=f"dpwa-tx-{self.name}",
            setup=self.security.client if self.security is not None else None,
            pushes=port.inbox is not None,
            retry_s=self.timeouts.exchange_s,
        )
