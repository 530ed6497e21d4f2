"""ZeroMQ sockets and the two threads that own them.

* :class:`RxServer` binds a ROUTER and answers every FETCH with the latest
  snapshot, zero-copy; a slow or vanished requester only fills its own queue.
* :class:`TxFetcher` owns one DEALER per peer, runs one fetch job at a time
  against a hard deadline, receives each payload frame straight into a
  preallocated buffer, validates it chunk by chunk, and after a timeout closes
  and reopens the peer's socket (Lazy Pirate) so a late reply is never taken
  for the next one.

Every wait here is a poll with a timeout; ``stop()`` ends a thread within
``POLL_MS`` milliseconds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from . import wire
from .wire import CHUNK_BYTES, FiniteChecker, Header, Kind, Layout, WireError

log = logging.getLogger(__name__)

POLL_MS = 100
"""Longest a thread sleeps in poll before it looks at its stop flag."""
HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
MAX_REQUEST_BYTES = wire.MAX_HEADER_BYTES


def _common_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def _discard_rest(sock: zmq.Socket) -> None:
    """Drop the remaining frames of the message being received."""
    while sock.get(zmq.RCVMORE):
        sock.recv_into(bytearray(), flags=zmq.NOBLOCK)


# --------------------------------------------------------------------------- RX


@dataclass
class Reply:
    """What the RX thread sends back: a header frame, zero-copy payload frames, and a hook run after sending."""

    header: bytes
    payload: Sequence[memoryview] = ()
    sent: Callable[[zmq.MessageTracker | None], None] | None = None
    """Called once with the send's tracker (None when the reply was dropped)."""


