"""Group averaging, WAGMA-style."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import traced

from dpwa.rules import RULES, NodeState, PeerSnapshot, make_rule
from dpwa.rules.group import GroupRule, GroupSettings, is_sync_step
from dpwa.rules.mixing import BLOCK
from dpwa.rules.schedules import GroupsSchedule
from dpwa.tools.simulation import Simulation

NAMES = ("a", "b", "c", "d")


def snap(arrays, name: str, clock: float = 1.0) -> PeerSnapshot:
    return PeerSnapshot(NodeState(name, clock, 0.0, {}), arrays)


def started(rule: GroupRule, name: str = "a", names=NAMES, clock: float = 1.0, loss: float = 1.0) -> NodeState:
    return NodeState(name, clock, loss, rule.initial_extras(name, names))


def frozen(arrays) -> list[np.ndarray]:
    out = [np.array(a, copy=True) for a in arrays]
    for a in out:
        a.flags.writeable = False
    return out


# ------------------------------------------------------------------ one node, hand-built snapshots


def test_registry_factory_and_validation():
    assert RULES["group"] is GroupRule and GroupRule.name == "group"
    rule = make_rule("group", GroupSettings(group_size=3, sync_every=5, max_staleness=2.0), 0.0)
    assert (rule.group_size, rule.sync_every, rule.max_staleness) == (3, 5, 2.0)
    assert repr(rule) == "GroupRule(group_size=3, sync_every=5, max_staleness=2.0, divergence_threshold=0.0)"
    for kwargs in ({"group_size": 1}, {"group_size": 2.5}, {"sync_every": -1}, {"max_staleness": -1.0}):
        with pytest.raises(ValueError):
            GroupRule(**kwargs)
    with pytest.raises(ValueError):
        GroupRule(max_staleness=math.nan)
    assert GroupRule(max_staleness=math.inf).max_staleness == math.inf


def test_all_fresh_equals_wagma_formula_exactly():
    """S = 4, every member fresh, no training since update_send: x <- (sum over G + x) / (S + 1)."""
    rule = GroupRule(group_size=4)
    own = started(rule)
    x = [np.array([1.0, 2.0, -3.0, 8.0]), np.array([[0.5, 7.0]])]
    group = [x] + [[np.array([v, 2 * v, 0.0, 1.0]), np.array([[v, -v]])] for v in (3.0, 5.0, 6.0)]
    expect = [(sum(m[i] for m in group) + x[i]) / 5 for i in range(2)]  # float64 reference
    rule.on_publish(own, frozen(x))
    out = rule.mix(own, x, [snap([np.array(a, copy=True) for a in m], n) for m, n in zip(group[1:], NAMES[1:])])
    for got, want in zip(x, expect):
        np.testing.assert_array_equal(got, want)  # small integers: every sum exact, one correctly rounded division
    assert out.factor == 3 / 5 and out.peers == ("b", "c", "d")
    assert out.metrics == {"stale_left_out": 0.0, "members": 3.0, "sync": 0.0}


def test_group_step_averages_the_published_models_and_keeps_the_whole_local_step():
    """The peers' snapshots and x_pub are the models before the step; the trainer's step since (x - x_pub) is kept
    whole: (sum_j x_j + 2 x_pub) / (k + 2) + (x - x_pub), clocks alike. Averaging the fresh x in instead kept
    1/(k+2) of the step (the group's mean moved by a fifth of its step at S = 4)."""
    rng = np.random.default_rng(0)
    rule = GroupRule(group_size=3)
    own = started(rule, "b", clock=10.0)
    x_pub = rng.standard_normal(50)
    rule.on_publish(own, frozen([x_pub]))
    step = rng.standard_normal(50)
    x = [x_pub + step]  # a local step between update_send and update_wait
    peers = [rng.standard_normal(50) for _ in range(2)]
    out = rule.mix(own, x, [snap([peers[0].copy()], "a", 9.0), snap([peers[1].copy()], "c", 7.0)])
    np.testing.assert_allclose(x[0], (peers[0] + peers[1] + 2 * x_pub) / 4 + step, rtol=1e-13, atol=1e-14)
    assert own.clock == (9.0 + 7.0 + 10.0 + 10.0) / 4
    assert out.factor == 0.5


def test_in_a_group_that_agrees_the_mean_moves_by_the_whole_mean_step():
    """Four nodes at the same x_pub, each stepping u_i: every node ends at x_pub + u_i (its own step whole), so the
    group's mean moves by mean(u) -- WAGMA's lock-step property, all-reduce SGD's; the old form moved it by
    mean(u)/5."""
    rules = {name: GroupRule(group_size=4) for name in NAMES}
    states = {name: started(rules[name], name) for name in NAMES}
    steps = {name: np.array([-1.0 - i]) for i, name in enumerate(NAMES)}
    models = {}
    for name in NAMES:
        rules[name].on_publish(states[name], frozen([np.zeros(1)]))
        models[name] = [np.zeros(1) + steps[name]]
    for name in NAMES:
        peers = [snap([np.zeros(1)], other) for other in NAMES if other != name]
        rules[name].mix(states[name], models[name], peers)
        np.testing.assert_array_equal(models[name][0], steps[name])
    assert np.mean([models[n][0] for n in NAMES]) == np.mean([steps[n] for n in NAMES])


def test_sync_step_is_the_plain_average_plus_the_local_step():
    rule = GroupRule(sync_every=2)
    own = started(rule, clock=4.0)
    for step in range(2):
        rule.on_publish(own, frozen([np.array([1.0, 1.0])]))  # x_pub counts once on a sync step
        assert rule.step == step and is_sync_step(step, 2) == (step == 1)
    x = [np.array([1.5, 0.25])]  # the local step since update_send: (0.5, -0.75)
    out = rule.mix(own, x, [snap([np.array([2.0, 5.0])], "b", 1.0), snap([np.array([3.0, 0.0])], "c", 1.0)])
    np.testing.assert_array_equal(x[0], [2.5, 1.25])  # (1+2+3)/3 + 0.5, (1+5+0)/3 - 0.75
    assert own.clock == 2.0 and out.factor == 2 / 3 and out.metrics["sync"] == 1.0


def test_stale_member_is_left_out_and_counted():
    rule = GroupRule(max_staleness=10.0)
    own = started(rule, clock=20.0)
    x = [np.array([4.0])]
    rule.on_publish(own, frozen(x))
    peers = [
        snap([np.array([0.0])], "b", 10.0),  # lags by exactly 10: fresh
        snap([np.array([100.0])], "c", 9.5),  # lags by 10.5: stale
        snap([np.array([100.0])], "d", math.nan),  # unknown age: stale
    ]
    out = rule.mix(own, x, peers)
    np.testing.assert_allclose(x[0], [8.0 / 3.0], rtol=1e-15)  # (0 + 4 + 4) / 3
    assert out.peers == ("b",) and out.metrics["stale_left_out"] == 2.0 and rule.stale_left_out == 2
    assert own.clock == pytest.approx(50.0 / 3.0, abs=1e-14)
    rule.on_publish(own, frozen(x))
    out = rule.mix(own, x, [snap([np.array([1.0])], "c", -5.0)])  # cumulative count
    assert out.metrics["stale_left_out"] == 3.0 and out.factor == 0.0


def test_a_peer_ahead_is_never_stale():
    rule = GroupRule(max_staleness=0.0)
    own = started(rule, clock=3.0)
    x = [np.array([0.0])]
    rule.on_publish(own, frozen(x))
    out = rule.mix(own, x, [snap([np.array([3.0])], "b", 300.0), snap([np.array([3.0])], "c", 3.0)])
    assert out.peers == ("b", "c") and x[0][0] == 1.5


def test_no_fresh_peer_changes_nothing():
    rule = GroupRule(max_staleness=1.0)
    own = started(rule, clock=5.0)
    rule.on_publish(own, frozen([np.zeros(3)]))
    x = [np.array([1.0, -0.0, np.inf])]
    before = x[0].copy()
    for peers in ([], [snap([np.ones(3)], "b", 1.0)]):
        out = rule.mix(own, x, peers)
        assert (out.factor, out.peers) == (0.0, ())
        np.testing.assert_array_equal(x[0], before)
        assert own.clock == 5.0


def test_divergence_scales_the_displacement():
    """loss < t: the move x_new - x is scaled by g = loss/t."""
    rng = np.random.default_rng(1)
    x0, pub, p1, p2 = (rng.standard_normal(20) for _ in range(4))
    full = (p1 + p2 + 2 * pub) / 4 + (x0 - pub)
    rule = GroupRule(divergence_threshold=2.0)
    own = started(rule, loss=0.5, clock=8.0)  # g = 0.25
    rule.on_publish(own, frozen([pub]))
    x = [x0.copy()]
    out = rule.mix(own, x, [snap([p1.copy()], "b", 4.0), snap([p2.copy()], "c", 4.0)])
    np.testing.assert_allclose(x[0], x0 + 0.25 * (full - x0), rtol=1e-13, atol=1e-14)
    assert out.factor == 0.25 * 2 / 4
    assert own.clock == pytest.approx(8.0 + 0.25 * ((4 + 4 + 8 + 8) / 4 - 8.0), abs=1e-14)
    own.loss = 0.0  # g = 0: keep x, bit-exact
    before = x[0].copy()
    assert rule.mix(own, x, [snap([p1.copy()], "b", 8.0)]).factor == 0.0
    np.testing.assert_array_equal(x[0], before)


def test_mix_before_any_publish_counts_x_twice():
    rule = GroupRule()
    own = started(rule)
    x = [np.array([2.0])]
    rule.mix(own, x, [snap([np.array([6.0])], "b")])
    assert x[0][0] == pytest.approx((6.0 + 2.0 + 2.0) / 3, rel=1e-15)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_mix_allocates_no_model_sized_temporaries(dtype):
    n = 2 * 1024 * 1024
    rng = np.random.default_rng(2)
    rule = GroupRule(group_size=4)
    own = started(rule)
    x = [rng.standard_normal(n).astype(dtype)]
    rule.on_publish(own, frozen(x))  # documented state: views of x_pub, no copy
    peers = [snap([rng.standard_normal(n).astype(dtype)], name) for name in NAMES[1:]]
    out, peak = traced(lambda: rule.mix(own, x, peers))
    assert out.factor == 0.6
    compute = 4 if dtype == np.float16 else np.dtype(dtype).itemsize
    assert peak < 3 * BLOCK * compute + 128 * 1024  # three block-sized scratch buffers and small objects
    assert peak < x[0].nbytes / 4


def test_is_sync_step_marks_every_sync_every_th_step():
    assert [i for i in range(12) if is_sync_step(i, 4)] == [3, 7, 11]
    assert not any(is_sync_step(i, 0) for i in range(12))  # 0 = never
    assert all(is_sync_step(i, 1) for i in range(12))
    assert [GroupsSchedule(2, 4).is_sync_step(i) for i in range(8)] == [is_sync_step(i, 4) for i in range(8)]


# ------------------------------------------------------------------ cluster (Simulation)


def group_cluster(arrays, s: int, sync_every: int = 0, **kwargs) -> Simulation:
    return Simulation(
        arrays,
        lambda: GroupRule(group_size=s, sync_every=sync_every, **kwargs),
        lambda: GroupsSchedule(s, sync_every),
    )


@pytest.mark.parametrize("s", [3, 4])
def test_two_rotations_mix_everyone_with_everyone(s):
    """N = S^2, node i starts with the unit vector e_i: after one step it depends on S initial
    vectors (its group), after two on all N of them."""
    n = s * s
    sim = group_cluster([[np.eye(n)[i]] for i in range(n)], s)
    sim.run_round()
    support = np.array(sim.flats()) > 0
    assert (support.sum(axis=1) == s).all()
    for i, row in enumerate(support):
        assert set(np.flatnonzero(row)) == {j for j in range(n) if j // s == i // s}
    sim.run_round()
    assert (np.array(sim.flats()) > 0).all()
    # every node's vector stays a convex combination, and the total is kept: x_pub's weight 2/(S+1) at home and
    # 1/(S+1) at each of the S-1 others sum to 1 (doubly stochastic within each group)
    np.testing.assert_allclose(np.array(sim.flats()).sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(np.array(sim.flats()).sum(axis=0), 1.0, rtol=1e-12)


def test_sync_step_makes_every_node_the_same_average():
    n, s, sync_every = 9, 3, 4
    rng = np.random.default_rng(3)
    sim = group_cluster([[rng.standard_normal(1000).astype(np.float32)] for _ in range(n)], s, sync_every)
    step_rng = np.random.default_rng(4)

    def train(node) -> None:
        node.arrays[0] += step_rng.standard_normal(1000).astype(np.float32)

    for r in range(3 * sync_every):
        sync = is_sync_step(r, sync_every)
        published = np.mean(sim.flats(), axis=0)  # what the nodes publish this round (float64 mean)
        out = sim.run_round(train=None if sync else train)
        assert all(o.metrics["sync"] == float(sync) for o in out.values())
        flats = sim.flats()
        if sync:
            for f in flats[1:]:
                np.testing.assert_allclose(f, flats[0], rtol=2e-6, atol=2e-6)  # each adds to its own x_pub: rounding
            np.testing.assert_allclose(flats[0], published, rtol=1e-5, atol=1e-5)
            assert all(o.factor == (n - 1) / n for o in out.values())
        else:
            assert sim.spread() > 1.0  # training noise keeps them apart between syncs


def test_sync_step_with_training_keeps_each_nodes_step_whole():
    """Training between send and wait on the sync step: x_i = mean(published) + step_i, so the spread that is left
    is the steps' (small), and the cluster's mean moves by their mean."""
    n, s, sync_every = 16, 4, 3
    rng = np.random.default_rng(5)
    sim = group_cluster([[rng.standard_normal(200)] for _ in range(n)], s, sync_every)
    step_rng = np.random.default_rng(6)
    steps: dict[str, np.ndarray] = {}

    def train(node) -> None:
        steps[node.name] = 0.1 * step_rng.standard_normal(200)
        node.arrays[0] += steps[node.name]

    sim.run_round(train=train)
    sim.run_round(train=train)
    before = sim.spread()
    published = np.mean(sim.flats(), axis=0)
    sim.run_round(train=train)  # step 2: the sync step
    assert sim.spread() < before * 0.7  # what is left apart is the steps (0.1 each), not the models (~1)
    for name in sim.names:
        np.testing.assert_allclose(sim[name].flat() - steps[name], published, rtol=1e-12, atol=1e-12)
    moved = np.mean(sim.flats(), axis=0) - published
    np.testing.assert_allclose(moved, np.mean([steps[name] for name in sim.names], axis=0), atol=1e-12)


def test_stale_node_is_left_out_in_a_cluster():
    """A node whose clock lags by more than max_staleness (e.g. restarted) is left out by the others."""
    n, s = 4, 4  # one group of everybody on every step
    rng = np.random.default_rng(7)
    sim = group_cluster([[rng.standard_normal(5)] for _ in range(n)], s, max_staleness=10.0)
    sim.run_round()
    sim.run_round()
    sim["w1"].state.clock -= 12.0  # publishes clock 3 - 12 = -9 while the others publish 3: gap 12
    start = {name: sim[name].flat() for name in sim.names}
    out = sim.run_round()
    for name in ("w2", "w3", "w4"):
        assert out[name].metrics["stale_left_out"] == 1.0 and out[name].metrics["members"] == 2.0
        assert "w1" not in out[name].peers
        others = [start[m] for m in ("w2", "w3", "w4") if m != name]
        np.testing.assert_allclose(sim[name].flat(), (sum(others) + 2 * start[name]) / 4, rtol=1e-13)
    # w1 itself sees everybody ahead, which is never stale
    assert out["w1"].metrics["stale_left_out"] == 0.0 and out["w1"].peers == ("w2", "w3", "w4")
