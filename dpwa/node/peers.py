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
from collections.abc import Callable, Collection, Sequence

import numpy as np

from dpwa.node.states import FlowEffect

__all__ = ["JITTER", "FlowControl"]

JITTER = (10, 1000)
"""Bounds (inclusive) of the uniform integer added to each score when choosing."""


class FlowControl:
    """Peer scores in [10, 1000] start at 1000: +10 per good fetch, -100 per timeout/refusal/rejection.

    Choose the peer with the largest score + U{10..1000}.  Never drops a peer forever.  The scores live in numpy
    arrays, one entry per peer in construction order, so that :meth:`choose` costs a few vector operations
    whether a node knows 3 peers or 4,096 (the simulator runs thousands of these).
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
        self._draws = np.random.default_rng(rng.getrandbits(64))
        """The jitter and tie-break draws, seeded from ``rng`` (one draw of it, here)."""
        self._now = now
        self._initial = float(initial)
        self._floor = float(floor)
        self._ceiling = float(ceiling)
        self._reward = float(reward)
        self._penalty = float(penalty)
        self._down_after = int(down_after)
        self._backoff_first = float(first)
        self._backoff_cap = float(cap)
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        self._score = np.zeros(0)
        self._failures = np.zeros(0, dtype=np.int64)  # consecutive
        self._down = np.zeros(0, dtype=bool)
        self._backoff = np.zeros(0)  # current probe backoff while down
        self._next_probe = np.zeros(0)  # time (of ``now``) from which a probe is due while down
        self._grow(names)

    def _grow(self, names: Sequence[str]) -> None:
        """Append ``names`` (new) as up peers at ``initial`` score."""
        if not names:
            return
        n = len(names)
        self._index.update({name: len(self._names) + i for i, name in enumerate(names)})
        self._names.extend(names)
        self._score = np.concatenate([self._score, np.full(n, self._initial)])
        self._failures = np.concatenate([self._failures, np.zeros(n, dtype=np.int64)])
        self._down = np.concatenate([self._down, np.zeros(n, dtype=bool)])
        self._backoff = np.concatenate([self._backoff, np.zeros(n)])
        self._next_probe = np.concatenate([self._next_probe, np.zeros(n)])

    def add(self, peer: str) -> None:
        """A new member: up, at ``initial`` score (nothing if known already)."""
        if peer not in self._index:
            self._grow([peer])

    def remove(self, peer: str) -> None:
        """A member that left or was forgotten: never chosen or probed again (nothing if unknown)."""
        i = self._index.pop(peer, None)
        if i is None:
            return
        del self._names[i]
        self._index = {name: j for j, name in enumerate(self._names)}
        self._score, self._failures, self._down, self._backoff, self._next_probe = (
            np.delete(a, i) for a in (self._score, self._failures, self._down, self._backoff, self._next_probe)
        )

    def choose(self, k: int = 1, among: Collection[str] | None = None) -> list[str]:
        """Up to ``k`` distinct peers to fetch from, best first (``among``: only those peers; None: any).

        If a down peer is due for a probe, the most overdue one takes the first
        slot (at most one probe per call) and its next probe is pushed back by
        its current backoff, so a probe in flight is not repeated.  The other
        slots go to the up peers with the largest ``score + randint(10, 1000)``
        (ties broken uniformly at random; one slot among equal scores: a uniform choice, the same law).
        Returns ``[]`` for ``k == 0``, or when no peer is up and none is due.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        now = self._now()
        chosen: list[str] = []
        allowed = None if among is None else np.array([name in among for name in self._names], dtype=bool)
        if self._down.any() or allowed is not None:
            due_mask = self._down & (now >= self._next_probe)
            due = np.flatnonzero(due_mask if allowed is None else due_mask & allowed)
            if due.size:
                probe = min(due.tolist(), key=lambda i: (self._next_probe[i], self._names[i]))
                self._next_probe[probe] = now + self._backoff[probe]
                chosen.append(self._names[probe])
            up = np.flatnonzero(~self._down if allowed is None else ~self._down & allowed)
        else:
            up = None
        need = k - len(chosen)
        count = len(self._names) if up is None else up.size
        if need <= 0 or count == 0:
            return chosen
        scores = self._score if up is None else self._score[up]
        if need == 1 and scores[0] == scores.min() == scores.max():  # all equal: by symmetry, one uniformly
            pick = int(self._draws.integers(count))
            chosen.append(self._names[pick if up is None else int(up[pick])])
            return chosen
        key = self._draws.integers(JITTER[0], JITTER[1] + 1, size=count) + scores
        ties = self._draws.random(count)
        if need == 1:
            top = np.flatnonzero(key == key.max())
            best = [top[int(np.argmax(ties[top]))]]
        else:
            best = np.lexsort((ties, key))[::-1][:need].tolist()
        chosen.extend(self._names[int(i) if up is None else int(up[i])] for i in best)
        return chosen

    def admit(self, peers: Sequence[str]) -> list[str]:
        """The peers of a schedule's list worth fetching now: those up, and those down but due for a probe.

        A down peer admitted as a probe has its next probe pushed back, as in :meth:`choose`.
        """
        now = self._now()
        admitted = []
        for name in peers:
            i = self._index.get(name)
            if i is None:  # not (or no longer) a member
                continue
            if not self._down[i]:
                admitted.append(name)
            elif now >= self._next_probe[i]:
                self._next_probe[i] = now + self._backoff[i]
                admitted.append(name)
        return admitted

    def success(self, peer: str) -> None:
        """A good fetch: ``score += reward`` (clamped); a down peer comes back up at ``initial``, backoff reset.
        A peer removed meanwhile is ignored."""
        i = self._index.get(peer)
        if i is None:
            return
        if self._down[i]:
            self._down[i], self._score[i], self._backoff[i], self._next_probe[i] = False, self._initial, 0.0, 0.0
        else:
            self._score[i] = min(self._ceiling, self._score[i] + self._reward)
        self._failures[i] = 0

    def failure(self, peer: str) -> None:
        """A timeout, refusal or rejected reply: ``score -= penalty`` (clamped); down after ``down_after`` in a row.

        A failure of a down peer (a failed probe) doubles its backoff, up to the cap. A removed peer is ignored.
        """
        i = self._index.get(peer)
        if i is None:
            return
        self._score[i] = max(self._floor, self._score[i] - self._penalty)
        self._failures[i] += 1
        if self._down[i]:
            self._backoff[i] = min(self._backoff_cap, self._backoff[i] * 2.0)
            self._next_probe[i] = self._now() + self._backoff[i]
        elif self._failures[i] >= self._down_after:
            self._down[i], self._backoff[i] = True, self._backoff_first
            self._next_probe[i] = self._now() + self._backoff[i]

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
        return dict(zip(self._names, self._score.tolist()))

    def is_up(self, peer: str) -> bool:
        """False while ``peer`` is down (``down_after`` consecutive failures, not yet answered a probe)."""
        i = self._index.get(peer)
        return i is not None and not self._down[i]

    def up_peers(self) -> list[str]:
        """The peers that are up, in construction order."""
        return [name for name, down in zip(self._names, self._down.tolist()) if not down]
