"""Push-sum -- Stochastic Gradient Push (Assran et al. 2019), and its overlap variant OSGP (docs/rules.md).

Every node holds a weight ``w`` (1.0 at start). The model it trains is the de-biased
``x = z / w`` of a numerator ``z``. At ``update_send`` a node with ``k`` out-neighbours
keeps ``(z, w) / (k+1)`` and pushes the same share to each (in de-biased form: ``x`` stays,
``w <- w/(k+1)``, each push carries ``x`` and ``w_given = w/(k+1)``, the weight kept). At ``update_wait`` it folds
every message ``(x_j, w_j)`` that arrived:

    x <- (w*x + sum_j w_j*x_j) / (w + sum_j w_j) ;  w <- w + sum_j w_j

one message after the other (``f = w_j / (w + w_j)``, ``x <- (1-f)*x + f*x_j``), which is the
same. ``clock <- (1-f)*clock + f*clock_j`` likewise.

Mass is never destroyed by the network: a refused push comes back (the node folds its own
snapshot back in with the weight it gave), and a push whose ACK was lost is settled by
sequence number (``dpwa.node.pushes``). So ``sum(w) + in_flight == N`` at all times, and
``sum(w) == N`` once no push is in flight and every inbox is drained.

Members that come and go (docs/membership.md): a joining node brings its own unit (``w = 1``, its model
counted like a founding node's), so ``N`` is the number of members ever admitted; a node leaving cleanly
first hands its whole ``(x, w)`` to a member (:meth:`PushSumRule.hand_off`), so no mass leaves with it.
Only a node that dies takes its mass along (as in any push-sum).

``overlap`` (OSGP's tau): ``update_wait`` returns while at most ``overlap`` of the node's
pushes still await their ACK, and (on a fixed schedule) once every in-neighbour's push of round
``k - overlap`` is in (the node's wait, bounded by ``timeout_ms``; docs/rules.md); 0 is synchronous SGP.

The local step goes to the numerator (SGP, Assran et al. 2019, Algorithm 1: the gradient is taken at the
de-biased ``x`` and applied to ``z``). Whatever the user's optimizer did between ``update_send`` and
``update_wait`` is a motion ``delta = x_now - x_published`` of the de-biased model; in numerator terms
``z <- z + delta``, i.e. ``x <- x_published + delta / w`` with ``w`` the weight the node kept when it
pushed. :meth:`PushSumRule.mix` applies that first, then folds the messages. Without it node ``i``'s
steps count ``w_i`` times in the cluster's sum: it would minimize ``sum_i w_i f_i``, not ``sum_i f_i``.
dpwa pushes the snapshot published at ``update_send`` (before the step), so a step's numerator stays
with its node for a round and travels with the next push; the cluster's sums are those of Algorithm 1.

Weights are bounded below by design: a node never gives away more than keeps its own weight at
:data:`WEIGHT_FLOOR` (the even split ``w/(k+1)`` when that stays above it, else only the excess
``(w - WEIGHT_FLOOR)/k`` per target, possibly 0: an empty message), so the step's scale ``1/w`` never
exceeds ``1/WEIGHT_FLOOR``. Any split keeps the mixing column-stochastic: mass and the consensus point
are unchanged. Above, ``w`` is bounded by ``N``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule, Transfer
from dpwa.rules.mixing import interpolate_, mix_clock, scale_motion_, scale_motion_and_interpolate_
from dpwa.utils.settings import Settings, setting

__all__ = ["WEIGHT_FLOOR", "PushSumRule", "PushSumSettings", "valid_mass"]

WEIGHT_FLOOR = 0.25
"""The least weight a node keeps when it pushes (so a local step is scaled by at most ``1/WEIGHT_FLOOR = 4``)."""


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


def _is_zero(value: Any) -> bool:
    """True for a JSON number equal to 0 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0


@dataclasses.dataclass(frozen=True)
class PushSumSettings(Settings):
    """SGP push-sum: each step keep ``w/(k+1)`` and push ``(x, w/(k+1))`` to each of ``k`` out-neighbours;
    fold every message in: ``f = w_j / (w + w_j)``, ``w <- w + w_j``. ``overlap`` (OSGP's tau): how many
    pushes may still await their ACK when ``update_wait`` returns (0 = SGP)."""

    overlap: int = setting(0, lo=0, integer=True)


