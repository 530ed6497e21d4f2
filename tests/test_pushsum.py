"""Push-sum (SGP) in push form: the rule's shares and folds, and mass conservation in the simulator."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import traced_peak

from dpwa.config import PushSumSettings
from dpwa.rules import RULES, NodeState, PeerSnapshot, make_rule
from dpwa.rules.mixing import BLOCK
from dpwa.rules.pushsum import PushSumRule, valid_mass
from dpwa.rules.schedules import ExponentialSchedule, RandomSchedule, RingSchedule
from dpwa.tools.simulation import Simulation


def node(rule: PushSumRule, name: str = "a", n: int = 4, clock: float = 0.0, loss: float = 1.0) -> NodeState:
    return NodeState(name, clock, loss, rule.initial_extras(name, [f"n{i}" for i in range(n - 1)] + [name]))


def snap(arrays, name: str = "b", clock: float = 0.0, **extras) -> PeerSnapshot:
    return PeerSnapshot(NodeState(name, clock, 0.0, dict(extras)), arrays)


def weights(sim: Simulation) -> list[float]:
    return [n.state.extras["weight"] for n in sim.nodes.values()]


def cluster(n: int, schedule, seed: int = 0, size: int = 6) -> Simulation:
    rng = np.random.default_rng(seed)
    return Simulation([[rng.standard_normal(size)] for _ in range(n)], PushSumRule, schedule, seed=seed)


def noise(seed: int):
    rng = np.random.default_rng(seed)

    def train(n) -> float:
        n.arrays[0] += 0.1 * rng.standard_normal(n.arrays[0].shape)
        return None

    return train


# ------------------------------------------------------------------ one node


def test_registry_and_factory():
    assert RULES["pushsum"] is PushSumRule and PushSumRule.name == "pushsum"
    assert PushSumRule.transfer == "push"
    rule = make_rule("pushsum", PushSumSettings(), 0.25)
    assert isinstance(rule, PushSumRule) and rule.divergence_threshold == 0.25 and rule.overlap == 0
    assert repr(rule) == "PushSumRule(overlap=0, divergence_threshold=0.25)"
    assert make_rule("pushsum", PushSumSettings(overlap=3), 0.0).overlap == 3
    with pytest.raises(ValueError, match="overlap"):
        PushSumRule(overlap=-1)


def test_push_shares_split_the_weight_evenly():
    rule = PushSumRule()
    own = node(rule)
    assert own.extras == {"weight": 1.0}
    assert rule.push_shares(own, 1) == [{"w_given": 0.5}]
    assert own.extras["weight"] == 0.5
    shares = rule.push_shares(own, 3)  # keep a quarter, give a quarter to each of three
    assert shares == [{"w_given": 0.125}] * 3 and own.extras["weight"] == 0.125
    assert rule.push_shares(own, 0) == [] and own.extras["weight"] == 0.125
    assert own.extras["weight"] + 0.5 + 3 * 0.125 == 1.0  # nothing created or lost


def test_mix_hand_computed():
    rule = PushSumRule()
    own = node(rule, clock=4.0)
    rule.push_shares(own, 1)  # w = 0.5
    x = [np.array([3.0, 0.0, -3.0]), np.array([[6.0]])]
    peer = [np.array([0.0, 3.0, 3.0]), np.array([[0.0]])]
    out = rule.mix(own, x, [snap(peer, clock=1.0, w_given=0.25)])
    # f = 0.25 / (0.5 + 0.25) = 1/3;  x <- (0.5*x + 0.25*peer) / 0.75
    assert out.factor == pytest.approx(1 / 3, abs=1e-15) and out.peers == ("b",)
    np.testing.assert_allclose(x[0], [2.0, 1.0, -1.0], rtol=1e-15)
    np.testing.assert_allclose(x[1], [[4.0]], rtol=1e-15)
    assert own.extras["weight"] == 0.75
    assert own.clock == pytest.approx(3.0, abs=1e-15)  # (2/3)*4 + (1/3)*1
    assert out.metrics == {"weight": 0.75, "pushes_returned": 0.0, "messages_received": 1.0, "bad_messages": 0.0}


def test_a_returned_push_folds_the_mass_back_and_leaves_the_clock():
    """A refused push comes back as a message named like the node: the same fold, no clock mixing."""
    rule = PushSumRule(divergence_threshold=10.0)  # damping never applies to one's own mass
    own = node(rule, name="a", clock=5.0, loss=1.0)
    sent = [np.array([2.0, 2.0])]
    given = rule.push_shares(own, 1)[0]
    x = [np.array([4.0, 0.0])]  # trained since
    out = rule.mix(own, x, [PeerSnapshot(NodeState("a", 4.0, 1.0, dict(given)), sent)])
    np.testing.assert_allclose(x[0], [3.0, 1.0], rtol=1e-15)  # (0.5*x + 0.5*sent) / 1
    assert own.extras["weight"] == 1.0 and own.clock == 5.0
    assert (out.factor, out.peers) == (0.0, ()) and rule.returned == 1


def test_no_peer_changes_nothing_and_still_reports():
    rule = PushSumRule()
    own = node(rule, clock=2.0)
    x = [np.array([1.0, 2.0])]
    out = rule.mix(own, x, [])
    assert (out.factor, out.peers) == (0.0, ())
    assert {"weight", "pushes_returned", "bad_messages"} <= set(out.metrics)
    np.testing.assert_array_equal(x[0], [1.0, 2.0])
    assert own.clock == 2.0 and own.extras["weight"] == 1.0


@pytest.mark.parametrize("w_given", [None, math.nan, math.inf, -math.inf, -0.5, 0.0, "0.5", True, False, [0.5], 5.0])
def test_hostile_w_given_changes_nothing(w_given):
    rule = PushSumRule()
    own = node(rule, n=4, clock=3.0)  # total mass 4: 5.0 is impossible for an honest peer
    x = [np.array([1.0, -2.0, 0.5])]
    before = x[0].copy()
    extras = {} if w_given is None else {"w_given": w_given}
    out = rule.mix(own, x, [snap([np.array([9.0, 9.0, 9.0])], clock=50.0, **extras)])
    assert (out.factor, out.peers) == (0.0, ())
    np.testing.assert_array_equal(x[0], before)
    assert own.clock == 3.0 and own.extras["weight"] == 1.0
    assert rule.bad_messages == 1 and out.metrics["bad_messages"] == 1.0


def test_valid_mass():
    assert valid_mass(0.5) == 0.5 and valid_mass(2) == 2.0
    assert valid_mass(4.0, limit=4.0) == 4.0 and valid_mass(4.5, limit=4.0) is None
    for bad in (None, True, False, "1", 0, -1e-300, math.nan, math.inf):
        assert valid_mass(bad) is None


def test_several_peers_equal_the_closed_form():
    """Sequential absorption is exactly x <- (w*x + sum_j w_j*x_j) / (w + sum_j w_j)."""
    rule = PushSumRule()
    own = node(rule, n=8)
    rng = np.random.default_rng(5)
    x0, p1, p2 = (rng.standard_normal(7) for _ in range(3))
    x = [x0.copy()]
    out = rule.mix(own, x, [snap([p1.copy()], "b", w_given=0.5), snap([p2.copy()], "c", w_given=1.5)])
    np.testing.assert_allclose(x[0], (1.0 * x0 + 0.5 * p1 + 1.5 * p2) / 3.0, rtol=1e-14)
    assert own.extras["weight"] == 3.0 and out.peers == ("b", "c")
    assert out.factor == pytest.approx(2.0 / 3.0, abs=1e-15)  # the peers' share of the new x


def test_divergence_damps_the_factor_but_not_the_mass():
    rule = PushSumRule(divergence_threshold=2.0)
    own = node(rule, loss=0.5)  # f <- f * 0.5 / 2
    x = [np.zeros(3)]
    out = rule.mix(own, x, [snap([np.full(3, 8.0)], w_given=1.0)])
    assert out.factor == 0.125  # 0.5 * 0.25
    np.testing.assert_array_equal(x[0], np.full(3, 1.0))
    assert own.extras["weight"] == 2.0


def test_mix_allocates_no_model_sized_temporaries():
    rule = PushSumRule()
    own = node(rule)
    n = 4 * 1024 * 1024
    x = [np.ones(n, np.float32)]
    peers = [snap([np.zeros(n, np.float32)], w_given=0.5)]
    peak = traced_peak(lambda: rule.mix(own, x, peers))
    assert peak < BLOCK * 4 + 128 * 1024 < x[0].nbytes / 10
    np.testing.assert_allclose(x[0][:5], 2.0 / 3.0, rtol=1e-6)


# ------------------------------------------------------------------ cluster (Simulation)


@pytest.mark.parametrize("schedule", [RandomSchedule, ExponentialSchedule, RingSchedule])
@pytest.mark.parametrize("train", [False, True])
def test_fault_free_weights_always_sum_to_n(schedule, train):
    n = 7
    sim = cluster(n, schedule, seed=3)
    step = noise(4) if train else None
    saw_uneven = False
    for _ in range(40):
        sim.run_round(train=step)
        w = weights(sim)
        assert math.fsum(w) == pytest.approx(n, abs=1e-9)
        saw_uneven |= max(w) - min(w) > 0.1
    # random peer choice pushes to some nodes several times a round: the weights really move
    assert saw_uneven or schedule is not RandomSchedule


@pytest.mark.parametrize("n", [8, 16])
def test_exponential_graph_reaches_the_exact_average_in_log2_n_rounds(n):
    """The push form on SGP's graph: after log2 N synchronous rounds every node holds the exact average."""
    sim = cluster(n, ExponentialSchedule, seed=n, size=10)
    mean = np.mean(sim.flats(), axis=0)
    rounds = int(math.log2(n))
    for r in range(rounds):
        sim.run_round()
        err = max(float(np.abs(f - mean).max()) for f in sim.flats())
        if r < rounds - 1:
            assert err > 0.01  # not there before the last round
    assert err < 1e-12
    assert weights(sim) == [1.0] * n  # each node received exactly one push a round: w = 1/2 + 1/2


