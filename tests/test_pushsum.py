"""Push-sum in pull form: mass conservation, exact averaging, lost-mass accounting."""

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
    rule = make_rule("pushsum", PushSumSettings(), 0.25)
    assert isinstance(rule, PushSumRule) and rule.divergence_threshold == 0.25
    assert repr(rule) == "PushSumRule(divergence_threshold=0.25)"


def test_serve_halves_and_failed_serve_gives_back():
    rule = PushSumRule()
    own = node(rule)
    assert own.extras == {"weight": 1.0}
    given = [rule.on_serve(own) for _ in range(3)]
    assert given == [{"w_given": 0.5}, {"w_given": 0.25}, {"w_given": 0.125}]
    assert own.extras["weight"] == 0.125
    rule.on_serve_failed(own, given[1])  # that reply was never sent
    assert own.extras["weight"] == 0.375
    assert own.extras["weight"] + given[0]["w_given"] + given[2]["w_given"] == 1.0  # nothing created or lost


def test_mix_hand_computed():
    rule = PushSumRule()
    own = node(rule, clock=4.0)
    rule.on_serve(own)  # w = 0.5
    x = [np.array([3.0, 0.0, -3.0]), np.array([[6.0]])]
    peer = [np.array([0.0, 3.0, 3.0]), np.array([[0.0]])]
    out = rule.mix(own, x, [snap(peer, clock=1.0, w_given=0.25)])
    # f = 0.25 / (0.5 + 0.25) = 1/3;  x <- (0.5*x + 0.25*peer) / 0.75
    assert out.factor == pytest.approx(1 / 3, abs=1e-15) and out.peers == ("b",)
    np.testing.assert_allclose(x[0], [2.0, 1.0, -1.0], rtol=1e-15)
    np.testing.assert_allclose(x[1], [[4.0]], rtol=1e-15)
    assert own.extras["weight"] == 0.75
    assert own.clock == pytest.approx(3.0, abs=1e-15)  # (2/3)*4 + (1/3)*1
    assert out.metrics == {
        "weight": 0.75,
        "mass_lost": 0.0,
        "replies_lost_unknown": 0.0,
        "bad_replies": 0.0,
        "empty_replies": 0.0,
    }


def test_no_peer_changes_nothing_and_still_reports():
    rule = PushSumRule()
    own = node(rule, clock=2.0)
    x = [np.array([1.0, 2.0])]
    out = rule.mix(own, x, [])
    assert (out.factor, out.peers) == (0.0, ())
    assert {"weight", "mass_lost", "replies_lost_unknown"} <= set(out.metrics)
    np.testing.assert_array_equal(x[0], [1.0, 2.0])
    assert own.clock == 2.0 and own.extras["weight"] == 1.0


@pytest.mark.parametrize("w_given", [None, math.nan, math.inf, -math.inf, -0.5, "0.5", True, False, [0.5], 5.0])
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
    assert rule.bad_replies == 1 and out.metrics["bad_replies"] == 1.0
    assert rule.mass_lost == 0.0


@pytest.mark.parametrize("w_given", [0.0, -0.0, 0])
def test_a_reply_with_no_mass_is_skipped_not_counted_as_bad(w_given):
    rule = PushSumRule()
    own = node(rule, n=4, clock=3.0)
    x = [np.array([1.0, -2.0, 0.5])]
    before = x[0].copy()
    out = rule.mix(own, x, [snap([np.array([9.0, 9.0, 9.0])], clock=50.0, w_given=w_given)])
    assert (out.factor, out.peers) == (0.0, ())
    np.testing.assert_array_equal(x[0], before)
    assert own.extras["weight"] == 1.0 and rule.bad_replies == 0 and rule.empty_replies == 1


def test_a_node_that_mixed_since_publishing_serves_no_mass():
    """Between its update_wait (mix) and its next update_send the published model is pre-mix: no mass goes with it."""
    rule = PushSumRule()
    own = node(rule, n=4)
    x = [np.zeros(3)]
    rule.on_publish(own, [x[0].copy()])
    assert rule.on_serve(own) == {"w_given": 0.5}  # serving the fresh snapshot halves the weight
    rule.mix(own, x, [snap([np.ones(3)], w_given=0.5)])
    assert own.extras["weight"] == 1.0
    assert rule.on_serve(own) == {"w_given": 0.0}  # mixed since publishing
    assert own.extras["weight"] == 1.0  # nothing handed out
    rule.on_publish(own, [x[0].copy()])
    assert rule.on_serve(own) == {"w_given": 0.5}


