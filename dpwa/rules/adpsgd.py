"""AD-PSGD -- asynchronous decentralized parallel SGD (Lian et al. 2018; docs/rules.md).

Pairs average symmetrically. Node ``i`` fetches ``j`` with its own published snapshot ``s_i``
riding on the request; ``j`` answers with its snapshot ``s_j`` and keeps ``s_i``. Both then
move to the pair's average, each against the snapshot it sent:

    i (at its update_wait):       x_i <- x_i + a*(s_j - s_i)
    j (at its next update_wait):  x_j <- x_j + a*(s_i - s_j)

with ``a = 1/2`` (divergence damping may lower it). The two moves cancel, so the sum over the
pair -- and the cluster's mean -- changes only by the local training steps. Divergence damping breaks
that: each end damps ``a`` by its own loss, so the two moves differ once one end's loss is below the
threshold. ``j`` mixes only once ``i`` confirmed it got ``s_j`` (a SETTLE commit); an exchange whose reply was lost is
aborted on both sides. ``clock <- (clock + peer_clock) / 2``.

``bipartite: true`` splits the nodes as the paper's code does: *active* nodes start every exchange, each with a
*passive* peer, and passive nodes only answer (:func:`is_active`), so no node is ever in two exchanges of one step
as both ends, and each keeps one exchange buffer (a receive buffer, or an inbox slot) instead of both.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule, Transfer
from dpwa.rules.mixing import add_difference_, mix_clock
from dpwa.utils.settings import Flag, Settings, setting

__all__ = ["AdpsgdRule", "AdpsgdSettings", "is_active"]


@dataclasses.dataclass(frozen=True)
class AdpsgdSettings(Settings):
    """AD-PSGD: a fetch carries the fetcher's snapshot; both ends move ``x <- x + (x_peer - x_sent)/2``.
    ``bipartite``: active nodes start the exchanges, with passive peers only (:func:`is_active`)."""

    bipartite: bool = setting(False, spec=Flag(), omit_default=True)


def is_active(name: str, roster: Sequence[str] | Mapping[str, int]) -> bool:
    """A node's role under ``bipartite: true``: the first, third, ... node of ``roster`` (the cluster file's nodes,
    in file order; or a mapping of each to its position) is active, the second, fourth, ... passive; a node not in
    it by the parity of the CRC-32 of its name. A pure function: every node computes every role alike."""
    position = roster.get(name) if isinstance(roster, Mapping) else (roster.index(name) if name in roster else None)
    if position is not None:
        return position % 2 == 0
    return zlib.crc32(name.encode()) % 2 == 0


class AdpsgdRule(Rule):
    """``x <- x + a*(x_peer - x_sent)`` on both ends of an exchange (``a = 1/2``, then divergence damping).

    ``x_sent`` is the snapshot this node sent in the exchange: its own published model when it
    fetched, the snapshot it served when the exchange came to its inbox (``PeerSnapshot.reference``).
    Counter ``passive``: exchanges mixed from the inbox.
    """

    name = "adpsgd"
    settings_class = AdpsgdSettings
    transfer = Transfer.EXCHANGE

    def __init__(self, bipartite: bool = False, divergence_threshold: float = 0.0) -> None:
        super().__init__(divergence_threshold)
        self.bipartite = bool(bipartite)
        """Only active nodes start exchanges, with passive peers (the schedule's part: ``make_schedule``)."""
        self._published: list[np.ndarray] | None = None
        self.active = 0
        self.passive = 0

    def _params(self) -> dict[str, Any]:
        return {"bipartite": self.bipartite, "divergence_threshold": self.divergence_threshold}

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        """Keep the views of the model just published: what this node's next exchange sends."""
        self._published = list(published)

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Apply ``a*(x_peer - x_sent)`` for every exchange in ``peers``; the factor is ``a`` (0.0: none)."""
        a = self.diverge(0.5, own.loss)
        mixed: list[str] = []
        for peer in peers:
            reference = peer.reference if peer.reference is not None else self._published
            if peer.difference:  # the inbox took the difference already (one snapshot buffer)
                reference = None
            elif reference is None:  # pragma: no cover - an exchange always follows a publish
                continue
            add_difference_(arrays, peer.arrays, reference, a)
            own.clock = mix_clock(own.clock, peer.state.clock, a)
            if peer.reference is None and not peer.difference:
                self.active += 1
            else:
                self.passive += 1
            mixed.append(peer.state.name)
        metrics = {"exchanges_active": float(self.active), "exchanges_passive": float(self.passive)}
        return MixOutcome(a if mixed else 0.0, tuple(mixed), metrics)
