"""Pull: every round, fetch the published snapshots of the round's peers (pairwise, GEM, D-PSGD, leader, group).

The node serves its own snapshot to whoever fetches it; it takes no pushes (the RX thread answers them
``unsupported``) and refuses exchanges. A round fetches as many peers as the schedule's fan-out, one receive
buffer each.
"""

from __future__ import annotations

from typing import ClassVar

from dpwa.node.snapshots import Snapshot
from dpwa.node.transfers.base import Arrival, TransferPattern
from dpwa.node.transfers.fetcher import Fetcher
from dpwa.node.transfers.host import Host
from dpwa.rules import Transfer

__all__ = ["PullTransfer"]


class PullTransfer(TransferPattern):
    """Fetch this round's peers; mix their replies."""

    kind: ClassVar[Transfer] = Transfer.PULL

    def __init__(self, host: Host) -> None:
        super().__init__(host, Fetcher(host))

    def receive_buffers(self) -> int:
        return self.host.schedule.max_fanout(len(self.host.names))

    def start(self, snapshot: Snapshot | None) -> None:
        planned = self.fetcher.plan()
        if planned is not None:
            # transport.memory low: the peer's one buffer is lent only while this node copies it out
            lend = self.host.config.transport.memory != "low"
            self.fetcher.submit(self.fetcher.job(*planned, lend=lend))

    def collect(self, upto: int | None) -> Arrival:
        targets, fetched = self.fetcher.collect()
        return Arrival(targets, fetched, release=self.fetcher.give_back)
