"""The receiving end of PUSH: an inbox of preallocated slots the RX thread fills and the trainer drains.

A push arrives whole (header and its one chunk in one message) or streamed (a header, then one tagged message per
chunk; ``dpwa.node.wire``). The RX thread hands each to :class:`PushReceiver`, which validates it exactly like a
fetched reply (known sender, CURVE identity, layout, sizes, frame order, finite values) and copies it into a free
slot. A slot's life::

    free -> receiving -> full                            (a push: ACK sent; mixed at update_wait)
    free -> receiving -> held -> served -> committed     (an exchange's push: kept until the
                                                          sender's SETTLE commit; mixed then)
    any state but mixing -> free                         (refused, expired, aborted)
    full / committed -> mixing -> free                   (the trainer's update_wait)

(:class:`~dpwa.node.states.SlotState`; every move goes through :data:`~dpwa.node.states.SLOT_MOVES`,
and one the table does not list is a bug: it raises.)

Rules of the inbox:

* at most ``slots`` pushes are held, and at most ``per_sender`` from one sender (one more is refused ``busy``, so
  the sender keeps its mass); push-sum's ``update_wait`` mixes every push that is here, oldest first (a late push
  is folded with the next round's), an exchange rule's one per sender, its oldest, so a push that lands while its
  sender's previous one is unmixed waits one step instead of being refused (a jitter buffer for two clocks that
  drift);
* an exchange keeps the snapshot served to it (a lease) until it is mixed; a node with one snapshot buffer
  that rewrites it first (:meth:`PushReceiver.unpair`) leaves the slot holding ``push - served`` instead;
* per sender, the round a push names (``extras["round"]``, the sender's step) is remembered once the push has its
  verdict, taken or refused: :meth:`PushReceiver.wait_rounds` is SGP's wait for the in-neighbours of a round;
* per sender, sequence numbers only grow: a push or a SETTLE names sequence number ``q``, and once ``q`` has a
  verdict (accepted, or refused) it never changes. A SETTLE ``query`` closes a push still arriving (its remaining
  chunks are dropped) so that the sender's reading of the verdict is final: a push is delivered exactly when the
  receiver said ACK for it;
* nothing here allocates per message: payload frames are received straight into a slot (or widened from ZeroMQ's
  buffer), and every message that belongs to no slot is discarded and counted;
* only the trainer's thread reads a slot's arrays into the parameters (:meth:`PushReceiver.drain`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from dpwa.node import wire
from dpwa.node.frames import copy_segment, discard_rest, receive_payload
from dpwa.node.sharedmem import SegmentReader
from dpwa.node.states import SLOT_MOVES, SlotState, moves
from dpwa.node.verdicts import Verdicts
from dpwa.node.wire import CHUNK_BYTES, ErrorCode, Layout, PayloadReader, Push, Settle, WireError

__all__ = ["HOLD_TIMEOUTS", "InboxSlot", "PushReceiver", "round_of"]

log = logging.getLogger(__name__)

HOLD_TIMEOUTS = 8.0
"""An exchange's push waits at most this many ``timeout_ms`` for its SETTLE before it is dropped."""


@dataclass
class InboxSlot:
    """One preallocated receive buffer of the inbox and the push it holds."""

    index: int
    buffer: np.ndarray
    views: list[np.ndarray]
    state: SlotState = SlotState.FREE
    sender: str = ""
    identity: bytes = b""
    seq: int = -1
    header: Push | None = None
    next_chunk: int = 0
    deadline: float = 0.0
    served: Any = None
    """An exchange: the snapshot (leased) this node served to the sender's fetch: the other half of the pair."""
    difference: bool = False
    """An exchange whose buffer holds ``push - served`` (:meth:`PushReceiver.unpair`); ``served`` is then None."""
    colocated: bool = False
    """The sender offered this node's co-location identity (and, with CURVE, authenticated): its ACK says this
    node takes its pushes through shared memory."""


@dataclass(frozen=True)
class _Reserved:
    """What :meth:`PushReceiver._reserve` did: a slot reserved (``slot``), or none and ``answer`` to send."""

    slot: InboxSlot | None
    answer: bytes | None