def test_a_refused_push_returns_its_mass_and_the_average_stays_exact():
    """Refused pushes (the network's busy / never-arrived) bring their share back: sum(w) stays N, and the
    weighted average sum(w*x)/N is still the initial mean."""
    n = 8
    sim = cluster(n, ExponentialSchedule, seed=1)
    mean = np.mean(sim.flats(), axis=0)
    out = sim.run_round(lose=lambda sender, peer: "rejected" if (sender, peer) == ("w1", "w2") else None)
    assert sim["w1"].rule.returned == 1 and out["w1"].metrics["pushes_returned"] == 1.0
    assert sim["w1"].state.extras["weight"] == 1.5  # kept 0.5, its 0.5 came back, w8 pushed 0.5 to it
    assert sim["w2"].state.extras["weight"] == 0.5  # kept 0.5, w1's push to it never arrived
    for k in range(30):
        flaky = lambda s, p, k=k: "rejected" if (k + sum(map(ord, s + p))) % 3 == 0 else None
        sim.run_round(lose=flaky)
        assert math.fsum(weights(sim)) == pytest.approx(n, abs=1e-9)
    weighted = sum(node.state.extras["weight"] * node.flat() for node in sim.nodes.values()) / n
    np.testing.assert_allclose(weighted, mean, atol=1e-12)
    assert sum(sim[name].rule.returned for name in sim.names) > 20
    for _ in range(400):  # uneven weights: geometric, not log2 N, convergence
        sim.run_round()
    assert sim.spread() < 1e-9
    np.testing.assert_allclose(sim.flats()[0], mean, atol=1e-9)  # consensus on the exact initial mean
