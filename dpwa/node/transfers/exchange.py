"""Exchange (AD-PSGD): each round, one fetch that carries this node's snapshot to the peer it fetches from.

``update_send`` hands the TX thread one job: the exchange's push (this node's snapshot, held by the peer's
inbox) goes just before the FETCH, and the FETCH names it, so that the peer pairs the push with the snapshot it
serves back. The reply's verdict settles the exchange on both ends (a SETTLE commit, or abort). Each end then
mixes the other's model against what it sent: the fetcher at its ``update_wait``, the peer when it drains the
committed exchange from its inbox (one per sender a step, its oldest).

A node that lingers (trains no more) refuses new exchanges ``busy``: it would never apply its half of them
while the peer applied its own, and the pair's sum (the cluster's mean) would drift. Pulls are still served.
"""

from __future__ import annotations

import functools
from typing import ClassVar

from dpwa.node.pushes import Push
from dpwa.node.snapshots import Snapshot
from dpwa.node.transfers.base import Arrival
from dpwa.node.transfers.receiving import InboxTransfer
from dpwa.rules import Transfer

__all__ = ["ExchangeTransfer"]


class ExchangeTransfer(InboxTransfer):
    """Fetch one peer a round, carrying this node's snapshot; mix the reply and the committed exchanges."""

    kind: ClassVar[Transfer] = Transfer.EXCHANGE

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
        self.fetcher.submit(job)

    def collect(self, upto: int | None) -> Arrival:
        """The reply, and per sender its oldest committed exchange."""
        targets, fetched = self.fetcher.collect()
        slots, received = self.drain(every=False, upto=None, window=0)
        return Arrival(targets, fetched, received, release=functools.partial(self.inbox.release, slots))

    def linger_starts(self) -> None:
        self.inbox.closing = True
