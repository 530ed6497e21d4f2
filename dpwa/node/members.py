"""The member table: who is in the cluster, as every node believes it, merged entry by entry (pure, no sockets).

Each entry is ``(name, host, port, state, version)``. ``version`` is the member's *incarnation*: only the member
itself raises it (when it joins, refutes a suspicion, or leaves). Merging keeps, per name, the entry that
wins :func:`newer`: the higher version; at equal versions the stronger state (``left`` > ``suspected`` >
``alive``), so a suspicion spreads until the member refutes it with a higher version, and a clean leave is
final for that incarnation; two claims equal in both are ordered by address. That is a total order, so
gossip of whole tables converges: merging is commutative, associative and idempotent (tested).

Members from the cluster file are *permanent*: their address is the file's, an entry from the network never
changes it and never removes them (such a node is ``left`` only on its own word, see
:meth:`MemberTable.merge`). The table holds at most ``capacity`` joined members and
:data:`TABLE_BUDGET_BYTES` on the wire; beyond that, new names are refused (counted), so a flood of forged
entries costs bounded memory. Joined members that have been ``suspected`` or ``left`` for
``forget_after_s`` are forgotten (:meth:`MemberTable.expire`); a forgotten name is remembered as a
*tombstone* (name and version, within the capacity) for another ``forget_after_s``, so that a
peer that has not forgotten it yet cannot gossip it back: only a newer incarnation (a new join) is taken.

On the wire an entry is the JSON list ``[name, host, port, state, version]`` (:func:`to_wire`, :func:`from_wire`);
:meth:`MemberTable.digest` names a whole table in 16 hex digits, so that two nodes whose tables agree send
nothing more.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dpwa.config import ConfigError, NodeSpec
from dpwa.config.tablesize import TABLE_BUDGET_BYTES
from dpwa.config.tablesize import entry_bytes as named_entry_bytes

__all__ = [
    "CLAIM_CEILING",
    "FILE_LEAVE_JUMP",
    "MAX_MEMBER_NAME",
    "MAX_WIRE_MEMBERS",
    "STATES",
    "TABLE_BUDGET_BYTES",
    "entry_bytes",
    "JoinRefused",
    "Member",
    "MemberTable",
    "from_wire",
    "newer",
    "to_wire",
]

STATES = ("alive", "suspected", "left")
"""Member states, weakest first: at equal versions the later one wins."""
MAX_VERSION = 2**53
"""Versions above this (not exact in a JSON number) are refused."""
FILE_LEAVE_JUMP = 1024
"""How far above its known version a claim that a file node is down (suspected, left) may be taken: its own leave
is its version + 1, the slack covers refutations this node missed, and the node can outbid any such claim."""
CLAIM_CEILING = MAX_VERSION - FILE_LEAVE_JUMP - 1
"""The highest claim about a file node that is outbid (by the node itself) or taken beyond the jump (a relayed leave
of a node this one suspects): above it the node would have no version left to refute or leave with."""
MAX_WIRE_MEMBERS = 4096
"""A member list on the wire longer than this is malformed (the table's own bound is the capacity setting)."""
MAX_MEMBER_NAME = 128
"""The longest member name taken from the network."""


class JoinRefused(Exception):
    """A JOIN this table does not admit; the message says why (a clash of names, a permanent name)."""


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


def to_wire(members: Iterable[Member]) -> list[list[Any]]:
    """The JSON form of ``members``: ``[[name, host, port, state, version], ...]``."""
    return [[m.name, m.host, m.port, m.state, m.version] for m in members]


def from_wire(raw: Any) -> list[Member] | None:
    """The entries of a member list from the wire, or None when its shape is wrong (not a list of 5-lists of
    str, str, int, str, int; more than :data:`MAX_WIRE_MEMBERS`). Values are checked by :meth:`MemberTable.merge`."""
    if not isinstance(raw, list) or len(raw) > MAX_WIRE_MEMBERS:
        return None
    out = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 5:
            return None
        name, host, port, state, version = item
        if not (isinstance(name, str) and isinstance(host, str) and isinstance(state, str)):
            return None
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (port, version)):
            return None
        out.append(Member(name, host, port, state, version))
    return out


def entry_bytes(m: Member) -> int:
    """About what ``m`` takes in a table on the wire (its JSON list, with room for the numbers)."""
    return named_entry_bytes(m.name, m.host)