_UNSETTLED = frozenset({SlotState.RECEIVING, SlotState.HELD, SlotState.SERVED})
"""A push still arriving, or an exchange's push waiting for its FETCH or its SETTLE: what expires or aborts."""
_READY = frozenset({SlotState.FULL, SlotState.COMMITTED})
"""Whole and taken: what the trainer mixes."""


def _move(slot: InboxSlot, new: SlotState) -> None:
    """Move ``slot`` to ``new`` (caller holds the inbox's lock); RuntimeError for a move :data:`SLOT_MOVES` lacks."""
    if not moves(SLOT_MOVES, slot.state, new):
        raise RuntimeError(f"inbox slot {slot.index}: no move from {slot.state} to {new}")
    slot.state = new


def _shared_refusal(reason: str) -> ErrorCode:
    """The code refusing a push through shared memory for ``reason``: ``busy`` when the segment changed before it
    was read (a passing race: an exchange's pusher that gave up on it), ``shared-memory`` when this node will not
    or cannot read the sender's segments (the sender pushes over the socket from then on), else ``bad-request``."""
    if reason in ("shm-gen", "shm-torn"):
        return ErrorCode.BUSY
    return ErrorCode.SHARED_MEMORY if reason.startswith("shm-") else ErrorCode.BAD_REQUEST


def round_of(header: Push | None) -> int | None:
    """The round a push names (``extras["round"]``, the sender's step: a non-negative integer), or None."""
    value = header.extras.get("round") if header is not None else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _early(slot: InboxSlot, upto: int | None, window: int) -> bool:
    """True when ``slot``'s push is of a round after ``upto`` but at most ``window`` after it."""
    if upto is None:
        return False
    r = round_of(slot.header)
    return r is not None and upto < r <= upto + window


