"""The receiving half shared by the patterns whose node takes models it did not ask for: push and exchange.

:class:`InboxTransfer` owns the node's inbox (:class:`~dpwa.node.inbox.PushReceiver`), which the RX thread
fills: it pairs an exchange's push with the snapshot served to the same sender's FETCH, turns the slots
``update_wait`` drains into peers for the rule (an exchange's with the snapshot served as its reference), tells
the inbox who the members are, and accounts for what the inbox holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from dpwa.node.inbox import InboxSlot, PushReceiver
from dpwa.node.snapshots import Snapshot
from dpwa.node.states import SlotState
from dpwa.node.transfers.base import Arrival, Refusal, TransferPattern
from dpwa.node.transfers.fetcher import Fetcher
from dpwa.node.transfers.host import Host
from dpwa.node.wire import ErrorCode, Layout
from dpwa.rules import NodeState, PeerSnapshot

__all__ = ["PUSH_MISSING", "InboxTransfer"]

PUSH_MISSING: Refusal = (ErrorCode.NOT_DELIVERED, "the exchange's push is not here")
"""The answer to an exchange's FETCH whose push did not arrive (or was refused): nothing to pair it with."""


class InboxTransfer(TransferPattern):
    """A pattern with an inbox; a subclass says what it sends (:meth:`start`) and what it takes (:meth:`collect`)."""

    inbox: PushReceiver

    def __init__(self, host: Host) -> None:
        super().__init__(host, Fetcher(host))
        config = host.config
        self.inbox = PushReceiver(
            host.name,
            host.names,
            host.layouts,
            config.inbox_slots,
            host.timeouts.exchange_s,
            host.stats.add,
            host.stats.reject_push,
            host.release_snapshot,
            check_identity=config.security.curve,
            per_sender=config.per_sender_limit,
            host_id=host.host_id,
        )

    def closed(self) -> None:
        """The node's threads stopped: unmap what the fetcher still maps, and the segments of peers whose pushes came
        through shared memory."""
        super().closed()
        self.inbox.segments.close()

    def held_snapshots(self) -> int:
        """One per inbox slot (an exchange's pair), and per push a round may still have unsettled."""
        host = self.host
        return host.config.inbox_slots + max(1, host.schedule.max_fanout(len(host.names))) * (host.rule.overlap + 2)

    def allocate(self, layout: Layout) -> None:
        """The receive buffers, and the inbox's slots unless no peer ever pushes to this node (AD-PSGD's active
        nodes: a push reaching one is refused ``unsupported``)."""
        super().allocate(layout)
        host = self.host
        self.inbox.allocate(layout, host.config.inbox_slots if host.schedule.fetched(host.name, host.names) else 0)

    def drain(self, *, every: bool, upto: int | None, window: int) -> tuple[list[InboxSlot], list[PeerSnapshot]]:
        """The inbox's slots to mix now (:meth:`PushReceiver.drain`) and the peers they hold, for the rule; the
        slots stay the trainer's until released."""
        slots = self.inbox.drain(every=every, upto=upto, window=window)
        try:
            return slots, [self._peer(s) for s in slots]
        except BaseException:
            self.inbox.release(slots)
            raise

    def _peer(self, slot: InboxSlot) -> PeerSnapshot:
        """What an inbox slot holds, as a peer for the rule (an exchange with the snapshot served as reference)."""
        header = slot.header
        assert header is not None
        self.host.note_front(header.front)
        reference = slot.served.readonly if slot.served is not None else None
        state = NodeState(slot.sender, header.clock, header.loss, dict(header.extras))
        return PeerSnapshot(state, slot.views, reference, difference=slot.difference)

    def _wait_out(self, state: SlotState, deadline: float) -> None:
        """Leaving: wait until no slot is in ``state`` (a push arriving, an exchange awaiting its SETTLE), at most
        until ``deadline``; each ends within one exchange timeout (completed, or expired)."""
        while self.inbox.slots_in(state) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _mix_out(self, *states: SlotState) -> None:
        """Leaving: mix until no slot is in ``states`` (update_wait takes one push or exchange per sender): at most
        one more time than the inbox has slots."""
        for _ in range(self.host.config.inbox_slots + 1):
            self.host.wait_and_mix(None)
            if not self.inbox.slots_in(*states):
                break

    def fields(self, arrival: Arrival) -> dict[str, Any]:
        return {"received": len(arrival.received)}

    def unpair(self, snapshot: Snapshot) -> None:
        """Before ``snapshot`` is rewritten in place: the exchanges paired with it keep their difference."""
        self.inbox.unpair(snapshot)

    def pair_exchange(self, sender: str, seq: int, snapshot: Snapshot) -> Refusal | None:
        """Keep ``snapshot`` (a lease of its own) as the pair of the held push of ``sender``'s exchange ``seq``."""
        pool = self.host.pool
        assert pool is not None
        pool.retain(snapshot)
        if self.inbox.serve_exchange(sender, seq, snapshot):
            return None
        pool.release(snapshot)  # the lease taken for the exchange
        return PUSH_MISSING

    def set_senders(self, names: Sequence[str]) -> None:
        self.inbox.set_senders(list(names))

    def verdict_for(self, peer: str) -> tuple[int, bool | None]:
        return self.inbox.verdict_for(peer)

    def stats(self) -> dict[str, Any]:
        return {"inbox_mass": self.inbox.pending_mass(self.host.rule.mass_key), "inbox_occupied": self.inbox.occupied()}
