"""The network model: when a message of ``n`` bytes sent at ``t`` arrives, if it arrives.

``per="node"``: every node has one uplink and one downlink of ``bandwidth`` bytes/s (its NIC); a message holds
the sender's uplink for ``n / bandwidth`` from when it is free, then, ``latency_s`` later, the receiver's downlink
for as long: messages to or from one node queue behind each other. A downlink is booked when a message is sent,
for the time it will reach it: a message that reaches it earlier than one booked before it (whose sender's uplink
was busy) takes the gap before that one if it fits whole, else the first gap after (:class:`Downlink`; the booked
one keeps its time, where a NIC would take them in the order they come: the one that came first sooner, the
booking later;
and two messages of one pair of nodes may arrive out of order, a small one taking a gap a large one did not fit).
``per="link"``: each directed pair of nodes has its own link of that bandwidth (a switch fabric with no shared
port). Every message is lost with probability ``loss`` (its bandwidth is spent all the same).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

__all__ = ["HEADER_BYTES", "LINK_MODES", "Downlink", "LinkModel", "Network"]

LINK_MODES = ("node", "link")
HEADER_BYTES = 250
"""A message's JSON header (request, refusal, ACK, commit; and in front of every reply and push)."""


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Latency (seconds), bandwidth (bytes per second), whose bandwidth it is (:data:`LINK_MODES`), loss rate."""

    latency_s: float = 1e-3
    bandwidth: float = 1.25e8
    per: str = "node"
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency must be >= 0 seconds, got {self.latency_s}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.per not in LINK_MODES:
            raise ValueError(f"bandwidth per {self.per!r}: expected one of {', '.join(LINK_MODES)}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")


def _end(interval: tuple[float, float]) -> float:
    return interval[1]


class Downlink:
    """The times one node's downlink is booked: disjoint ``[start, end)`` intervals, sorted."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []

    def book(self, landing: float, wire: float, now: float) -> float:
        """Book ``wire`` seconds from the first time at or after ``landing`` that is free for that long; when the
        message has arrived whole. Intervals that ended by ``now`` are dropped (nothing lands before ``now``), and
        back-to-back ones merged (a burst of messages to one node is one interval, not one each)."""
        busy = self.busy
        del busy[: bisect.bisect_right(busy, now, key=_end)]  # disjoint and sorted: their ends are sorted too
        start, i = landing, bisect.bisect_left(busy, (landing, -math.inf))
        if i > 0 and busy[i - 1][1] > start:  # the interval before it still runs at ``landing``
            start = busy[i - 1][1]
        while i < len(busy) and busy[i][0] < start + wire:  # does not fit before the next one: after it
            start = max(start, busy[i][1])
            i += 1
        end = start + wire
        lo, hi = start, end
        if i > 0 and busy[i - 1][1] == start:  # merged with the one it follows
            lo = busy[i - 1][0]
            i -= 1
            del busy[i]
        if i < len(busy) and busy[i][0] == end:  # and with the one it precedes
            hi = busy[i][1]
            del busy[i]
        busy.insert(i, (lo, hi))
        return end


class Network:
    """The links of a cluster of up to ``capacity`` nodes (grows on demand); counts bytes and messages."""

    def __init__(self, model: LinkModel, rng: np.random.Generator, capacity: int) -> None:
        self.model = model
        self._rng = rng
        self._up = np.zeros(capacity)
        self._down = [Downlink() for _ in range(capacity)]
        self._links: dict[tuple[int, int], float] = {}
        self.bytes_sent = np.zeros(capacity, dtype=np.int64)
        self.messages = 0
        self.lost = 0

    def grow(self, capacity: int) -> None:
        """Room for nodes up to index ``capacity - 1``."""
        extra = capacity - len(self._up)
        if extra > 0:
            self._up = np.concatenate([self._up, np.zeros(extra)])
            self._down += [Downlink() for _ in range(extra)]
            self.bytes_sent = np.concatenate([self.bytes_sent, np.zeros(extra, dtype=np.int64)])

    def send(self, src: int, dst: int, nbytes: int, now: float) -> float | None:
        """The time a message of ``nbytes`` sent by node ``src`` to ``dst`` at ``now`` arrives whole; None if lost."""
        model = self.model
        wire = nbytes / model.bandwidth
        self.messages += 1
        self.bytes_sent[src] += nbytes
        if model.per == "node":
            start = max(now, self._up[src])
            self._up[src] = start + wire
            arrival = self._down[dst].book(start + model.latency_s, wire, now)
        else:
            start = max(now, self._links.get((src, dst), 0.0))
            self._links[(src, dst)] = start + wire
            arrival = start + wire + model.latency_s
        if model.loss and self._rng.random() < model.loss:
            self.lost += 1
            return None
        return arrival
