"""Peer schedules (dpwa/rules/schedules.py): whom each node fetches at each step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from dpwa.rules import NodeState
from dpwa.rules.dpsgd import DpsgdSettings
from dpwa.rules.group import GroupSettings
from dpwa.rules.pushsum import PushSumSettings
from dpwa.rules.schedules import (
    SCHEDULES,
    ExponentialSchedule,
    GroupsSchedule,
    LeaderSchedule,
    NeighboursSchedule,
    RandomSchedule,
    RingSchedule,
    Round,
    make_schedule,
)


def names(n: int) -> tuple[str, ...]:
    return tuple(f"w{i}" for i in range(n))


def targets(schedule, n: int, rank: int, index: int, **extras) -> list[str] | None:
    ns = names(n)
    return schedule.targets(Round(ns[rank], ns, index, NodeState(ns[rank], extras=dict(extras))))


def ranks(schedule, n: int, rank: int, index: int) -> list[int]:
    return [int(name[1:]) for name in targets(schedule, n, rank, index)]


# ------------------------------------------------------------------ exponential, ring, random, leader


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9, 16])
def test_exponential_targets(n):
    hops = max(1, math.ceil(math.log2(n)))
    for rank in range(n):
        for k in range(3 * hops):
            assert ranks(ExponentialSchedule(), n, rank, k) == [(rank + 2 ** (k % hops)) % n]


def test_exponential_examples_and_single_node():
    assert [ranks(ExponentialSchedule(), 8, 0, k)[0] for k in range(7)] == [1, 2, 4, 1, 2, 4, 1]
    assert [ranks(ExponentialSchedule(), 5, 3, k)[0] for k in range(4)] == [4, 0, 2, 4]  # hops = ceil(log2 5) = 3
    assert targets(ExponentialSchedule(), 1, 0, 0) == []


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_exponential_each_node_is_fetched_once_per_round(m):
    """On N = 2^m nodes every step is a permutation: each node is served exactly once (push-sum's exact average)."""
    n = 2**m
    for k in range(m):
        fetched = sorted(ranks(ExponentialSchedule(), n, rank, k)[0] for rank in range(n))
        assert fetched == list(range(n))


def test_ring_random_leader():
    assert [ranks(RingSchedule(), 4, r, 7)[0] for r in range(4)] == [1, 2, 3, 0]
    assert targets(RingSchedule(), 1, 0, 0) == []
    assert targets(RandomSchedule(), 4, 0, 0) is None
    assert targets(LeaderSchedule(), 4, 0, 0, pull="w2") == ["w2"]
    for bad in ("w0", "nobody", 3, None):  # myself, unknown, not a name, absent
        assert targets(LeaderSchedule(), 4, 0, 0, pull=bad) is None


def test_default_max_fanout():
    for cls in (RandomSchedule, ExponentialSchedule, RingSchedule, LeaderSchedule):
        assert cls().max_fanout(8) == 1 and cls().max_fanout(1) == 0 and cls().max_fanout(0) == 0


# ------------------------------------------------------------------ groups


def test_groups_partitions_hand_checked():
    g = GroupsSchedule(3, 0)
    # N = 9: even steps {0,1,2},{3,4,5},{6,7,8}; odd steps rank mod 3
    assert g.group(4, 9, 0) == [3, 4, 5] and g.group(4, 9, 1) == [1, 4, 7]
    assert ranks(g, 9, 4, 2) == [3, 5] and ranks(g, 9, 4, 3) == [1, 7]
    # N = 7, S = 3: even {0,1,2},{3,4,5},{6}; odd: 3 groups by rank mod 3
    assert g.group(6, 7, 0) == [6] and ranks(g, 7, 6, 0) == []
    assert g.group(6, 7, 1) == [0, 3, 6]


@pytest.mark.parametrize("n", [1, 2, 5, 7, 9, 10, 16, 17])
@pytest.mark.parametrize("s", [2, 3, 4])
def test_groups_are_symmetric_partitions(n, s):
    """Every step splits the nodes into disjoint groups: j is in i's group iff i is in j's."""
    g = GroupsSchedule(s, 5)
    for index in range(10):
        groups = {tuple(g.group(r, n, index)) for r in range(n)}
        members = sorted(r for grp in groups for r in grp)
        assert members == list(range(n))
        for r in range(n):
            assert r in g.group(r, n, index)
            assert r not in ranks(g, n, r, index)


@pytest.mark.parametrize("s", [2, 3, 4, 8])
def test_groups_two_rotations_connect_everyone_when_n_is_s_squared(s):
    n = s * s
    g = GroupsSchedule(s, 0)
    for start in (0, 1, 6):  # any two consecutive steps, starting even or odd
        for i in range(n):
            first = g.group(i, n, start)
            assert len(first) == s
            reached = {j for m in first for j in g.group(m, n, start + 1)}
            assert reached == set(range(n))
            # the two partitions are orthogonal: each pair of groups meets in exactly one node
            for m in first:
                assert len(set(first) & set(g.group(m, n, start + 1))) == 1


def test_groups_one_step_reaches_only_the_group():
    n, s = 16, 4
    g = GroupsSchedule(s, 0)
    assert all(len(g.group(i, n, k)) == s for i in range(n) for k in range(4))  # S of N, not everyone


def test_groups_sync_step_is_everybody():
    g = GroupsSchedule(3, 4)
    assert [g.is_sync_step(i) for i in range(9)] == [False, False, False, True] * 2 + [False]
    assert ranks(g, 9, 2, 3) == [0, 1, 3, 4, 5, 6, 7, 8]
    assert ranks(g, 9, 2, 7) == [0, 1, 3, 4, 5, 6, 7, 8]
    assert len(ranks(g, 9, 2, 4)) == 2
    assert not any(GroupsSchedule(3, 0).is_sync_step(i) for i in range(50))
    assert all(GroupsSchedule(3, 1).is_sync_step(i) for i in range(50))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 9, 10, 11, 16, 17, 30])
