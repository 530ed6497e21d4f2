"""The 2017 dpwa rules (docs/rules.md, the pairwise rules): one peer, one scalar factor.

``x <- f*x_peer + (1-f)*x`` with ``f`` from :meth:`PairwiseRule.factor`, then
damped by the divergence threshold, then ``clock <- f*peer_clock + (1-f)*clock``.
"""

from __future__ import annotations

import dataclasses
import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import REPEATS, MixOutcome, NodeState, PeerSnapshot, Rule, check_repeats, fresh_peers
from dpwa.rules.mixing import interpolate_, mix_clock
from dpwa.utils.settings import Settings, choice, setting

__all__ = [
    "ClockRule",
    "ClockSettings",
    "ConstantRule",
    "ConstantSettings",
    "LossRule",
    "LossSettings",
    "PairwiseRule",
    "share",
]


def share(a: float, b: float) -> float:
    """``a / (a + b)`` in [0, 1] for any floats, without overflow.

    Negative values count as 0 and NaN as +inf; 0.5 when both are 0 or both
    are infinite; 1.0 when only ``a`` is infinite, 0.0 when only ``b`` is.
    """
    a = math.inf if math.isnan(a) else max(float(a), 0.0)
    b = math.inf if math.isnan(b) else max(float(b), 0.0)
    if a == b:  # both 0, both inf, or equal: exactly one half
        return 0.5
    if math.isinf(a) or math.isinf(b):
        return 1.0 if math.isinf(a) else 0.0
    if a >= b:  # ratio <= 1, so nothing overflows
        return 1.0 / (1.0 + b / a)
    r = a / b
    return r / (1.0 + r)


class PairwiseRule(Rule):
    """Base of single-peer rules: ``f = diverge(factor(own, peer), own.loss)``, interpolate, then mix the clock.

    ``repeats``: ``skip`` (default) mixes each snapshot of a peer at most once -- a reply that repeats the
    snapshot fetched from that peer last time is not mixed (counted in ``repeats_skipped``); ``mix`` mixes it
    again, as dpwa did in 2017 (a stalled or finished peer then anchors the node to its model).
    """

    def __init__(self, divergence_threshold: float = 0.0, *, repeats: str = "skip") -> None:
        super().__init__(divergence_threshold)
        self.repeats = check_repeats(repeats)
        self.repeats_skipped = 0

    def mixes_narrower_peers(self) -> bool:
        return True  # interpolate_

    def _params(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "repeats_skipped"}

    def state_metrics(self, own: NodeState) -> dict[str, float]:
        """``repeats_skipped``: replies not mixed because they repeated the peer's last snapshot."""
        return {"repeats_skipped": float(self.repeats_skipped)}

    @abstractmethod
    def factor(self, own: NodeState, peer: NodeState) -> float:
        """The raw interpolation factor in [0, 1] (pure; before divergence damping)."""

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Mix the single peer into ``arrays`` in place; the clock is updated after mixing.

        No peers (or only a skipped repeat): nothing changes, factor 0.0.  More than one peer
        is a caller error (one peer per exchange): ValueError, nothing changed.
        """
        if len(peers) > 1:
            raise ValueError(f"{type(self).__name__} mixes one peer at a time, got {len(peers)}")
        peers, skipped = fresh_peers(peers, self.repeats)
        self.repeats_skipped += skipped
        if not peers:
            return MixOutcome(0.0, (), self.state_metrics(own))
        peer = peers[0]
        raw = self.factor(own, peer.state)
        f = self.diverge(raw, own.loss)
        interpolate_(arrays, peer.arrays, f)
        own.clock = mix_clock(own.clock, peer.state.clock, f)
        return MixOutcome(f, (peer.state.name,), {"raw_factor": raw, **self.state_metrics(own)})


@dataclasses.dataclass(frozen=True)
class ConstantSettings(Settings):
    """``f = value``: the fixed interpolation factor (0.5 = plain pairwise average); ``repeats``: see
    :class:`PairwiseRule`."""

    value: float = setting(0.5, lo=0, hi=1)
    repeats: str = choice("skip", REPEATS)


class ConstantRule(PairwiseRule):
    """``f = value`` (0 <= value <= 1; 0.5 is the plain pairwise average of Jin et al. 2016)."""

    name = "constant"
    settings_class = ConstantSettings

    def __init__(self, value: float = 0.5, divergence_threshold: float = 0.0, *, repeats: str = "skip") -> None:
        super().__init__(divergence_threshold, repeats=repeats)
        v = float(value)
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"constant value must lie in [0, 1], got {value!r}")
        self.value = v

    def factor(self, own: NodeState, peer: NodeState) -> float:
        return self.value


@dataclasses.dataclass(frozen=True)
class ClockSettings(Settings):
    """``f = peer_clock / (clock + peer_clock)``; ``repeats``: see :class:`PairwiseRule`."""

    repeats: str = choice("skip", REPEATS)


class ClockRule(PairwiseRule):
    """``f = peer_clock / (clock + peer_clock)``; 0.5 when both are 0 (see :func:`share`)."""

    name = "clock"
    settings_class = ClockSettings

    def factor(self, own: NodeState, peer: NodeState) -> float:
        return share(peer.clock, own.clock)


@dataclasses.dataclass(frozen=True)
class LossSettings(Settings):
    """``f = loss / (loss + peer_loss)``; ``repeats``: see :class:`PairwiseRule`."""

    repeats: str = choice("skip", REPEATS)


class LossRule(PairwiseRule):
    """``f = loss / (loss + peer_loss)``: the node with the higher loss leans more on its peer.

    Both zero: 0.5.  Negative losses count as 0; a NaN loss counts as +inf (a
    diverged node copies a finite peer outright) -- see :func:`share`.
    """

    name = "loss"
    settings_class = LossSettings

    def factor(self, own: NodeState, peer: NodeState) -> float:
        return share(own.loss, peer.loss)
