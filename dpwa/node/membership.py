"""One node's view of the cluster's members: the member table under a lock, what to tell each peer, what changed.

The table (:mod:`dpwa.node.members`) travels with the messages a node sends anyway: every FETCH, STATE
reply, PUSH and ERROR carries the sender's table digest, and the whole table when the sender believes the
receiver's digest differs (the digest that receiver last sent). Both ends of a fetch leave it with the union
of the two tables (push-pull anti-entropy), so a change reaches every node in O(log N) rounds, and nodes whose
tables agree send 16 hex digits and nothing more.

A node is the only one that raises its own entry's version: when it learns it is suspected (or listed as
left) while it is alive, it supersedes that entry (a refutation); when it closes cleanly it announces
``left``. ``events()`` lists every change (joined, suspected, left, forgotten, refuted) for the metrics file.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dpwa.config import NodeSpec
from dpwa.node.members import CLAIM_CEILING, JoinRefused, Member, MemberTable
from dpwa.node.wire import MemberNews, WithNews

log = logging.getLogger(__name__)


__all__ = ["MAX_CLASHES_LOGGED", "MAX_EVENTS", "MemberEvent", "Membership"]

MAX_CLASHES_LOGGED = 16
"""The most addresses at which another process holds this node's name that are logged (each once)."""
MAX_EVENTS = 4096
"""Membership events kept for the metrics file until read (the oldest go first)."""


@dataclass(frozen=True)
class MemberEvent:
    """A change of the table as this node saw it: ``what`` is started (this node, the table it starts with),
    joined, alive, suspected, refuted, left or forgotten."""

    time: float
    name: str
    what: str
    version: int
    members: int
    """Members not ``left`` after the change (this node included)."""

    def record(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "event": "member",
            "member": self.name,
            "state": self.what,
            "version": self.version,
            "members": self.members,
        }