class PushReceiver:
    """Validates pushes into an inbox of ``slots`` preallocated buffers; see the module doc-string.

    ``names``: the cluster's nodes (the only senders taken); ``layouts()``: ``(wire, local)`` or None before the
    first publish; ``on_event(counter, n)``: stats; ``on_reject(reason)``: a push refused by validation;
    ``release(snapshot)``: give back the lease of a served snapshot. ``timeout_s``: how long a push may take to
    arrive whole; ``per_sender``: pushes one sender may have here. ``host_id``: this node's co-location identity
    ("": it takes no push through shared memory)."""

    def __init__(
        self,
        name: str,
        names: Sequence[str],
        layouts: Callable[[], tuple[Layout, Layout] | None],
        slots: int,
        timeout_s: float,
        on_event: Callable[[str, int], None],
        on_reject: Callable[[str], None],
        release: Callable[[Any], None],
        *,
        chunk: int = CHUNK_BYTES,
        check_identity: bool = False,
        per_sender: int = 2,
        host_id: str = "",
    ) -> None:
        if slots < 1:
            raise ValueError(f"an inbox needs at least one slot, got {slots}")
        if not 1 <= per_sender <= slots:
            raise ValueError(f"per_sender must be in [1, {slots}], got {per_sender}")
        self._per_sender = per_sender
        self.name = name
        self._senders = frozenset(n for n in names if n != name)
        self._layouts = layouts
        self._n_slots = slots
        self._timeout_s = timeout_s
        self._on_event = on_event
        self._on_reject = on_reject
        self._release = release
        self._chunk = chunk
        self._check_identity = check_identity
        self._host_id = host_id
        self.segments = SegmentReader()
        """The senders' segments a push through shared memory names (RX thread; closed with the node)."""
        self._gone: set[str] = set()
        """Senders no longer members whose segments the RX thread has still to unmap (:meth:`expire`)."""
        self._lock = threading.Condition()
        """Guards everything below; notified when a sender's round is settled here (:meth:`wait_rounds`)."""
        self._slots: list[InboxSlot] = []
        self._takes = True
        """False once allocated with no slot (an active AD-PSGD node): every push is refused ``unsupported``."""
        self._reader: PayloadReader | None = None
        self._bounds: list[tuple[int, int]] = []
        self._verdicts = Verdicts()
        """Per sender: its latest sequence number seen and the verdict on it; retired ones (:mod:`verdicts`)."""
        self._rounds: dict[str, int] = {}
        """sender -> the round (``extras["round"]``) of its latest push that has a verdict here."""
        self.closing = False
        """Set when the node leaves: every new push is refused busy (the sender keeps its mass)."""

    # ------------------------------------------------------------ set-up (trainer thread)

    def set_senders(self, names: Sequence[str]) -> None:
        """The members pushes are taken from (any thread): the table changed. The verdicts of senders no longer
        among them and with nothing in the inbox are retired (:class:`~dpwa.node.verdicts.Verdicts`): still the
        answer to their SETTLE queries, and theirs again if they come back."""
        with self._lock:
            senders = frozenset(n for n in names if n != self.name)
            went = self._senders - senders
            self._gone = (self._gone | went) - senders
            self._senders = senders
            held = {s.sender for s in self._slots if s.state != SlotState.FREE}
            for sender in self._verdicts.follow(senders, held, went):
                self._rounds.pop(sender, None)

    def allocate(self, local: Layout, slots: int | None = None) -> None:
        """Allocate the slots for ``local`` (once, at the node's first publish): ``slots`` of them (None: the
        number given at construction)."""
        with self._lock:
            if self._slots or not self._takes:
                return
            self._takes = slots != 0
            for i in range(self._n_slots if slots is None else slots):
                buffer = local.allocate()
                self._slots.append(InboxSlot(i, buffer, local.views(buffer)))

    def _ready(self) -> tuple[Layout, PayloadReader] | None:
        layouts = self._layouts()
        if layouts is None or not self._slots:
            return None
        wire_layout, local = layouts
        if self._reader is None or self._reader.wire is not wire_layout or self._reader.local is not local:
            self._reader = PayloadReader(wire_layout, local)
            self._bounds = wire_layout.frame_bounds(self._chunk)
        return wire_layout, self._reader

    # ------------------------------------------------------------ RX thread

    def begin(self, identity: bytes, header: Push, user: str | None) -> bytes | None:
        """A streamed PUSH's header: reserve a slot (None: nothing to answer yet) or refuse it (the ERROR); a PUSH
        naming its sender's segment is taken whole (:meth:`shared`)."""
        if header.shm is not None:
            return self.shared(identity, header, user)
        return self._reserve(identity, header, user, whole=False).answer

    def shared(self, identity: bytes, header: Push, user: str | None) -> bytes | None:
        """A PUSH whose payload lies in its sender's segment (``header.shm``): reserve a slot and copy the payload
        into it, checked as a socket push is, the segment's generation the same before and after; or refuse it:
        ERROR ``shared-memory`` when this node would not or could not read the segment (the sender pushes over
        the socket from then on), ``busy`` when the segment changed before it was read. Returns the answer (None: an
        exchange's push, held until its SETTLE)."""
        reserved = self._reserve(identity, header, user, whole=False)
        slot = reserved.slot
        if slot is None:  # refused, or a repeat of a push that is here already (its verdict, or none yet)
            return reserved.answer
        assert header.shm is not None and self._reader is not None
        try:
            if not slot.colocated:
                raise WireError("shm-unasked", "not co-located with this node")
            mapped = self.segments.open(header.node, header.shm, self._reader.wire.total_bytes, header.gen)
            copy_segment(mapped, header.gen, self._reader, slot.buffer, slot.views, self._bounds)
        except WireError as exc:
            self._on_reject(exc.reason)
            with self._lock:
                self._free(slot, accepted=False)
            return wire.encode_error(self.name, header.req, _shared_refusal(exc.reason), f"{exc.reason}: {exc.detail}")
        self._on_event("shm_pushes_taken", 1)
        slot.next_chunk = len(self._bounds)
        return self._arrived(slot)

    def _colocated(self, header: Push, user: str | None) -> bool:
        """Whether ``header``'s sender is co-located with this node and, with CURVE, authenticated as itself."""
        same_host = bool(self._host_id) and header.host == self._host_id
        return same_host and (not self._check_identity or user == header.node)

    def whole(self, identity: bytes, header: Push, user: str | None, sock: zmq.Socket) -> bytes | None:
        """A whole PUSH, its one chunk next on ``sock``: reserve a slot and take the chunk, or refuse it.

        Returns the answer to send (ACK, ERROR) or None (an exchange's push: held, answered by its SETTLE)."""
        reserved = self._reserve(identity, header, user, whole=True)
        if reserved.slot is None:
            discard_rest(sock)
            return reserved.answer
        return self.chunk(identity, header.req, 0, sock)

    def _reserve(self, identity: bytes, header: Push, user: str | None, *, whole: bool) -> _Reserved:
        """A slot for ``header``'s push (moved to ``receiving``), or no slot and the answer: an ERROR, or, for a
        repeat of a push already here, its verdict of record (None: it has none yet, it comes when the push does)."""
        sender = header.node
        if self._stranger(sender, user):
            return _Reserved(
                None, wire.encode_error(self.name, header.req, ErrorCode.BAD_REQUEST, "not a peer of this cluster")
            )
        if not self._takes:  # an active AD-PSGD node: it starts exchanges, it takes none
            self._on_event("pushes_unsupported", 1)
            with self._lock:
                self._settle_round(sender, header)
            return _Reserved(
                None, wire.encode_error(self.name, header.req, ErrorCode.UNSUPPORTED, "this node takes no exchanges")
            )
        ready = self._ready()
        if ready is None:  # refused before this node's first publish: the sender keeps its mass, the round is over
            self._on_event("pushes_not_ready", 1)
            with self._lock:
                self._settle_round(sender, header)
            return _Reserved(None, wire.encode_error(self.name, header.req, ErrorCode.NOT_READY, "no layout yet"))
        wire_layout, _ = ready
        try:
            header.check_against(wire_layout, chunk=self._chunk, whole=whole)
        except WireError as exc:
            self._on_reject(exc.reason)
            return _Reserved(
                None, wire.encode_error(self.name, header.req, ErrorCode.BAD_REQUEST, f"{exc.reason}: {exc.detail}")
            )
        with self._lock:
            last, verdict = self._verdicts.get(sender)
            if header.req <= last:  # a repeat or an old push: it has (or will get) the verdict of record
                self._on_event("pushes_stale", 1)
                return _Reserved(None, self._verdict_reply(header.req, last, verdict))
            if self.closing:  # the node is leaving: it takes no more mass, the sender keeps it
                return _Reserved(None, self._busy(header, "this node is leaving"))
            if sum(s.state != SlotState.FREE and s.sender == sender for s in self._slots) >= self._per_sender:
                return _Reserved(None, self._busy(header, f"this sender has {self._per_sender} unmixed pushes here"))
            slot = next((s for s in self._slots if s.state == SlotState.FREE), None)
            if slot is None:
                return _Reserved(None, self._busy(header, "inbox full"))
            self._verdicts.set(sender, header.req, None)
            _move(slot, SlotState.RECEIVING)
            slot.sender, slot.identity, slot.seq = sender, identity, header.req
            slot.header, slot.next_chunk = header, 0
            slot.deadline = time.monotonic() + self._timeout_s
            slot.colocated = self._colocated(header, user)
        return _Reserved(slot, None)

    def chunk(self, identity: bytes, seq: int, index: int, sock: zmq.Socket) -> bytes | None:
        """A chunk message of push ``seq``: take its payload frame (next on ``sock``) into the slot.

        Returns the reply to send: ACK once a plain push is whole, ERROR when it went wrong, else None.
        """
        with self._lock:
            slot = next(
                (s for s in self._slots if s.state == SlotState.RECEIVING and s.identity == identity and s.seq == seq),
                None,
            )
        if slot is None:
            discard_rest(sock)
            self._on_event("push_stale_chunks", 1)
            return None
        try:
            self._take(slot, index, sock)
        except WireError as exc:
            discard_rest(sock)
            self._on_reject(exc.reason)
            with self._lock:
                self._free(slot, accepted=False)
            return wire.encode_error(self.name, seq, ErrorCode.BAD_REQUEST, f"{exc.reason}: {exc.detail}")
        if slot.next_chunk < len(self._bounds):
            return None
        return self._arrived(slot)

    def _arrived(self, slot: InboxSlot) -> bytes | None:
        """``slot``'s push is here whole: full (its ACK, saying whether the sender may push through shared
        memory), or, an exchange's, held for its SETTLE (None)."""
        assert slot.header is not None
        seq = slot.seq
        with self._lock:
            if slot.header.hold:
                _move(slot, SlotState.HELD)
                slot.deadline = time.monotonic() + HOLD_TIMEOUTS * self._timeout_s
                return None
            _move(slot, SlotState.FULL)
            self._give_verdict(slot.sender, seq, slot.header, taken=True)
        self._on_event("pushes_received", 1)
        return wire.encode_ack(self.name, seq, shm=slot.colocated)

    def _take(self, slot: InboxSlot, index: int, sock: zmq.Socket) -> None:
        assert self._reader is not None
        if index != slot.next_chunk:
            raise WireError("frames", f"chunk {index} arrived, expected chunk {slot.next_chunk}")
        if not sock.get(zmq.RCVMORE):
            raise WireError("frames", "a chunk message without its payload frame")
        start, end = self._bounds[index]
        self._on_event("bytes_in", receive_payload(sock, self._reader, slot.buffer, slot.views, start, end))
        if sock.get(zmq.RCVMORE):
            raise WireError("frames", "a chunk message with more than one payload frame")
        slot.next_chunk += 1

    def holds_exchange(self, sender: str, seq: int) -> bool:
        """Whether the push of ``sender``'s exchange ``seq`` is here whole, waiting for its FETCH."""
        with self._lock:
            return any(s.state == SlotState.HELD and s.sender == sender and s.seq == seq for s in self._slots)

    def serve_exchange(self, sender: str, seq: int, snapshot: Any) -> bool:
        """A FETCH completing exchange ``seq`` of ``sender``: remember the (leased) ``snapshot`` served to it.

        False (nothing kept: serve an ERROR instead) when no held push of that exchange is here."""
        with self._lock:
            slot = next(
                (s for s in self._slots if s.state == SlotState.HELD and s.sender == sender and s.seq == seq), None
            )
            if slot is None:
                return False
            _move(slot, SlotState.SERVED)
            slot.served = snapshot
            return True

    def unpair(self, snapshot: Any) -> int:
        """Trainer thread, before a node with one snapshot buffer rewrites ``snapshot``: every exchange paired with
        it keeps ``push - snapshot`` in its own buffer instead (what its mix adds) and gives the lease back.
        Returns how many."""
        with self._lock:
            paired = [s for s in self._slots if s.served is snapshot]
            for slot in paired:
                for mine, served in zip(slot.views, snapshot.readonly):
                    np.subtract(mine, served, out=mine)
                slot.served, slot.difference = None, True
                self._release(snapshot)
            return len(paired)

    def settle(self, identity: bytes, header: Settle, user: str | None) -> bytes:
        """A SETTLE from ``header.node`` about its push ``header.req``: the ACK or ERROR to send back."""
        sender, seq = header.node, header.req
        retired = self._retired_answer(header, user)
        if retired is not None:
            return retired
        if self._stranger(sender, user):
            return wire.encode_error(self.name, seq, ErrorCode.BAD_REQUEST, "not a peer of this cluster")
        with self._lock:
            slot = next(
                (s for s in self._slots if s.state != SlotState.FREE and s.sender == sender and s.seq == seq), None
            )
            last, verdict = self._verdicts.get(sender)
            if header.op == "commit":
                if slot is not None and slot.state == SlotState.SERVED:
                    _move(slot, SlotState.COMMITTED)
                    self._verdicts.set(sender, seq, True)
                    self._on_event("exchanges_committed", 1)
                    return wire.encode_ack(self.name, seq, shm=slot.colocated)
                return wire.encode_error(self.name, seq, ErrorCode.NOT_DELIVERED, "no exchange to commit")
            if header.op == "abort":
                if slot is not None and slot.state in _UNSETTLED:
                    self._free(slot, accepted=False)
                    self._on_event("exchanges_aborted", 1)
                elif seq > last:
                    self._verdicts.set(sender, seq, False)
                return wire.encode_ack(self.name, seq)
            # query: close a push still arriving, so that the verdict read now is final
            if seq > last:
                self._verdicts.set(sender, seq, False)
                return wire.encode_error(self.name, seq, ErrorCode.NOT_DELIVERED, "never arrived whole")
            if seq == last and verdict is None:  # an exchange's push too: a commit after this finds nothing
                if slot is not None and slot.state in _UNSETTLED:
                    self._free(slot, accepted=False)
                self._verdicts.set(sender, seq, False)
                verdict = False
            return self._verdict_reply(seq, last, verdict)

    def _retired_answer(self, header: Settle, user: str | None) -> bytes | None:
        """A SETTLE query from a sender no longer a member whose verdicts are retired here (with CURVE, asked by
        that node itself): the verdict of record (a push after the last one recorded was refused: not a member);
        None for anything else."""
        sender, seq = header.node, header.req
        if header.op != "query" or sender in self._senders or (self._check_identity and user != sender):
            return None
        with self._lock:
            record = self._verdicts.retired(sender)
        if record is None:
            return None
        last, verdict = record
        if seq > last or verdict is None:
            return wire.encode_error(self.name, seq, ErrorCode.NOT_DELIVERED, "refused: not a member")
        return self._verdict_reply(seq, last, verdict)

    def _verdict_reply(self, seq: int, last: int, verdict: bool | None) -> bytes | None:
        """What push ``seq`` gets when its sender asks again (caller holds the lock)."""
        if seq == last and verdict:
            return wire.encode_ack(self.name, seq)
        if seq == last and verdict is None:
            return None  # still arriving: the verdict comes when it is whole
        return wire.encode_error(self.name, seq, ErrorCode.NOT_DELIVERED, "refused earlier")

    def expire(self, now: float) -> None:
        """Free the slots of pushes that did not arrive whole in time, and of exchanges never settled; unmap the
        segments of senders that are no members any more."""
        with self._lock:
            gone, self._gone = self._gone, set()
        for sender in gone:
            self.segments.forget(sender)
        with self._lock:
            for slot in self._slots:
                if slot.state in _UNSETTLED and now >= slot.deadline:
                    self._on_event("pushes_expired" if slot.state == SlotState.RECEIVING else "exchanges_expired", 1)
                    log.debug("node %s: %s push %d of %s expired", self.name, slot.state, slot.seq, slot.sender)
                    self._free(slot, accepted=False)

    def _busy(self, header: Push, detail: str) -> bytes:
        """Refuse ``header``'s push ``busy`` for good (caller holds the lock; the sender keeps its mass): the ERROR."""
        self._give_verdict(header.node, header.req, header, taken=False)
        self._on_event("pushes_busy", 1)
        return wire.encode_error(self.name, header.req, ErrorCode.BUSY, detail)

    def _give_verdict(self, sender: str, seq: int, header: Push | None, *, taken: bool) -> None:
        """Push ``seq`` of ``sender`` is taken or refused for good (caller holds the lock): record its verdict and
        settle the round ``header`` names."""
        self._verdicts.set(sender, seq, taken)
        self._settle_round(sender, header)

    def _settle_round(self, sender: str, header: Push | None) -> None:
        """A push of ``sender`` got its verdict (taken, or refused: its mass went back): its round, if it names
        one, is settled here (caller holds the lock)."""
        value = round_of(header)
        if value is not None:
            self._rounds[sender] = max(value, self._rounds.get(sender, -1))
            self._lock.notify_all()

    def _stranger(self, sender: str, user: str | None) -> bool:
        """True when ``sender`` is no member, or, with CURVE, not the name the connection authenticated as (``user``):
        counted under ``identity``, or ``pushes_from_departed`` for a member that went (its push crossed its leave)."""
        named = not self._check_identity or user == sender
        with self._lock:
            if named and sender in self._senders:
                return False
            went = named and self._verdicts.went(sender)
        self._on_event("pushes_from_departed", 1) if went else self._on_reject("identity")
        return True

    def _free(self, slot: InboxSlot, *, accepted: bool) -> None:
        """Empty ``slot`` (caller holds the lock); a refused push's verdict is recorded as refused and its round
        settled (the sender keeps its mass: SGP need not wait it out), whatever refused it: a bad chunk, a segment
        that could not be read, an expiry, an abort, a query. A free slot stays as it is."""
        if slot.state == SlotState.FREE:
            return
        if not accepted and self._verdicts.get(slot.sender)[0] == slot.seq:
            self._give_verdict(slot.sender, slot.seq, slot.header, taken=False)
        if slot.served is not None:
            self._release(slot.served)
        _move(slot, SlotState.FREE)
        slot.sender, slot.identity, slot.seq = "", b"", -1
        slot.header, slot.served, slot.next_chunk, slot.difference, slot.colocated = None, None, 0, False, False

    # ------------------------------------------------------------ trainer thread

    def drain(self, *, every: bool = False, upto: int | None = None, window: int = 0) -> list[InboxSlot]:
        """The pushes to mix now, marked ``mixing`` until :meth:`release`: per sender its oldest ready one
        (whole push, committed exchange), in sender order; ``every``: all ready ones, by sender then sequence.

        ``upto`` (a round): a push naming a round in ``(upto, upto + window]`` stays for its own round (a
        sender in lock-step, a little ahead); one naming none, an earlier round, or a later one is taken."""
        with self._lock:
            ready = sorted(
                (s for s in self._slots if s.state in _READY and not _early(s, upto, window)),
                key=lambda s: (s.sender, s.seq),
            )
            if not every:
                oldest: dict[str, InboxSlot] = {}
                for s in ready:
                    oldest.setdefault(s.sender, s)
                ready = list(oldest.values())
            for s in ready:
                _move(s, SlotState.MIXING)
        return ready

    def latest_round(self, sender: str) -> int:
        """The round of ``sender``'s latest push with a verdict here (-1: none named a round)."""
        with self._lock:
            return self._rounds.get(sender, -1)

    def wait_rounds(self, wanted: Mapping[str, int], timeout_s: float) -> list[str]:
        """Wait (at most ``timeout_s`` seconds) until each sender ``s`` of ``wanted`` has a push of round
        ``>= wanted[s]`` settled here (taken or refused); the senders still missing, in order."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            while True:
                missing = [s for s, r in wanted.items() if self._rounds.get(s, -1) < r]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self._lock.wait(left)

    def release(self, slots: Sequence[InboxSlot]) -> None:
        """The trainer is done with ``slots``: free them."""
        with self._lock:
            for s in slots:
                self._free(s, accepted=True)

    def pending_mass(self, key: str | None) -> float:
        """The sum of ``extras[key]`` over the pushes held and not yet mixed (accounting, any thread); 0.0 for no
        key."""
        with self._lock:
            held = [s.header.extras for s in self._slots if s.state in _READY and s.header is not None]
        return wire.extras_sum(held, key) if key is not None else 0.0

    def verdict_for(self, sender: str) -> tuple[int, bool | None]:
        """``sender``'s latest sequence number here and its verdict (True taken, False refused, None pending);
        ``(-1, None)`` for a sender never seen. A leaving node sends it in its announcement: final once
        ``closing`` is set and nothing is arriving."""
        with self._lock:
            return self._verdicts.get(sender)

    def slots_in(self, *states: SlotState) -> int:
        """How many slots are in one of ``states`` (any thread): pushes arriving, exchanges awaiting a SETTLE ..."""
        with self._lock:
            return sum(s.state in states for s in self._slots)

    def occupied(self) -> int:
        """Slots not free (any thread)."""
        with self._lock:
            return sum(s.state != SlotState.FREE for s in self._slots)
