"""Peer schedules: whom a node fetches in a round (SGP's graph manager; the rules are its mixing manager).

A schedule is a pure function of the round: the node's name, every member's name
(the cluster file's nodes in file order, then joined members by name; members that
left are not there), the node's step index and its state. It returns the peers to
fetch, or None to let flow control pick ``fanout`` peers. The connection then
drops scheduled peers that flow control knows to be down (unless a probe is
due), so a dead peer in a fixed schedule costs a skipped round, not a timeout.

| schedule | peers of node ``i`` (of ``N``) at step ``k`` |
|---|---|
| ``random`` | one peer, chosen by flow control (score + random term) |
| ``exponential`` | ``(i + 2^(k mod ceil(log2 N))) mod N`` -- SGP's one-peer exponential graph |
| ``ring`` | ``(i + 1) mod N`` |
| ``leader`` | the node the leader rule wants to pull from (``extras["pull"]``), else one random peer |
| ``groups`` | WAGMA's rotating groups of ``S``: even steps ``j // S == i // S``, odd steps |
|            | ``j mod ceil(N/S) == i mod ceil(N/S)``; every ``sync_every``-th step everyone |
| ``neighbours`` | each step every graph neighbour: ring ``i +- 1``, exponential ``i +- 2^k``, directed ring ``i-1`` |

AD-PSGD's ``bipartite: true`` turns ``random`` into :class:`BipartiteSchedule`: an active node's one peer is
chosen by flow control among the passive members alone (:meth:`Schedule.candidates`), and a passive node fetches
nobody (:meth:`Schedule.fetches` False); nobody fetches an active node (:meth:`Schedule.fetched` False).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dpwa.rules.adpsgd import is_active
from dpwa.rules.base import NodeState
from dpwa.rules.dpsgd import neighbours, readers
from dpwa.rules.group import is_sync_step

__all__ = [
    "SCHEDULES",
    "BipartiteSchedule",
    "ExponentialSchedule",
    "GroupsSchedule",
    "LeaderSchedule",
    "NeighboursSchedule",
    "RandomSchedule",
    "RingSchedule",
    "Round",
    "Schedule",
    "make_schedule",
]


@dataclass(frozen=True)
class Round:
    """What a schedule may look at: who I am, who exists, which step this is, my state."""

    me: str
    names: tuple[str, ...]  # the members: file nodes in file order, then joined ones by name (me included)
    index: int  # this node's step: update_send calls before this one
    own: NodeState

    @property
    def rank(self) -> int:
        return self.names.index(self.me)


class Schedule(ABC):
    """Chooses the peers of one round."""

    name: ClassVar[str]
    fanout: int = 1
    """How many peers flow control picks when :meth:`targets` returns None."""
    period: int = 1
    """How many steps apart this schedule's rounds are: 1, except under an outer optimizer, which exchanges every
    ``every``-th step (:class:`dpwa.rules.outer.OuterSchedule`); push rules scale the rounds they wait for by it."""

    def max_fanout(self, n_nodes: int) -> int:
        """The most peers one round can fetch (receive buffers are allocated for that many)."""
        return min(self.fanout, max(0, n_nodes - 1))

    @abstractmethod
    def targets(self, rnd: Round) -> Sequence[str] | None:
        """The peers to fetch this round, or None: let flow control pick ``fanout`` of them."""

    def sources(self, rnd: Round) -> Sequence[str] | None:
        """The nodes whose ``targets`` at round ``rnd.index`` include ``rnd.me`` (a push rule's in-neighbours of
        the round), or None when that depends on state this node cannot see (flow control's choice)."""
        return None

    def candidates(self, rnd: Round) -> frozenset[str] | None:
        """The peers flow control may pick from when :meth:`targets` returns None; None: any member."""
        return None

    def fetches(self, me: str, names: Sequence[str]) -> bool:
        """Whether node ``me`` ever starts a round (fetches or pushes); False: it needs no receive buffer."""
        return True

    def fetched(self, me: str, names: Sequence[str]) -> bool:
        """Whether a peer ever starts a round with node ``me``; False: it needs no inbox."""
        return True

    def splits_roles(self) -> bool:
        """Whether the nodes take roles (AD-PSGD's active and passive, :class:`BipartiteSchedule`): a joining
        node must agree with the member it joins through (its JOIN says so)."""
        return False

    def adopt_roster(self, roster: Sequence[str]) -> None:  # noqa: B027 - optional step
        """A joined node learnt the cluster file's nodes, in file order (the answer to its JOIN): the schedules
        that place nodes by it take it from now on; the others ignore it. Called before the node's first step."""


class RandomSchedule(Schedule):
    """Flow control picks the peer: largest ``score + U{10..1000}``, dead peers probed rarely."""

    name = "random"

    def targets(self, rnd: Round) -> None:
        return None


class ExponentialSchedule(Schedule):
    """``i -> (i + 2^(k mod ceil(log2 N))) mod N``: after log2 N synchronous rounds everyone has mixed with everyone."""

    name = "exponential"

    def targets(self, rnd: Round) -> list[str]:
        n = len(rnd.names)
        if n < 2:
            return []
        return [rnd.names[(rnd.rank + self.hop(n, rnd.index)) % n]]

    @staticmethod
    def hop(n_nodes: int, index: int) -> int:
        """``2^(k mod ceil(log2 N))``: how far round ``k`` pushes."""
        return 2 ** (index % max(1, math.ceil(math.log2(n_nodes))))

    def sources(self, rnd: Round) -> list[str]:
        """``(i - 2^(k mod ceil(log2 N))) mod N``: the one node pushing to ``i`` at round ``k``."""
        n = len(rnd.names)
        if n < 2:
            return []
        return [rnd.names[(rnd.rank - self.hop(n, rnd.index)) % n]]


class RingSchedule(Schedule):
    """``i -> (i + 1) mod N``."""

    name = "ring"

    def targets(self, rnd: Round) -> list[str]:
        n = len(rnd.names)
        return [] if n < 2 else [rnd.names[(rnd.rank + 1) % n]]

    def sources(self, rnd: Round) -> list[str]:
        """``(i - 1) mod N``."""
        n = len(rnd.names)
        return [] if n < 2 else [rnd.names[(rnd.rank - 1) % n]]


class LeaderSchedule(Schedule):
    """Fetch the node the leader rule named in ``own.extras["pull"]``; otherwise one random peer.

    A random fetch still carries the best-known table, so the leader's identity
    spreads epidemically even while a node does not know whom to pull toward.
    """

    name = "leader"

    def targets(self, rnd: Round) -> list[str] | None:
        pull = rnd.own.extras.get("pull")
        if isinstance(pull, str) and pull != rnd.me and pull in rnd.names:
            return [pull]
        return None


class GroupsSchedule(Schedule):
    """WAGMA-style rotating groups of ``group_size``, alternating two partitions; a full round every ``sync_every``."""

    name = "groups"

    def __init__(self, group_size: int, sync_every: int = 0) -> None:
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {group_size}")
        if sync_every < 0:
            raise ValueError(f"sync_every must be >= 0 (0 = never), got {sync_every}")
        self.group_size = group_size
        self.sync_every = sync_every

    def max_fanout(self, n_nodes: int) -> int:
        if self.sync_every:
            return max(0, n_nodes - 1)
        n_groups = math.ceil(n_nodes / self.group_size)
        biggest_b = math.ceil(n_nodes / n_groups) if n_nodes else 0
        return max(0, min(n_nodes, max(self.group_size, biggest_b)) - 1)

    def is_sync_step(self, index: int) -> bool:
        """True on every ``sync_every``-th step (the group rule's own definition, shared)."""
        return is_sync_step(index, self.sync_every)

    def group(self, rank: int, n_nodes: int, index: int) -> list[int]:
        """The ranks in ``rank``'s group at step ``index`` (``rank`` included)."""
        if self.is_sync_step(index):
            return list(range(n_nodes))
        if index % 2 == 0:
            return [j for j in range(n_nodes) if j // self.group_size == rank // self.group_size]
        n_groups = math.ceil(n_nodes / self.group_size)
        return [j for j in range(n_nodes) if j % n_groups == rank % n_groups]

    def targets(self, rnd: Round) -> list[str]:
        rank = rnd.rank
        return [rnd.names[j] for j in self.group(rank, len(rnd.names), rnd.index) if j != rank]

    def sources(self, rnd: Round) -> list[str]:
        """A group is symmetric: the same nodes."""
        return self.targets(rnd)


class NeighboursSchedule(Schedule):
    """Every neighbour of a regular graph, every step (:func:`dpwa.rules.dpsgd.neighbours`: the nodes read)."""

    name = "neighbours"

    def __init__(self, graph: str = "ring") -> None:
        neighbours(0, 2, graph)  # validates the name
        self.graph = graph

    def max_fanout(self, n_nodes: int) -> int:
        return len(neighbours(0, n_nodes, self.graph))

    def targets(self, rnd: Round) -> list[str]:
        return [rnd.names[j] for j in neighbours(rnd.rank, len(rnd.names), self.graph)]

    def sources(self, rnd: Round) -> list[str]:
        """The nodes that read this one (:func:`dpwa.rules.dpsgd.readers`): the same on an undirected graph."""
        return [rnd.names[j] for j in readers(rnd.rank, len(rnd.names), self.graph)]


class BipartiteSchedule(Schedule):
    """``random`` between two roles (:func:`dpwa.rules.adpsgd.is_active`): an active node's one peer is flow
    control's choice among the passive members; a passive node starts no round. ``roster``: the cluster file's
    nodes, in file order; ``()`` for a joining node until its JOIN is answered (:meth:`adopt_roster`: until then
    every member's role comes from its name, its own included, which is the role the cluster gives it); None:
    each round's members, which a simulation without churn keeps."""

    name = "bipartite"

    def __init__(self, roster: Sequence[str] | None = None) -> None:
        self._placed: tuple[tuple[str, ...], dict[str, int]] | None = None
        """The roster and each of its nodes' positions, replaced whole (None: each round's members)."""
        self._passive: tuple[tuple[object, tuple[str, ...]], frozenset[str]] = ((None, ()), frozenset())
        """(the roster, the members) last asked about and the passive ones among them (a step costs O(1) until
        either changes)."""
        if roster is not None:
            self.adopt_roster(roster)

    @property
    def roster(self) -> tuple[str, ...] | None:
        return None if self._placed is None else self._placed[0]

    def splits_roles(self) -> bool:
        return True

    def adopt_roster(self, roster: Sequence[str]) -> None:
        roster = tuple(roster)
        self._placed = (roster, {n: i for i, n in enumerate(roster)})

    def _passive_among(self, names: Sequence[str]) -> frozenset[str]:
        names, placed = tuple(names), self._placed
        key = (None if placed is None else placed[0], names)
        asked, passive = self._passive
        if asked != key:
            positions = {n: i for i, n in enumerate(names)} if placed is None else placed[1]
            passive = frozenset(n for n in names if not is_active(n, positions))
            self._passive = (key, passive)
        return passive

    def targets(self, rnd: Round) -> list[str] | None:
        return [] if rnd.me in self._passive_among(rnd.names) else None

    def candidates(self, rnd: Round) -> frozenset[str]:
        return self._passive_among(rnd.names) - {rnd.me}

    def fetches(self, me: str, names: Sequence[str]) -> bool:
        return me not in self._passive_among(names)

    def fetched(self, me: str, names: Sequence[str]) -> bool:
        return me in self._passive_among(names)

    def __repr__(self) -> str:
        return f"BipartiteSchedule(roster={self.roster!r})"


SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls
    for cls in (RandomSchedule, ExponentialSchedule, RingSchedule, LeaderSchedule, GroupsSchedule, NeighboursSchedule)
}


def make_schedule(name: str, settings: Any = None, roster: Sequence[str] | None = None) -> Schedule:
    """The schedule ``name``; ``groups`` takes ``group_size`` and ``sync_every`` from the rule's ``settings``,
    ``neighbours`` its ``graph`` (default ring); ``random`` with AD-PSGD's ``bipartite`` is
    :class:`BipartiteSchedule` over ``roster`` (the cluster file's nodes; ``()`` for a joining node, None: each
    round's members)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown peer schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    if getattr(settings, "bipartite", False):
        if name != "random":
            raise ValueError(f"bipartite chooses among the passive nodes at random: it takes peers random, not {name}")
        return BipartiteSchedule(roster)
    if name == "groups":
        if settings is None or not hasattr(settings, "group_size"):
            raise ValueError("the groups schedule needs group_size (and sync_every) from the group rule's settings")
        return GroupsSchedule(int(settings.group_size), int(getattr(settings, "sync_every", 0)))
    if name == "neighbours":
        return NeighboursSchedule(str(getattr(settings, "graph", "ring")))
    return SCHEDULES[name]()
