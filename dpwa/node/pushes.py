"""The sending end of PUSH: every push a node made, until it is known delivered or refused.

The trainer opens a :class:`Push` at ``update_send`` (the rule has already taken from its own
state what the push gives, e.g. half of a push-sum weight); the TX thread sends it and gives
it its verdict (:meth:`PushLedger.settle`):

* ``delivered`` -- the receiver answered ACK: what the push carried is the receiver's now;
* ``refused`` -- the receiver answered ERROR (``busy``, a validation failure, or, to a SETTLE
  query, "never arrived whole"): what the push carried comes back to the sender, which folds
  the push's own snapshot back in at its next ``update_wait``;
* while neither came (the deadline passed without an answer: the ACK, or the push itself, may
  be lost) the push is ``unknown`` and the TX thread asks the receiver with a SETTLE query
  until it answers. The receiver closes a push it is asked about, so its answer is final:
  nothing is ever lost or counted twice;
* ``lost`` -- the receiver was forgotten with the push unresolved (:meth:`PushLedger.abandon`).

A push's status is a :class:`~dpwa.node.states.PushStatus`; the ledger moves it only along
:data:`~dpwa.node.states.PUSH_MOVES` and ignores a move the table does not list (a verdict that
comes after another one).

A node keeps at most one unresolved push per receiver (a step whose target still has one
skips its push, keeping what it would have given). The ledger is shared by the trainer and
the TX thread; everything in it changes under one condition variable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpwa.node.states import PUSH_MOVES, PushStatus, moves
from dpwa.node.wire import extras_sum

__all__ = ["Push", "PushLedger"]


@dataclass
class Push:
    """One push: to ``peer``, sequence number ``seq``, carrying ``given`` (rule extras) and ``snapshot`` (leased)."""

    peer: str
    seq: int
    given: dict[str, Any]
    snapshot: Any
    deadline: float
    prepare: Callable[[int], None] | None = None
    """Called with a chunk index before that chunk is sent (rounds a narrower wire dtype in place)."""
    status: PushStatus = PushStatus.SENDING
    queries: int = 0
    """SETTLE queries sent about this push so far."""
    code: str = ""
    started: float = field(default_factory=time.monotonic)
    next_query: float = 0.0
    tracker: Any = None
    """The zero-copy send's tracker: the snapshot stays busy until ZeroMQ is done with its frames."""
    release: Callable[[Any], None] | None = None
    """Gives the snapshot's lease back, with the tracker (an exchange's push: called by the TX thread)."""
    ms: float = 0.0


class PushLedger:
    """Open pushes by peer, and the finished ones the trainer has not collected yet."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open: dict[str, Push] = {}
        self._finished: list[Push] = []
        self.unsupported: set[str] = set()
        """Peers that answered a push with ``unsupported``: never asked again in this session."""

    def open(self, push: Push) -> None:
        """Register a push before it is handed to the TX thread (trainer thread)."""
        with self._cond:
            if push.peer in self._open:
                raise RuntimeError(f"a push to {push.peer} is still unresolved")
            self._open[push.peer] = push

    def busy(self, peer: str) -> bool:
        """True while a push to ``peer`` has no verdict."""
        with self._cond:
            return peer in self._open

    def settle(self, push: Push, status: PushStatus | str, code: str = "") -> bool:
        """Give ``push`` its final verdict (``delivered`` or ``refused``); False when it already had one."""
        verdict = PushStatus(status)
        with self._cond:
            if self._open.get(push.peer) is not push or not moves(PUSH_MOVES, push.status, verdict):
                return False
            del self._open[push.peer]
            push.status, push.code = verdict, code
            push.ms = (time.monotonic() - push.started) * 1000.0
            self._finished.append(push)
            self._cond.notify_all()
            return True

    def mark_unknown(self, push: Push) -> None:
        """The deadline passed without an answer (the TX thread asks the receiver from now on): wake waiters."""
        with self._cond:
            if moves(PUSH_MOVES, push.status, PushStatus.UNKNOWN):
                push.status = PushStatus.UNKNOWN
            self._cond.notify_all()

    def wait_settled(self, timeout_s: float, waited: Callable[[str], bool] = lambda peer: True) -> bool:
        """Block until every push to a peer ``waited(peer)`` says is worth waiting for has its verdict (SETTLE
        queries answer the unknown ones), at most ``timeout_s``; True if reached."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(waited(peer) for peer in self._open):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def wait_for(self, push: Push, timeout_s: float) -> bool:
        """Block until ``push`` has its verdict, at most ``timeout_s``; True if it has."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._open.get(push.peer) is push:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def open_push(self, peer: str) -> Push | None:
        """The push to ``peer`` without a verdict, if any."""
        with self._cond:
            return self._open.get(peer)

    def abandon(self, peer: str) -> Push | None:
        """``peer`` is gone without a word (forgotten): its open push will never be answered. It is closed as
        ``lost`` (its mass is neither back nor known delivered: a dead member's mass is lost, as in any
        push-sum) and not collected; returned for its snapshot's release."""
        with self._cond:
            push = self._open.pop(peer, None)
            if push is not None and moves(PUSH_MOVES, push.status, PushStatus.LOST):
                push.status, push.code = PushStatus.LOST, "member-gone"
                self._cond.notify_all()
            return push

    def unresolved(self) -> list[Push]:
        """The pushes without a verdict yet."""
        with self._cond:
            return list(self._open.values())

    def wait_until(self, at_most: int, slack_s: float) -> bool:
        """Block until at most ``at_most`` pushes are still ``sending`` (no verdict, not yet past their own
        deadline), at most until the latest such deadline plus ``slack_s``; True if reached."""
        with self._cond:
            while True:
                sending = [p for p in self._open.values() if p.status == PushStatus.SENDING]
                if len(sending) <= at_most:
                    return True
                left = max(p.deadline for p in sending) + slack_s - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def collect(self) -> list[Push]:
        """The pushes that got their verdict since the last call (trainer thread)."""
        with self._cond:
            done, self._finished = self._finished, []
            return done

    def in_flight(self, key: str | None) -> float:
        """The sum of ``given[key]`` over the pushes without a verdict (accounting); 0.0 for no key."""
        with self._cond:
            return extras_sum((p.given for p in self._open.values()), key) if key is not None else 0.0
