"""Push-sum in pull form -- Stochastic Gradient Push / GoSGD (Assran et al. 2019; Blot et al. 2016; docs/rules.md).

Every node holds a weight ``w`` (1.0 at start; the cluster's weights sum to N
while no reply is lost).  Serving a fetch gives half of it away with the reply:

    server:  w <- w / 2 ;  reply carries w_given = w
    fetcher: f = w_given / (w + w_given) ;  x <- (1-f)*x + f*x_peer ;  w <- w + w_given

i.e. ``x <- (w*x + w_given*x_peer) / (w + w_given)``, the de-biased push-sum
step; ``clock <- f*peer_clock + (1-f)*clock``.

Where things live: the weight is ``own.extras["weight"]`` (it travels with the
published state, which is harmless and shows it to peers); ``w_given`` travels
in the extras of the one reply that carries it.  The counters (``mass_lost``,
``replies_lost_unknown``, ``bad_replies``) are attributes of the rule instance
-- one per node, touched only under the node's state lock -- and are reported
in every :class:`~dpwa.rules.base.MixOutcome`'s metrics; peers never need them.

The weights' sum is exact: ``sum(w) + mass_lost == N`` whenever every lost
reply's content is known.  The average ``sum(w*x)/N`` is exact in synchronous
rounds (everybody serves, then everybody mixes -- dpwa.tools.simulation).  In the
network path a reply carries the snapshot published at ``update_send`` with
half of the weight at serve time: a serve that lands after the server's own
``update_wait`` and before its next ``update_send`` would hand out mass with the
pre-mix model and bias the average.  So a node that has mixed since it last
published serves its model with ``w_given = 0`` ("no mass"): nothing is halved,
the fetcher mixes nothing and counts it in ``empty_replies`` (not as a bad
reply).  In the usual loop (send, train, wait, send) that window is short.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.mixing import interpolate_, mix_clock

__all__ = ["PushSumRule", "valid_mass"]


def valid_mass(value: Any, limit: float = math.inf) -> float | None:
    """``value`` as a weight a peer may hand over: a finite real number in (0, limit]; else None.

    Booleans (JSON true/false) and non-numbers are not weights.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        w = float(value)
    except OverflowError:  # a JSON integer beyond float range (e.g. 10**400)
        return None
    if not (math.isfinite(w) and 0.0 < w <= limit):
        return None
    return w


class PushSumRule(Rule):
    """``f = w_given / (w + w_given)``, ``x <- (1-f)*x + f*x_peer``, ``w <- w + w_given`` (then divergence on f).

    Divergence damping (``f <- f*loss/t`` when ``loss < t``) only changes how
    much of the peer's model is taken; the weight always absorbs ``w_given``,
    so the weights keep summing to N (damping biases the average, like a lost
    reply, but never loses mass).

    A reply whose ``w_given`` is missing, not a finite number, ``<= 0``, or
    larger than the whole cluster's mass N (impossible for an honest peer;
    N is known after :meth:`initial_extras`) is not mixed and changes nothing;
    it is counted in ``bad_replies``.  Several peers in one call are absorbed one
    after the other, which is exactly ``x <- (w*x + sum_j w_j*x_j) / (w + sum_j w_j)``.
    """

    name = "pushsum"

    def __init__(self, divergence_threshold: float = 0.0) -> None:
        super().__init__(divergence_threshold)
        self.mass_lost = 0.0  # sum of w_given of replies that arrived but were rejected
        self.replies_lost_unknown = 0  # replies lost with unknown content (timeouts)
        self.bad_replies = 0  # replies ignored for a missing/invalid w_given
        self.empty_replies = 0  # replies that carried no mass (the server had mixed since publishing)
        self._n_nodes = math.inf  # the cluster's total mass, once known
        self._mixed_since_publish = False

    def _params(self) -> dict[str, Any]:
        return {"divergence_threshold": self.divergence_threshold}

    @staticmethod
    def weight(own: NodeState) -> float:
        """This node's push-sum weight (1.0 until :meth:`initial_extras` set it)."""
        return float(own.extras.get("weight", 1.0))

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        self._n_nodes = float(max(1, len(names)))
        return {"weight": 1.0}

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        """A fresh snapshot: the weight belongs to the published model again."""
        self._mixed_since_publish = False

    def on_params_replaced(self, own: NodeState) -> None:
        """A copy replaced the model: until the next publish, serve "no mass" (as after a mix)."""
        self._mixed_since_publish = True

    def on_serve(self, own: NodeState) -> dict[str, Any]:
        """``w <- w/2``; the reply carries ``{"w_given": w}`` -- or ``0.0`` when the published model is pre-mix."""
        if self._mixed_since_publish:
            return {"w_given": 0.0}
        w = self.weight(own) / 2.0
        own.extras["weight"] = w
        return {"w_given": w}

    def on_serve_failed(self, own: NodeState, given: dict[str, Any]) -> None:
        """The reply was never sent: ``w <- w + w_given`` (the half comes back)."""
        w = valid_mass(given.get("w_given"))
        if w is not None:
            own.extras["weight"] = self.weight(own) + w

    def on_reply_not_mixed(self, own: NodeState, peer_extras: Mapping[str, Any]) -> None:
        """A reply copied outright, or skipped, by recovery: ``w <- w + w_given`` (the mass it carried stays)."""
        given = valid_mass(peer_extras.get("w_given"), self._n_nodes)
        if given is not None:
            own.extras["weight"] = self.weight(own) + given

    def on_reply_lost(self, own: NodeState, peer_extras: dict[str, Any] | None) -> None:
        """A rejected reply's ``w_given`` adds to ``mass_lost``; a timeout (or unreadable extras) counts as unknown."""
        w = valid_mass(peer_extras.get("w_given"), self._n_nodes) if peer_extras is not None else None
        if w is None:
            self.replies_lost_unknown += 1
        else:
            self.mass_lost += w

    def state_metrics(self, own: NodeState) -> dict[str, float]:
        """What the metrics file shows every step: the weight and the mass counters."""
        return {
            "weight": self.weight(own),
            "mass_lost": self.mass_lost,
            "replies_lost_unknown": float(self.replies_lost_unknown),
            "bad_replies": float(self.bad_replies),
            "empty_replies": float(self.empty_replies),
        }

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Absorb each peer's ``(x_peer, w_given)``; the outcome's factor is the peers' total share of the new ``x``.

        With one peer that is ``f``; with several, ``1 - prod(1 - f_j)``.  No (valid) peer: factor 0.0.
        """
        keep = 1.0  # share of the old x still in x
        mixed: list[str] = []
        for peer in peers:
            offered = peer.state.extras.get("w_given")
            if isinstance(offered, (int, float)) and not isinstance(offered, bool) and offered == 0:
                self.empty_replies += 1  # the peer had mixed since publishing: no mass, nothing to mix
                continue
            given = valid_mass(offered, self._n_nodes)
            if given is None:
                self.bad_replies += 1
                continue
            w = self.weight(own)
            total = w + given
            if not math.isfinite(total):  # cannot happen with honest weights (sum <= N)
                self.bad_replies += 1
                continue
            f = self.diverge(given / total, own.loss)
            interpolate_(arrays, peer.arrays, f)  # validates before writing: on error nothing changed
            own.clock = mix_clock(own.clock, peer.state.clock, f)
            own.extras["weight"] = total
            keep *= 1.0 - f
            mixed.append(peer.state.name)
        if mixed:
            self._mixed_since_publish = True
        factor = 1.0 - keep if mixed else 0.0
        return MixOutcome(factor, tuple(mixed), self.state_metrics(own))
