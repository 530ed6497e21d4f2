"""LSGD in gossip form: dpwa/rules/leader.py with dpwa.rules.schedules.LeaderSchedule."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest

from dpwa.rules import RULES, make_rule
from dpwa.rules.base import NodeState, PeerSnapshot
from dpwa.rules.leader import TABLE_BUDGET, UNKNOWN_LOSS, LeaderRule, LeaderSettings, parse_entry
from dpwa.rules.schedules import LeaderSchedule
from dpwa.tools.simulation import Simulation


def cluster(n: int, seed: int = 0, **kwargs) -> Simulation:
    """n leader nodes w1..wn; node i holds [8i, -4i, 2] (exact binary fractions)."""
    arrays = [[np.array([8.0 * i, -4.0 * i, 2.0])] for i in range(n)]
    return Simulation(arrays, functools.partial(LeaderRule, **kwargs), LeaderSchedule, seed=seed)


def leaders(sim: Simulation) -> dict[str, str | None]:
    return {name: node.rule.leader() for name, node in sim.nodes.items()}


def snap(name: str, table, arrays=None, clock: float = 0.0) -> PeerSnapshot:
    extras = {"leaders": table} if table is not None else {}
    return PeerSnapshot(NodeState(name, clock, 1.0, extras), arrays if arrays is not None else [np.zeros(2)])


def node(me: str = "b", names=("a", "b", "c", "d"), **kwargs) -> tuple[LeaderRule, NodeState]:
    rule = LeaderRule(**kwargs)
    return rule, NodeState(me, extras=rule.initial_extras(me, list(names)))


# ------------------------------------------------------------ the rule, by hand


def test_hand_computed_pull_and_when_it_applies():
    rule, own = node(strength=0.25, window=2)
    assert own.extras == {"leaders": {}, "pull": None}
    x = [np.array([8.0, -4.0])]
    own.loss = 3.0
    # a random fetch of c brings c's table: a leads with mean loss 0.5 -> pull a next; nothing moves yet
    out = rule.mix(own, x, [snap("c", {"a": [0.5, 7], "c": [2.0, 9]})])
    assert (out.factor, out.peers) == (0.0, ())
    assert own.extras["pull"] == "a" and rule.leader() == "a"
    assert own.extras["leaders"] == {"a": [0.5, 7.0], "c": [2.0, 9.0], "b": [3.0, 1.0]}
    np.testing.assert_array_equal(x[0], [8.0, -4.0])
    # a answers: x <- x - 0.25*(x - x_a) = [8, -4] - 0.25*([8, -4] - [0, 4]) = [6, -2]
    own.clock, own.loss = 4.0, 1.0
    out = rule.mix(own, x, [snap("a", {"a": [0.5, 8]}, [np.array([0.0, 4.0])], clock=8.0)])
    assert (out.factor, out.peers) == (0.25, ("a",))
    np.testing.assert_array_equal(x[0], [6.0, -2.0])
    assert own.clock == 0.75 * 4.0 + 0.25 * 8.0
    assert rule.mean_loss() == 2.0  # window 2: (3 + 1) / 2
    # a reply from someone else than the node I meant to pull: table merge only
    out = rule.mix(own, x, [snap("c", {"c": [2.0, 10]}, [np.array([100.0, 100.0])])])
    assert out.factor == 0.0 and rule.table()["c"] == (2.0, 10.0)
    np.testing.assert_array_equal(x[0], [6.0, -2.0])


def test_missed_pull_gives_one_random_step():
    rule, own = node()
    own.loss = 3.0
    rule.mix(own, [np.zeros(2)], [snap("c", {"a": [0.5, 7]})])
    assert own.extras["pull"] == "a"
    rule.mix(own, [np.zeros(2)], [])  # a's reply never came (timeout, or flow control skipped a down peer)
    assert own.extras["pull"] is None  # a random peer next, so the table keeps flowing
    rule.mix(own, [np.zeros(2)], [])
    assert own.extras["pull"] == "a"


def test_no_move_when_the_target_was_dethroned_by_its_own_reply():
    rule, own = node(strength=0.5)
    own.loss = 3.0
    x = [np.array([1.0, 1.0])]
    rule.mix(own, x, [snap("c", {"a": [0.5, 7]})])
    assert own.extras["pull"] == "a"
    # a's reply carries news: d is better -> f = 0, next pull d
    out = rule.mix(own, x, [snap("a", {"a": [0.5, 8], "d": [0.1, 3]}, [np.array([9.0, 9.0])])])
    assert out.factor == 0.0 and own.extras["pull"] == "d"
    np.testing.assert_array_equal(x[0], [1.0, 1.0])


def test_a_node_that_became_the_leader_ignores_its_planned_pull():
    rule, own = node(strength=0.5, window=1)
    own.loss = 3.0
    x = [np.array([1.0, 1.0])]
    rule.mix(own, x, [snap("c", {"a": [0.5, 7]})])
    assert own.extras["pull"] == "a"
    own.loss = 0.1  # b's mean 0.1 < a's 0.5: b leads now, and the leader never moves
    out = rule.mix(own, x, [snap("a", {"a": [0.5, 8]}, [np.array([9.0, 9.0])])])
    assert out.factor == 0.0 and rule.leader() == "b" and own.extras["pull"] is None
    assert out.metrics["leader_is_me"] == 1.0
    np.testing.assert_array_equal(x[0], [1.0, 1.0])


@pytest.mark.parametrize("loss, expect", [(5.0, 0.5), (1.0, 0.25), (0.0, 0.0)])
def test_divergence_damps_the_pull(loss, expect):
    rule, own = node(strength=0.5, divergence_threshold=2.0)
    own.loss = 3.0
    x = [np.array([4.0, 4.0])]
    rule.mix(own, x, [snap("c", {"a": [0.5, 7]})])
    own.loss = loss
    out = rule.mix(own, x, [snap("a", {"a": [0.5, 8]}, [np.array([0.0, 8.0])])])
    assert out.factor == expect
    np.testing.assert_array_equal(x[0], [4.0 - 4.0 * expect, 4.0 + 4.0 * expect])


def test_mean_loss_window_and_non_finite_losses():
    rule, own = node(window=3)
    assert rule.mean_loss() == math.inf
    for v, mean in [(3.0, 3.0), (1.0, 2.0), (2.0, 2.0), (6.0, 3.0)]:
        own.loss = v
        rule.mix(own, [np.zeros(2)], [])
        assert rule.mean_loss() == mean
    own.loss = math.nan
    rule.mix(own, [np.zeros(2)], [])
    assert rule.mean_loss() == UNKNOWN_LOSS and rule.leader() is None
    assert own.extras["leaders"]["b"] == [UNKNOWN_LOSS, 5.0]
    json.dumps(own.extras, allow_nan=False)  # what the wire does: never NaN/inf
    for _ in range(3):
        own.loss = 1e308  # huge but finite: the mean does not overflow
        rule.mix(own, [np.zeros(2)], [])
    assert rule.mean_loss() == pytest.approx(1e308)


def test_published_table_fits_the_budget_and_keeps_the_leaders():
    names = [f"node-{i:04d}.a-rather-long-host-name.example.org" for i in range(2000)]
    me = names[1500]
    rule = LeaderRule(group_size=4)
    own = NodeState(me, extras=rule.initial_extras(me, names))
    table = {n: [1.0 + i / 10000, 3] for i, n in enumerate(names)}
    table[names[1777]] = [0.01, 3]  # the global leader, far from me
    table[names[1501]] = [5.0, 3]  # my group (1500..1503) is worse than most
    own.loss = 9.0
    rule.mix(own, [np.zeros(2)], [snap(names[3], table)])
    published = own.extras["leaders"]
    assert len(rule.table()) == 2000 and len(published) < 2000  # all known, not all published
    assert len(json.dumps(published, separators=(",", ":"), allow_nan=False)) <= TABLE_BUDGET  # as the wire
    assert {me, *names[1500:1504], names[1777], names[0], names[1]} <= set(published)
    kept = sorted(set(published) - set(names[1500:1504]) - {names[1777]})
    assert kept == names[: len(kept)]  # then the best by mean loss


# ------------------------------------------------------------ hostile tables


GARBAGE = {
    "zz": [0.0, 99],  # not a node of the cluster
    "c": [float("nan"), 5],
    "d": [0.0, float("inf")],
    "a": ["0.1", 5],
}
MORE_GARBAGE = [
    {"a": [True, 5]},
    {"a": [0.1]},
    {"a": [0.1, 2, 3]},
    {"a": {"loss": 0.1}},
    {"a": None},
    {7: [0.1, 2]},
    {("a",): [0.1, 2]},
]


def test_parse_entry():
    assert parse_entry([0.5, 3]) == (0.5, 3.0) and parse_entry((1, 2.5)) == (1.0, 2.5)
    for bad in ([True, 1], [1, False], [1], [1, 2, 3], "12", None, {"a": 1}, [math.nan, 1], [1, -math.inf]):
        assert parse_entry(bad) is None


def test_hostile_entries_are_ignored():
    rule, own = node()
    own.loss = 3.0
    bad = 0
    for table in [GARBAGE, *MORE_GARBAGE, ["a", 0.1], "leaders", 42]:
        bad += rule.mix(own, [np.zeros(2)], [snap("c", table)]).metrics["leader_bad_entries"]
    assert set(rule.table()) == {"b"} and own.extras["pull"] is None
    assert bad == len(GARBAGE) + len(MORE_GARBAGE) + 3
    # a lie about myself is ignored too: I am the authority on my own entry (stamp = my mixes so far)
    rule.mix(own, [np.zeros(2)], [snap("c", {"b": [-5.0, 1e9], "a": [0.5, 1]})])
    assert rule.table() == {"b": (3.0, 12.0), "a": (0.5, 1.0)}
    json.dumps(own.extras, allow_nan=False)


class _Hostile(LeaderRule):
    """Publishes garbage claiming a fantastic loss for a non-existent node, and malformed entries."""

    def mix(self, own, arrays, peers):
        out = super().mix(own, arrays, peers)
        own.extras = {"leaders": {"ghost": [-1e9, 1e9], "w1": [float("nan"), 1e9], "w2": "best"}, "pull": None}
        return out


def test_cluster_with_a_hostile_node_still_agrees_on_the_leader():
    made = iter(range(100))
    rule = lambda: _Hostile() if next(made) == 3 else LeaderRule()  # noqa: E731 - node w4 is hostile
    sim = Simulation([[np.full(2, float(i))] for i in range(8)], rule, LeaderSchedule, seed=5)
    losses = {n: (0.2 if n == "w6" else 1.0 + i) for i, n in enumerate(sim.names)}
    for _ in range(40):
        sim.run_round(losses)
    honest = [n for n in sim.names if n != "w4"]
    assert all(sim[n].rule.leader() == "w6" for n in honest)
    assert all("ghost" not in sim[n].rule.table() for n in sim.names)


# ------------------------------------------------------------ staleness


def test_stale_entry_ages_out_and_does_not_come_back():
    rule, own = node()
    rule.stale_after = 5
    own.loss = 3.0
    rule.mix(own, [np.zeros(2)], [snap("c", {"a": [0.5, 7]})])  # step 1: a learned, stamp 7
    for _ in range(2, 7):  # steps 2..6: 5 steps without news about a
        rule.mix(own, [np.zeros(2)], [snap("c", {"a": [0.5, 7]})])  # the same old stamp is no news
        assert rule.leader() == "a"
    rule.mix(own, [np.zeros(2)], [])  # step 7: 6 steps since a's stamp last advanced > 5
    assert "a" not in rule.table() and rule.leader() == "b" and own.extras["pull"] is None
    for _ in range(5):  # copies of the old entry still circulate: refused (tombstone)
        rule.mix(own, [np.zeros(2)], [snap("c", {"a": [0.5, 7]})])
        assert "a" not in rule.table()
    rule.mix(own, [np.zeros(2)], [snap("c", {"a": [0.5, 8]})])  # anything newer is news: a is back
    assert rule.leader() == "a"


def test_live_leader_stays_fresh():
    rule, own = node()
    rule.stale_after = 3
    own.loss = 3.0
    for stamp in range(1, 30):  # a's stamp advances every other step: never stale
        rule.mix(own, [np.zeros(2)], [snap("c", {"a": [0.5, stamp // 2]})])
        assert rule.leader() == "a"


def _with_horizon(rule: LeaderRule, h: int) -> LeaderRule:
    rule.stale_after = h
    return rule


def test_dead_leader_ages_out_of_the_cluster_and_the_next_best_takes_over():
    make = lambda: _with_horizon(LeaderRule(strength=0.5, window=1), 12)  # noqa: E731
    sim = Simulation([[np.full(2, float(i))] for i in range(8)], make, LeaderSchedule, seed=2)
    losses = {n: (0.1 if n == "w1" else 0.2 if n == "w2" else 1.0 + i) for i, n in enumerate(sim.names)}
    for _ in range(30):
        sim.run_round(losses)
    assert set(leaders(sim).values()) == {"w1"}
    for r in range(60):  # w1 dies: nobody hears from it again
        sim.run_round(losses, skip=["w1"])
        if r < 10:  # not stale yet (horizon 12 own steps since w1's stamp last advanced)
            assert all(sim[n].rule.leader() == "w1" for n in sim.names[1:])
    alive = sim.names[1:]
    assert all("w1" not in sim[n].rule.table() for n in alive)  # aged out everywhere, no zombie copies
    assert all(sim[n].rule.leader() == "w2" for n in alive)
    w2 = sim["w2"].arrays[0].copy()
    outs = sim.run_round(losses, skip=["w1"])
    np.testing.assert_array_equal(sim["w2"].arrays[0], w2)  # the new leader does not move
    assert any(outs[n].peers == ("w2",) and outs[n].factor == 0.5 for n in alive[1:])


# ------------------------------------------------------------ a cluster


def test_leader_never_moves_followers_move_by_exactly_strength():
    sim = cluster(6, seed=1, strength=0.25, window=1)
    losses = {n: (0.1 if n == "w1" else 1.0 + i) for i, n in enumerate(sim.names)}
    w1 = sim["w1"].arrays[0].copy()
    moves = dict.fromkeys(sim.names, 0)
    first_w2 = None
    for _ in range(30):
        before = {n: sim[n].arrays[0].copy() for n in sim.names}
        outs = sim.run_round(losses)
        np.testing.assert_array_equal(sim["w1"].arrays[0], w1)
        assert outs["w1"].factor == 0.0
        for n in sim.names[1:]:
            x, out = before[n], outs[n]
            if out.factor:
                assert (out.factor, out.peers) == (0.25, ("w1",))
                np.testing.assert_array_equal(sim[n].arrays[0], x - 0.25 * (x - w1))
                moves[n] += 1
                if n == "w2" and first_w2 is None:
                    first_w2 = sim[n].arrays[0].copy()
            else:
                np.testing.assert_array_equal(sim[n].arrays[0], x)
    np.testing.assert_array_equal(first_w2, [6.0, -3.0, 2.0])  # [8, -4, 2] - 0.25*([8, -4, 2] - [0, 0, 2])
    assert all(moves[n] >= 20 for n in sim.names[1:]) and moves["w1"] == 0


@pytest.mark.parametrize("seed", range(20))
def test_leader_identity_spreads_in_log_n_rounds(seed):
    """One node knows it is best (finite loss); the other 15 know nothing (no finite loss yet).

    Whoever knows no leader pulls a random peer, so this is pull gossip, which informs everybody in
    log2 N + O(log log N) rounds (the informed set doubles until half are informed, then the
    uninformed fraction squares per round; Karp et al. 2000).  For N = 16: mean 6.1 rounds, P(> 12)
    about 1e-3 (3000 seeds).  Bound: 3*log2 N = 12.
    """
    n = 16
    sim = cluster(n, seed=seed)
    losses = {name: (0.1 if name == "w5" else math.inf) for name in sim.names}
    sim.run_round(losses)  # w5 now knows itself; tables were empty when published, so nobody else knows
    assert leaders(sim) == {name: ("w5" if name == "w5" else None) for name in sim.names}
    rounds = 0
    while set(leaders(sim).values()) != {"w5"}:
        sim.run_round(losses)
        rounds += 1
        assert rounds <= 3 * math.log2(n)


def test_a_better_node_takes_over():
    """Every other step is a random pull (every=2), which spreads the news; followers then move toward it."""
    for seed in range(3):
        sim = cluster(16, seed=seed, every=2, window=1)
        losses = {n: (0.5 if n == "w1" else 1.0 + i) for i, n in enumerate(sim.names)}
        for _ in range(60):
            sim.run_round(losses)
        assert set(leaders(sim).values()) == {"w1"}
        losses["w9"] = 0.1
        for _ in range(40):
            sim.run_round(losses)
        assert set(leaders(sim).values()) == {"w9"}
        outs = [sim.run_round(losses) for _ in range(2)]
        assert all(("w9",) in (o[n].peers for o in outs) for n in sim.names if n != "w9")


def test_groups_local_and_global_pulls_at_their_periods_and_strengths():
    """8 nodes, groups {w1..w4} {w5..w8}; w1 best overall, w6 best of group 2; global every 3, local every step."""
    strength, local = 0.5, 0.25
    sim = cluster(8, seed=4, strength=strength, every=3, group_size=4, local_strength=local, window=1)
    losses = {n: (0.1 if n == "w1" else 0.2 if n == "w6" else 1.0 + i) for i, n in enumerate(sim.names)}
    for _ in range(30):
        sim.run_round(losses)
    group_leader = {n: ("w1" if i < 4 else "w6") for i, n in enumerate(sim.names)}
    seen = set()
    for _ in range(12):
        before = {n: sim[n].arrays[0].copy() for n in sim.names}
        plans = {n: sim[n].state.extras["pull"] for n in sim.names}
        steps = {n: sim[n].step for n in sim.names}
        outs = sim.run_round(losses)
        for n in sim.names:
            k = steps[n]
            if n == "w1":
                want = (None, 0.0)
            elif (k + 1) % 3 == 0:
                want = ("w1", strength)  # global step: global leader (precedence over the local pull)
            elif group_leader[n] != n:
                want = (group_leader[n], local)
            else:
                want = (None, 0.0)  # w6 on a local step: it is its group's leader
            assert (plans[n], outs[n].factor) == want, (n, k)
            target, f = want
            if target is not None:
                x, t = before[n], before[target]
                np.testing.assert_allclose(sim[n].arrays[0], x - f * (x - t), rtol=1e-15)
                seen.add((n in ("w6",), target, f))
    assert (True, "w1", strength) in seen and (False, "w6", local) in seen and (False, "w1", local) in seen


# ------------------------------------------------------------ plumbing


def test_registered_and_built_from_settings():
    assert RULES["leader"] is LeaderRule and LeaderRule.name == "leader"
    rule = make_rule("leader", LeaderSettings(), 0.5)
    assert isinstance(rule, LeaderRule)
    assert repr(rule) == (
        "LeaderRule(strength=0.1, window=10, every=1, group_size=0, local_strength=0.1, local_every=1, "
        "divergence_threshold=0.5)"
    )
    assert rule.stale_after == 100 and LeaderRule(every=20).stale_after == 200


@pytest.mark.parametrize(
    "kwargs",
    [{"strength": 0.0}, {"strength": 1.5}, {"local_strength": 0.0}, {"window": 0}, {"every": 0},
     {"group_size": -1}, {"local_every": 0}, {"window": 2.5}, {"every": True}],
)  # fmt: skip
def test_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        LeaderRule(**kwargs)


def test_errors():
    rule = LeaderRule()
    with pytest.raises(RuntimeError, match="initial_extras"):
        rule.mix(NodeState("a"), [np.zeros(2)], [])
    with pytest.raises(ValueError, match="not one of"):
        rule.initial_extras("z", ["a", "b"])
    rule, own = node()
    own.loss = 1.0
    with pytest.raises(ValueError):
        rule.mix(own, [np.zeros(2)], [snap("a", {"a": [0.1, 1]}, [np.zeros(3)])])
    assert rule.table() == {}  # nothing changed


def test_news_of_a_better_node_reaches_everyone_fast_when_all_pull_the_leader():
    """every=1: followers only ever fetch the leader, and requests carry tables (push-pull). The news of a better
    node spreads from the nodes it pulls (they learn from its request, then pull it) and reaches the old leader
    when the leader pulls one that knows; every follower then hears it from the leader's next reply. The number
    of rounds is random (whom the new best and the old leader happen to pull): over seeds 0-29 (exact, the
    simulator) 3-11 rounds, mean 4.1 -- a handful, where pull-only gossip needs about N. Asserted over the same
    30 seeds: mean at most 5, none as slow as N."""
    n = 16
    counts = []
    for seed in range(30):
        sim = cluster(n, seed=seed, window=1)
        losses = {name: (0.5 if name == "w1" else 1.0 + i) for i, name in enumerate(sim.names)}
        for _ in range(30):
            sim.run_round(losses)
        assert set(leaders(sim).values()) == {"w1"}
        losses["w9"] = 0.1
        rounds = 0
        while set(leaders(sim).values()) != {"w9"} and rounds < n:
            sim.run_round(losses)
            rounds += 1
        counts.append(rounds)
    assert max(counts) < n and float(np.mean(counts)) <= 5.0, counts


def test_a_request_table_is_merged_and_garbage_in_it_counted():
    rule = LeaderRule()
    own = NodeState("a", extras=rule.initial_extras("a", ["a", "b", "c"]))
    rule.on_request(own, {"leaders": {"c": [0.1, 3.0], "zz": [0.0, 1.0], "b": "junk"}})
    assert rule.table()["c"] == (0.1, 3.0) and "zz" not in rule.table()
    out = rule.mix(own, [np.zeros(2)], [])
    assert out.metrics["leader_bad_entries"] == 2.0
    assert rule.request_extras(own)["leaders"]["c"] == [0.1, 3.0]


def test_a_joined_member_is_a_leader_candidate_and_group_mates_follow_the_members():
    """on_members (a join): entries of the new member are taken, and groups are recomputed on the new order."""
    rule = LeaderRule(group_size=2)
    own = NodeState("a", extras=rule.initial_extras("a", ["a", "b", "c"]))
    rule.on_request(own, {"leaders": {"zz": [0.0, 1.0]}})
    assert "zz" not in rule.table()  # not a member yet: garbage
    rule.on_members("a", ["a", "b", "c", "zz"], 4.0)
    rule.on_request(own, {"leaders": {"zz": [0.0, 2.0]}})
    assert rule.table()["zz"] == (0.0, 2.0) and rule.leader() == "zz"
    rule.on_members("a", ["c", "a", "b", "zz"], 4.0)  # a is second now: its group is {c, a}
    rule.on_request(own, {"leaders": {"c": [0.0, 5.0], "b": [0.0, 5.0]}})
    assert rule.leader("group") == "c"


def test_the_published_table_follows_every_change_of_the_table_and_of_the_group():
    """The published table is built once per change: a merge (a request between two publishes), an entry aging out
    and a new group order all show in the next one; with no change it is the very same object."""
    rule = _with_horizon(LeaderRule(group_size=2), 2)
    own = NodeState("a", extras=rule.initial_extras("a", ["a", "b", "c", "d"]))
    rule.mix(own, [np.zeros(2)], [])
    first = rule.request_extras(own)["leaders"]
    assert rule.request_extras(own)["leaders"] is first and list(first) == ["a"]
    rule.on_request(own, {"leaders": {"d": [0.5, 1.0], "c": [0.2, 1.0]}})
    assert list(rule.request_extras(own)["leaders"]) == ["a", "c", "d"]  # by mean loss after my own entry
    rule.on_members("a", ["a", "d", "b", "c"], 4.0)  # d is in my group now: it comes right after me
    assert list(rule.request_extras(own)["leaders"]) == ["a", "d", "c"]
    for _ in range(4):  # c and d stop advancing: both age out
        rule.mix(own, [np.zeros(2)], [])
    assert list(rule.request_extras(own)["leaders"]) == ["a"]
