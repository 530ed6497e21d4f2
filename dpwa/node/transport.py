"""ZeroMQ sockets and the two threads that own them.

* :class:`RxServer` binds a ROUTER and answers every FETCH with the latest
  snapshot, zero-copy; a slow or vanished requester only fills its own queue.
  A requester that asks for it gets the reply streamed: the header, then one
  message per chunk (``dpwa.node.wire``), so it can take chunk *i* while the next
  ones are still on the wire.
* :class:`TxFetcher` owns one DEALER per peer, runs one fetch job at a time
  against a hard deadline, takes each payload chunk from ZeroMQ's buffer into a
  preallocated receive buffer, copying (or widening a 16-bit wire dtype) and
  validating it in one pass, and after a timeout -- or a broken stream -- closes
  and reopens the peer's socket (Lazy Pirate) so a late reply is never taken
  for the next one. Its DEALERs refuse any frame larger than a valid reply's
  (ZMQ_MAXMSGSIZE from the layout); every message that belongs to no fetch in
  flight is dropped and counted (``stale_replies``).

Every wait here is a poll with a timeout; ``stop()`` ends a thread within
``POLL_MS`` milliseconds. A thread that dies of a bug keeps the exception in
``failure`` (DpwaConnection raises it in the trainer's next call).
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from dpwa.node import wire
from dpwa.node.frames import discard_rest, receive_payload
from dpwa.node.inbox import PushReceiver
from dpwa.node.pushes import Push
from dpwa.node.wire import CHUNK_BYTES, ErrorCode, Kind, Layout, MemberNews, PayloadReader, WireError
from dpwa.utils.socket_thread import POLL_MS, SocketThread

__all__ = [
    "HEARTBEAT_MS",
    "HEARTBEAT_TIMEOUT_MS",
    "LATE_DETAIL",
    "NOT_A_MEMBER",
    "MAX_MESSAGES_PER_WAKE",
    "MAX_REQUEST_BYTES",
    "REPLY_QUEUE_MESSAGES",
    "VERDICT_SLACK_S",
    "FetchJob",
    "FetchTarget",
    "PortInUseError",
    "Reply",
    "RxServer",
    "TxFetcher",
    "push_send_hwm",
    "tune_data_socket",
]

log = logging.getLogger(__name__)

HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
MAX_REQUEST_BYTES = wire.MAX_HEADER_BYTES
REPLY_QUEUE_MESSAGES = 1 << 15
"""Messages the RX ROUTER queues per requester before it drops a reply (its SNDHWM). Set once, before it binds:
libzmq forwards an HWM change to the pipe of every connection, and a connection being torn down at that moment
(a peer closing a socket) gets it after its pipe was freed -- a crash of the I/O thread. A streamed reply needs
its chunks + 1 messages: one of up to 128 GiB fits; a requester that stops reading holds at most this many."""


OWN_REQUESTS = frozenset({Kind.FETCH, Kind.PUSH, Kind.SETTLE, Kind.JOIN, Kind.MEMBERS})
"""Kinds a node sends on its DEALERs: one coming back to the same node means the socket is connected to itself."""


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


NOT_A_MEMBER = "not-a-member"
"""The code of a fetch or push refused here, without a message: its peer left or was forgotten."""


def _common_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def push_send_hwm(chunks: int, others: int = 4) -> int:
    """SNDHWM of a pushing DEALER: room for one streamed push (a header and ``chunks`` messages) and ``others``.

    libzmq's writer learns that its reader took messages only every ``(hwm + 1) // 2`` messages, so
    right after a push that the receiver took whole it may still count up to half the mark as queued.
    Twice the need is what always fits: a push cut short by a full queue would wait a whole
    ``timeout_ms`` for its SETTLE."""
    return 2 * (chunks + 1 + others)


def tune_data_socket(sock: zmq.Socket) -> None:
    """Options of every socket that carries payloads (RX ROUTER, TX DEALER, and the bench's raw sockets).

    Deliberately none today: fixed SO_SNDBUF/SO_RCVBUF of 256 KiB to 4 MiB measured no
    faster than Linux's buffer autotuning on loopback (``dpwa bench exchange``), and
    setting them turns autotuning off. This is the one place to add such options, so
    that the benchmark's raw-pyzmq reference always gets the same ones.
    """


# --------------------------------------------------------------------------- RX


@dataclass
class Reply:
    """What the RX thread sends back: a header frame, zero-copy payload frames, and a hook run after sending."""

    header: bytes
    payload: Sequence[memoryview] = ()
    sent: Callable[[zmq.MessageTracker | None], None] | None = None
    """Called once with the send's tracker (None when the reply was dropped)."""
    prepare: Callable[[int], None] | None = None
    """Called with a payload index before that frame is sent (fills a wire buffer chunk by chunk)."""
    stream: bool = False
    """Send the payload as one message per chunk, each tagged with ``req`` and its index."""
    req: int = 0


def _user_id(frame: zmq.Frame) -> str | None:
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


class RxServer(SocketThread):
    """Serves FETCH requests on a bound ROUTER socket by calling ``serve(header) -> Reply``.

    With ``pushes`` it also takes PUSH messages (header, then tagged chunks) and SETTLEs into that
    inbox and answers them (ACK / ERROR); without, it answers both with ERROR ``unsupported``, and
    its frames stay limited to a request's size. A failure (DpwaConnection raises it in the
    trainer's next call) means the node no longer serves."""

    failure_message = "RX thread failed: this node no longer serves its peers"

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        serve: Callable[[wire.Fetch], Reply],
        on_event: Callable[[str, int], None],
        *,
        name: str = "dpwa-rx",
        sndhwm: int = REPLY_QUEUE_MESSAGES,
        setup: Callable[[zmq.Socket], None] | None = None,
        pushes: PushReceiver | None = None,
        chunk: int = CHUNK_BYTES,
        node: str = "-",
        membership: Callable[[wire.Push | wire.Join | wire.Members, str | None], bytes | None] | None = None,
    ) -> None:
        # Bind here, in the caller's thread, so that a busy port fails the constructor loudly.
        super().__init__(ctx.socket(zmq.ROUTER), name=name)
        self._serve = serve
        self._on_event = on_event
        self._pushes = pushes
        self._node = node
        self._membership = membership
        self._next_tick = 0.0
        _common_options(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.RCVHWM, 64)
        # A push's chunk frames are up to a chunk; a node that takes no pushes keeps a request's limit.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_REQUEST_BYTES, chunk) if pushes else MAX_REQUEST_BYTES)
        tune_data_socket(self._sock)
        try:
            if setup is not None:  # e.g. make it a CURVE server (dpwa.security.curve); must precede bind
                setup(self._sock)
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:  # taken since `dpwa run` checked it (dpwa.launcher.ports), or no launcher
                raise PortInUseError(f"node {node}: cannot bind {endpoint}: the port is already in use") from None
            raise OSError(f"cannot bind {endpoint}: {exc}") from exc
        self.endpoint = endpoint

    def _poll_ms(self) -> int:
        return 10 if self._pushes is not None else POLL_MS

    def _tick(self) -> None:
        """Expire pushes that stalled and send ACKs a test hook held back (every 10 ms at most)."""
        if self._pushes is None:
            return
        now = time.monotonic()
        if now < self._next_tick:
            return
        self._next_tick = now + 0.01
        self._pushes.expire(now)
        for identity, frame in self._pushes.take_delayed(now):
            self._answer(self._sock, identity, frame)

    def _answer(self, sock: zmq.Socket, identity: bytes, frame: bytes | None) -> None:
        """Send a small answer (ACK / ERROR) to ``identity``; a full or vanished queue drops it (counted)."""
        if frame is None:
            return
        try:
            sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            self._on_event("answers_dropped", 1)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._on_event("answers_dropped", 1)

    def _handle_one(self, sock: zmq.Socket) -> None:
        identity = sock.recv(zmq.NOBLOCK)
        if not sock.get(zmq.RCVMORE):
            self._on_event("requests_rejected", 1)
            return
        head = sock.recv(zmq.NOBLOCK, copy=False)
        if sock.get(zmq.RCVMORE):
            self._framed_message(sock, identity, head)
            return
        try:
            header = wire.decode_message(head.buffer)
            if header.kind not in (Kind.FETCH, Kind.PUSH, Kind.SETTLE, Kind.JOIN, Kind.MEMBERS):
                raise WireError("header", f"expected FETCH, PUSH, SETTLE, JOIN or MEMBERS, got {header.kind.name}")
        except WireError as exc:
            log.debug("dropping bad request: %s", exc)
            self._on_event("requests_rejected", 1)
            return
        if header.kind in (Kind.JOIN, Kind.MEMBERS):
            try:
                answer = self._membership(header, _user_id(head)) if self._membership is not None else None
            except Exception:  # pragma: no cover - a bug in the membership code must not kill the server
                log.exception("membership message from %s failed", header.node)
                answer = None
            self._answer(sock, identity, answer)
            return
        if header.kind is not Kind.FETCH:
            self._push_message(sock, identity, header, head)
            return
        try:
            reply = self._serve(header)
        except Exception:  # pragma: no cover - a bug in a rule's on_serve must not kill the server
            log.exception("serving %s failed", header.node)
            return
        frames: list[zmq.Frame] = []
        try:
            if reply.payload and reply.stream:
                self._send_stream(sock, identity, reply, frames)
            else:
                self._send_single(sock, identity, reply, frames)
            if reply.payload:
                self._on_event("served", 1)
                self._on_event("bytes_out", sum(mv.nbytes for mv in reply.payload))
        except zmq.Again:
            self._on_event("serve_dropped", 1)  # requester's queue full: it will time out and retry
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._on_event("serve_dropped", 1)  # requester vanished
        finally:
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
        self._on_event("push_stale_chunks" if tag is not None else "requests_rejected", 1)

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
            self._on_event("pushes_unsupported", 1)
            answer = wire.encode_error(
                self._node, header.req, ErrorCode.UNSUPPORTED, "this node's rule takes no pushes"
            )
            self._answer(sock, identity, answer)
            return
        user = _user_id(head)
        if header.kind is Kind.PUSH and self._membership is not None:
            self._membership(header, user)  # the member news it carries
        if whole:
            self._answer(sock, identity, self._pushes.whole(identity, header, user, sock))
        elif header.kind is Kind.PUSH:
            self._answer(sock, identity, self._pushes.begin(identity, header, user))
        else:
            self._answer(sock, identity, self._pushes.settle(identity, header, user))

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