@pytest.mark.parametrize("s", [2, 3, 4, 5])
@pytest.mark.parametrize("sync_every", [0, 3])
def test_groups_max_fanout_bounds_every_step(n, s, sync_every):
    g = GroupsSchedule(s, sync_every)
    bound = g.max_fanout(n)
    most = max((len(ranks(g, n, r, k)) for r in range(n) for k in range(8)), default=0)
    assert most <= bound
    if sync_every:
        assert bound == max(0, n - 1)
    if n == s * s:
        assert bound == (n - 1 if sync_every else s - 1)


def test_groups_validation():
    with pytest.raises(ValueError, match="group_size"):
        GroupsSchedule(1)
    with pytest.raises(ValueError, match="sync_every"):
        GroupsSchedule(3, -1)


# ------------------------------------------------------------------ make_schedule


def test_make_schedule():
    assert set(SCHEDULES) == {"random", "exponential", "ring", "leader", "groups", "neighbours"}
    for name, cls in SCHEDULES.items():
        assert cls.name == name
    assert isinstance(make_schedule("exponential"), ExponentialSchedule)
    assert isinstance(make_schedule("ring", PushSumSettings()), RingSchedule)
    g = make_schedule("groups", GroupSettings(group_size=3, sync_every=7))
    assert isinstance(g, GroupsSchedule) and (g.group_size, g.sync_every) == (3, 7)
    nb = make_schedule("neighbours", DpsgdSettings(graph="exponential"))
    assert isinstance(nb, NeighboursSchedule) and nb.graph == "exponential"
    assert make_schedule("neighbours").graph == "ring"


def test_make_schedule_errors():
    with pytest.raises(ValueError, match="unknown peer schedule 'star'; allowed: random, exponential"):
        make_schedule("star")
    with pytest.raises(ValueError, match="needs group_size"):
        make_schedule("groups")
    with pytest.raises(ValueError, match="needs group_size"):
        make_schedule("groups", PushSumSettings())
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        make_schedule("groups", SimpleNamespace(group_size=1, sync_every=0))
