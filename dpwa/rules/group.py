"""Group averaging -- WAGMA-SGD (Li et al. 2021; docs/rules.md).

The ``groups`` schedule fetches this node's group (rotating groups of
``group_size``; everybody on every ``sync_every``-th step); this rule averages
what arrived.  WAGMA's group step is ``x_i <- (sum_{j in G} x_j + x_i) / (S + 1)``
over the models after the local step, the group G holding the node itself: its
own model counts twice, and in lock-step the group's mean moves by the whole
mean step (as all-reduce SGD's does).  Here the peers' ``x_j`` are the snapshots
they published at their ``update_send`` (before their step), and so is this
node's ``x_pub``; the trainer took its step since (``x = x_pub + u``).  With ``k``
fresh peers, the average of the published models plus the whole local step:

    group step:  x <- (sum_j x_j + 2 x_pub) / (k + 2) + (x - x_pub)  =  x + sum_j (x_j - x_pub) / (k + 2)
    sync step:   x <- (sum_j x_j + x_pub) / (k + 1) + (x - x_pub)    =  x + sum_j (x_j - x_pub) / (k + 1)

as D-PSGD's step averages the step-k models and keeps the node's whole step
(``k = S - 1`` when every member answered in time).  Averaging the fresh ``x``
in instead, ``(sum_j x_j + x_pub + x) / (k + 2)``, keeps only ``1/(S+1)`` of each
local step (``1/N`` on a sync step): every step shrunk fivefold at ``S = 4``.
A sync step, with no training between send and wait, leaves every node at the
average of all published models (to rounding: each adds the differences to its
own ``x_pub``).  The clock moves with the same weights.  A peer whose clock
lags this node's by more than ``max_staleness`` (or is not a finite number) is
left out and counted.  No fresh peer: nothing changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule, checked_step
from dpwa.rules.mixing import add_differences_
from dpwa.utils.settings import Settings, setting

__all__ = ["GroupRule", "GroupSettings", "is_sync_step"]


def is_sync_step(index: int, sync_every: int) -> bool:
    """True on every ``sync_every``-th step (0-based ``index``: ``sync_every - 1``, ``2*sync_every - 1``, ...).

    :meth:`dpwa.rules.schedules.GroupsSchedule.is_sync_step` calls this one, so rule and schedule agree.
    """
    return bool(sync_every) and (index + 1) % sync_every == 0


@dataclasses.dataclass(frozen=True)
class GroupSettings(Settings):
    """WAGMA group averaging: ``x <- (sum of group + x_pub) / (S + 1) + (x - x_pub)`` over rotating groups of
    ``group_size``; a full average every ``sync_every`` steps (0 = never); peers more than ``max_staleness`` steps
    behind are left out."""

    group_size: int = setting(4, lo=2, integer=True)
    sync_every: int = setting(11, lo=0, integer=True)
    max_staleness: float = setting(10.0, lo=0)


class GroupRule(Rule):
    """Average the fresh group's published models: ``x + sum_j (x_j - x_pub)/(k+2)``; on sync steps ``/(k+1)``.

    Step index: the number of :meth:`on_publish` calls (one per ``update_send``)
    before the current one -- what the schedule's ``Round.index`` counts.

    ``divergence_threshold`` ``t``: when ``loss < t`` the displacement
    ``x_new - x`` is scaled by ``g = loss / t`` -- the same "move less toward
    the others" as the pairwise rules' ``f <- f*loss/t``.  Note that nodes below
    ``t`` then no longer reach the common average on sync steps; that is the
    point of the threshold.

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

    def follow(self, step: int) -> None:
        """The node's step is ``step``: the next publish starts step ``step`` (the schedule's sync steps and this
        rule's agree after a restored checkpoint)."""
        self._sends = checked_step(step)

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
        counted = 1 if sync else 2  # x_pub: once on a sync step; on a group step once more, for the fresh model
        d = float(k + counted)
        sent, sent_clock = self._published, self._published_clock
        if sent is None:  # before any update_send, x is x_pub (a copy: the kernel reads it while it writes x)
            sent, sent_clock = [a.copy() for a in arrays], own.clock
        ordered = sorted(fresh, key=lambda p: self._rank.get(p.state.name, len(self._rank)))
        add_differences_(arrays, [p.arrays for p in ordered], sent, g / d)  # one pass over x
        own.clock += g * math.fsum(p.state.clock - sent_clock for p in ordered) / d
        factor = g * k / d
        return MixOutcome(factor, tuple(p.state.name for p in ordered), metrics)
