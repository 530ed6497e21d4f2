"""Group averaging -- WAGMA-SGD (Li et al. 2021; docs/rules.md).

The ``groups`` schedule fetches this node's group (rotating groups of
``group_size``; everybody on every ``sync_every``-th step); this rule averages
what arrived.  With ``k`` fresh peers ``x_j``, this node's model ``x`` and the
model it published at ``update_send`` ``x_pub``:

    group step:  x <- (sum_j x_j + x_pub + x) / (k + 2)
    sync step:   x <- (sum_j x_j + x) / (k + 1)

The group step is WAGMA's ``(sum_{j in G} x_j + x_i) / (S + 1)``: the group G
holds this node's own published model, and its fresh model counts once more
(``k = S - 1`` when every member answered in time).  On a sync step, with no
training between send and wait, every node ends up holding the same average
(bit-identical: every node sums the same models in rank order).  The clock is
averaged with the same weights.  A peer whose clock lags this node's by more
than ``max_staleness`` (or is not a finite number) is left out and counted.
No fresh peer: nothing changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.mixing import weighted_sum_
from dpwa.utils.settings import Settings, setting

__all__ = ["GroupRule", "GroupSettings", "is_sync_step"]


def is_sync_step(index: int, sync_every: int) -> bool:
    """True on every ``sync_every``-th step (0-based ``index``: ``sync_every - 1``, ``2*sync_every - 1``, ...).

    :meth:`dpwa.rules.schedules.GroupsSchedule.is_sync_step` calls this one, so rule and schedule agree.
    """
    return bool(sync_every) and (index + 1) % sync_every == 0


@dataclasses.dataclass(frozen=True)
class GroupSettings(Settings):
    """WAGMA group averaging: ``x <- (sum of group + x) / (S + 1)`` over rotating groups of ``group_size``;
    a full average every ``sync_every`` steps (0 = never); peers more than ``max_staleness`` steps
    behind are left out."""

    group_size: int = setting(4, lo=2, integer=True)
    sync_every: int = setting(11, lo=0, integer=True)
    max_staleness: float = setting(10.0, lo=0)


class GroupRule(Rule):
    """Average the fresh group: ``(sum_j x_j + x_pub + x)/(k+2)``; on sync steps ``(sum_j x_j + x)/(k+1)``.

    Step index: the number of :meth:`on_publish` calls (one per ``update_send``)
    before the current one -- what the schedule's ``Round.index`` counts.

    ``divergence_threshold`` ``t``: when ``loss < t`` every term other than the
    fresh ``x`` (peers and, on group steps, ``x_pub``) has its weight scaled by
    ``g = loss / t`` and ``x`` takes the rest, i.e. the displacement
    ``x_new - x`` is scaled by ``g`` -- the same "move less toward the others"
    as the pairwise rules' ``f <- f*loss/t``.  Note that nodes below ``t`` then
    no longer reach the exact common average on sync steps; that is the point
    of the threshold.

    Counters (rule attributes, reported in every outcome's metrics; nothing
    travels to peers): ``stale_left_out`` -- peers left out as stale.  State
    kept between calls: the read-only views of the last published model (no copy).
    """

    name = "group"
    settings_class = GroupSettings
    allowed_schedules = ("groups",)  # the rotating groups this rule averages over
    default_schedule = "groups"

    def __init__(
        self,
        group_size: int = 4,
        sync_every: int = 11,
        max_staleness: float = 10.0,
        divergence_threshold: float = 0.0,
    ) -> None:
        super().__init__(divergence_threshold)
        if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 2:
            raise ValueError(f"group_size must be an integer >= 2, got {group_size!r}")
        if isinstance(sync_every, bool) or int(sync_every) != sync_every or sync_every < 0:
            raise ValueError(f"sync_every must be an integer >= 0 (0 = never), got {sync_every!r}")
        s = float(max_staleness)
        if not s >= 0.0:  # also rejects NaN; +inf means "never stale"
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness!r}")
        self.group_size = int(group_size)
        self.sync_every = int(sync_every)
        self.max_staleness = s
        self.stale_left_out = 0
        self._published: list[np.ndarray] | None = None
        self._published_clock = 0.0
        self._sends = 0
        self._rank: dict[str, int] = {}

    def _params(self) -> dict[str, Any]:
        return {
            "group_size": self.group_size,
            "sync_every": self.sync_every,
            "max_staleness": self.max_staleness,
            "divergence_threshold": self.divergence_threshold,
        }

    @property
    def step(self) -> int:
        """The current step's index (``update_send`` calls before the latest one); -1 before any."""
        return self._sends - 1

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        self._rank = {n: i for i, n in enumerate(names)}
        return {}

    def on_members(self, me: str, names: Sequence[str], mass: float) -> None:
        """Ranks follow the members' order (groups are recomputed from it every step)."""
        self._rank = {n: i for i, n in enumerate(names)}

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        """Keep the views of ``x_pub`` (valid until the next ``update_send``) and count the step."""
        self._published = list(published)
        self._published_clock = own.clock
        self._sends += 1

    def is_fresh(self, own: NodeState, peer: NodeState) -> bool:
        """``own.clock - peer.clock <= max_staleness`` (a non-finite peer clock is never fresh)."""
        return math.isfinite(peer.clock) and own.clock - peer.clock <= self.max_staleness

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Average the fresh peers into ``arrays`` in place; the factor is the peers' share of the new ``x``."""
        sync = self.step >= 0 and is_sync_step(self.step, self.sync_every)
        fresh = [p for p in peers if self.is_fresh(own, p.state)]
        self.stale_left_out += len(peers) - len(fresh)
        k = len(fresh)
        metrics = {"stale_left_out": float(self.stale_left_out), "members": float(k), "sync": float(sync)}
        g = self.diverge(1.0, own.loss)  # 1.0 unless damped
        if k == 0 or g == 0.0:
            return MixOutcome(0.0, (), metrics)
        # Terms in rank order (own x, and x_pub next to it, at this node's rank): the same sum on every node.
        me = self._rank.get(own.name, len(self._rank))
        ordered = sorted(fresh, key=lambda p: self._rank.get(p.state.name, len(self._rank)))
        before = [p for p in ordered if self._rank.get(p.state.name, len(self._rank)) < me]
        after = ordered[len(before) :]
        own_terms: list[Sequence[np.ndarray]] = []
        own_clocks: list[float] = []
        if not sync:  # x_pub is one of the group; before any update_send it is x itself
            own_terms.append(self._published if self._published is not None else arrays)
            own_clocks.append(self._published_clock if self._published is not None else own.clock)
        others = len(own_terms) + k  # terms other than the fresh x
        d = float(others + 1)
        terms = [p.arrays for p in before] + own_terms + [arrays] + [p.arrays for p in after]
        clocks = [p.state.clock for p in before] + own_clocks + [own.clock] + [p.state.clock for p in after]
        x_at = len(before) + len(own_terms)
        if g == 1.0:  # the exact formula: plain sum, one division
            weights = [1.0] * len(terms)
        else:  # damped: others' weights scaled by g, x takes the rest
            weights = [g] * len(terms)
            weights[x_at] = d - g * others
        weighted_sum_(arrays, terms, weights, d)
        own.clock = math.fsum(w * c for w, c in zip(weights, clocks)) / d
        factor = g * k / d
        return MixOutcome(factor, tuple(p.state.name for p in ordered), metrics)
