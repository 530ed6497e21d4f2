"""The TX thread: one DEALER per peer, fetch jobs against a hard deadline, and the sending end of pushes.

:class:`TxFetcher` runs one :class:`~dpwa.node.transport.fetch.FetchJob` at a time. For each target it sends a
FETCH and takes the reply as it lands: each payload chunk goes from ZeroMQ's buffer into the target's preallocated
receive buffer, copied (or widened from a 16-bit wire dtype) and validated in one pass. After a timeout -- or a
broken stream -- it closes and reopens the peer's socket (Lazy Pirate) so a late reply is never taken for the next
one. Its DEALERs refuse any frame larger than a valid reply's (ZMQ_MAXMSGSIZE from the layout); every message that
belongs to no fetch in flight is dropped and counted (``stale_replies``).

It also sends the node's pushes (:class:`~dpwa.node.pushes.Push`) zero-copy from their snapshots, settles each from
the receiver's ACK or ERROR, and asks about one unanswered by its deadline with a SETTLE query every ``retry_s``
seconds until the receiver answers.

Every verdict, count and question goes to the node through one
:class:`~dpwa.node.transport.protocol.NodePort`. The thread polls at most
:data:`~dpwa.utils.socket_thread.POLL_MS` ms at a time and is woken at once (an in-process socket) when work
is submitted or it is stopped. A bug that raises ends the thread with the exception in ``failure``; the jobs
still queued are marked done so that nobody waits on them.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from dpwa.node import wire
from dpwa.node.frames import discard_rest, receive_payload
from dpwa.node.pushes import Push
from dpwa.node.states import FetchStatus, PushStatus
from dpwa.node.transport.fetch import NOT_A_MEMBER, FetchJob, FetchTarget
from dpwa.node.transport.headers import fetch_request, push_header
from dpwa.node.transport.protocol import NodePort
from dpwa.node.transport.pushing import send_push_frames, send_shared_push
from dpwa.node.transport.shared import SharedReplies
from dpwa.node.transport.sockets import common_options, connect_address, is_own_echo, push_send_hwm, tune_data_socket
from dpwa.node.wire import CHUNK_BYTES, Kind, Layout, PayloadReader, WireError
from dpwa.utils.socket_thread import POLL_MS
from dpwa.utils.waker import Waker

__all__ = ["MAX_MESSAGES_PER_WAKE", "TxFetcher"]

log = logging.getLogger(__name__)


class _Broken(Exception):
    """A streamed reply that cannot go on: reject the target and reset the socket (its other chunks vanish)."""

    def __init__(self, error: WireError) -> None:
        super().__init__(str(error))
        self.error = error


MAX_MESSAGES_PER_WAKE = 64
"""Messages the TX thread takes from one socket before it looks at the deadline again."""


class TxFetcher(threading.Thread):
    """Runs the fetch jobs handed over by :meth:`submit` and the pushes handed over by :meth:`submit_push`,
    reporting every verdict to ``port`` (:class:`~dpwa.node.transport.protocol.NodePort`).

    ``endpoints``: peer name -> tcp:// endpoint (changed later by :meth:`set_peer`). ``setup(sock, peer)`` runs on
    each DEALER before it connects (a CURVE client's options, :meth:`dpwa.security.curve.NodeSecurity.client`);
    one that raises KeyError, OSError or ValueError leaves that peer unreachable (counted ``peer_setup_failed``).
    ``pushes``: the node pushes (its DEALERs get a send queue a whole push fits, :func:`push_send_hwm`).
    ``retry_s``: seconds between SETTLE queries about a push past its deadline.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        node: str,
        endpoints: dict[str, str],
        port: NodePort,
        *,
        name: str = "dpwa-tx",
        chunk: int = CHUNK_BYTES,
        setup: Callable[[zmq.Socket, str], None] | None = None,
        pushes: bool = False,
        retry_s: float = 1.0,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._ctx = ctx
        self._setup = setup
        self._node = node
        self._endpoints = dict(endpoints)
        self._peer_changes: queue.SimpleQueue[tuple[str, str | None]] = queue.SimpleQueue()
        self._port = port
        self._push_rule = pushes
        self._chunk = chunk
        self._jobs: queue.SimpleQueue[FetchJob] = queue.SimpleQueue()
        self._push_queue: queue.SimpleQueue[Push] = queue.SimpleQueue()
        self._pushes: dict[tuple[str, int], Push] = {}
        """Pushes sent and not settled yet, by (peer, sequence number)."""
        self._settles: list[tuple[str, int, str]] = []
        """SETTLEs to send at the end of this wake: (peer, sequence number, op)."""
        self._settling: dict[tuple[str, int], FetchJob] = {}
        """Exchanges whose SETTLE awaits the peer's answer, by (peer, sequence number)."""
        self._retry_s = retry_s
        self._shared = SharedReplies(node, lambda event, n: port.count(event, n))
        self._sndhwm = 4
        self._stop_flag = threading.Event()
        self._waker = Waker(ctx, f"tx-{node}")
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

    def submit_release(self, peer: str, req: int) -> None:
        """Queue a RELEASE of the snapshot ``peer`` lent to request ``req`` (any thread) and wake the thread."""
        self._shared.submit_release(peer, req)
        self._wake()

    def submit_push(self, push: Push) -> None:
        """Queue a push (already in the node's ledger) and wake the thread."""
        self._push_queue.put(push)
        self._wake()

    def stop(self) -> None:
        """Ask the thread to end; it is woken at once (join it to know), closing its sockets."""
        self._stop_flag.set()
        self._wake()

    def _wake(self) -> None:
        self._waker.wake()

    def close_waker(self) -> None:
        """Close the wake sockets (after the thread has stopped; the thread closes them itself as it ends)."""
        self._waker.close()

    # -- the thread
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._waker.socket, zmq.POLLIN)
        job: FetchJob | None = None
        try:
            while not self._stop_flag.is_set():
                events = dict(poller.poll(self._poll_timeout(job)))
                if self._waker.socket in events:
                    self._waker.drain()
                self._apply_peer_changes(poller, job)
                for peer, sock in list(self._sockets.items()):
                    if events.get(sock, 0) & zmq.POLLIN:
                        self._receive(poller, job, peer, sock)
                if job is not None and time.monotonic() >= job.deadline:
                    for target in job.targets:
                        if target.status == FetchStatus.PENDING or target.late:  # late: update_wait timed it out
                            self._finish(job, target, FetchStatus.TIMEOUT, "timeout", "no reply before the deadline")
                            self._reset(poller, target.peer)
                if job is not None and all(t.status != FetchStatus.PENDING for t in job.targets):
                    self._job_done(job)
                    job = None
                self._push_work(poller)
                self._shared.send_releases(functools.partial(self._socket, poller))
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
            for waiting in self._settling.values():  # nobody will take their answers now
                waiting.settle_answered.set()
            self._close_sockets()

    def _close_sockets(self) -> None:
        """The thread's last act: close every DEALER and the wake sockets (a later wake does nothing)."""
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._waker.close()
        self._shared.close()

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
            self._shared.forget(peer)
            for key in [key for key in self._pushes if key[0] == peer]:
                del self._pushes[key]
            for target in job.targets if job is not None else ():
                if target.peer == peer and target.status == FetchStatus.PENDING:
                    self._finish(job, target, FetchStatus.REFUSED, NOT_A_MEMBER, f"{peer} is no member any more")

    def _poll_timeout(self, job: FetchJob | None) -> int:
        """Milliseconds until the next deadline of the fetch job or of a push (at most POLL_MS)."""
        due = [job.deadline] if job is not None else []
        for push in self._pushes.values():
            due.append(push.deadline if push.status == PushStatus.SENDING else push.next_query)
        if not due:
            return POLL_MS
        return max(0, min(POLL_MS, int((min(due) - time.monotonic()) * 1000) + 1))

    def _job_done(self, job: FetchJob) -> None:
        """Wake the job's waiter; an exchange's push gives its snapshot back once ZeroMQ is done with it."""
        push = job.push
        if push is not None and push.status != PushStatus.DONE:
            push.status = PushStatus.DONE
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
            if push.status == PushStatus.SENDING and now >= push.deadline:
                self._port.count("pushes_unknown", 1)
                self._port.push_unanswered(push)  # the node marks it unknown (its ledger wakes its waiters)
                push.next_query = now
            if push.status == PushStatus.UNKNOWN and now >= push.next_query:
                if push.queries:  # the last query went unanswered for retry_s: the peer may be gone
                    self._port.push_unanswered(push)
                push.queries += 1
                push.next_query = now + self._retry_s
                self._settles.append((push.peer, push.seq, "query"))
                self._port.count("push_queries", 1)

    def _send_settles(self, poller: zmq.Poller) -> None:
        for peer, seq, op in self._settles:
            sock = self._socket(poller, peer)
            if sock is None:  # no member any more: nobody left to answer
                self._port.count("settles_dropped", 1)
                self._settle_answered(peer, seq)
                continue
            try:
                sock.send(wire.encode_settle(self._node, seq, op), zmq.NOBLOCK)
            except zmq.Again:
                self._port.count("settles_dropped", 1)  # a query is asked again; an unsent abort expires there
                self._settle_answered(peer, seq)  # no answer will come
        self._settles.clear()

    def _settle_answered(self, peer: str, seq: int) -> None:
        """The exchange ``seq`` with ``peer`` (if one awaits it) needs no more of its SETTLE."""
        job = self._settling.pop((peer, seq), None)
        if job is not None:
            job.settle_answered.set()

    def _push_frames(self, sock: zmq.Socket, push: Push, wire_layout: Layout, *, hold: bool) -> bool:
        """Send push ``push``: its payload whole or streamed (:func:`send_push_frames`), or a header naming its
        segment (a peer that takes this node's pushes through shared memory); False when nothing went out."""
        shared = self._shared.pushes_shared(push)
        news, host = self._port.news_for(push.peer), self._port.host_id
        header = push_header(self._node, push, wire_layout, self._chunk, news, hold=hold, host=host, shared=shared)
        if shared:  # the header alone: it names the snapshot's segment
            return send_shared_push(sock, push, header, self._port.count)
        return send_push_frames(sock, push, header, self._port.count)

    def _send_push(self, poller: zmq.Poller, push: Push) -> None:
        layouts = self._ensure_layout(poller)
        if layouts is None:  # pragma: no cover - the node publishes before it pushes
            self._settle_push(push, PushStatus.REFUSED, "layout")
            return
        sock = self._socket(poller, push.peer)
        if sock is None:
            self._settle_push(push, PushStatus.REFUSED, NOT_A_MEMBER)  # it left: the mass comes back
            return
        self._pushes[(push.peer, push.seq)] = push
        if not self._push_frames(sock, push, layouts[0], hold=False):
            self._settle_push(push, PushStatus.REFUSED, "send-queue-full")  # nothing left: the mass comes back

    def _settle_push(self, push: Push, status: PushStatus, code: str) -> None:
        self._pushes.pop((push.peer, push.seq), None)
        self._port.push_settled(push, status, code)

    def _push_answer(self, peer: str, header: wire.Ack | wire.Error) -> bool:
        """An ACK or ERROR from ``peer``: settle the push it names; True when it named one."""
        if header.node == peer:  # an exchange's push, never among these, is answered here too
            self._shared.answered(peer, header)
        push = self._pushes.get((peer, header.req))
        if push is None or header.node != peer:
            return False
        if isinstance(header, wire.Error):
            self._settle_push(push, PushStatus.REFUSED, header.code)
        else:
            self._settle_push(push, PushStatus.DELIVERED, "")
        return True

    def _ensure_layout(self, poller: zmq.Poller) -> tuple[Layout, Layout] | None:
        layouts = self._port.layouts()
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
            common_options(sock)
            sock.setsockopt(zmq.MAXMSGSIZE, self._maxmsgsize)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            tune_data_socket(sock)
            if self._setup is not None:
                try:
                    self._setup(sock, peer)
                except (KeyError, OSError, ValueError) as exc:  # e.g. no public key file for a joined member
                    sock.close(linger=0)
                    log.warning("cannot connect to %s: %s", peer, exc)
                    self._port.count("peer_setup_failed", 1)
                    return None
            try:
                sock.connect(connect_address(self._endpoints[peer]))
            except zmq.ZMQError as exc:  # an endpoint libzmq refuses (the member table only takes plain hosts)
                sock.close(linger=0)
                log.warning("cannot connect to %s at %s: %s", peer, self._endpoints[peer], exc)
                self._port.count("peer_setup_failed", 1)
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
                self._finish(job, target, FetchStatus.REJECTED, "layout", "no local layout yet")
            return
        wire_layout = layouts[0]
        for target in job.targets:
            host = self._shared.host_for(target.peer, self._port.host_id)
            request = fetch_request(self._node, job, wire_layout, self._port.news_for(target.peer), host)
            sock = self._socket(poller, target.peer)
            if sock is None:
                self._finish(job, target, FetchStatus.REFUSED, NOT_A_MEMBER, f"{target.peer} is no member any more")
                continue
            if job.push is not None and target.peer == job.push.peer:  # the exchange's push goes first
                job.push.status = PushStatus.SENDING
                if not self._push_frames(sock, job.push, wire_layout, hold=True):
                    self._finish(job, target, FetchStatus.TIMEOUT, "send-queue-full", "send queue full")
                    self._reset(poller, target.peer)
                    continue
            try:
                sock.send(request, zmq.NOBLOCK)
                self._port.count("fetches_started", 1)
            except zmq.Again:
                self._finish(job, target, FetchStatus.TIMEOUT, "send-queue-full", "send queue full")
                self._reset(poller, target.peer)

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
        hwm = push_send_hwm(len(bounds)) if self._push_rule else 4
        if limit != self._maxmsgsize or hwm != self._sndhwm:
            self._maxmsgsize = limit
            self._sndhwm = hwm
            for peer in list(self._sockets):
                self._reset(poller, peer)

    def _finish(
        self, job: FetchJob, target: FetchTarget, status: FetchStatus, code: str = "", detail: str = ""
    ) -> None:
        """Report ``target``'s verdict; a reply judged after update_wait timed the target out counts as stale.

        An exchange stands or falls with its reply: SETTLE commit once the reply is OK, abort otherwise -- also
        when update_wait timed the target out first (it mixes nothing), so the peer frees the push it holds at
        once instead of keeping it until it expires."""
        settled = job.settle(target, status, code, detail)
        if job.push is not None and target.peer == job.push.peer and not job.exchange_settled:
            job.exchange_settled = True
            self._settles.append((target.peer, job.push.seq, "commit" if target.status == FetchStatus.OK else "abort"))
            self._settling[(target.peer, job.push.seq)] = job
        if settled:
            self._port.fetch_done(job, target)
        elif status != FetchStatus.TIMEOUT:
            log.debug("dropping the verdict %s on %s: update_wait stopped waiting for it", status, target.peer)
            self._port.count("stale_replies", 1)

    def _receive(self, poller: zmq.Poller, job: FetchJob | None, peer: str, sock: zmq.Socket) -> None:
        """Take the messages waiting on ``peer``'s socket (at most MAX_MESSAGES_PER_WAKE)."""
        for _ in range(MAX_MESSAGES_PER_WAKE):
            target = None
            if job is not None:
                target = next((t for t in job.targets if t.peer == peer and t.status == FetchStatus.PENDING), None)
            try:
                head = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if is_own_echo(head, self._node):  # connected to itself (connect_address): reconnect
                discard_rest(sock)
                self._port.count("self_connections", 1)
                log.info("node %s: its socket to %s reached itself; reconnecting", self._node, peer)
                self._reset(poller, peer)
                return
            try:
                self._message(job, target, sock, head, peer)
            except _Broken as broken:
                discard_rest(sock)
                assert job is not None and target is not None
                self._finish(job, target, FetchStatus.REJECTED, broken.error.reason, broken.error.detail)
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
            if header is not None and header.kind in (Kind.ACK, Kind.ERROR) and header.node == peer:
                self._settle_answered(peer, header.req)  # if it answers an exchange's SETTLE; then taken as before
            if header is not None and header.kind is Kind.ACK:  # a commit's ACK, or one for a push settled already
                self._port.count("acks_unmatched", 1)
                return
        tag = wire.decode_chunk_tag(head)
        if tag is not None:
            if job is None or target is None or tag[0] != job.req or target.next_chunk < 0:
                discard_rest(sock)  # a chunk of a reply already judged (or never announced): nothing to take
                self._port.count("stale_replies", 1)
                return
            self._chunk_message(target, sock, tag[1], len(head))
            if target.next_chunk == len(self._bounds):
                self._finish(job, target, FetchStatus.OK)
            return
        if target is None or job is None:
            discard_rest(sock)
            self._port.count("stale_replies", 1)
            self._release_stale(peer, header)
            return
        if target.next_chunk >= 0:
            raise _Broken(WireError("frames", "a message other than the next chunk inside a streamed reply"))
        self._header_message(job, target, sock, head, header)

    def _release_stale(self, peer: str, header: wire.Message | None) -> None:
        """A reply nobody waits for any more that lent a snapshot (shared memory): give it back now, rather than
        leave the server's buffer leased until the loan ends (a one-buffer server skips its publishes meanwhile)."""
        if isinstance(header, wire.State) and header.shm is not None and header.node == peer:
            self._shared.submit_release(peer, header.req)

    def _header_message(
        self, job: FetchJob, target: FetchTarget, sock: zmq.Socket, head: bytes, decoded: wire.Message | None = None
    ) -> None:
        """A reply's header (``decoded``: already decoded), and with the single-message framing its payload
        frames too."""
        layouts = self._port.layouts()
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
                    self._port.count("stale_replies", 1)
                    return
                target.header = header
                self._finish(job, target, FetchStatus.REFUSED, header.code, header.detail)
                return
            if header.kind is not Kind.STATE:
                raise WireError("header", f"unexpected {header.kind.name} reply")
            try:
                header.check_against(wire_layout, peer=target.peer, req=job.req, chunk=self._chunk)
            except WireError as exc:
                if exc.reason == "stale":
                    discard_rest(sock)
                    self._port.count("stale_replies", 1)
                    self._release_stale(target.peer, header)
                    return
                raise
            target.header = header  # validated: kept even if the payload is rejected (push-sum mass accounting)
            if header.shm is not None:
                if sock.get(zmq.RCVMORE):
                    raise WireError("frames", "a shared-memory reply came with payload frames")
                target.nbytes = received
                finish = functools.partial(self._finish, job, target)
                payload = (wire_layout, self._reader, self._bounds)
                self._shared.answer(sock, job, target, header, payload, finish, self._port.host_id)
                return
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
            self._finish(job, target, FetchStatus.REJECTED, exc.reason, exc.detail)
            return
        target.nbytes = received
        self._finish(job, target, FetchStatus.OK)

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
