"""Leader -- LSGD in gossip form (Teng et al. 2019; docs/rules.md).

Followers are pulled toward the leader, the node with the lowest running mean
of its last ``window`` batch losses (the loss passed to ``update_wait``):

    x <- x - c*(x - x_leader)        (c = strength; the leader itself never moves)

No server knows the leader: every node carries a best-known table in its
extras, ``{"leaders": {name: [mean_loss, stamp]}}`` (``stamp`` = the author's
own step counter, strictly increasing), which travels with every reply.  At
every :meth:`LeaderRule.mix` a node merges each peer's table (per name the
larger stamp wins), then rewrites its own entry (a node is the authority on
itself, whatever others claim), drops stale entries and decides whom to pull
next, in ``own.extras["pull"]`` (read by :class:`~dpwa.rules.schedules.LeaderSchedule`;
None means a random peer, which still spreads the table).

Size: the published table is capped at :data:`TABLE_BUDGET` bytes of JSON (the
reply header holds at most 64 KiB): my own entry first, then my group's entries,
then everybody else's, each by increasing mean loss -- so the leaders always
travel; only the tails of large clusters stay local.

Validation: a table that is not a mapping is ignored; an entry is skipped
unless its name is a node of the cluster and its value is a pair of
finite numbers (booleans are not numbers).  This is structural hygiene, not
authentication: a peer that lies with well-formed entries is believed.

Staleness horizon ``H`` (:attr:`LeaderRule.stale_after`, default
``max(100, 10*every, 10*local_every)`` own steps): an entry whose stamp has not
advanced for ``H`` of this node's steps is dropped, and its last stamp is
remembered for another ``H`` steps so that copies still circulating in other
tables cannot bring it back (anything newer can).  A live leader's stamp
advances at a follower every ``every`` steps (it pulls the leader directly), so
``H`` tolerates a leader at least 10x slower than its followers; a dead leader is
forgotten ``H`` steps after its last news, and a restarted node (stamps from 0
again) is believed again after at most ``2H`` steps.

Pull schedule for the fetch at step ``k`` (0-based; decided at the end of the
previous step's mix): on a global step (``(k+1) % every == 0``) the global leader with
``strength``; else, with ``group_size > 0``, on a local step
(``(k+1) % local_every == 0``) the group's leader (``index // group_size`` in
file order) with ``local_strength``; else nobody (a random peer).  After an
intended pull that did not arrive, the next step pulls a random peer once, so
a dead or unreachable leader does not cut the node off the gossip.  A reply
from the intended node moves the node by the strength that applied (then
divergence damping) only if that node is still the leader (of that scope)
after merging; otherwise ``f = 0`` and only the table is merged.
"""

from __future__ import annotations

import json
import math
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.mixing import check_pairs, interpolate_, mix_clock
from dpwa.utils.settings import Settings, setting

__all__ = ["TABLE_BUDGET", "LeaderRule", "LeaderSettings", "UNKNOWN_LOSS", "parse_entry"]

TABLE_BUDGET = 16 * 1024
"""Most bytes of compact JSON (as the wire encodes it) for the published ``leaders`` table: 1/4 of the header limit."""

UNKNOWN_LOSS = sys.float_info.max
"""The mean loss a node publishes for itself when its own is not finite (NaN/inf): never a leader, JSON-safe."""


def _number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # a JSON integer beyond float range (e.g. 10**400)
        return None
    return f if math.isfinite(f) else None