class PushSumRule(Rule):
    """Push ``(x, w/(k+1))`` to each of ``k`` out-neighbours; fold ``(x_j, w_j)``: ``f = w_j/(w + w_j)``,
    ``x <- (1-f)*x + f*x_j``, ``w <- w + w_j`` (then divergence damping on ``f``).

    Divergence damping (``f <- f*loss/t`` when ``loss < t``) only changes how much
    of the message's model is taken; the weight always absorbs ``w_j``, so mass is
    kept (damping biases the average, never the weights).

    A message whose ``w_given`` is missing, not a finite number, ``<= 0``, or larger
    than the whole cluster's mass N (impossible for an honest peer) is not mixed and
    changes nothing; it is counted in ``bad_messages``.
    """

    name = "pushsum"
    settings_class = PushSumSettings
    default_schedule = "exponential"  # SGP's one-peer exponential graph
    transfer = Transfer.PUSH
    mass_key = "w_given"

    def __init__(self, overlap: int = 0, divergence_threshold: float = 0.0) -> None:
        super().__init__(divergence_threshold)
        if isinstance(overlap, bool) or int(overlap) != overlap or overlap < 0:
            raise ValueError(f"overlap must be an integer >= 0, got {overlap!r}")
        self.overlap = int(overlap)
        self.bad_messages = 0  # messages ignored for a missing/invalid w_given
        self.returned = 0  # refused pushes whose mass came back
        self.received = 0  # messages folded in
        self.held = 0  # steps whose shares were cut to keep the weight at the floor
        self.empty = 0  # empty messages (w_given 0) received
        self.step_scale = 1.0  # 1/w of the latest local step moved to the numerator
        self._n_nodes = math.inf  # the cluster's total mass, once known
        self._published: Sequence[np.ndarray] | None = None  # x at update_send, until the step is scaled

    def _params(self) -> dict[str, Any]:
        return {"overlap": self.overlap, "divergence_threshold": self.divergence_threshold}

    @staticmethod
    def weight(own: NodeState) -> float:
        """This node's push-sum weight (1.0 until :meth:`initial_extras` set it)."""
        return float(own.extras.get("weight", 1.0))

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        self._n_nodes = float(max(1, len(names)))
        return {"weight": 1.0}

    def on_members(self, me: str, names: Sequence[str], mass: float) -> None:
        """A member joined with its own unit of mass: the sanity bound on a message's weight follows."""
        self._n_nodes = max(self._n_nodes if math.isfinite(self._n_nodes) else 1.0, float(mass))

    def hand_off(self, own: NodeState) -> dict[str, Any] | None:
        """Leaving: hand the whole ``(x, w)`` to one member (``{"w_given": w}``), ``w <- 0``."""
        given = self.weight(own)
        own.extras["weight"] = 0.0
        return {"w_given": given}

    def push_shares(self, own: NodeState, targets: int) -> list[dict[str, Any]]:
        """Each of the ``k = targets`` pushes carries ``{"w_given": s}``, ``w <- w - k*s``, with the even split
        ``s = w/(k+1)`` when that keeps ``w >= WEIGHT_FLOOR``, else ``s = (w - WEIGHT_FLOOR)/k`` (only the
        excess; 0 at or below the floor: an empty message, which still tells the target this round's push)."""
        if targets <= 0:
            return []
        w = self.weight(own)
        share = w / (targets + 1)
        if share < WEIGHT_FLOOR:
            share = max(0.0, (w - WEIGHT_FLOOR) / targets)
            self.held += 1
        own.extras["weight"] = w - targets * share
        return [{"w_given": share} for _ in range(targets)]

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        """Keep the views of the model just published: the local step is measured against them."""
        self._published = published

    def on_params_replaced(self, own: NodeState) -> None:
        """A copy replaced the parameters: there is no local step to move to the numerator."""
        self._published = None

    def on_reply_not_mixed(self, own: NodeState, peer_extras: Mapping[str, Any]) -> None:
        """A message copied outright, or skipped, by recovery: ``w <- w + w_given`` (the mass it carried stays)."""
        given = valid_mass(peer_extras.get("w_given"), self._n_nodes)
        if given is not None:
            own.extras["weight"] = self.weight(own) + given

    def state_metrics(self, own: NodeState) -> dict[str, float]:
        """What the metrics file shows every step: the weight and the message counters."""
        return {
            "weight": self.weight(own),
            "pushes_returned": float(self.returned),
            "messages_received": float(self.received),
            "bad_messages": float(self.bad_messages),
            "pushes_held": float(self.held),
            "messages_empty": float(self.empty),
            "step_scale": float(self.step_scale),
        }

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Move the local step to the numerator (``x <- x_published + (x - x_published) / w``), then fold each
        message ``(x_j, w_given)`` in; the outcome's factor is the messages' share of the new ``x``.

        With one message that is ``f``; with several, ``1 - prod(1 - f_j)``. A refused push of this node
        (a peer named ``own.name``) is folded back the same way. No (valid) message: factor 0.0.
        """
        published, self._published = self._published, None
        unscaled = None  # the published model the local step is still to be scaled against (None: no step)
        if published is not None:
            w = self.weight(own)
            if w > 0.0 and math.isfinite(w):
                self.step_scale = 1.0 / w
                unscaled = published if self.step_scale != 1.0 else None
        scaled = unscaled is not None
        keep = 1.0  # share of the old x still in x
        mixed: list[str] = []
        for peer in peers:
            if _is_zero(peer.state.extras.get("w_given")):  # an empty message: this round's push, no mass
                self.empty += peer.state.name != own.name  # (one of this node's own, come back: nothing)
                continue
            given = valid_mass(peer.state.extras.get("w_given"), self._n_nodes)
            if given is None:
                self.bad_messages += 1
                continue
            w = self.weight(own)
            total = w + given
            if not math.isfinite(total):  # cannot happen with honest weights (sum <= N)
                self.bad_messages += 1
                continue
            returned = peer.state.name == own.name
            f = given / total if returned else self.diverge(given / total, own.loss)
            if unscaled is not None:  # the step's scaling and the first message's fold, in one pass over x
                scale_motion_and_interpolate_(arrays, unscaled, self.step_scale, peer.arrays, f)
                unscaled = None
            else:
                interpolate_(arrays, peer.arrays, f)  # validates before writing: on error nothing changed
            scaled = scaled or f > 0.0
            if returned:
                self.returned += 1
            else:
                own.clock = mix_clock(own.clock, peer.state.clock, f)
                self.received += 1
                mixed.append(peer.state.name)
            own.extras["weight"] = total
            if not returned:
                keep *= 1.0 - f
        if unscaled is not None:  # no message to fold in
            scale_motion_(arrays, unscaled, self.step_scale)
        factor = 1.0 - keep if mixed else 0.0
        # a returned push or the step's scaling moves x with factor 0: say so (a GPU copy must follow)
        return MixOutcome(factor, tuple(mixed), self.state_metrics(own), moved=scaled or factor > 0.0)