# --------------------------------------------------------------------------- TX


@dataclass
class FetchTarget:
    """One peer of a fetch job and the preallocated buffer its reply lands in (in the local layout)."""

    peer: str
    buffer: np.ndarray
    views: list[np.ndarray]
    status: str = "pending"  # ok | timeout | refused | rejected
    code: str = ""  # short reason, a stats key for rejections
    detail: str = ""
    header: wire.State | wire.Error | None = None
    ms: float = 0.0
    nbytes: int = 0
    next_chunk: int = -1
    """In a streamed reply: the index of the chunk expected next; -1 while the header is awaited."""
    late: bool = False
    """update_wait timed this target out itself: the TX thread had no verdict by the deadline."""


LATE_DETAIL = "the TX thread gave no verdict by the deadline"
VERDICT_SLACK_S = 0.05
"""How long a waiter (update_wait, bootstrap) waits past a fetch's deadline for the TX thread's verdict."""


@dataclass
class FetchJob:
    """Fetch the latest snapshot of every target before ``deadline`` (time.monotonic seconds).

    Each target gets exactly one verdict (:meth:`settle`): from the TX thread, or -- when
    update_wait stops waiting -- a timeout from :meth:`expire`; a verdict that comes later is ignored.
    """

    req: int
    targets: list[FetchTarget]
    deadline: float
    extras: dict[str, Any] = field(default_factory=dict)  # sent with the request (rule push-pull state)
    push: Push | None = None
    """An exchange: this push (of the fetcher's own snapshot) goes to its peer just before the FETCH."""
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    expired: bool = False
    """update_wait gave up on this job (:meth:`expire`): the TX thread drops it."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def settle(self, target: FetchTarget, status: str, code: str = "", detail: str = "") -> bool:
        """Give ``target`` its verdict; False (and nothing changes) when it already has one."""
        with self.lock:
            if target.status != "pending":
                return False
            target.status, target.code, target.detail = status, code, detail
            target.ms = (time.monotonic() - self.started) * 1000.0
            return True

    def wait(self) -> list[FetchTarget]:
        """Block until every target has a verdict, at most until ``deadline + VERDICT_SLACK_S``; then time out
        (:meth:`expire`) and return the targets still without one (``[]`` when the TX thread gave every verdict)."""
        if self.done.wait(max(0.0, self.deadline - time.monotonic()) + VERDICT_SLACK_S):
            return []
        return self.expire()

    def expire(self) -> list[FetchTarget]:
        """Time out every target still without a verdict (``late``) and return them; the job is abandoned."""
        with self.lock:
            self.expired = True
            late = [t for t in self.targets if t.status == "pending"]
            for t in late:
                t.status, t.code, t.detail, t.late = "timeout", "timeout", LATE_DETAIL, True
                t.ms = (time.monotonic() - self.started) * 1000.0
        return late


class _Broken(Exception):
    """A streamed reply that cannot go on: reject the target and reset the socket (its other chunks vanish)."""

    def __init__(self, error: WireError) -> None:
        super().__init__(str(error))
        self.error = error


def _mark_unknown(push: Push) -> None:
    """What a push past its deadline becomes when no ledger is told (a TxFetcher without a node)."""
    push.status = "unknown"


MAX_MESSAGES_PER_WAKE = 64
"""Messages the TX thread takes from one socket before it looks at the deadline again."""


class TxFetcher(threading.Thread):
    """Runs fetch jobs handed over by ``submit``; reports every finished target through ``on_target``.

    ``layouts()`` returns ``(wire, local)``: the layout replies arrive in (its fingerprint is
    what the peers must match) and the layout of the receive buffers; None before the first publish.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        node: str,
        endpoints: dict[str, str],
        layouts: Callable[[], tuple[Layout, Layout] | None],
        on_target: Callable[[FetchJob, FetchTarget], None],
        on_event: Callable[[str, int], None],
        *,
        name: str = "dpwa-tx",
        chunk: int = CHUNK_BYTES,
        setup: Callable[[zmq.Socket, str], None] | None = None,
        on_push: Callable[[Push, str, str], None] | None = None,
        on_push_unknown: Callable[[Push], None] | None = None,
        retry_s: float = 1.0,
        news: Callable[[str], MemberNews | None] | None = None,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._ctx = ctx
        self._setup = setup  # (socket, peer) before connect, e.g. make it a CURVE client (dpwa.security.curve)
        self._node = node
        self._endpoints = dict(endpoints)
        self._peer_changes: queue.SimpleQueue[tuple[str, str | None]] = queue.SimpleQueue()
        self._news = news or (lambda peer: None)
        self._layouts = layouts
        self._on_target = on_target
        self._on_event = on_event
        self._chunk = chunk
        self._jobs: queue.SimpleQueue[FetchJob] = queue.SimpleQueue()
        self._push_queue: queue.SimpleQueue[Push] = queue.SimpleQueue()
        self._pushes: dict[tuple[str, int], Push] = {}
        """Pushes sent and not settled yet, by (peer, sequence number)."""
        self._settles: list[tuple[str, int, str]] = []
        """SETTLEs to send at the end of this wake: (peer, sequence number, op)."""
        self._on_push = on_push
        self._on_push_unknown = on_push_unknown or _mark_unknown
        self._retry_s = retry_s
        self._sndhwm = 4
        self._stop_flag = threading.Event()
        address = f"inproc://dpwa-tx-wake-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(address)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(address)
        self._wake_lock = threading.Lock()
        self._sockets: dict[str, zmq.Socket] = {}
        self._reader: PayloadReader | None = None
        self._bounds: list[tuple[int, int]] = []
        self._maxmsgsize = max(chunk, wire.MAX_HEADER_BYTES)
        self.failure: BaseException | None = None
        """The exception that ended the thread, if one did (a bug, not a network fault)."""

    # -- called from other threads
    def submit(self, job: FetchJob) -> None:
        """Queue a job and wake the thread."""
        self._jobs.put(job)
        self._wake()

    def set_peer(self, peer: str, endpoint: str | None) -> None:
        """A member joined (or moved): fetch ``peer`` at ``endpoint`` from now on; None: it is gone. Applied by
        the thread at its next wake; a fetch or push to a peer without an endpoint fails as refused."""
        self._peer_changes.put((peer, endpoint))
        self._wake()

    def submit_push(self, push: Push) -> None:
        """Queue a push (already in the node's ledger) and wake the thread."""
        self._push_queue.put(push)
        self._wake()

    def stop(self) -> None:
        self._stop_flag.set()
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_tx.closed:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # already woken

    def close_waker(self) -> None:
        """Close the caller-side wake socket (after the thread has stopped)."""
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    # -- the thread
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        job: FetchJob | None = None
        try:
            while not self._stop_flag.is_set():
                events = dict(poller.poll(self._poll_timeout(job)))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                self._apply_peer_changes(poller, job)
                for peer, sock in list(self._sockets.items()):
                    if events.get(sock, 0) & zmq.POLLIN:
                        self._receive(poller, job, peer, sock)
                if job is not None and time.monotonic() >= job.deadline:
                    for target in job.targets:
                        if target.status == "pending" or target.late:  # late: update_wait timed it out
                            self._finish(job, target, "timeout", "timeout", "no reply before the deadline")
                            self._reset(poller, target.peer)
                if job is not None and all(t.status != "pending" for t in job.targets):
                    self._job_done(job)
                    job = None
                self._push_work(poller)
                if job is None:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        self._send_settles(poller)
                        continue
                    if job.expired:  # queued while this thread was busy; update_wait already gave up on it
                        self._job_done(job)
                        job = None
                        continue
                    self._start(poller, job)
                self._send_settles(poller)
        except Exception as exc:  # a bug, not a network fault: DpwaConnection raises it in the trainer
            self.failure = exc
            log.exception("TX thread failed")
        finally:
            if job is not None:
                self._job_done(job)
            if self.failure is not None:  # nobody will run the queued jobs: wake whoever waits on them
                while True:
                    try:
                        self._job_done(self._jobs.get_nowait())
                    except queue.Empty:
                        break
            for sock in self._sockets.values():
                sock.close(linger=0)
            self._wake_rx.close(linger=0)

    def _apply_peer_changes(self, poller: zmq.Poller, job: FetchJob | None) -> None:
        """Take the members that came, moved or went. A fetch from a member that went ends at once (refused
        ``not-a-member``: it said it left, or was forgotten); its pushes are no longer asked about (the node
        settles them from the leave announcement, or abandons them when the member is forgotten)."""
        while True:
            try:
                peer, endpoint = self._peer_changes.get_nowait()
            except queue.Empty:
                return
            if self._endpoints.get(peer) == endpoint:
                continue
            self._reset(poller, peer)
            if endpoint is not None:
                self._endpoints[peer] = endpoint
                continue
            self._endpoints.pop(peer, None)
            for key in [key for key in self._pushes if key[0] == peer]:
                del self._pushes[key]
            for target in job.targets if job is not None else ():
                if target.peer == peer and target.status == "pending":
                    self._finish(job, target, "refused", NOT_A_MEMBER, f"{peer} is no member any more")

    def _poll_timeout(self, job: FetchJob | None) -> int:
        """Milliseconds until the next deadline of the fetch job or of a push (at most POLL_MS)."""
        due = [job.deadline] if job is not None else []
        for push in self._pushes.values():
            due.append(push.deadline if push.status == "sending" else push.next_query)
        if not due:
            return POLL_MS
        return max(0, min(POLL_MS, int((min(due) - time.monotonic()) * 1000) + 1))

    def _job_done(self, job: FetchJob) -> None:
        """Wake the job's waiter; an exchange's push gives its snapshot back once ZeroMQ is done with it."""
        push = job.push
        if push is not None and push.status != "done":
            push.status = "done"
            if push.release is not None:
                push.release(push.tracker)
        job.done.set()

    def _push_work(self, poller: zmq.Poller) -> None:
        """Send new pushes; ask about pushes past their deadline (a SETTLE query, again every ``retry_s``)."""
        while True:
            try:
                push = self._push_queue.get_nowait()
            except queue.Empty:
                break
            self._send_push(poller, push)
        now = time.monotonic()
        for push in list(self._pushes.values()):
            if push.status == "sending" and now >= push.deadline:
                self._on_event("pushes_unknown", 1)
                self._on_push_unknown(push)  # status "unknown" (the node's ledger, which wakes its waiters)
                push.next_query = now
            if push.status == "unknown" and now >= push.next_query:
                if push.queries:  # the last query went unanswered for retry_s: the peer may be gone
                    self._on_push_unknown(push)
                push.queries += 1
                push.next_query = now + self._retry_s
                self._settles.append((push.peer, push.seq, "query"))
                self._on_event("push_queries", 1)

    def _send_settles(self, poller: zmq.Poller) -> None:
        for peer, seq, op in self._settles:
            sock = self._socket(poller, peer)
            if sock is None:  # no member any more: nobody left to answer
                self._on_event("settles_dropped", 1)
                continue
            try:
                sock.send(wire.encode_settle(self._node, seq, op), zmq.NOBLOCK)
            except zmq.Again:
                self._on_event("settles_dropped", 1)  # a query is asked again; an unsent abort expires there
        self._settles.clear()

    def _push_frames(self, sock: zmq.Socket, push: Push, wire_layout: Layout, *, hold: bool) -> bool:
        """Send push ``push`` zero-copy from its snapshot: whole (header and its one chunk in one message)
        or streamed (its header, then one tagged message per chunk).

        False when not even the header could be queued (nothing went out). A queue that fills after the
        header leaves the push cut short: the receiver drops it, and a SETTLE settles it."""
        snap = push.snapshot
        news = self._news(push.peer)
        encode = functools.partial(
            wire.encode_push,
            self._node,
            push.seq,
            clock=snap.clock,
            loss=snap.loss,
            extras={**snap.extras, **push.given},
            layout=wire_layout,
            chunk=self._chunk,
            hold=hold,
            whole=len(snap.frames) == 1,
            front=snap.front,
        )
        try:
            header = encode(news=news)
        except ValueError:  # the member table does not fit a header: its digest goes alone
            header = encode(news=MemberNews(news.digest) if news is not None else None)
        frames: list[zmq.Frame] = []
        started = False
        try:
            if len(snap.frames) != 1:
                sock.send(header, zmq.NOBLOCK)
                started = True
            for index, memory in enumerate(snap.frames):
                if push.prepare is not None:
                    push.prepare(index)
                frame = zmq.Frame(memory, copy=False, track=True)
                first = header if len(snap.frames) == 1 else wire.encode_chunk_tag(push.seq, index)
                sock.send(first, zmq.SNDMORE | zmq.NOBLOCK)
                sock.send(frame, zmq.NOBLOCK, copy=False)
                started = True
                frames.append(frame)
            self._on_event("pushes_sent", 1)
            self._on_event("bytes_out", sum(memory.nbytes for memory in snap.frames))
            return True
        except zmq.Again:
            self._on_event("push_send_queue_full", 1)
            return started
        finally:
            if frames:
                push.tracker = zmq.MessageTracker(*frames)

    def _send_push(self, poller: zmq.Poller, push: Push) -> None:
        layouts = self._ensure_layout(poller)
        if layouts is None:  # pragma: no cover - the node publishes before it pushes
            self._settle_push(push, "refused", "layout")
            return
        sock = self._socket(poller, push.peer)
        if sock is None:
            self._settle_push(push, "refused", NOT_A_MEMBER)  # it left: the mass comes back
            return
        self._pushes[(push.peer, push.seq)] = push
        if not self._push_frames(sock, push, layouts[0], hold=False):
            self._settle_push(push, "refused", "send-queue-full")  # nothing left: the mass comes back

    def _settle_push(self, push: Push, status: str, code: str) -> None:
        self._pushes.pop((push.peer, push.seq), None)
        if self._on_push is not None:
            self._on_push(push, status, code)

    def _push_answer(self, peer: str, header: wire.Ack | wire.Error) -> bool:
        """An ACK or ERROR from ``peer``: settle the push it names; True when it named one."""
        push = self._pushes.get((peer, header.req))
        if push is None or header.node != peer:
            return False
        if isinstance(header, wire.Error):
            self._settle_push(push, "refused", header.code)
        else:
            self._settle_push(push, "delivered", "")
        return True

    def _ensure_layout(self, poller: zmq.Poller) -> tuple[Layout, Layout] | None:
        layouts = self._layouts()
        if layouts is None:
            return None
        wire_layout, local = layouts
        if self._reader is None or self._reader.wire is not wire_layout or self._reader.local is not local:
            self._reader = PayloadReader(wire_layout, local)
            self._bounds = wire_layout.frame_bounds(self._chunk)
            self._limit_frames(poller, wire_layout)
        return layouts

    def _socket(self, poller: zmq.Poller, peer: str) -> zmq.Socket | None:
        """The DEALER connected to ``peer`` (opened now if needed); None when ``peer`` is no member any more."""
        sock = self._sockets.get(peer)
        if sock is None:
            if peer not in self._endpoints:
                return None
            sock = self._ctx.socket(zmq.DEALER)
            _common_options(sock)
            sock.setsockopt(zmq.MAXMSGSIZE, self._maxmsgsize)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            tune_data_socket(sock)
            if self._setup is not None:
                try:
                    self._setup(sock, peer)
                except (KeyError, OSError, ValueError) as exc:  # e.g. no public key file for a joined member
                    sock.close(linger=0)
                    log.warning("cannot connect to %s: %s", peer, exc)
                    self._on_event("peer_setup_failed", 1)
                    return None
            try:
                sock.connect(connect_address(self._endpoints[peer]))
            except zmq.ZMQError as exc:  # an endpoint libzmq refuses (the member table only takes plain hosts)
                sock.close(linger=0)
                log.warning("cannot connect to %s at %s: %s", peer, self._endpoints[peer], exc)
                self._on_event("peer_setup_failed", 1)
                return None
            poller.register(sock, zmq.POLLIN)
            self._sockets[peer] = sock
        return sock

    def _reset(self, poller: zmq.Poller, peer: str) -> None:
        """Lazy Pirate: close the socket so that a late reply can never be read as the next one."""
        sock = self._sockets.pop(peer, None)
        if sock is not None:
            poller.unregister(sock)
            sock.close(linger=0)

    def _start(self, poller: zmq.Poller, job: FetchJob) -> None:
        layouts = self._ensure_layout(poller)
        if layouts is None:  # pragma: no cover - the connection publishes before fetching
            for target in job.targets:
                self._finish(job, target, "rejected", "layout", "no local layout yet")
            return
        wire_layout = layouts[0]
        exchange = job.push.seq if job.push is not None else -1
        for target in job.targets:
            request = self._fetch_request(job, wire_layout, exchange, self._news(target.peer))
            sock = self._socket(poller, target.peer)
            if sock is None:
                self._finish(job, target, "refused", NOT_A_MEMBER, f"{target.peer} is no member any more")
                continue
            if job.push is not None and target.peer == job.push.peer:  # the exchange's push goes first
                job.push.status = "sending"
                if not self._push_frames(sock, job.push, wire_layout, hold=True):
                    self._finish(job, target, "timeout", "send-queue-full", "send queue full")
                    self._reset(poller, target.peer)
                    continue
            try:
                sock.send(request, zmq.NOBLOCK)
                self._on_event("fetches_started", 1)
            except zmq.Again:
                self._finish(job, target, "timeout", "send-queue-full", "send queue full")
                self._reset(poller, target.peer)

    def _fetch_request(self, job: FetchJob, wire_layout: Layout, exchange: int, news: MemberNews | None) -> bytes:
        """The FETCH of ``job``; without the rule's extras when they do not encode, without the member table
        when it does not fit a header (the digest still goes)."""
        for extras, sent in ((job.extras, news), (None, news), (None, MemberNews(news.digest) if news else None)):
            try:
                return wire.encode_fetch(
                    self._node, job.req, wire_layout.fingerprint, extras, stream=True, exchange=exchange, news=sent
                )
            except (TypeError, ValueError) as exc:  # too big, or extras not JSON: try with less
                log.warning("request extras or member table dropped: %s", exc)
        return wire.encode_fetch(self._node, job.req, wire_layout.fingerprint, stream=True, exchange=exchange)

    def _limit_frames(self, poller: zmq.Poller, wire_layout: Layout) -> None:
        """ZMQ_MAXMSGSIZE of the DEALERs from the layout replies must have (libzmq applies it to every frame).

        No valid reply has a frame above the larger of a header and a payload frame: the
        layout's wire bytes up to one chunk (the 16-byte chunk tag of the streamed framing
        is a frame of its own). A peer sending more loses its connection before ZeroMQ
        buffers the frame. Sockets opened under an older limit are closed and reopened.
        """
        bounds = wire_layout.frame_bounds(self._chunk)
        largest = max(end - start for start, end in bounds)  # at most a chunk
        limit = max(wire.MAX_HEADER_BYTES, largest)
        hwm = push_send_hwm(len(bounds)) if self._on_push is not None else 4
        if limit != self._maxmsgsize or hwm != self._sndhwm:
            self._maxmsgsize = limit
            self._sndhwm = hwm
            for peer in list(self._sockets):
                self._reset(poller, peer)

    def _finish(self, job: FetchJob, target: FetchTarget, status: str, code: str = "", detail: str = "") -> None:
        """Report ``target``'s verdict; a reply judged after update_wait timed the target out counts as stale."""
        if job.settle(target, status, code, detail):
            if job.push is not None and target.peer == job.push.peer:  # the exchange stands or falls with the reply
                self._settles.append((target.peer, job.push.seq, "commit" if status == "ok" else "abort"))
            self._on_target(job, target)
        elif status != "timeout":
            log.debug("dropping the verdict %s on %s: update_wait stopped waiting for it", status, target.peer)
            self._on_event("stale_replies", 1)

    def _receive(self, poller: zmq.Poller, job: FetchJob | None, peer: str, sock: zmq.Socket) -> None:
        """Take the messages waiting on ``peer``'s socket (at most MAX_MESSAGES_PER_WAKE)."""
        for _ in range(MAX_MESSAGES_PER_WAKE):
            target = None
            if job is not None:
                target = next((t for t in job.targets if t.peer == peer and t.status == "pending"), None)
            try:
                head = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if is_own_echo(head, self._node):  # connected to itself (connect_address): reconnect
                discard_rest(sock)
                self._on_event("self_connections", 1)
                log.info("node %s: its socket to %s reached itself; reconnecting", self._node, peer)
                self._reset(poller, peer)
                return
            try:
                self._message(job, target, sock, head, peer)
            except _Broken as broken:
                discard_rest(sock)
                assert job is not None and target is not None
                self._finish(job, target, "rejected", broken.error.reason, broken.error.detail)
                self._reset(poller, peer)
                return

    def _message(
        self, job: FetchJob | None, target: FetchTarget | None, sock: zmq.Socket, head: bytes, peer: str
    ) -> None:
        """One message whose first frame is ``head``; raises _Broken when a streamed reply goes wrong."""
        header: wire.Message | None = None  # a lone header frame is decoded once, here: push answers are routed by it
        if not sock.get(zmq.RCVMORE) and len(head) <= wire.MAX_HEADER_BYTES and head[:4] == wire.MAGIC:
            try:
                header = wire.decode_message(head)
            except WireError:
                pass  # _header_message decodes it again and rejects the reply with the reason
            if header is not None and header.kind in (Kind.ACK, Kind.ERROR) and self._push_answer(peer, header):
                return
            if header is not None and header.kind is Kind.ACK:  # a commit's ACK, or one for a push settled already
                self._on_event("acks_unmatched", 1)
                return
        tag = wire.decode_chunk_tag(head)
        if tag is not None:
            if job is None or target is None or tag[0] != job.req or target.next_chunk < 0:
                discard_rest(sock)  # a chunk of a reply already judged (or never announced): nothing to take
                self._on_event("stale_replies", 1)
                return
            self._chunk_message(target, sock, tag[1], len(head))
            if target.next_chunk == len(self._bounds):
                self._finish(job, target, "ok")
            return
        if target is None or job is None:
            discard_rest(sock)
            self._on_event("stale_replies", 1)
            return
        if target.next_chunk >= 0:
            raise _Broken(WireError("frames", "a message other than the next chunk inside a streamed reply"))
        self._header_message(job, target, sock, head, header)

    def _header_message(
        self, job: FetchJob, target: FetchTarget, sock: zmq.Socket, head: bytes, decoded: wire.Message | None = None
    ) -> None:
        """A reply's header (``decoded``: already decoded), and with the single-message framing its payload
        frames too."""
        layouts = self._layouts()
        assert layouts is not None and self._reader is not None
        wire_layout = layouts[0]
        received = len(head)
        alone = not sock.get(zmq.RCVMORE)  # a header without payload frames: streamed chunks may follow it
        try:
            header = decoded if decoded is not None else wire.decode_message(head)
            if header.kind is Kind.ERROR:
                discard_rest(sock)
                if header.node != target.peer or header.req != job.req:  # not a refusal of this fetch
                    log.debug("dropping an ERROR reply of %s to request %s", header.node, header.req)
                    self._on_event("stale_replies", 1)
                    return
                target.header = header
                self._finish(job, target, "refused", header.code, header.detail)
                return
            if header.kind is not Kind.STATE:
                raise WireError("header", f"unexpected {header.kind.name} reply")
            try:
                header.check_against(wire_layout, peer=target.peer, req=job.req, chunk=self._chunk)
            except WireError as exc:
                if exc.reason == "stale":
                    discard_rest(sock)
                    self._on_event("stale_replies", 1)
                    return
                raise
            target.header = header  # validated: kept even if the payload is rejected (push-sum mass accounting)
            if header.stream:
                if sock.get(zmq.RCVMORE):
                    raise WireError("frames", "a streamed reply's header came with payload frames")
                target.next_chunk = 0
                target.nbytes = received
                return
            for start, end in self._bounds:
                if not sock.get(zmq.RCVMORE):
                    raise WireError("frames", "reply has fewer payload frames than announced")
                received += self._take(sock, target, start, end)
            if sock.get(zmq.RCVMORE):
                raise WireError("frames", "reply has more payload frames than announced")
        except WireError as exc:
            target.nbytes = received
            if alone:  # reset the socket, so that the chunks of a rejected streamed reply never arrive as strays
                raise _Broken(exc) from None
            discard_rest(sock)
            self._finish(job, target, "rejected", exc.reason, exc.detail)
            return
        target.nbytes = received
        self._finish(job, target, "ok")

    def _chunk_message(self, target: FetchTarget, sock: zmq.Socket, index: int, tag_bytes: int) -> None:
        """Chunk ``index`` of the streamed reply ``target`` awaits: exactly [tag, payload], in order, finite."""
        assert self._reader is not None
        if index != target.next_chunk:
            raise _Broken(WireError("frames", f"chunk {index} arrived, expected chunk {target.next_chunk}"))
        if not sock.get(zmq.RCVMORE):
            raise _Broken(WireError("frames", "a chunk message without its payload frame"))
        start, end = self._bounds[index]
        try:
            target.nbytes += tag_bytes + self._take(sock, target, start, end)
        except WireError as exc:
            raise _Broken(exc) from None
        if sock.get(zmq.RCVMORE):
            raise _Broken(WireError("frames", "a chunk message with more than one payload frame"))
        target.next_chunk += 1

    def _take(self, sock: zmq.Socket, target: FetchTarget, start: int, end: int) -> int:
        """Receive the next frame as wire bytes [start, end) into ``target``'s buffer (:func:`receive_payload`)."""
        assert self._reader is not None
        return receive_payload(sock, self._reader, target.buffer, target.views, start, end)
