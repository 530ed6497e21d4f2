"""The member table: who is in the cluster, as every node believes it, merged entry by entry (pure, no sockets).

Each entry is ``(name, host, port, state, version)``. ``version`` is the member's *incarnation*: only the member
itself raises it (when it joins, refutes a suspicion, or leaves). Merging keeps, per name, the entry that
wins :func:`newer`: the higher version; at equal versions the stronger state (``left`` > ``suspected`` >
``alive``), so a suspicion spreads until the member refutes it with a higher version, and a clean leave is
final for that incarnation; two claims equal in both are ordered by address. That is a total order, so
gossip of whole tables converges: merging is commutative, associative and idempotent (tested).

Members from the cluster file are *permanent*: their address is the file's, an entry from the network never
changes it and never removes them. The table holds at most ``capacity`` joined members; beyond that, new
names are refused (counted), so a flood of forged entries costs bounded memory. Joined members that have
been ``suspected`` or ``left`` for ``forget_after_s`` are forgotten (:meth:`MemberTable.expire`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from dpwa.config import ConfigError, NodeSpec

__all__ = ["STATES", "Member", "MemberTable", "newer"]

STATES = ("alive", "suspected", "left")
"""Member states, weakest first: at equal versions the later one wins."""
MAX_VERSION = 2**53
"""Versions above this (not exact in a JSON number) are refused."""


@dataclass(frozen=True)
class Member:
    """One entry: where ``name`` listens and what is known of it at incarnation ``version``."""

    name: str
    host: str
    port: int
    state: str = "alive"
    version: int = 0

    def spec(self) -> NodeSpec:
        return NodeSpec(self.name, self.host, self.port)


def newer(a: Member, b: Member) -> bool:
    """True when ``a`` supersedes ``b`` (same name): a higher version, or at the same version a stronger state;
    two claims equal in both are ordered by address, so that every node keeps the same one (a total order)."""
    if a.version != b.version:
        return a.version > b.version
    if a.state != b.state:
        return STATES.index(a.state) > STATES.index(b.state)
    return (a.host, a.port) > (b.host, b.port)


def _valid(m: Member) -> bool:
    """A known state, a version a JSON number holds exactly, and a name and address a cluster file could list."""
    if m.state not in STATES or not isinstance(m.version, int) or not 0 <= m.version <= MAX_VERSION:
        return False
    try:
        m.spec()  # NodeSpec checks the name, host and port as it does for a cluster file
    except ConfigError:
        return False
    return True


class MemberTable:
    """The members one node knows; ``permanent``: the cluster file's nodes. Not thread-safe (the caller locks)."""

    def __init__(self, permanent: Sequence[NodeSpec], capacity: int, forget_after_s: float) -> None:
        if capacity < 0 or forget_after_s <= 0:
            raise ValueError(f"capacity >= 0 and forget_after_s > 0 needed, got {capacity}, {forget_after_s}")
        self._permanent = {n.name: n for n in permanent}
        self._entries: dict[str, Member] = {n.name: Member(n.name, n.host, n.port) for n in permanent}
        self._down_since: dict[str, float] = {}
        self.capacity = capacity
        self.forget_after_s = forget_after_s
        self.refused = 0
        """Entries from the network that were not taken: invalid, a permanent member's address, over capacity."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> Member | None:
        return self._entries.get(name)

    def members(self) -> list[Member]:
        """Every entry, in a stable order (by name): the order schedules that depend on N use."""
        return [self._entries[n] for n in sorted(self._entries)]

    def alive(self) -> list[Member]:
        """The members to exchange with: not ``left`` (a ``suspected`` one may still answer)."""
        return [m for m in self.members() if m.state != "left"]

    def joined(self) -> int:
        return sum(name not in self._permanent for name in self._entries)

    def merge(self, entries: Iterable[Member], now: float) -> list[Member]:
        """Take every entry that supersedes what is known; returns the entries that changed the table."""
        changed = []
        for entry in entries:
            if not _valid(entry):
                self.refused += 1
                continue
            fixed = self._permanent.get(entry.name)
            if fixed is not None and (entry.host, entry.port) != (fixed.host, fixed.port):
                self.refused += 1  # a permanent member's address is the file's
                continue
            known = self._entries.get(entry.name)
            if known is None and fixed is None and self.joined() >= self.capacity:
                self.refused += 1
                continue
            if known is not None and not newer(entry, known):
                continue
            self._entries[entry.name] = entry
            if entry.state == "alive":
                self._down_since.pop(entry.name, None)
            elif known is None or known.state == "alive":
                self._down_since[entry.name] = now
            changed.append(entry)
        return changed

    def suspect(self, name: str, now: float) -> Member | None:
        """This node could not reach ``name``: mark it suspected at its current version (None if unknown/left)."""
        known = self._entries.get(name)
        if known is None or known.state != "alive":
            return None
        return (self.merge([replace(known, state="suspected")], now) or [None])[0]

    def expire(self, now: float) -> list[str]:
        """Forget joined members down (suspected or left) for ``forget_after_s``; returns their names."""
        gone = [
            name
            for name, since in self._down_since.items()
            if name not in self._permanent and now - since >= self.forget_after_s
        ]
        for name in gone:
            del self._entries[name]
            del self._down_since[name]
        return gone
