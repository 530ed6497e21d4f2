"""A fetch job: the peers one fetch asks, the preallocated buffers their replies land in, and their verdicts.

The trainer's thread builds a :class:`FetchJob` (one :class:`FetchTarget` per peer, a deadline) and hands it to
the TX thread (:class:`~dpwa.node.transport.tx.TxFetcher`). Each target gets exactly one verdict, a
:class:`~dpwa.node.states.FetchStatus` that leaves ``pending`` once (:data:`~dpwa.node.states.FETCH_MOVES`):
from the TX thread (:meth:`FetchJob.settle`), or -- when the waiter stops waiting, :data:`VERDICT_SLACK_S`
seconds past the deadline -- a timeout from :meth:`FetchJob.expire`. A verdict that comes later changes nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpwa.node import wire
from dpwa.node.pushes import Push
from dpwa.node.states import FETCH_MOVES, FetchStatus, moves
from dpwa.node.timeouts import Timeouts

__all__ = ["LATE_DETAIL", "NOT_A_MEMBER", "VERDICT_SLACK_S", "FetchJob", "FetchTarget"]

LATE_DETAIL = "the TX thread gave no verdict by the deadline"
"""The detail of a target the waiter timed out itself (``late``)."""
NOT_A_MEMBER = "not-a-member"
"""The code of a fetch or push refused here, without a message: its peer left or was forgotten."""
VERDICT_SLACK_S = Timeouts.verdict_slack_s
"""How long a waiter (update_wait, bootstrap) waits past a fetch's deadline for the TX thread's verdict, in s."""


@dataclass
class FetchTarget:
    """One peer of a fetch job and the preallocated buffer its reply lands in (in the local layout)."""

    peer: str
    buffer: np.ndarray
    views: list[np.ndarray]
    status: FetchStatus = FetchStatus.PENDING
    code: str = ""
    """A short reason, a stats key for rejections (the peer's ERROR code for a refusal)."""
    detail: str = ""
    header: wire.State | wire.Error | None = None
    ms: float = 0.0
    """Milliseconds from the job's start to this target's verdict."""
    nbytes: int = 0
    next_chunk: int = -1
    """In a streamed reply: the index of the chunk expected next; -1 while the header is awaited."""
    late: bool = False
    """update_wait timed this target out itself: the TX thread had no verdict by the deadline."""
    shared: bool = False
    """The reply came through shared memory (its payload read from the peer's segment, not the socket)."""
    loan: tuple[np.ndarray, int] | None = None
    """``views`` lie in the peer's shared-memory segment, lent to request ``req``: the segment's generation word
    and the generation it must still hold when the rule is done (then the loan is given back)."""


@dataclass
class FetchJob:
    """Fetch the latest snapshot of every target before ``deadline`` (time.monotonic seconds).

    Each target gets exactly one verdict (:meth:`settle`): from the TX thread, or -- when
    update_wait stops waiting -- a timeout from :meth:`expire`; a verdict that comes later is ignored.
    """

    req: int
    targets: list[FetchTarget]
    deadline: float
    extras: dict[str, Any] = field(default_factory=dict)
    """Sent with the request (the rule's push-pull state)."""
    push: Push | None = None
    """An exchange: this push (of the fetcher's own snapshot) goes to its peer just before the FETCH."""
    exchange_settled: bool = False
    """The exchange's SETTLE (commit or abort) is queued: one per exchange (the TX thread's alone)."""
    settle_answered: threading.Event = field(default_factory=threading.Event)
    """The peer answered that SETTLE (ACK or ERROR), or it could not go out, or the TX thread ended: a leaving node
    waits for it before its sockets close (dropping what they have not sent), or the peer would expire a commit
    whose other half this node mixed."""
    lend: bool = False
    """A shared-memory reply stays lent until the rule has mixed it (the views point into the peer's segment);
    else the TX thread copies it into the receive buffer and gives it back at once."""
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    expired: bool = False
    """update_wait gave up on this job (:meth:`expire`): the TX thread drops it."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def settle(self, target: FetchTarget, status: FetchStatus | str, code: str = "", detail: str = "") -> bool:
        """Give ``target`` its verdict; False (and nothing changes) when it already has one."""
        status = FetchStatus(status)
        with self.lock:
            if not moves(FETCH_MOVES, target.status, status):
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
            late = [t for t in self.targets if moves(FETCH_MOVES, t.status, FetchStatus.TIMEOUT)]
            for t in late:
                t.status, t.code, t.detail, t.late = FetchStatus.TIMEOUT, "timeout", LATE_DETAIL, True
                t.ms = (time.monotonic() - self.started) * 1000.0
        return late
