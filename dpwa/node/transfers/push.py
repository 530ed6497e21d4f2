"""Push (push-sum, SGP, OSGP): each round, send this node's snapshot with a share of the rule's mass to the
round's peers; mix whatever arrived in the inbox.

The sending end is the :class:`~dpwa.node.pushes.PushLedger`: every push until it is known delivered (ACK) or
refused (ERROR; what it carried comes back and is mixed in as a peer named like the node). A receiver whose
previous push is still unanswered is skipped. ``update_wait`` returns once at most ``rule.overlap`` pushes await
their ACK (OSGP's tau; 0 is synchronous SGP).

On a fixed schedule ``update_wait`` first waits, at most one exchange timeout, for the push of round
``k - overlap`` of each in-neighbour (:meth:`PushTransfer.wait_sources`); the inbox keeps a push of a later
round, within :meth:`PushTransfer.source_window`, for its own round. A node that leaves cleanly settles its
pushes, folds in what arrived and hands its whole mass to one member (:meth:`PushTransfer.hand_off`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any, ClassVar

import numpy as np

from dpwa.node.pushes import Push, PushLedger
from dpwa.node.snapshots import Snapshot
from dpwa.node.states import PUSH_FLOW_EFFECT, PushStatus, SlotState
from dpwa.node.transfers.base import Arrival
from dpwa.node.transfers.fetcher import round_peers
from dpwa.node.transfers.host import Host
from dpwa.node.transfers.receiving import InboxTransfer
from dpwa.node.wire import ErrorCode
from dpwa.rules import NodeState, PeerSnapshot, Transfer
from dpwa.rules.schedules import Round

__all__ = ["PushTransfer", "in_step", "source_window"]

log = logging.getLogger(__name__)

ROUTINE_REFUSALS = frozenset({ErrorCode.BUSY.value, ErrorCode.NOT_READY.value})
"""A push refused for these is routine (a full inbox, a peer that has published nothing yet): said at INFO."""


def source_window(members: int, overlap: int, period: int) -> int:
    """How many rounds behind the awaited one an in-neighbour may be and still be waited for, in a cluster of
    ``members``: a node in lock-step is at most a graph's diameter (``ceil(log2 N)`` on the exponential graph) plus
    the ``overlap`` away; one further behind (it restarted, or it is not synchronous) is not waited for. Rounds are
    ``period`` steps apart (an outer optimizer's schedule exchanges every ``every`` steps)."""
    return (2 * max(1, math.ceil(math.log2(max(2, members)))) + overlap + 2) * period


def in_step(latest: int, awaited: int, window: int, started_together: bool) -> bool:
    """Whether an in-neighbour is waited for its push of round ``awaited``: it was heard naming a round within
    ``window`` of it (``latest``, -1 if never), or, in the first ``window`` rounds, it started with this node."""
    return latest >= max(0, awaited - window) or (latest < 0 and awaited < window and started_together)


class PushTransfer(InboxTransfer):
    """Push to this round's peers; mix the inbox and the pushes that came back."""

    kind: ClassVar[Transfer] = Transfer.PUSH

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self.ledger = PushLedger()
        self.pushed = 0
        """Pushes the latest ``update_send`` started."""
        self.push_ms = 0.0
        """The slowest push delivered (send to ACK) found by the latest wait."""
        self.delivered = 0
        """Pushes delivered (ACK) found by the latest wait: ``push_ms`` is theirs."""
        self.sources_late: list[str] = []
        """In-neighbours whose push of the awaited round did not come in time."""
        self.sources_wait_ms = 0.0
        """How long the latest ``update_wait`` waited for them."""
        self._returned: list[Push] = []

    # ------------------------------------------------------------ the step (trainer thread)

    def start(self, snapshot: Snapshot | None) -> None:
        """Push the snapshot just published to this round's peers, giving each its share.

        A receiver whose previous push from this node has no verdict yet (OSGP runs on before the ACK) is waited
        for until that push's deadline, so that each round's push goes out (its receiver waits for it); one still
        unanswered then (the TX thread asks about it) is skipped, its share kept."""
        host, ledger = self.host, self.ledger
        self.pushed = 0
        if host.rng.random() >= host.config.fetch_probability:
            return
        chosen, wanted = round_peers(host)
        if not wanted:  # the schedule wants nobody this round (an outer optimizer's local steps): nothing skipped
            return
        for peer in chosen:  # the previous push to a receiver still on its way: wait for its verdict (bounded)
            previous = ledger.open_push(peer)
            if previous is not None and previous.status == PushStatus.SENDING:
                slack = host.timeouts.verdict_slack_s
                ledger.wait_for(previous, max(0.0, previous.deadline + slack - time.monotonic()))
        ready = [p for p in chosen if not ledger.busy(p) and p not in ledger.unsupported]
        if snapshot is None or not ready:
            host.stats.add("pushes_skipped")
            return
        with host.state_lock:
            shares = host.rule.push_shares(host.state, len(ready))
        deadline = time.monotonic() + host.timeouts.exchange_s
        for peer, given in zip(ready, shares):
            self._send(peer, {**given, "round": host.step}, snapshot, deadline)  # "round": for the receiver's wait
        self.pushed = len(ready)

    def _send(self, peer: str, given: dict[str, Any], snapshot: Snapshot, deadline: float) -> Push:
        """Open a push of ``snapshot`` (a lease of its own) carrying ``given`` to ``peer`` and hand it to the TX
        thread."""
        pool = self.host.pool
        assert pool is not None
        pool.retain(snapshot)
        prepare = functools.partial(pool.prepare_push, snapshot)
        push = Push(peer, next(self.host.requests), given, snapshot, deadline, prepare=prepare)
        self.ledger.open(push)
        self.host.transport.submit_push(push)
        return push

    def source_window(self) -> int:
        """:func:`source_window` for this node's members, rule and schedule."""
        return source_window(len(self.host.names), self.host.rule.overlap, self.host.schedule.period)

    def wait_sources(self, upto: int | None) -> None:
        """On a fixed schedule: wait, at most one exchange timeout, until every in-neighbour of round
        ``upto - overlap`` has a push of that round settled in the inbox (``upto`` None: no round, no wait).

        Not waited for: a source that is down, that never sent a push naming its round (it is starting, or not
        a synchronous node; in the first :meth:`source_window` rounds a peer that answered the node's
        ``wait_for_peers`` is waited for all the same), or that is more than :meth:`source_window` rounds behind.
        A push that comes late is folded at the next ``update_wait`` (the inbox's drain takes every one there)."""
        self.sources_late, self.sources_wait_ms = [], 0.0
        wanted = self._owed(upto) if upto is not None else {}
        if not wanted:
            return
        started = time.perf_counter()
        self.sources_late = self.inbox.wait_rounds(wanted, self.host.timeouts.exchange_s)
        self.sources_wait_ms = (time.perf_counter() - started) * 1000.0
        if self.sources_late:
            self.host.stats.add("sources_late", len(self.sources_late))

    def _owed(self, upto: int) -> dict[str, int]:
        """The in-neighbours to wait for, each with the round awaited of it (see :meth:`wait_sources`)."""
        host = self.host
        awaited = upto - host.rule.overlap
        if awaited < 0:
            return {}
        with host.state_lock:
            sources = host.schedule.sources(Round(host.name, tuple(host.names), awaited, host.state))
        if not sources:
            return {}
        with host.flow_lock:
            up = set(host.flow.up_peers())
        window = self.source_window()

        def waited(source: str) -> bool:
            return in_step(self.inbox.latest_round(source), awaited, window, source in host.started_with)

        return {s: awaited for s in sources if s != host.name and s in up and waited(s)}

    def wait(self) -> None:
        super().wait()
        self._returned = self._settle_pushes()

    def _settle_pushes(self) -> list[Push]:
        """Wait (bounded by the pushes' deadlines) until at most ``rule.overlap`` pushes await an answer; release
        the delivered ones' snapshots and return the refused ones (their mass comes back)."""
        self.ledger.wait_until(self.host.rule.overlap, self.host.timeouts.verdict_slack_s)
        returned = []
        self.push_ms = 0.0
        self.delivered = 0
        for push in self.ledger.collect():
            if push.status == PushStatus.DELIVERED:
                self.push_ms = max(self.push_ms, push.ms)
                self.delivered += 1
                self.host.stats.add("pushes_delivered")
                self.host.release_snapshot(push.snapshot, push.tracker)
            else:
                self.host.stats.add("pushes_returned")
                returned.append(push)
        return returned

    def collect(self, upto: int | None) -> Arrival:
        """Every push in the inbox of round ``upto`` or earlier (all of them for None), oldest first, and the
        refused pushes, each as a peer named like this node carrying what it gave."""
        host = self.host
        targets, fetched = self.fetcher.collect()
        returned, self._returned = self._returned, []
        try:
            slots, received = self.drain(every=True, upto=upto, window=self.source_window())
        except BaseException:  # the refused pushes' snapshots go back all the same
            for p in returned:
                host.release_snapshot(p.snapshot, p.tracker)
            raise
        back = [
            PeerSnapshot(NodeState(host.name, p.snapshot.clock, p.snapshot.loss, dict(p.given)), p.snapshot.readonly)
            for p in returned
        ]

        def release() -> None:
            self.inbox.release(slots)
            for p in returned:
                host.release_snapshot(p.snapshot, p.tracker)

        return Arrival(targets, fetched, received, back, release)

    def fields(self, arrival: Arrival) -> dict[str, Any]:
        return {
            **super().fields(arrival),
            "pushed": self.pushed,
            "push_ms": self.push_ms,
            "delivered": self.delivered,
            "returned": len(arrival.returned),
            "unacked": len(self.ledger.unresolved()),
            "sources_late": len(self.sources_late),
            "sources_wait_ms": self.sources_wait_ms,
        }

    # ------------------------------------------------------------ TX thread

    def push_settled(self, push: Push, status: PushStatus, code: str) -> None:
        """The TX thread settled ``push``: delivered (ACK) or refused (ERROR); a peer that takes no pushes is
        never pushed to again in this session."""
        host = self.host
        host.flow_outcome(push.peer, PUSH_FLOW_EFFECT[PushStatus(status)])
        refused = status == PushStatus.REFUSED
        if refused and code == ErrorCode.UNSUPPORTED.value and push.peer not in self.ledger.unsupported:
            self.ledger.unsupported.add(push.peer)
            log.warning(
                "node %s: peer %s takes no pushes (its rule is pull-only); not pushing to it again",
                host.name,
                push.peer,
            )
        elif refused:
            host.once.warning(
                (push.peer, "push", code),
                "node %s: peer %s refused a push: %s",
                host.name,
                push.peer,
                code,
                level=logging.INFO if code in ROUTINE_REFUSALS else logging.WARNING,
            )
        self.ledger.settle(push, status, code)

    def push_unanswered(self, push: Push) -> None:
        """A push is past its deadline without an answer (or a SETTLE query about it went unanswered): the ledger
        marks it unknown (queries follow), and flow control counts a failure, so a peer that died is marked
        down and suspected as a peer that stopped answering fetches is."""
        self.ledger.mark_unknown(push)
        self.host.flow_outcome(push.peer, PUSH_FLOW_EFFECT[PushStatus.UNKNOWN])

    # ------------------------------------------------------------ membership

    def forget(self, peer: str) -> None:
        """Also abandon an unanswerable push to ``peer`` (its mass is lost, as a dead member's is)."""
        self._abandon(peer)
        super().forget(peer)

    def member_back(self, peer: str) -> None:
        """Abandon the push to ``peer``'s former incarnation still open (its leave's verdict never came): nobody
        asks about it any more, and an open push would keep every later push from going to ``peer``."""
        self._abandon(peer)

    def _abandon(self, peer: str) -> None:
        push = self.ledger.abandon(peer)
        if push is not None:
            self.host.stats.add("pushes_lost")
            self.host.release_snapshot(push.snapshot, push.tracker)

    def settle_with_leaver(self, peer: str, last: int, verdict: bool | None) -> None:
        """Settle an open push to ``peer``, which left: taken (``last`` is it, ``verdict`` True) is delivered;
        refused, never arrived, or still arriving when it left, the mass comes back."""
        push = self.ledger.open_push(peer)
        if push is None:
            return
        delivered = last == push.seq and verdict is True
        self.ledger.settle(push, PushStatus.DELIVERED if delivered else PushStatus.REFUSED, "left")

    # ------------------------------------------------------------ leaving (trainer thread)

    def hand_off(self, deadline: float, *, final_mix: bool) -> None:
        """Settle the pushes to members that are up, take no more, fold in everything that arrived, then push the
        rule's hand-off (push-sum: the whole ``(x, w)``) to one up member after another until one takes it.
        Bounded by ``deadline``. ``final_mix`` False puts the trainer's arrays back as they were before, so the
        model the user saves after closing is the one they last trained and evaluated."""
        params = self.host.params
        if params is None:
            return
        kept = None if final_mix else [np.array(a, copy=True) for a in params]
        try:
            self._fold_arrived(deadline)
            self._hand_over(deadline)
        finally:
            for array, before in zip(params, kept or ()):
                np.copyto(array, before)

    def _fold_arrived(self, deadline: float) -> None:
        """Refuse new pushes, wait for the pushes to up members to settle and for those arriving, then fold."""
        host = self.host
        self.inbox.closing = True  # from now on every push is refused busy: the senders keep their mass
        with host.flow_lock:
            up = set(host.flow.up_peers())
        self.ledger.wait_settled(max(0.0, deadline - time.monotonic()), waited=lambda peer: peer in up)
        self._wait_out(SlotState.RECEIVING, deadline)
        self._mix_out(*(set(SlotState) - {SlotState.FREE}))  # until empty: the inbox, and the pushes that came back

    def _hand_over(self, deadline: float) -> None:
        """Push the rule's hand-off to one up member after another until one takes it (or ``deadline``)."""
        host = self.host
        with host.flow_lock:
            candidates = [p for p in host.flow.up_peers() if not self.ledger.busy(p)]
        host.rng.shuffle(candidates)
        for peer in candidates:
            if time.monotonic() >= deadline:
                break
            snapshot = host.publish(tick=False)
            if snapshot is None:
                break
            with host.state_lock:
                given = host.rule.hand_off(host.state)
            if given is None:
                return
            push = self._send(peer, given, snapshot, min(deadline, time.monotonic() + host.timeouts.exchange_s))
            self.ledger.wait_for(push, max(0.0, deadline - time.monotonic()))
            if push.status == PushStatus.DELIVERED:
                log.info("node %s: handed its mass %s to %s", host.name, given, peer)
                self._settle_pushes()
                host.stats.add("hand_offs")
                return
            if push.status != PushStatus.REFUSED:  # no answer in time: the mass is with the peer or on the way
                log.warning("node %s: its hand-off to %s was not answered before it left", host.name, peer)
                return
            host.wait_and_mix(None)  # refused: the mass came back; try the next member
        if candidates:
            log.warning("node %s: no member took its mass before it left; it leaves with it", host.name)
        else:
            log.info("node %s: no member is up to take its mass; it leaves with it", host.name)

    # ------------------------------------------------------------ any thread

    def stats(self) -> dict[str, Any]:
        mass_key = self.host.rule.mass_key
        return {
            "push_in_flight": self.ledger.in_flight(mass_key),
            "pushes_unsettled": len(self.ledger.unresolved()),
            **super().stats(),
        }
