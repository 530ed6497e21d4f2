"""Snapshots lent through shared memory: which co-located requester holds which snapshot, until when.

A FETCH answered with a shared-memory reference (:attr:`dpwa.node.wire.State.shm`) leaves the snapshot leased
(the pool reuses no leased buffer) until the requester sends RELEASE for that request, or the loan's deadline
passes (the RX thread's tick). Either way the lease ends exactly once. At most :data:`MAX_LOANS` loans are out at
a time; past that a request is answered over the socket.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dpwa.node.snapshots import Snapshot

__all__ = ["MAX_LOANS", "Loans"]

MAX_LOANS = 256
"""The most loans out at once (each one keeps a snapshot buffer from reuse)."""


class Loans:
    """Loans keyed by (requester, request id); ``release(snapshot)`` ends a snapshot's lease (the pool's)."""

    def __init__(self, release: Callable[[Snapshot], None], count: Callable[[str, int], None]) -> None:
        self._release = release
        self._count = count
        self._lock = threading.Lock()
        self._out: dict[tuple[str, int], tuple[Snapshot, float]] = {}

    def lend(self, requester: str, req: int, snapshot: Snapshot, until: float) -> bool:
        """Record the loan of ``snapshot`` (already leased) until ``until`` (monotonic s); False when
        :data:`MAX_LOANS` are out or that request already holds one (the caller answers over the socket)."""
        with self._lock:
            key = (requester, req)
            if len(self._out) >= MAX_LOANS or key in self._out:
                return False
            self._out[key] = (snapshot, until)
            return True

    def give_back(self, requester: str, req: int) -> bool:
        """End the loan of ``requester``'s request ``req``; False when there is none (released or expired)."""
        with self._lock:
            loan = self._out.pop((requester, req), None)
        if loan is None:
            return False
        self._release(loan[0])
        return True

    def cancel(self, requester: str, req: int) -> bool:
        """Forget the loan of ``requester``'s request ``req`` *without* ending its lease: the reply naming it was
        never made, and whoever leased the snapshot releases it. False when there is none."""
        with self._lock:
            return self._out.pop((requester, req), None) is not None

    def expire(self, now: float) -> int:
        """End every loan whose deadline passed (counted ``shm_loans_expired``); how many."""
        with self._lock:
            due = [key for key, (_, until) in self._out.items() if until <= now]
            loans = [self._out.pop(key)[0] for key in due]
        for snapshot in loans:
            self._release(snapshot)
        if loans:
            self._count("shm_loans_expired", len(loans))
        return len(loans)

    def outstanding(self) -> int:
        """Loans out now."""
        with self._lock:
            return len(self._out)

    def close(self) -> None:
        """End every loan (the node closes; not counted as expired)."""
        with self._lock:
            loans = [snapshot for snapshot, _ in self._out.values()]
            self._out.clear()
        for snapshot in loans:
            self._release(snapshot)
