"""Flow-control peer selection (docs/rules.md, "Choosing a peer: flow control"); no peer is ever dropped for good.

Each peer has a score in ``[floor, ceiling]`` starting at ``initial``:
``+reward`` per good fetch, ``-penalty`` per timeout / refusal / rejection.
:meth:`FlowControl.choose` picks the up peers with the largest
``score + U{10..1000}``.  After ``down_after`` consecutive failures a peer is
*down*: it is not chosen normally but probed after a backoff (``probe_backoff[0]``
seconds, doubling after each failed probe, capped at ``probe_backoff[1]``), and
a successful answer brings it back at full score.  Nobody is ever dropped.
:meth:`FlowControl.record` applies an outcome's :class:`~dpwa.node.states.FlowEffect` (the table of which
outcome counts as what is :mod:`dpwa.node.states`).

Pure and seedable (inject ``rng`` and ``now``); not thread-safe -- the caller locks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpwa.node.states import FlowEffect

__all__ = ["JITTER", "FlowControl"]

JITTER = (10, 1000)
"""Bounds (inclusive) of the uniform integer added to each score when choosing."""


@dataclass
class _Peer:
    score: float
    failures: int = 0  # consecutive
    down: bool = False
    backoff: float = 0.0  # current probe backoff while down
    next_probe: float = 0.0  # monotonic time from which a probe is due while down


class FlowControl:
    """Peer scores in [10, 1000] start at 1000: +10 per good fetch, -100 per timeout/refusal/rejection.

    Choose the peer with the largest score + U{10..1000}.  Never drops a peer forever.
    """

    def __init__(
        self,
        peers: Sequence[str],
        rng: random.Random,
        *,
        now: Callable[[], float] = time.monotonic,
        initial: float = 1000,
        floor: float = 10,
        ceiling: float = 1000,
        reward: float = 10,
        penalty: float = 100,
        down_after: int = 3,
        probe_backoff: tuple[float, float] = (1.0, 60.0),
    ) -> None:
        names = list(peers)
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate peer names in {names}")
        if not floor <= initial <= ceiling:
            raise ValueError(f"need floor <= initial <= ceiling, got {floor}, {initial}, {ceiling}")
        if reward < 0 or penalty < 0:
            raise ValueError(f"reward and penalty must be >= 0, got {reward}, {penalty}")
        if down_after < 1:
            raise ValueError(f"down_after must be >= 1, got {down_after}")
        first, cap = probe_backoff
        if not 0 < first <= cap:
            raise ValueError(f"probe_backoff must be (first, cap) with 0 < first <= cap, got {probe_backoff}")
        self._rng = rng
        self._now = now
        self._initial = float(initial)
        self._floor = float(floor)
        self._ceiling = float(ceiling)
        self._reward = float(reward)
        self._penalty = float(penalty)
        self._down_after = int(down_after)
        self._backoff_first = float(first)
        self._backoff_cap = float(cap)
        self._peers: dict[str, _Peer] = {name: _Peer(score=self._initial) for name in names}

    def add(self, peer: str) -> None:
        """A new member: up, at ``initial`` score (nothing if known already)."""
        self._peers.setdefault(peer, _Peer(score=self._initial))

    def remove(self, peer: str) -> None:
        """A member that left or was forgotten: never chosen or probed again (nothing if unknown)."""
        self._peers.pop(peer, None)

    def choose(self, k: int = 1) -> list[str]:
        """Up to ``k`` distinct peers to fetch from, best first.

        If a down peer is due for a probe, the most overdue one takes the first
        slot (at most one probe per call) and its next probe is pushed back by
        its current backoff, so a probe in flight is not repeated.  The other
        slots go to the up peers with the largest ``score + randint(10, 1000)``.
        Returns ``[]`` for ``k == 0``, or when no peer is up and none is due.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        now = self._now()
        chosen: list[str] = []
        due = [(p.next_probe, name) for name, p in self._peers.items() if p.down and now >= p.next_probe]
        if due:
            _, probe = min(due)
            state = self._peers[probe]
            state.next_probe = now + state.backoff
            chosen.append(probe)
        ranked = sorted(
            (
                (p.score + self._rng.randint(*JITTER), self._rng.random(), name)
                for name, p in self._peers.items()
                if not p.down
            ),
            reverse=True,
        )
        chosen.extend(name for _, _, name in ranked[: k - len(chosen)])
        return chosen

    def admit(self, peers: Sequence[str]) -> list[str]:
        """The peers of a schedule's list worth fetching now: those up, and those down but due for a probe.

        A down peer admitted as a probe has its next probe pushed back, as in :meth:`choose`.
        """
        now = self._now()
        admitted = []
        for name in peers:
            p = self._peers.get(name)
            if p is None:  # not (or no longer) a member
                continue
            if not p.down:
                admitted.append(name)
            elif now >= p.next_probe:
                p.next_probe = now + p.backoff
                admitted.append(name)
        return admitted

    def success(self, peer: str) -> None:
        """A good fetch: ``score += reward`` (clamped); a down peer comes back up at ``initial``, backoff reset.
        A peer removed meanwhile is ignored."""
        p = self._peers.get(peer)
        if p is None:
            return
        if p.down:
            p.down, p.score, p.backoff, p.next_probe = False, self._initial, 0.0, 0.0
        else:
            p.score = min(self._ceiling, p.score + self._reward)
        p.failures = 0

    def failure(self, peer: str) -> None:
        """A timeout, refusal or rejected reply: ``score -= penalty`` (clamped); down after ``down_after`` in a row.

        A failure of a down peer (a failed probe) doubles its backoff, up to the cap. A removed peer is ignored.
        """
        p = self._peers.get(peer)
        if p is None:
            return
        p.score = max(self._floor, p.score - self._penalty)
        p.failures += 1
        if p.down:
            p.backoff = min(self._backoff_cap, p.backoff * 2.0)
            p.next_probe = self._now() + p.backoff
        elif p.failures >= self._down_after:
            p.down, p.backoff = True, self._backoff_first
            p.next_probe = self._now() + p.backoff

    def record(self, peer: str, effect: FlowEffect) -> bool:
        """Apply ``effect`` to ``peer`` (:meth:`success`, :meth:`failure`, or nothing); True when it was a failure
        that leaves the peer down (the caller suspects it)."""
        if effect is FlowEffect.SUCCESS:
            self.success(peer)
        elif effect is FlowEffect.FAILURE:
            self.failure(peer)
            return not self.is_up(peer)
        return False

    def scores(self) -> dict[str, float]:
        """Current score of every peer (up or down), in construction order."""
        return {name: p.score for name, p in self._peers.items()}

    def is_up(self, peer: str) -> bool:
        """False while ``peer`` is down (``down_after`` consecutive failures, not yet answered a probe)."""
        p = self._peers.get(peer)
        return p is not None and not p.down

    def up_peers(self) -> list[str]:
        """The peers that are up, in construction order."""
        return [name for name, p in self._peers.items() if not p.down]
