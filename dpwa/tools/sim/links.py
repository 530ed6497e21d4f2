"""The network model: when a message of ``n`` bytes sent at ``t`` arrives, if it arrives.

``per="node"``: every node has one uplink and one downlink of ``bandwidth`` bytes/s (its NIC); a message holds
the sender's uplink for ``n / bandwidth`` from when it is free, then, ``latency_s`` later, the receiver's downlink
for as long (from when that is free): messages to or from one node queue behind each other. ``per="link"``: each
directed pair of nodes has its own link of that bandwidth (a switch fabric with no shared port). Every message is
lost with probability ``loss`` (its bandwidth is spent all the same).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["HEADER_BYTES", "LINK_MODES", "LinkModel", "Network"]

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


class Network:
    """The links of a cluster of up to ``capacity`` nodes (grows on demand); counts bytes and messages."""

    def __init__(self, model: LinkModel, rng: np.random.Generator, capacity: int) -> None:
        self.model = model
        self._rng = rng
        self._up = np.zeros(capacity)
        self._down = np.zeros(capacity)
        self._links: dict[tuple[int, int], float] = {}
        self.bytes_sent = np.zeros(capacity, dtype=np.int64)
        self.messages = 0
        self.lost = 0

    def grow(self, capacity: int) -> None:
        """Room for nodes up to index ``capacity - 1``."""
        extra = capacity - len(self._up)
        if extra > 0:
            self._up, self._down = (
                np.concatenate([self._up, np.zeros(extra)]),
                np.concatenate([self._down, np.zeros(extra)]),
            )
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
            landing = max(start + model.latency_s, self._down[dst])
            arrival = landing + wire
            self._down[dst] = arrival
        else:
            start = max(now, self._links.get((src, dst), 0.0))
            self._links[(src, dst)] = start + wire
            arrival = start + wire + model.latency_s
        if model.loss and self._rng.random() < model.loss:
            self.lost += 1
            return None
        return arrival