def parse_entry(value: object) -> tuple[float, float] | None:
    """``(mean_loss, stamp)`` from a table value ``[loss, stamp]``; None unless it is a pair of finite numbers."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    loss, stamp = _number(value[0]), _number(value[1])
    if loss is None or stamp is None:
        return None
    return loss, stamp


@dataclass
class _Entry:
    loss: float
    stamp: float
    seen: int  # own step at which the stamp last advanced
    size: int = -1  # bytes of its compact JSON in the published table (-1: not measured yet)


@dataclass(frozen=True)
class _Pull:
    target: str
    strength: float
    scope: str  # "global" or "local"


@dataclass(frozen=True)
class LeaderSettings(Settings):
    """LSGD: ``x <- x - strength*(x - x_leader)`` every ``every`` steps, leader = lowest mean loss over
    ``window`` batches; with ``group_size > 0`` also ``local_strength`` toward the group's leader every
    ``local_every`` steps."""

    strength: float = setting(0.1, lo=0, hi=1, lo_open=True)
    window: int = setting(10, lo=1, hi=1_000_000, integer=True)
    every: int = setting(1, lo=1, integer=True)
    group_size: int = setting(0, lo=0, integer=True)
    local_strength: float = setting(0.1, lo=0, hi=1, lo_open=True)
    local_every: int = setting(1, lo=1, integer=True)


class LeaderRule(Rule):
    """``x <- x - c*(x - x_leader)`` toward the global (``c = strength``, every ``every`` steps) or group
    (``c = local_strength``, every ``local_every`` steps) leader; leader = lowest mean loss of ``window`` batches.
    """

    name = "leader"
    settings_class = LeaderSettings
    allowed_schedules = ("leader",)  # the schedule reads whom to pull from this rule's table
    default_schedule = "leader"

    def __init__(
        self,
        strength: float = 0.1,
        window: int = 10,
        every: int = 1,
        group_size: int = 0,
        local_strength: float = 0.1,
        local_every: int = 1,
        divergence_threshold: float = 0.0,
    ) -> None:
        super().__init__(divergence_threshold)
        for what, c in (("strength", strength), ("local_strength", local_strength)):
            if not 0.0 < float(c) <= 1.0:
                raise ValueError(f"leader {what} must lie in (0, 1], got {c!r}")
        ints = {
            "window": (window, 1),
            "every": (every, 1),
            "group_size": (group_size, 0),
            "local_every": (local_every, 1),
        }
        for what, (n, lo) in ints.items():
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < lo:
                raise ValueError(f"leader {what} must be an integer >= {lo}, got {n!r}")
        self.strength, self.local_strength = float(strength), float(local_strength)
        self.window, self.every = int(window), int(every)
        self.group_size, self.local_every = int(group_size), int(local_every)
        self.stale_after = max(100, 10 * self.every, 10 * self.local_every)
        self._me: str | None = None
        self._names: frozenset[str] = frozenset()
        self._group: frozenset[str] = frozenset()
        self._losses: deque[float] = deque(maxlen=self.window)
        self._table: dict[str, _Entry] = {}
        self._version = 0  # raised by every change of the table or of my group: the published table is cached
        self._published: tuple[int, dict[str, list[float]]] = (-1, {})
        self._name_bytes: dict[str, int] = {}  # len(json.dumps(name)), per name
        self._dropped: dict[str, tuple[float, int]] = {}  # name -> (last stamp, own step until which it is refused)
        self._step = 0  # mixes done
        self._pull: _Pull | None = None
        self._bad_requests = 0  # garbage entries in requesters' tables (on_request)

    def mixes_narrower_peers(self) -> bool:
        return True  # check_pairs(narrower_peer=True), interpolate_

    def _params(self) -> dict[str, Any]:
        keys = ("strength", "window", "every", "group_size", "local_strength", "local_every", "divergence_threshold")
        return {k: getattr(self, k) for k in keys}

    # ------------------------------------------------------------ state

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        """Learn my place (group ``index // group_size``); the table starts empty and nobody is pulled."""
        names = list(names)
        if me not in names:
            raise ValueError(f"leader: {me!r} is not one of the cluster's nodes")
        self._me, self._names = me, frozenset(names)
        if self.group_size:
            g = names.index(me) // self.group_size
            self._group = frozenset(n for i, n in enumerate(names) if i // self.group_size == g)
        else:
            self._group = frozenset({me})
        self._version += 1
        return {"leaders": {}, "pull": None}

    def on_members(self, me: str, names: Sequence[str], mass: float) -> None:
        """Members came or went: entries of every member are taken; my group is recomputed on the new order."""
        names = list(names) if me in names else [me, *names]
        self._names = frozenset(names)
        self._version += 1
        if self.group_size:
            g = names.index(me) // self.group_size
            self._group = frozenset(n for i, n in enumerate(names) if i // self.group_size == g)

    def mean_loss(self) -> float:
        """Mean of the last ``window`` losses; inf before any, :data:`UNKNOWN_LOSS` if one is not finite."""
        if not self._losses:
            return math.inf
        if not all(math.isfinite(v) for v in self._losses):
            return UNKNOWN_LOSS
        n = len(self._losses)
        mean = math.fsum(v / n for v in self._losses)  # v/n first: no overflow for huge finite losses
        return mean if math.isfinite(mean) else UNKNOWN_LOSS

    def table(self) -> dict[str, tuple[float, float]]:
        """The best-known table: name -> (mean loss, stamp)."""
        return {n: (e.loss, e.stamp) for n, e in self._table.items()}

    def leader(self, scope: str = "global") -> str | None:
        """The best-known node (lowest mean loss, ties by name) overall or in my group; None if nobody qualifies."""
        best: tuple[float, str] | None = None
        for name, e in self._table.items():
            if (scope == "global" or name in self._group) and e.loss < UNKNOWN_LOSS:
                if best is None or (e.loss, name) < best:
                    best = (e.loss, name)
        return best[1] if best is not None else None

    # ------------------------------------------------------------ merging

    def _merge(self, extras: Mapping[str, Any]) -> int:
        """Merge one peer's table; returns the number of entries skipped as garbage."""
        raw = extras.get("leaders") if isinstance(extras, Mapping) else None
        if raw is None:
            return 0
        if not isinstance(raw, Mapping):
            return 1
        bad = 0
        names, table, dropped_at, isfinite = self._names, self._table, self._dropped, math.isfinite
        for name, value in raw.items():
            if not isinstance(name, str) or name not in names:
                bad += 1
                continue
            loss = stamp = None
            if type(value) is list and len(value) == 2:
                loss, stamp = value
            if not (type(loss) is float and type(stamp) is float and isfinite(loss) and isfinite(stamp)):
                parsed = parse_entry(value)  # the common case, two finite floats, is checked inline: a hot loop
                if parsed is None:
                    bad += 1
                    continue
                loss, stamp = parsed
            old = table.get(name)
            if old is not None and stamp <= old.stamp:
                continue
            dropped = dropped_at.get(name)
            if dropped is not None and stamp <= dropped[0]:
                continue
            table[name] = _Entry(loss, stamp, self._step)
            if dropped is not None:
                del dropped_at[name]
            self._version += 1
        return bad

    def _age(self) -> None:
        """Drop entries whose stamp has not advanced for ``stale_after`` steps; forget old tombstones."""
        for name in [n for n, e in self._table.items() if n != self._me and self._step - e.seen > self.stale_after]:
            self._dropped[name] = (self._table.pop(name).stamp, self._step + self.stale_after)
            self._version += 1
        for name in [n for n, (_, until) in self._dropped.items() if until < self._step]:
            del self._dropped[name]

    def _next_pull(self, missed: bool) -> _Pull | None:
        k = self._step  # index of the next fetch
        top = self.leader("global")
        if top is None or top == self._me or missed:
            return None
        if (k + 1) % self.every == 0:
            return _Pull(top, self.strength, "global")
        if self.group_size and (k + 1) % self.local_every == 0:
            local = self.leader("local")
            if local is not None and local != self._me:
                return _Pull(local, self.local_strength, "local")
        return None

    def _published_table(self) -> dict[str, list[float]]:
        """My own entry, then my group's, then the rest (each by mean loss), within :data:`TABLE_BUDGET` bytes.

        The same object until the table changes (published snapshots share it: never modify it)."""
        version, cached = self._published
        if version == self._version:
            return cached
        table, group = self._table, self._group
        rank = lambda n: (n != self._me, n not in group, table[n].loss, n)  # noqa: E731
        out: dict[str, list[float]] = {}
        size = 2  # {}
        for name in sorted(table, key=rank):
            e = table[name]
            if e.size < 0:
                name_bytes = self._name_bytes.get(name)
                if name_bytes is None:
                    name_bytes = self._name_bytes[name] = len(json.dumps(name))
                e.size = name_bytes + len(repr(e.loss)) + len(repr(e.stamp)) + 5  # "name":[l,s],
            size += e.size
            if size > TABLE_BUDGET:
                break
            out[name] = [e.loss, e.stamp]
        self._published = (self._version, out)
        return out

    # ------------------------------------------------------------ push-pull

    def request_extras(self, own: NodeState) -> dict[str, Any]:
        """Send my table with every fetch: the node I pull from (usually the leader) learns it at once."""
        return {"leaders": self._published_table()} if self._me is not None else {}

    def on_request(self, own: NodeState, extras: dict[str, Any]) -> None:
        """Merge a requester's table (garbage entries skipped and counted)."""
        if self._me is not None:
            self._bad_requests += self._merge(extras)

    # ------------------------------------------------------------ mix

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Merge tables, update my entry, move toward the node I meant to pull if it still leads, plan the next pull.

        Raises RuntimeError before :meth:`initial_extras`, ValueError (nothing changed) for a peer whose
        layout differs from ``arrays``.
        """
        if self._me is None:
            raise RuntimeError("leader: mix() before initial_extras(): the node's place is unknown")
        for p in peers:
            check_pairs(arrays, p.arrays, narrower_peer=True)
        self._step += 1
        self._losses.append(float(own.loss))
        bad = sum(self._merge(p.state.extras) for p in peers)
        mean = self.mean_loss()
        self._table[self._me] = _Entry(mean, float(self._step), self._step)
        self._version += 1
        self._age()
        top = self.leader("global")

        plan, f, mixed = self._pull, 0.0, ()
        arrived = None
        if plan is not None:
            arrived = next((p for p in peers if p.state.name == plan.target), None)
        if plan is not None and arrived is not None and top != self._me:
            still = top if plan.scope == "global" else self.leader("local")
            if still == plan.target:
                f = self.diverge(plan.strength, own.loss)
                interpolate_(arrays, arrived.arrays, f)
                own.clock = mix_clock(own.clock, arrived.state.clock, f)
                mixed = (plan.target,) if f > 0.0 else ()

        self._pull = self._next_pull(missed=plan is not None and arrived is None)
        extras = dict(own.extras)  # new objects only: published snapshots share the old ones
        extras["leaders"] = self._published_table()
        extras["pull"] = self._pull.target if self._pull is not None else None
        own.extras = extras

        metrics: dict[str, float] = {
            "leader_is_me": float(top == self._me),
            "leader_known": float(len(self._table)),
            "leader_pull": 0.0 if plan is None else (1.0 if plan.scope == "global" else 2.0),
            "leader_bad_entries": float(bad + self._bad_requests),
        }
        if top is not None:
            metrics["leader_loss"] = self._table[top].loss
        self._bad_requests = 0
        return MixOutcome(f, mixed, metrics)
