"""The TX thread's side of shared memory: a reply that names the peer's segment instead of carrying its payload,
and a push that names this node's segment instead of carrying its own.

:class:`SharedReplies` reads such a reply (:meth:`SharedReplies.take`): it maps the segment (checked: the
token, the size, the generation), and either hands the rule views into it (a job that ``lend``s, with the wire
layout the local one: the mix reads the segment itself, one pass, no copy; the loan is given back after the mix)
or copies (widens, dequantizes) it into the receive buffer, checking every value as the socket path does. A peer
whose segment cannot be opened is fetched over the socket from then on. It also queues the RELEASEs the trainer
asks for (after its mix) until the TX thread sends them.

A push goes through shared memory (:func:`~dpwa.node.transport.pushing.send_shared_push`) to a peer that said
it takes them: an ACK with ``shm`` set (the peer found the push's co-location identity its own, and, with CURVE,
the sender authenticated; a node that does not know such pushes never sets it, though it may lend replies). The
push names the snapshot's segment; the snapshot stays leased until the push has its verdict (an exchange's push:
until its fetch ended), so the peer reads it unchanged. A peer that refuses such a push ``shared-memory`` gets
this node's pushes over the socket for the rest of the session (``shm_push_fallbacks``); what that push carried
comes back, as for any refused push.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

import zmq

from dpwa.node import wire
from dpwa.node.frames import copy_segment
from dpwa.node.pushes import Push
from dpwa.node.sharedmem import SegmentReader
from dpwa.node.states import FetchStatus
from dpwa.node.transport.fetch import FetchJob, FetchTarget
from dpwa.node.wire import NON_FINITE, ErrorCode, Layout, PayloadReader, WireError

__all__ = ["SharedReplies"]

log = logging.getLogger(__name__)


class SharedReplies:
    """Node ``node``'s maps of its peers' segments, the peers it fetches over the socket instead, and the RELEASEs
    queued, and the peers that take its pushes through shared memory; ``count(event, n)`` counts ``shm_fetched``,
    ``shm_fallbacks``, ``releases_dropped`` and ``shm_push_fallbacks``. TX thread only, but
    :meth:`submit_release` (any thread)."""

    def __init__(self, node: str, count: Callable[[str, int], None]) -> None:
        self._node = node
        self._count = count
        self._segments = SegmentReader()
        self._refused: set[str] = set()
        self._releases: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._push_peers: set[str] = set()
        """Peers that take this node's pushes through shared memory."""
        self._push_refused: set[str] = set()
        """Peers that refused such a push: pushed over the socket for the rest of the session."""

    def forget(self, peer: str) -> None:
        """``peer`` is no member any more: drop the maps of its segments and what was learnt about it (a member of
        that name that comes later is another process)."""
        self._segments.forget(peer)
        for peers in (self._refused, self._push_peers, self._push_refused):
            peers.discard(peer)

    def host_for(self, peer: str, host_id: str) -> str:
        """The co-location identity a FETCH to ``peer`` carries: ``host_id``, or "" once its segment failed."""
        return "" if peer in self._refused else host_id

    def answer(
        self,
        sock: zmq.Socket,
        job: FetchJob,
        target: FetchTarget,
        header: wire.State,
        payload: tuple[Layout, PayloadReader, list[tuple[int, int]]],
        finish: Callable[..., None],
        host_id: str,
    ) -> None:
        """Give ``target`` its verdict (``finish(status, code, detail)``) on a reply whose payload lies in the peer's
        segment (:meth:`take`; ``payload``: the wire layout, its reader and chunk bounds); the loan is given back
        at once unless the rule is to mix it there (and update_wait still waits for it). A reply to a request that
        offered no co-location identity (``host_id``: this node's) is rejected ``shm-unasked``."""
        try:
            if not self.host_for(target.peer, host_id):
                raise WireError("shm-unasked", "a shared-memory reply to a request that offered none")
            kept = self.take(job, target, header, *payload)
        except WireError as exc:
            self.release(sock, job.req)
            finish(FetchStatus.REJECTED, exc.reason, exc.detail)
            return
        self._count("shm_fetched", 1)
        finish(FetchStatus.OK)
        if not kept or target.status != FetchStatus.OK:  # copied, or update_wait stopped waiting for it
            target.loan = None
            self.release(sock, job.req)

    def take(
        self,
        job: FetchJob,
        target: FetchTarget,
        header: wire.State,
        wire_layout: Layout,
        reader: PayloadReader,
        bounds: list[tuple[int, int]],
    ) -> bool:
        """Read ``target``'s reply from the segment ``header.shm`` names; True when the loan is kept (``target``'s
        views lie in the segment until the trainer gives it back), False when it can be given back now. Raises
        WireError (``shm-open``, ``shm-size``, ``shm-token``, ``shm-gen``, ``shm-torn``, or a value's reason);
        after ``shm-open`` the peer is fetched over the socket from then on."""
        assert header.shm is not None
        target.shared = True
        try:
            mapped = self._segments.open(target.peer, header.shm, wire_layout.total_bytes, header.gen)
        except WireError as exc:
            if exc.reason == "shm-open" and target.peer not in self._refused:
                self._refused.add(target.peer)
                self._count("shm_fallbacks", 1)
                log.warning("node %s: %s; fetching from %s over the socket", self._node, exc.detail, target.peer)
            raise
        payload, word = mapped.payload, mapped.gen
        if job.lend and reader.direct:
            views = wire_layout.views(payload)
            attested = int(mapped.checked[0]) == header.gen and not any(wire_layout.bounds)
            if not attested and not reader.check(views, 0, wire_layout.total_bytes):
                raise WireError(reader.fault or NON_FINITE, "payload holds a value that is not valid")
            target.views, target.loan = views, (word, header.gen)
            return True
        copy_segment(mapped, header.gen, reader, target.buffer, target.views, bounds)
        return False

    # ------------------------------------------------------------ pushes

    def pushes_shared(self, push: Push) -> bool:
        """Whether ``push`` goes through shared memory: its peer takes them and its snapshot lies in a segment."""
        return push.peer in self._push_peers and push.snapshot.segment is not None

    def answered(self, peer: str, header: wire.Ack | wire.Error) -> None:
        """An answer from ``peer`` to a push or an exchange's push: an ACK may say it takes this node's pushes
        through shared memory; an ERROR ``shared-memory`` sends its pushes over the socket from then on."""
        if isinstance(header, wire.Ack):
            if header.shm and peer not in self._push_refused:
                self._push_peers.add(peer)
        elif header.code == ErrorCode.SHARED_MEMORY.value and peer not in self._push_refused:
            self._push_peers.discard(peer)
            self._push_refused.add(peer)
            self._count("shm_push_fallbacks", 1)
            log.warning(
                "node %s: %s refused a push through shared memory (%s); pushing to it over the socket",
                self._node,
                peer,
                header.detail,
            )

    # ------------------------------------------------------------ releases

    def release(self, sock: zmq.Socket, req: int) -> None:
        """Send RELEASE for request ``req`` on ``sock``; a full queue drops it (the loan expires at the server)."""
        try:
            sock.send(wire.encode_release(self._node, req), zmq.NOBLOCK)
        except zmq.Again:
            self._count("releases_dropped", 1)

    def submit_release(self, peer: str, req: int) -> None:
        """Queue a RELEASE of what ``peer`` lent to request ``req`` (any thread); :meth:`send_releases` sends it."""
        self._releases.put((peer, req))

    def send_releases(self, socket_for: Callable[[str], zmq.Socket | None]) -> None:
        """Send every queued RELEASE on its peer's socket (``socket_for(peer)``; None: the peer is gone)."""
        while True:
            try:
                peer, req = self._releases.get_nowait()
            except queue.Empty:
                return
            sock = socket_for(peer)
            if sock is not None:
                self.release(sock, req)

    def close(self) -> None:
        """Drop every map (each unmapped once no array views it)."""
        self._segments.close()