class RxServer(threading.Thread):
    """Serves FETCH requests on a bound ROUTER socket by calling ``serve(header) -> Reply``."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        serve: Callable[[Header], Reply],
        on_event: Callable[[str, int], None],
        *,
        name: str = "dpwa-rx",
        sndhwm: int = 64,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._serve = serve
        self._on_event = on_event
        self._stop_flag = threading.Event()
        # Bind here, in the caller's thread, so that a busy port fails the constructor loudly.
        self._sock = ctx.socket(zmq.ROUTER)
        _common_options(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.RCVHWM, 64)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise OSError(f"cannot bind {endpoint}: {exc}") from exc
        self.endpoint = endpoint

    def stop(self) -> None:
        self._stop_flag.set()

    def run(self) -> None:
        sock = self._sock
        try:
            while not self._stop_flag.is_set():
                if sock.poll(POLL_MS, zmq.POLLIN):
                    self._handle_one(sock)
        except Exception:  # pragma: no cover - a bug, not a network fault
            log.exception("RX thread failed")
        finally:
            sock.close(linger=0)

    def _handle_one(self, sock: zmq.Socket) -> None:
        identity = sock.recv(zmq.NOBLOCK)
        if not sock.get(zmq.RCVMORE):
            self._on_event("requests_rejected", 1)
            return
        frame = sock.recv(zmq.NOBLOCK)
        if sock.get(zmq.RCVMORE):
            _discard_rest(sock)
            self._on_event("requests_rejected", 1)
            return
        try:
            header = wire.decode_header(frame)
            if header.kind is not Kind.FETCH:
                raise WireError("header", f"expected FETCH, got {header.kind.name}")
        except WireError as exc:
            log.debug("dropping bad request: %s", exc)
            self._on_event("requests_rejected", 1)
            return
        try:
            reply = self._serve(header)
        except Exception:  # pragma: no cover - a bug in a rule's on_serve must not kill the server
            log.exception("serving %s failed", header.node)
            return
        tracker = None
        try:
            sock.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
            if reply.payload:
                sock.send(reply.header, zmq.SNDMORE | zmq.NOBLOCK)
                frames = [zmq.Frame(mv, copy=False, track=True) for mv in reply.payload]
                for f in frames[:-1]:
                    sock.send(f, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
                sock.send(frames[-1], zmq.NOBLOCK, copy=False)
                tracker = zmq.MessageTracker(*frames)
                self._on_event("served", 1)
                self._on_event("bytes_out", sum(mv.nbytes for mv in reply.payload))
            else:
                sock.send(reply.header, zmq.NOBLOCK)
        except zmq.Again:
            self._on_event("serve_dropped", 1)  # requester's queue full: it will time out and retry
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._on_event("serve_dropped", 1)  # requester vanished
        finally:
            if reply.sent is not None:
                reply.sent(tracker)


# --------------------------------------------------------------------------- TX


@dataclass
class FetchTarget:
    """One peer of a fetch job and the preallocated buffer its reply lands in."""

    peer: str
    buffer: np.ndarray
    views: list[np.ndarray]
    status: str = "pending"  # ok | timeout | refused | rejected
    code: str = ""  # short reason, a stats key for rejections
    detail: str = ""
    header: Header | None = None
    ms: float = 0.0
    nbytes: int = 0


@dataclass
class FetchJob:
    """Fetch the latest snapshot of every target before ``deadline`` (time.monotonic seconds)."""

    req: int
    targets: list[FetchTarget]
    deadline: float
    extras: dict[str, Any] = field(default_factory=dict)  # sent with the request (rule push-pull state)
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)


class TxFetcher(threading.Thread):
    """Runs fetch jobs handed over by ``submit``; reports every finished target through ``on_target``."""

    def __init__(
        self,
        ctx: zmq.Context,
        node: str,
        endpoints: dict[str, str],
        layout_provider: Callable[[], Layout | None],
        on_target: Callable[[FetchJob, FetchTarget], None],
        on_event: Callable[[str, int], None],
        *,
        name: str = "dpwa-tx",
        chunk: int = CHUNK_BYTES,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._ctx = ctx
        self._node = node
        self._endpoints = dict(endpoints)
        self._layout_provider = layout_provider
        self._on_target = on_target
        self._on_event = on_event
        self._chunk = chunk
        self._jobs: queue.SimpleQueue[FetchJob] = queue.SimpleQueue()
        self._stop_flag = threading.Event()
        address = f"inproc://dpwa-tx-wake-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(address)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(address)
        self._wake_lock = threading.Lock()
        self._sockets: dict[str, zmq.Socket] = {}
        self._checker: FiniteChecker | None = None
        self._checker_layout: Layout | None = None

    # -- called from other threads
    def submit(self, job: FetchJob) -> None:
        """Queue a job and wake the thread."""
        self._jobs.put(job)
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
                timeout = POLL_MS
                if job is not None:
                    timeout = max(0, min(POLL_MS, int((job.deadline - time.monotonic()) * 1000) + 1))
                events = dict(poller.poll(timeout))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                for peer, sock in list(self._sockets.items()):
                    if events.get(sock, 0) & zmq.POLLIN:
                        self._receive(job, peer, sock)
                if job is not None and time.monotonic() >= job.deadline:
                    for target in job.targets:
                        if target.status == "pending":
                            self._finish(job, target, "timeout", "timeout", "no reply before the deadline")
                            self._reset(poller, target.peer)
                if job is not None and all(t.status != "pending" for t in job.targets):
                    job.done.set()
                    job = None
                if job is None:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        continue
                    self._start(poller, job)
        except Exception:  # pragma: no cover - a bug, not a network fault
            log.exception("TX thread failed")
        finally:
            if job is not None:
                job.done.set()
            for sock in self._sockets.values():
                sock.close(linger=0)
            self._wake_rx.close(linger=0)

    def _socket(self, poller: zmq.Poller, peer: str) -> zmq.Socket:
        sock = self._sockets.get(peer)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            _common_options(sock)
            sock.setsockopt(zmq.MAXMSGSIZE, max(self._chunk, wire.MAX_HEADER_BYTES))
            sock.setsockopt(zmq.SNDHWM, 4)
            sock.connect(self._endpoints[peer])
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
        layout = self._layout_provider()
        if layout is None:  # pragma: no cover - the connection publishes before fetching
            for target in job.targets:
                self._finish(job, target, "rejected", "layout", "no local layout yet")
            return
        if self._checker is None or self._checker_layout is not layout:
            self._checker, self._checker_layout = FiniteChecker(layout), layout
        try:
            request = wire.encode_fetch(self._node, job.req, layout.fingerprint, job.extras)
        except (TypeError, ValueError) as exc:  # a rule's extras too big or not JSON: fetch without them
            log.warning("request extras dropped: %s", exc)
            request = wire.encode_fetch(self._node, job.req, layout.fingerprint)
        for target in job.targets:
            sock = self._socket(poller, target.peer)
            try:
                sock.send(request, zmq.NOBLOCK)
                self._on_event("fetches_started", 1)
            except zmq.Again:
                self._finish(job, target, "timeout", "send-queue-full", "send queue full")
                self._reset(poller, target.peer)

    def _finish(self, job: FetchJob, target: FetchTarget, status: str, code: str = "", detail: str = "") -> None:
        target.status, target.code, target.detail = status, code, detail
        target.ms = (time.monotonic() - job.started) * 1000.0
        self._on_target(job, target)

    def _receive(self, job: FetchJob | None, peer: str, sock: zmq.Socket) -> None:
        target = None
        if job is not None:
            target = next((t for t in job.targets if t.peer == peer and t.status == "pending"), None)
        try:
            head = sock.recv(zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - poll said readable
            return
        if target is None or job is None:
            _discard_rest(sock)
            self._on_event("stale_replies", 1)
            return
        layout = self._layout_provider()
        assert layout is not None and self._checker is not None
        received = len(head)
        try:
            header = wire.decode_header(head)
            if header.kind is Kind.ERROR:
                _discard_rest(sock)
                target.header = header
                self._finish(job, target, "refused", header.code, header.detail)
                return
            if header.kind is not Kind.STATE:
                raise WireError("header", f"unexpected {header.kind.name} reply")
            try:
                wire.check_state_header(header, layout, peer=peer, req=job.req, chunk=self._chunk)
            except WireError as exc:
                if exc.reason == "stale":
                    _discard_rest(sock)
                    self._on_event("stale_replies", 1)
                    return
                raise
            target.header = header  # validated: kept even if the payload is rejected (push-sum mass accounting)
            for start, end in layout.frame_bounds(self._chunk):
                if not sock.get(zmq.RCVMORE):
                    raise WireError("frames", "reply has fewer payload frames than announced")
                n = sock.recv_into(target.buffer[start:end], flags=zmq.NOBLOCK)
                received += n
                if n != end - start:
                    raise WireError("size", f"payload frame of {n} bytes, expected {end - start}")
                if not self._checker.all_finite(target.views, start, end):
                    raise WireError("non-finite", "payload holds NaN or infinity")
            if sock.get(zmq.RCVMORE):
                raise WireError("frames", "reply has more payload frames than announced")
        except WireError as exc:
            _discard_rest(sock)
            target.nbytes = received
            self._finish(job, target, "rejected", exc.reason, exc.detail)
            return
        target.header = header
        target.nbytes = received
        self._finish(job, target, "ok")