def test_a_node_whose_params_were_replaced_serves_no_mass_until_it_publishes():
    rule = PushSumRule()
    own = node(rule, n=4)
    rule.on_publish(own, [np.zeros(3)])
    rule.on_params_replaced(own)  # e.g. a bootstrap copy of a peer
    assert rule.on_serve(own) == {"w_given": 0.0} and own.extras["weight"] == 1.0
    rule.on_publish(own, [np.zeros(3)])
    assert rule.on_serve(own) == {"w_given": 0.5}


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


def test_lost_replies_are_counted():
    rule = PushSumRule()
    own = node(rule)
    rule.on_reply_lost(own, {"w_given": 0.25, "weight": 0.25})
    rule.on_reply_lost(own, {"w_given": 0.125})
    rule.on_reply_lost(own, None)
    rule.on_reply_lost(own, {"weight": 1.0})  # a rejected reply without a readable w_given: unknown
    assert rule.mass_lost == 0.375 and rule.replies_lost_unknown == 2
    assert own.extras["weight"] == 1.0  # a lost reply brings nothing
    m = rule.mix(own, [np.zeros(1)], []).metrics
    assert (m["mass_lost"], m["replies_lost_unknown"]) == (0.375, 2.0)


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
        out = sim.run_round(train=step)
        w = weights(sim)
        assert math.fsum(w) == pytest.approx(n, abs=1e-9)
        assert all(o.metrics["mass_lost"] == 0.0 and o.metrics["replies_lost_unknown"] == 0.0 for o in out.values())
        saw_uneven |= max(w) - min(w) > 0.1
    # random peer choice serves some nodes several times a round: the weights really move
    assert saw_uneven or schedule is not RandomSchedule


@pytest.mark.parametrize("n", [8, 16])
def test_exponential_graph_reaches_the_exact_average_in_log2_n_rounds(n):
    sim = cluster(n, ExponentialSchedule, seed=n, size=10)
    mean = np.mean(sim.flats(), axis=0)
    rounds = int(math.log2(n))
    for r in range(rounds):
        sim.run_round()
        err = max(float(np.abs(f - mean).max()) for f in sim.flats())
        if r < rounds - 1:
            assert err > 0.01  # not there before the last round
    assert err < 1e-6
    assert weights(sim) == [1.0] * n  # each node served exactly once a round: w = 1/2 + 1/2


def test_rejected_reply_is_counted_as_lost_mass():
    n = 8
    sim = cluster(n, ExponentialSchedule, seed=1)
    # round 0: w1 fetches w2, whose weight is 1.0 -> the reply carries w_given = 0.5; it arrives but is rejected
    lose = lambda fetcher, server: "rejected" if (fetcher, server) == ("w1", "w2") else None
    out = sim.run_round(lose=lose)
    assert sim["w1"].rule.mass_lost == 0.5 and out["w1"].metrics["mass_lost"] == 0.5
    assert out["w1"].factor == 0.0 and out["w1"].peers == ()
    assert sim["w1"].state.extras["weight"] == 0.5  # served w8, got nothing
    assert sim["w2"].state.extras["weight"] == 1.0  # gave 0.5 (lost on the way to w1), got 0.5 from w3
    assert all(sim[name].rule.mass_lost == 0.0 for name in sim.names if name != "w1")
    total = lambda: math.fsum(weights(sim)) + sum(sim[name].rule.mass_lost for name in sim.names)
    assert math.fsum(weights(sim)) == pytest.approx(n - 0.5, abs=1e-12)
    assert total() == pytest.approx(n, abs=1e-9)
    for k in range(20):  # more losses later, of whatever mass the reply carried
        flaky = lambda f, s, k=k: "rejected" if (k + sum(map(ord, f + s))) % 5 == 0 else None
        sim.run_round(lose=flaky, train=noise(k))
        assert total() == pytest.approx(n, abs=1e-9)
    assert sum(sim[name].rule.mass_lost for name in sim.names) > 1.0


def test_timeout_counts_unknown_loss():
    n = 4
    sim = cluster(n, RingSchedule)
    out = sim.run_round(lose=lambda f, s: "timeout" if f == "w3" else None)
    rule = sim["w3"].rule
    assert rule.replies_lost_unknown == 1 and rule.mass_lost == 0.0
    assert out["w3"].metrics["replies_lost_unknown"] == 1.0
    assert math.fsum(weights(sim)) == pytest.approx(n - 0.5, abs=1e-12)  # really gone, amount unknown to w3


def test_lost_mass_only_biases_but_still_converges():
    """With mass lost the nodes still agree (push-sum's de-biased x), though not on the exact initial mean."""
    sim = cluster(8, ExponentialSchedule, seed=9)
    spread0 = sim.spread()
    sim.run_round(lose=lambda f, s: "rejected" if (f, s) == ("w5", "w6") else None)
    for _ in range(60):
        sim.run_round()
    assert sim.spread() < 1e-6 * spread0
