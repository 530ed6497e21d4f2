"""Following the member table (dpwa/node/following.py) with a real :class:`Membership` and recording fakes for
the rest of the node: what the node keeps of a member is dropped once the table forgets it."""

from __future__ import annotations

import threading
from typing import Any

from dpwa.config import NodeSpec
from dpwa.node.following import sync_members
from dpwa.node.members import Member
from dpwa.node.membership import Membership
from dpwa.node.wire import MemberNews
from dpwa.node.wire.messages import Fetch

FILE = [NodeSpec("w1", "127.0.0.1", 4001), NodeSpec("w2", "127.0.0.1", 4002)]
FORGET_AFTER_S = 10.0


class Recorder:
    """Any of the node's parts: every method called is recorded as (part, method, args)."""

    def __init__(self, part: str, calls: list[tuple[Any, ...]]) -> None:
        self._part, self._calls = part, calls

    def __getattr__(self, method: str) -> Any:
        return lambda *args, **kwargs: self._calls.append((self._part, method, *args))


class FakeFlow:
    def __init__(self) -> None:
        self.names: set[str] = set()

    def scores(self) -> dict[str, float]:
        return dict.fromkeys(self.names, 1.0)

    def add(self, name: str) -> None:
        self.names.add(name)

    def remove(self, name: str) -> None:
        self.names.discard(name)


class Follower:
    """The node as :func:`sync_members` sees it; ``clock``: the member table's time."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.clock = 0.0
        self.name, self.synced, self.security, self.state = "w1", False, None, None
        self.sync_lock, self.flow_lock, self.state_lock = threading.Lock(), threading.Lock(), threading.Lock()
        self.endpoints: dict[str, str] = {}
        self.departed: set[str] = set()
        self.names: list[str] = []
        self.flow = FakeFlow()
        self.transport, self.transfer = Recorder("transport", self.calls), Recorder("transfer", self.calls)
        self.stats, self.once, self.rule = (Recorder(p, self.calls) for p in ("stats", "once", "rule"))
        self.membership = Membership(FILE[0], FILE, 8, FORGET_AFTER_S, lambda: sync_members(self), now=self.now)
        self.synced = True
        sync_members(self)

    def now(self) -> float:
        return self.clock


def relayed(sender: str, *entries: Member) -> Fetch:
    """A request from ``sender`` carrying ``entries`` of its table (gossip, not the member's own word)."""
    return Fetch(node=sender, req=1, fingerprint="", news=MemberNews("x", tuple(entries)))


def test_a_member_whose_leave_came_by_gossip_is_cleaned_up_when_the_table_forgets_it() -> None:
    """Joined member j leaves and this node hears it from w2's table, not from j's announcement: j is dropped
    from the peers at once (the TX thread forgets its address), and when the table forgets j, forget_member runs
    (the transfer abandons an open push to j, the per-peer counters go). Before, forget_member ran only for a
    member forgotten while still a peer, so j's open push (a leased snapshot, push-sum mass) stayed forever."""
    node = Follower()
    node.membership.admit("j", "127.0.0.1", 5000)
    assert node.endpoints.get("j") == "tcp://127.0.0.1:5000"
    node.membership.observe(relayed("w2", Member("j", "127.0.0.1", 5000, "left", 2)))
    assert "j" not in node.endpoints and ("transport", "set_peer", "j", None) in node.calls
    assert ("transfer", "forget", "j") not in node.calls  # left, not forgotten: a settlement may still come
    node.clock += FORGET_AFTER_S + 1
    assert node.membership.expire() == ["j"]
    assert ("transfer", "forget", "j") in node.calls and ("stats", "forget_peer", "j") in node.calls
    assert not node.departed


def test_a_member_that_rejoins_before_it_is_forgotten_is_a_peer_again_and_not_forgotten() -> None:
    """...and what was open with its former incarnation is dropped (member_back: push-sum abandons the push whose
    leave verdict never came; before, that push stayed open and no push ever went to j again)."""
    node = Follower()
    node.membership.admit("j", "127.0.0.1", 5000)
    node.membership.observe(relayed("w2", Member("j", "127.0.0.1", 5000, "left", 2)))
    assert ("transfer", "member_back", "j") not in node.calls
    node.membership.observe(relayed("w2", Member("j", "127.0.0.1", 5001, "alive", 3)))  # back, elsewhere
    assert node.endpoints.get("j") == "tcp://127.0.0.1:5001" and not node.departed
    assert node.calls.count(("transfer", "member_back", "j")) == 1
    node.clock += FORGET_AFTER_S + 1
    assert node.membership.expire() == []
    assert ("transfer", "forget", "j") not in node.calls