class Membership:
    """The member table of node ``me``; ``permanent``: the cluster file's nodes. Thread-safe.

    ``on_change()`` is called (outside the lock) after every change that adds, moves, removes or marks
    ``left`` a member, so the node can update whom it fetches from.
    """

    def __init__(
        self,
        me: NodeSpec,
        permanent: Sequence[NodeSpec],
        capacity: int,
        forget_after_s: float,
        on_change: Callable[[], None],
        *,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me = me
        self._now = now
        self._lock = threading.Lock()
        self._table = MemberTable(permanent, capacity, forget_after_s)
        if self._table.get(me.name) is None:
            self._table.merge([Member(me.name, me.host, me.port)], now())
        self._on_change = on_change
        self._peer_digest: dict[str, str] = {}
        self._events: deque[MemberEvent] = deque(maxlen=MAX_EVENTS)
        self.leaving = False
        self._clashes: set[tuple[str, int]] = set()
        """Other addresses this node's name was seen alive at (each said once)."""
        self._event(me.name, "started", 0)  # the first record: the members a node starts with

    # ------------------------------------------------------------ reading

    def order(self) -> tuple[str, ...]:
        """File nodes (file order), then joined members not ``left`` by name: what schedules use. This node is
        always in it (a claim that it left, not refuted yet, does not take it out of its own schedule)."""
        with self._lock:
            order = self._table.order()
        return order if self.me.name in order else (*order, self.me.name)

    def peers(self) -> list[Member]:
        """Every member to exchange with (not ``left``, not this node)."""
        with self._lock:
            return [m for m in self._table.alive() if m.name != self.me.name]

    def get(self, name: str) -> Member | None:
        with self._lock:
            return self._table.get(name)

    def incarnations(self) -> int:
        with self._lock:
            return self._table.incarnations

    def snapshot(self) -> dict[str, Any]:
        """``members`` (name -> state, version, address), counts, the digest: for ``stats()``."""
        with self._lock:
            members = self._table.members()
            return {
                "members": {
                    m.name: {"state": m.state, "version": m.version, "host": m.host, "port": m.port} for m in members
                },
                "members_alive": sum(m.state != "left" for m in members),
                "members_digest": self._table.digest(),
                "members_refused": self._table.refused,
            }

    def events(self) -> list[MemberEvent]:
        """The changes since the last call, oldest first."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    # ------------------------------------------------------------ gossip

    def news_for(self, peer: str) -> MemberNews:
        """What to tell ``peer``: the digest, and the whole table unless ``peer``'s last digest equals ours."""
        with self._lock:
            digest = self._table.digest()
            full = self._peer_digest.get(peer) != digest
            return MemberNews(digest, self._table.members() if full else None)

    def reply_news(self, request: WithNews) -> MemberNews:
        """What to answer a message that carried ``request.digest``: the whole table when it differs."""
        with self._lock:
            digest = self._table.digest()
            return MemberNews(digest, self._table.members() if request.digest != digest else None)

    def full_news(self) -> MemberNews:
        with self._lock:
            return MemberNews(self._table.digest(), self._table.members())

    def observe(self, header: WithNews, authenticated: bool = False) -> None:
        """Take the member news of a message from ``header.node``: merge its table, remember its digest.
        ``authenticated``: the message is a leave announcement whose sender is who it says (with CURVE, its key's
        name), so a file node's own ``left`` is taken from it."""
        changed = False
        with self._lock:
            if header.members is not None:
                changed = self._merge(header.members, header.node if authenticated else None)
            if header.digest and self._table.get(header.node) is not None:
                self._peer_digest[header.node] = header.digest
        if changed:
            self._on_change()

    def _merge(self, entries: Sequence[Member], sender: str | None = None) -> bool:
        """Merge (caller holds the lock), refute what says this node is down; True when the peers changed."""
        now = self._now()
        changes = self._table.merge(entries, now, sender)
        state = "left" if self.leaving else "alive"
        before = self._table.get(self.me.name)
        own = self._table.assert_self(self.me, state, now)
        if before is not None and (before.host, before.port) != (self.me.host, self.me.port):
            self._name_clash(before, own)
        current = self._table.get(self.me.name)
        mine = [e for e in entries if e.name == self.me.name and e.state != state]
        claims = [e.version for e in mine if e.version <= CLAIM_CEILING]
        if own is None and current is not None and claims and max(claims) >= current.version:
            # a claim about this node the table did not take (a file node's relayed "left", or one far above what
            # a restarted node knows of itself): outbid it anyway, so whoever holds it learns better -- below
            # CLAIM_CEILING: outbidding a forged claim at the largest version would leave no version to refute with
            own = (self._table.merge([replace(current, state=state, version=max(claims) + 1)], now, self.me.name)
                   or [None])[0]  # fmt: skip
        if own is not None:
            changes.append(own)
        for m in changes:
            self._event(m.name, "refuted" if m is own and m.state == "alive" else m.state, m.version)
        return bool(changes)

    def _name_clash(self, entry: Member, own: Member | None) -> None:
        """The table holds this node's name at another address (caller holds the lock): say so, once per address."""
        if own is not None:
            log.warning(
                "node %s: its entry named %s:%d (%s, version %d), an old incarnation elsewhere; taken back at %s:%d",
                self.me.name, entry.host, entry.port, entry.state, entry.version, self.me.host, self.me.port,
            )  # fmt: skip
        elif (entry.host, entry.port) not in self._clashes and len(self._clashes) == MAX_CLASHES_LOGGED:
            self._clashes.add(("", 0))  # said once: the set stays bounded
            log.error("node %s: %d addresses claim this node's name; further ones are not logged", self.me.name,
                      MAX_CLASHES_LOGGED)  # fmt: skip
        elif (entry.host, entry.port) not in self._clashes and len(self._clashes) < MAX_CLASHES_LOGGED:
            self._clashes.add((entry.host, entry.port))  # bounded: each forged claim may name a new address
            log.error(
                "node %s: another live process holds this name at %s:%d (version %d); the members reach it, not this "
                "node at %s:%d: stop one of the two",
                self.me.name, entry.host, entry.port, entry.version, self.me.host, self.me.port,
            )  # fmt: skip

    def _event(self, name: str, what: str, version: int) -> None:
        """Record a change (caller holds the lock)."""
        alive = sum(m.state != "left" for m in self._table.members())
        self._events.append(MemberEvent(time.time(), name, what, version, alive))

    def suspect(self, name: str) -> None:
        """This node could not reach ``name`` (flow control marked it down)."""
        with self._lock:
            entry = self._table.suspect(name, self._now())
            if entry is not None:
                self._event(name, "suspected", entry.version)

    def expire(self) -> list[str]:
        """Forget joined members down for ``forget_after_s`` (probing them stops); their names."""
        with self._lock:
            gone = self._table.expire(self._now())
            for name in gone:
                self._peer_digest.pop(name, None)
                self._event(name, "forgotten", -1)
        if gone:
            self._on_change()
        return gone

    # ------------------------------------------------------------ joining and leaving

    def admit(self, name: str, host: str, port: int) -> Member:
        """Take a JOIN (RX thread); the entry it joins as, or JoinRefused."""
        with self._lock:
            entry = self._table.admit(name, host, port, self._now())
            self._event(name, "joined", entry.version)
        self._on_change()
        return entry

    def permanent(self) -> list[str]:
        """The cluster file's nodes in file order (a JOIN's answer lists them so: the joiner's schedules and
        AD-PSGD's roles see the order the file's nodes see)."""
        with self._lock:
            return list(self._table.permanent())

    def adopt(self, permanent: Sequence[NodeSpec], entries: Sequence[Member], mass: float | None = None) -> Member:
        """A JOIN was answered: the cluster's file nodes and its table replace this node's (``mass``: the
        sponsor's bound on the push-sum mass, kept if larger than this table's count); returns this node's
        entry (the version it joined as). JoinRefused when the answer does not list this node alive."""
        with self._lock:
            table = MemberTable(permanent, self._table.capacity, self._table.forget_after_s)
            table.merge(entries, self._now(), sponsor=True)
            if mass is not None:
                table.incarnations = max(table.incarnations, int(mass))
            own = table.get(self.me.name)
            if own is None or own.state != "alive" or (own.host, own.port) != (self.me.host, self.me.port):
                raise JoinRefused(f"the answer to the JOIN does not list {self.me.name} at its address: {own}")
            self._table = table
            self._peer_digest.clear()
            self._event(self.me.name, "joined", own.version)
        self._on_change()
        return own

    def leave(self) -> Member | None:
        """This node goes: its entry becomes ``left`` at the next version (announced with every later answer)."""
        with self._lock:
            self.leaving = True
            entry = self._table.assert_self(self.me, "left", self._now())
            if entry is not None:
                self._event(self.me.name, "left", entry.version)
        return entry