def _valid(m: Member) -> bool:
    """A known state, a version a JSON number holds exactly, a name of at most MAX_MEMBER_NAME characters a
    cluster file could list, and a host a cluster file could list (a host name or an IPv4 address)."""
    if m.state not in STATES or not isinstance(m.version, int) or not 0 <= m.version <= MAX_VERSION:
        return False
    if len(m.name) > MAX_MEMBER_NAME:
        return False
    try:
        m.spec()  # NodeSpec checks the name, host and port as it does for a cluster file (one rule for both)
    except ConfigError:
        return False
    return True


class MemberTable:
    """The members one node knows; ``permanent``: the cluster file's nodes, in file order. Not thread-safe (the
    caller locks)."""

    def __init__(self, permanent: Sequence[NodeSpec], capacity: int, forget_after_s: float) -> None:
        if capacity < 0 or forget_after_s <= 0:
            raise ValueError(f"capacity >= 0 and forget_after_s > 0 needed, got {capacity}, {forget_after_s}")
        self._permanent = {n.name: n for n in permanent}
        self._entries: dict[str, Member] = {n.name: Member(n.name, n.host, n.port) for n in permanent}
        self._down_since: dict[str, float] = {}
        self._tombstones: dict[str, tuple[int, float]] = {}
        """Forgotten joined members: name -> (the version forgotten, when)."""
        self._digest: str | None = None
        self._bytes = sum(entry_bytes(m) for m in self._entries.values())  # kept up to date by merge and expire
        self.capacity = capacity
        self.forget_after_s = forget_after_s
        self.refused = 0
        """Entries from the network that were not taken: invalid, a permanent member's address, over capacity."""
        self.incarnations = len(self._permanent)
        """Distinct (name, version) entries ever taken: a bound on the push-sum mass in the cluster (each
        admitted member brings one unit; a refutation or a leave also counts, which only loosens the bound)."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> Member | None:
        return self._entries.get(name)

    def is_permanent(self, name: str) -> bool:
        return name in self._permanent

    def permanent(self) -> tuple[str, ...]:
        """The cluster file's nodes in file order, those that left included (AD-PSGD's roles come from it)."""
        return tuple(self._permanent)

    def members(self) -> list[Member]:
        """Every entry, in a stable order (by name)."""
        return [self._entries[n] for n in sorted(self._entries)]

    def alive(self) -> list[Member]:
        """The members to exchange with: not ``left`` (a ``suspected`` one may still answer)."""
        return [m for m in self.members() if m.state != "left"]

    def order(self) -> tuple[str, ...]:
        """The members not ``left`` in the order schedules use: the file's nodes in file order, then joined
        members by name. Every node with the same table computes the same order."""
        fixed = [n for n in self._permanent if self._entries[n].state != "left"]
        joined = [m.name for m in self.members() if m.name not in self._permanent and m.state != "left"]
        return (*fixed, *joined)

    def wire_bytes(self) -> int:
        """About what the whole table takes on the wire (see :func:`entry_bytes`)."""
        return self._bytes

    def joined(self) -> int:
        """Joined members in the table (the file's nodes are always there: never removed)."""
        return len(self._entries) - len(self._permanent)

    def digest(self) -> str:
        """16 hex digits naming the whole table: equal tables, equal digests."""
        if self._digest is None:
            data = json.dumps(to_wire(self.members()), separators=(",", ":")).encode()
            self._digest = hashlib.blake2b(data, digest_size=8).hexdigest()
        return self._digest

    def merge(
        self, entries: Iterable[Member], now: float, sender: str | None = None, *, sponsor: bool = False
    ) -> list[Member]:
        """Take every entry that supersedes what is known; returns the entries that changed the table.

        A file node is ``left`` on its own word: such an entry is taken from ``sender`` == that node (its leave
        announcement, or this node itself) -- relayed only while this node suspects it (so a member that missed
        the announcement converges with the others once it finds the node gone). A claim that a file node is
        down (suspected or left) is taken at most :data:`FILE_LEAVE_JUMP` versions above the known one: without
        CURVE a sender's name is only its word, and a claim at the largest version could never be refuted; one
        within the jump the node refutes as any claim about itself. ``sponsor``: the table of a JOIN's answer,
        taken as it is (the joiner knows every file node at version 0)."""
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
            if fixed is not None and entry.state != "alive" and not sponsor:  # a claim that a file node is down
                relayed_leave = entry.state == "left" and sender != entry.name
                if relayed_leave and (known is None or known.state != "suspected"):
                    continue  # this node still reaches it: its own announcement reached those it could
                beyond = known is not None and entry.version > known.version + FILE_LEAVE_JUMP
                # a node found down itself takes the cluster's word that it left, however far its former
                # incarnation's versions went (a restarted member knows it at version 0)
                if beyond and not (relayed_leave and entry.version <= CLAIM_CEILING):
                    self.refused += 1
                    continue
            tomb = self._tombstones.get(entry.name) if known is None else None
            if tomb is not None and entry.version <= tomb[0]:
                continue  # gossip of a member this node forgot: not taken again
            if (
                known is None
                and fixed is None
                and (
                    self.joined() + len(self._tombstones) - (tomb is not None) >= self.capacity
                    or self.wire_bytes() + entry_bytes(entry) > TABLE_BUDGET_BYTES
                )
            ):
                self.refused += 1
                continue
            if (
                known is not None
                and entry_bytes(entry) > entry_bytes(known)
                and (self.wire_bytes() - entry_bytes(known) + entry_bytes(entry) > TABLE_BUDGET_BYTES)
            ):
                self.refused += 1  # a longer host for a known name, past the budget
                continue
            if known is not None and not newer(entry, known):
                continue
            if tomb is not None:  # taken: a new incarnation of a forgotten member (a refused one keeps it)
                del self._tombstones[entry.name]
            if known is None or known.version != entry.version:
                self.incarnations += 1
            self._entries[entry.name] = entry
            self._bytes += entry_bytes(entry) - (entry_bytes(known) if known is not None else 0)
            if entry.state == "alive":
                self._down_since.pop(entry.name, None)
            elif known is None or known.state == "alive":
                self._down_since[entry.name] = now
            changed.append(entry)
        if changed:
            self._digest = None
        return changed

    def admit(self, name: str, host: str, port: int, now: float) -> Member:
        """A JOIN of ``name`` at ``host:port``: the entry it joins as (taken into the table), or JoinRefused.

        Refused: a name of the cluster file, and a name another member holds (alive or suspected at another
        address). A name that left, or that asks again from the same address (a restart), joins as the next
        incarnation, so its entry supersedes the old one everywhere."""
        if name in self._permanent:
            raise JoinRefused(f"{name!r} is a node of the cluster file; it starts from the file, it does not join")
        try:
            Member(name, host, port).spec()
        except ConfigError as err:
            raise JoinRefused(f"not a valid member: {err.reason}") from None
        known = self._entries.get(name)
        if known is not None and known.state != "left" and (known.host, known.port) != (host, port):
            raise JoinRefused(
                f"the name {name!r} is taken by the member at {known.host}:{known.port} ({known.state}); "
                "choose another name"
            )
        versions = [known.version if known is not None else -1, self._tombstones.get(name, (-1, 0.0))[0]]
        entry = Member(name, host, port, "alive", max(versions) + 1)
        if not self.merge([entry], now):
            raise JoinRefused(f"the member table is full ({self.capacity} joined members, the max_members setting)")
        return entry

    def suspect(self, name: str, now: float) -> Member | None:
        """This node could not reach ``name``: mark it suspected at its current version (None if unknown/left)."""
        known = self._entries.get(name)
        if known is None or known.state != "alive":
            return None
        return (self.merge([replace(known, state="suspected")], now) or [None])[0]

    def assert_self(self, me: NodeSpec, state: str, now: float) -> Member | None:
        """This node is ``me`` and is ``state`` (alive, or left when it goes): when its entry says otherwise --
        another state, or another address that is not alive (an old incarnation elsewhere) -- supersede it with the
        next version at its own address (a refutation, or the leave announcement). The new entry, or None. An
        entry alive at another address (another live process took the name) is left alone: two processes that
        each took it back would outbid each other for ever."""
        known = self._entries.get(me.name)
        if known is None or (known.state, known.host, known.port) == (state, me.host, me.port):
            return None
        if (known.host, known.port) != (me.host, me.port) and known.state == "alive":
            return None
        own = replace(known, host=me.host, port=me.port, state=state, version=known.version + 1)
        return (self.merge([own], now, sender=me.name) or [None])[0]

    def expire(self, now: float) -> list[str]:
        """Forget joined members down (suspected or left) for ``forget_after_s``; returns their names. Their
        tombstones are dropped ``forget_after_s`` later."""
        for name in [n for n, (_, t) in self._tombstones.items() if now - t >= self.forget_after_s]:
            del self._tombstones[name]
        gone = [
            name
            for name, since in self._down_since.items()
            if name not in self._permanent and now - since >= self.forget_after_s
        ]
        for name in gone:
            gone_entry = self._entries.pop(name)
            self._bytes -= entry_bytes(gone_entry)
            self._tombstones[name] = (gone_entry.version, now)
            del self._down_since[name]
        if gone:
            self._digest = None
        return gone
