"""Thread-safe counters of one node, and log-once bookkeeping for repeated network faults."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from dpwa.metrics import DECLINED_CODES

__all__ = ["COUNTERS", "ONCE_LOG_KEYS", "NodeStats", "OnceLog"]

COUNTERS = (
    "fetches_started",  # fetch requests sent to a peer
    "fetches_ok",  # replies received, validated and handed to the trainer
    "fetches_timed_out",  # no (complete) reply before the deadline
    "fetches_late",  # of those: update_wait timed out itself, the TX thread had no verdict by deadline + 50 ms
    "fetches_refused",  # the peer answered with an error (by code in refused_by_reason)
    "fetches_declined",  # of those: declined, not failures (dpwa.metrics.DECLINED_CODES: not ready, busy, left)
    "fetches_not_ready",  # of those: "not ready", a peer that has published nothing yet (starting)
    "fetches_busy",  # of those: "busy", a peer in other exchanges (AD-PSGD: its inbox holds as many as it takes)
    "fetches_rejected",  # a reply that failed validation: dropped, params untouched
    "fetches_skipped",  # a batch wanted a fetch but no peer was up (or one was still in flight)
    "stale_replies",  # messages of no fetch in flight (late replies, stray chunks, other ERRORs), discarded
    "mixes",  # update_wait calls that mixed at least one peer in
    "served",  # snapshots sent to requesters
    "fetches_held",  # FETCHes the RX thread held back while the node rewrote its one snapshot (transport.memory low)
    "serve_dropped",  # replies dropped because a requester's queue was full
    "requests_rejected",  # malformed requests received by the RX thread
    "requests_failed",  # requests whose handling raised (a bug, logged with its traceback): unanswered
    "auth_denied",  # connections to the RX thread refused by CURVE authentication (security.curve)
    "snapshots_skipped",  # update_send found every snapshot buffer busy and kept the previous one
    "bytes_in",
    "bytes_out",
    # push rules (pushsum, adpsgd): the sending end
    "pushes_sent",  # pushes streamed to a peer
    "pushes_delivered",  # pushes the receiver acknowledged (ACK)
    "pushes_returned",  # pushes refused (busy, invalid, never arrived): their mass came back
    "pushes_unknown",  # pushes past their deadline without an answer: settled by a SETTLE query
    "push_queries",  # SETTLE queries sent about such pushes
    "pushes_skipped",  # steps whose push was skipped: the target still had one unsettled, or no target
    "push_send_queue_full",  # pushes (or part of one) the peer's send queue had no room for
    "settles_dropped",  # SETTLEs the send queue had no room for (a query is asked again)
    "acks_unmatched",  # ACKs of no push in flight (a commit's ACK, a repeat)
    # push rules: the receiving end
    "pushes_received",  # pushes taken whole into the inbox and acknowledged
    "pushes_busy",  # pushes refused with ERROR busy (inbox full, or the sender's last one unmixed)
    "pushes_stale",  # PUSH headers repeating a sequence number already settled
    "push_stale_chunks",  # chunk messages of no push being received, discarded
    "pushes_expired",  # pushes that did not arrive whole within timeout_ms: slot freed
    "pushes_rejected",  # pushes refused by validation (by reason in push_rejected_by_reason)
    "pushes_unsupported",  # pushes or settles sent to this node although its rule takes none
    "pushes_not_ready",  # pushes refused before this node's first publish (no layout yet): the sender keeps its mass
    "pushes_from_departed",  # pushes or settles from a member that went (sent before it left): refused, not invalid
    "answers_dropped",  # ACK / ERROR answers the requester's queue had no room for
    "exchanges_committed",  # AD-PSGD exchanges confirmed by the fetcher: mixed at the next update_wait
    "exchanges_aborted",  # exchanges the fetcher withdrew (its reply was lost or rejected)
    "exchanges_expired",  # exchanges neither committed nor aborted in time: dropped, not mixed
    "exchanges_declined",  # exchange FETCHes refused busy: the snapshot they would pair with served one already
    "exchanges_unmixed",  # committed exchanges a leaving node did not mix (close without final_mix): sum moved
    # shared memory between co-located nodes (transport.shared_memory; dpwa/node/sharedmem.py)
    "shm_served",  # of served: snapshots lent in shared memory (the socket carried the header only)
    "shm_released",  # of those: given back by the requester's RELEASE
    "shm_loans_expired",  # of those: given back at the loan's deadline (no RELEASE came)
    "releases_rejected",  # RELEASEs from a peer that did not authenticate as the node it names (CURVE)
    "releases_unmatched",  # RELEASEs of no loan held (it expired first, or was never made): nothing to give back
    "shm_fetched",  # of fetches_ok: replies read from the peer's segment
    "shm_fallbacks",  # peers whose segment could not be opened: fetched over the socket from then on
    "shm_loans_copied",  # lent replies copied out at update_wait (their loan was ending) and given back at once
    "shm_loans_lapsed",  # lent replies not mixed: the peer had rewritten them by update_wait
    "shm_torn",  # lent replies the server rewrote while they were mixed (a loan outlived: should stay 0)
    "shm_pushed",  # of pushes_sent: pushes that named this node's segment (a co-located receiver read it there)
    "shm_push_fallbacks",  # peers that refused such a push: pushed over the socket from then on
    "shm_pushes_taken",  # of pushes_received (and exchanges' pushes held): read from the sender's segment
    "releases_dropped",  # RELEASEs the send queue had no room for (the loan expires at the server)
    # membership (docs/membership.md)
    "joins_admitted",  # JOINs this node answered with its table
    "joins_refused",  # JOINs refused (name clash, a file node's name, a full table, a key of another name)
    "left_answers",  # requests answered "left" while this node was leaving
    "leave_acknowledged",  # members that answered this node's leave announcement
    "hand_offs",  # push rules: the leave's hand-off of the node's mass taken by a member
    "pushes_lost",  # pushes to a member forgotten without a word (it died): never answered, mass lost
    "peer_setup_failed",  # connections to a member not opened (no public key file for a joined member)
)


class NodeStats:
    """Counters shared by the trainer, TX and RX threads; ``snapshot()`` returns a plain dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._rejected: Counter[str] = Counter()
        self._push_rejected: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()
        self._reasons: Counter[str] = Counter()
        self._by_peer: dict[str, Counter[str]] = {}
        self._fetch_ms_total = 0.0

    def add(self, name: str, n: int = 1) -> None:
        """counters[name] += n"""
        with self._lock:
            self._counts[name] += n

    def reject(self, reason: str, received_bytes: int = 0) -> None:
        """Count a reply dropped by validation, under its reason."""
        with self._lock:
            self._counts["fetches_rejected"] += 1
            self._counts["bytes_in"] += received_bytes
            self._rejected[reason] += 1

    def refuse(self, code: str) -> None:
        """Count a fetch the peer refused (an ERROR), under its code; a declined one (``DECLINED_CODES``) also
        in ``fetches_declined`` and, for ``not-ready`` and ``busy``, in its own counter."""
        with self._lock:
            self._counts["fetches_refused"] += 1
            self._refused[code] += 1
            if code in DECLINED_CODES:
                self._counts["fetches_declined"] += 1
            if code == "not-ready":
                self._counts["fetches_not_ready"] += 1
            elif code == "busy":
                self._counts["fetches_busy"] += 1

    def outcome(self, reason: str) -> None:
        """Count a fetch that did not end ``ok`` under its reason (:func:`dpwa.metrics.fetch_reason`)."""
        with self._lock:
            self._reasons[reason] += 1

    def reject_push(self, reason: str) -> None:
        """Count a push refused by validation, under its reason."""
        with self._lock:
            self._counts["pushes_rejected"] += 1
            self._push_rejected[reason] += 1

    def fetch_done(self, ms: float, nbytes: int) -> None:
        """Count a good fetch of ``nbytes`` that took ``ms``."""
        with self._lock:
            self._counts["fetches_ok"] += 1
            self._counts["bytes_in"] += nbytes
            self._fetch_ms_total += ms

    def peer_outcome(self, peer: str, outcome: str) -> None:
        """Count a finished fetch from ``peer`` under ok / timeout / refused / rejected."""
        with self._lock:
            self._by_peer.setdefault(peer, Counter())[outcome] += 1

    def forget_peer(self, peer: str) -> None:
        """Drop ``peer``'s outcome counts (a member forgotten: per-peer state stays bounded by the table)."""
        with self._lock:
            self._by_peer.pop(peer, None)

    def snapshot(self) -> dict[str, Any]:
        """All counters, ``rejected_by_reason``, ``refused_by_reason``, ``push_rejected_by_reason``,
        ``fetches_by_reason`` (every fetch not ``ok``, by reason), ``by_peer``, ``mean_fetch_ms``, and
        ``fetches_failed``: timed out + refused + rejected, less the declined refusals (not ready, busy, left)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["fetches_failed"] = (
                out["fetches_timed_out"] + out["fetches_refused"] - out["fetches_declined"] + out["fetches_rejected"]
            )
            out["rejected_by_reason"] = dict(self._rejected)
            out["refused_by_reason"] = dict(self._refused)
            out["fetches_by_reason"] = dict(self._reasons)
            out["push_rejected_by_reason"] = dict(self._push_rejected)
            out["by_peer"] = {peer: dict(c) for peer, c in self._by_peer.items()}
            ok = self._counts["fetches_ok"]
            out["mean_fetch_ms"] = self._fetch_ms_total / ok if ok else 0.0
        return out


ONCE_LOG_KEYS = 16384
"""The most keys a :class:`OnceLog` remembers."""


class OnceLog:
    """Log a message the first time a key is seen (e.g. (peer, reason)), at debug level after that. At most
    ``limit`` keys are remembered: once full, a new key logs at DEBUG (after one WARNING saying so), so a flood of
    new keys costs neither memory nor a flood of warnings. Keys name members and the node's own events; what a
    stranger sends is keyed as one (``serving``'s layout refusals)."""

    def __init__(self, logger: logging.Logger, limit: int = ONCE_LOG_KEYS) -> None:
        self._logger = logger
        self._seen: set[tuple[Any, ...]] = set()
        self._lock = threading.Lock()
        self._limit = limit
        self._full_said = False

    def warning(self, key: tuple[Any, ...], msg: str, *args: Any, level: int = logging.WARNING) -> None:
        """Log at ``level`` the first time ``key`` is seen, at DEBUG afterwards (and once the keys are full)."""
        with self._lock:
            first = key not in self._seen and len(self._seen) < self._limit
            full = not first and key not in self._seen and not self._full_said
            if first:
                self._seen.add(key)
            self._full_said = self._full_said or full
        if full:
            self._logger.warning("%d kinds of first warnings seen: further ones are logged at DEBUG", self._limit)
        self._logger.log(level if first else logging.DEBUG, msg, *args)

    def forget(self, first: Any) -> None:
        """Forget the keys that start with ``first`` (a member forgotten): logged afresh if they come back."""
        with self._lock:
            self._seen = {key for key in self._seen if not key or key[0] != first}
