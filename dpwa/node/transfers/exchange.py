"""Exchange (AD-PSGD): each round, one fetch that carries this node's snapshot to the peer it fetches from.

``update_send`` hands the TX thread one job: the exchange's push (this node's snapshot, held by the peer's
inbox) goes just before the FETCH, and the FETCH names it, so that the peer pairs the push with the snapshot it
serves back. The reply's verdict settles the exchange on both ends (a SETTLE commit, or abort). Each end then
mixes the other's model against what it sent: the fetcher at its ``update_wait``, the peer when it drains the
committed exchange from its inbox (one per sender a step, its oldest).

A published snapshot pairs with one exchange at most (:func:`pairs_exchange`): a second FETCH that would pair
with it is refused ``busy`` (the fetcher aborts, and its push is freed here). Two peers that each averaged with
the same snapshot would each take half of it; applying both halves leaves this node's own model no weight, and a
slow node that served four fast peers in one of its steps would give its own model a weight of -1 (the simulator found
the models diverging from about 64 nodes with 10 % stragglers). The paper's averaging is atomic: one pair at a
time.

A node that lingers (trains no more) refuses every exchange ``busy``, also one whose push it held before it began
to linger: it would never apply its half of them while the peer applied its own, and the pair's sum (the cluster's
mean) would drift. Pulls are still served. Leaving, it waits for the exchanges it served before to settle:
``final_mix`` mixes the committed ones (:meth:`ExchangeTransfer.hand_off`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import ClassVar

from dpwa.node.pushes import Push
from dpwa.node.snapshots import Snapshot
from dpwa.node.states import SlotState
from dpwa.node.transfers.base import Arrival, Refusal
from dpwa.node.transfers.host import Host
from dpwa.node.transfers.receiving import PUSH_MISSING, InboxTransfer
from dpwa.node.transport import FetchJob
from dpwa.node.wire import ErrorCode
from dpwa.rules import Transfer

__all__ = ["ExchangeTransfer", "pairs_exchange"]

log = logging.getLogger(__name__)


def pairs_exchange(gen: int, paired_gen: int | None) -> bool:
    """Whether the snapshot of generation ``gen`` may pair with an exchange, the last one that did being of
    ``paired_gen`` (None: none yet): one exchange per published snapshot."""
    return gen != paired_gen


class ExchangeTransfer(InboxTransfer):
    """Fetch one peer a round, carrying this node's snapshot; mix the reply and the committed exchanges."""

    kind: ClassVar[Transfer] = Transfer.EXCHANGE

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self._paired_gen: int | None = None
        """The generation of the last snapshot paired with an exchange (the RX thread's alone)."""
        self._latest: FetchJob | None = None
        """The latest exchange this node started: a leaving node waits for the answer to its SETTLE."""

    def receive_buffers(self) -> int:
        return self.host.schedule.max_fanout(len(self.host.names))

    def start(self, snapshot: Snapshot | None) -> None:
        """Start the round's exchange with its one peer (none without a snapshot to send: every buffer busy)."""
        planned = self.fetcher.plan()
        if planned is None:
            return
        targets, extras = planned
        job = self.fetcher.job(targets[:1], extras)
        if snapshot is None:
            self.host.stats.add("fetches_skipped")
            return
        pool = self.host.pool
        assert pool is not None
        pool.retain(snapshot)  # the push's lease, given back by the TX thread when the job ends
        job.push = Push(
            job.targets[0].peer,
            job.req,
            {},
            snapshot,
            job.deadline,
            prepare=functools.partial(pool.prepare_push, snapshot),
            release=functools.partial(self.host.release_snapshot, snapshot),
        )
        self._latest = job
        self.fetcher.submit(job)

    def pair_exchange(self, sender: str, seq: int, snapshot: Snapshot) -> Refusal | None:
        """Pair ``snapshot`` with ``sender``'s exchange ``seq`` unless it paired with one already (refused busy;
        an exchange whose push is not here is refused ``not-delivered`` first, whatever the snapshot); a lingering
        node refuses every exchange ``busy``, also one whose push it held before it began to linger: it will not
        mix again, and the fetcher would have mixed its half alone."""
        declined = None
        if self.inbox.closing:
            declined = "this node trains no more"
        elif not pairs_exchange(snapshot.gen, self._paired_gen):
            declined = "this snapshot is in an exchange already"
        if declined is not None:
            if not self.inbox.holds_exchange(sender, seq):
                return PUSH_MISSING
            self.host.stats.add("exchanges_declined")
            return ErrorCode.BUSY, declined
        refusal = super().pair_exchange(sender, seq, snapshot)
        if refusal is None:
            self._paired_gen = snapshot.gen
        return refusal

    def collect(self, upto: int | None) -> Arrival:
        """The reply, and per sender its oldest committed exchange."""
        targets, fetched = self.fetcher.collect()
        slots, received = self.drain(every=False, upto=None, window=0)
        return Arrival(targets, fetched, received, release=functools.partial(self.inbox.release, slots))

    def linger_starts(self) -> None:
        self.inbox.closing = True

    def hand_off(self, deadline: float, *, final_mix: bool) -> None:
        """The node leaves: refuse new exchanges, wait (until ``deadline``) for the ones it served to settle, then
        mix the committed ones, whose fetchers applied their halves already (``final_mix``), or leave the arrays
        as the trainer last saw them and count each in ``exchanges_unmixed``: the pair's sum then moves by the
        half this node never applied (an exchange committed after its last ``update_wait``). So for its own
        exchange still in flight (an ``update_send`` with no ``update_wait`` after it): waited for (bounded by its
        deadline) and mixed, or counted if the peer took it."""
        self.inbox.closing = True
        if self.host.params is None:
            return
        self._wait_out(SlotState.SERVED, deadline)
        if final_mix:
            self._mix_out(SlotState.COMMITTED)
        else:
            self._count_unmixed()
        latest = self._latest  # its own latest exchange: the SETTLE answered before the sockets close, which drop
        if latest is not None and latest.exchange_settled:  # what they have not sent (else the peer expires a commit
            latest.settle_answered.wait(max(0.0, deadline - time.monotonic()))  # whose other half was mixed here)

    def _count_unmixed(self) -> None:
        """``hand_off`` without ``final_mix``: count the committed exchanges, and its own if the peer took it."""
        unmixed = self.inbox.slots_in(SlotState.COMMITTED)
        if self.fetcher.pending is not None:  # its own exchange: the peer mixes its half once the reply is taken
            self.fetcher.wait()
            unmixed += len(self.fetcher.collect()[1])
            self.fetcher.give_back()
        if unmixed:
            self.host.stats.add("exchanges_unmixed", unmixed)
            log.info(
                "node %s: %d committed exchange(s) left unmixed (their fetchers mixed their halves; close(final_mix="
                "True) would mix them)", self.host.name, unmixed,
            )  # fmt: skip
