"""The member table (dpwa/node/members.py): merging converges, permanent members stay, memory stays bounded."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dpwa.config import NodeSpec
from dpwa.node.members import STATES, Member, MemberTable, newer

FILE = [NodeSpec("w1", "127.0.0.1", 4001), NodeSpec("w2", "127.0.0.1", 4002)]

members = st.builds(
    Member,
    name=st.sampled_from(["w1", "w2", "j1", "j2", "j3", "bad name", ""]),
    host=st.sampled_from(["127.0.0.1", "10.0.0.9", ""]),
    port=st.sampled_from([4001, 4002, 5000, 0, 70000]),
    state=st.sampled_from([*STATES, "zombie"]),
    version=st.one_of(st.integers(0, 5), st.just(-1), st.just(2**60)),
)


def table(capacity: int = 8) -> MemberTable:
    return MemberTable(FILE, capacity=capacity, forget_after_s=10.0)


def snapshot(t: MemberTable) -> list[Member]:
    return t.members()


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(members, max_size=30), seed=st.integers(0, 2**32 - 1))
def test_merging_in_any_order_and_twice_gives_the_same_table(entries: list[Member], seed: int) -> None:
    """Without a capacity limit the merge is order-independent and idempotent, so gossip converges."""
    a, b = table(capacity=100), table(capacity=100)
    a.merge(entries, now=0.0)
    shuffled = entries[:]
    random.Random(seed).shuffle(shuffled)
    b.merge(shuffled, now=0.0)
    b.merge(shuffled, now=0.0)
    assert snapshot(a) == snapshot(b)


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(members, max_size=60))
def test_a_flood_never_moves_or_removes_a_permanent_member_and_stays_bounded(entries: list[Member]) -> None:
    t = table(capacity=2)
    t.merge(entries, now=0.0)
    t.expire(now=1e9)
    for node in FILE:
        entry = t.get(node.name)
        assert entry is not None and (entry.host, entry.port) == (node.host, node.port)
    assert t.joined() <= 2 and len(t) <= 4
    assert all(m.state in STATES and 0 <= m.version <= 2**53 and m.name and " " not in m.name for m in t.members())


def test_a_suspicion_spreads_until_the_member_refutes_it_with_a_higher_version() -> None:
    t = table()
    j = Member("j1", "127.0.0.1", 5000, "alive", 3)
    assert t.merge([j], now=0.0) == [j]
    assert t.suspect("j1", now=1.0) == Member("j1", "127.0.0.1", 5000, "suspected", 3)
    assert t.merge([j], now=2.0) == []  # the old "alive" does not undo the suspicion
    refuted = Member("j1", "127.0.0.1", 5000, "alive", 4)
    assert t.merge([refuted], now=3.0) == [refuted] and t.get("j1") == refuted
    left = Member("j1", "127.0.0.1", 5000, "left", 4)
    assert t.merge([left], now=4.0) == [left] and [m.name for m in t.alive()] == ["w1", "w2"]
    assert newer(left, refuted) and not newer(refuted, left)


def test_joined_members_down_for_forget_after_s_are_forgotten_permanent_ones_never() -> None:
    t = table()
    t.merge([Member("j1", "127.0.0.1", 5000), Member("j2", "127.0.0.1", 5001)], now=0.0)
    t.suspect("j1", now=5.0)
    t.suspect("w1", now=5.0)
    t.merge([Member("j2", "127.0.0.1", 5001, "left", 0)], now=6.0)
    assert t.expire(now=14.9) == []
    assert t.expire(now=15.0) == ["j1"] and t.expire(now=16.0) == ["j2"]
    assert [m.name for m in t.members()] == ["w1", "w2"] and t.get("w1").state == "suspected"  # type: ignore[union-attr]


def test_over_capacity_new_names_are_refused_and_counted() -> None:
    t = table(capacity=1)
    t.merge([Member("j1", "127.0.0.1", 5000), Member("j2", "127.0.0.1", 5001)], now=0.0)
    assert [m.name for m in t.members()] == ["j1", "w1", "w2"] and t.refused == 1
    t.merge([Member("w1", "10.6.6.6", 4001, "alive", 9)], now=0.0)  # a forged address for a file member
    assert t.get("w1") == Member("w1", "127.0.0.1", 4001) and t.refused == 2


def test_two_claims_of_one_name_and_version_resolve_the_same_way_everywhere() -> None:
    x, y = Member("j1", "127.0.0.1", 5000), Member("j1", "10.0.0.9", 5000)
    a, b = table(), table()
    a.merge([x, y], now=0.0)
    b.merge([y, x], now=0.0)
    assert a.get("j1") == b.get("j1") == x  # ("127.0.0.1", 5000) > ("10.0.0.9", 5000)
