"""Push-sum (SGP) in push form: the rule's shares and folds, and mass conservation in the simulator."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import traced_peak

from dpwa.rules import RULES, NodeState, PeerSnapshot, make_rule
from dpwa.rules.mixing import BLOCK
from dpwa.rules.pushsum import WEIGHT_FLOOR, PushSumRule, PushSumSettings, valid_mass
from dpwa.rules.schedules import ExponentialSchedule, RandomSchedule, RingSchedule, Schedule
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
    shares = rule.push_shares(own, 1)  # the even split: keep a quarter, give a quarter (the floor is reached)
    assert shares == [{"w_given": 0.25}] and own.extras["weight"] == WEIGHT_FLOOR == 0.25
    assert rule.push_shares(own, 0) == [] and own.extras["weight"] == 0.25
    assert own.extras["weight"] + 0.5 + 0.25 == 1.0  # nothing created or lost


def test_push_shares_never_take_the_weight_below_the_floor():
    """Below the even split only the excess over WEIGHT_FLOOR is given; at the floor, empty messages."""
    rule = PushSumRule()
    own = node(rule)
    own.extras["weight"] = 0.55
    shares = rule.push_shares(own, 3)  # even split 0.1375 < 0.25: give (0.55 - 0.25) / 3 each
    assert [sh["w_given"] for sh in shares] == pytest.approx([0.1] * 3, abs=1e-15)
    assert own.extras["weight"] == pytest.approx(WEIGHT_FLOOR, abs=1e-15) and rule.held == 1
    assert rule.push_shares(own, 2) == [{"w_given": 0.0}] * 2  # nothing left to give: empty messages
    assert own.extras["weight"] == pytest.approx(WEIGHT_FLOOR, abs=1e-15) and rule.held == 2
    own.extras["weight"] = 3.0
    assert rule.push_shares(own, 2) == [{"w_given": 1.0}] * 2 and own.extras["weight"] == 1.0  # even split


def test_an_empty_message_changes_nothing_and_is_counted():
    rule = PushSumRule()
    own = node(rule, clock=2.0)
    x = [np.array([1.0, 2.0])]
    out = rule.mix(own, x, [snap([np.array([9.0, 9.0])], w_given=0)])
    np.testing.assert_array_equal(x[0], [1.0, 2.0])
    assert (out.factor, out.peers) == (0.0, ()) and own.extras["weight"] == 1.0 and own.clock == 2.0
    assert rule.empty == 1 and rule.bad_messages == 0 and out.metrics["messages_empty"] == 1.0


def test_the_local_step_goes_to_the_numerator():
    """SGP: z <- z + delta (numerator), i.e. x <- x_published + delta / w with the weight kept after pushing;
    then the fold. Hand-computed: w = 1 pushes half (w = 0.5), steps delta, folds (x_j, 0.5)."""
    rule = PushSumRule()
    own = node(rule)
    published = [np.array([2.0, -2.0])]
    rule.on_publish(own, published)
    rule.push_shares(own, 1)  # w = 0.5
    x = [np.array([2.5, -3.0])]  # delta = (0.5, -1.0)
    out = rule.mix(own, x, [snap([np.array([0.0, 4.0])], w_given=0.5)])
    # numerator 0.5 * (2, -2) + (0.5, -1) + 0.5 * (0, 4) = (1.5, 0.0); weight 1
    np.testing.assert_allclose(x[0], [1.5, 0.0], rtol=0, atol=1e-15)
    assert own.extras["weight"] == 1.0 and out.metrics["step_scale"] == 2.0
    untouched = [np.array([7.0])]
    rule.mix(own, untouched, [])  # no publish since: no step to move
    np.testing.assert_array_equal(untouched[0], [7.0])


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
    assert out.metrics == {"weight": 0.75, "pushes_returned": 0.0, "messages_received": 1.0, "bad_messages": 0.0,
                           "pushes_held": 0.0, "messages_empty": 0.0, "step_scale": 1.0}  # fmt: skip


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


class FixedTargets(Schedule):
    """Round ``k``: node ``i`` pushes to ``pattern[k % len(pattern)][i]`` (ranks): an irregular, time-varying
    graph, so the weights really differ from 1."""

    name = "fixed"

    def __init__(self, pattern: list[list[list[int]]]) -> None:
        self.pattern = pattern

    def targets(self, rnd):  # type: ignore[no-untyped-def]
        return [rnd.names[j] for j in self.pattern[rnd.index % len(self.pattern)][rnd.rank]]


def test_sgp_matches_the_numerator_recurrence_of_algorithm_1_step_by_step():
    """Assran et al. 2019, Algorithm 1, in dpwa's order (the push leaves at update_send with the model published
    then; the step, computed at the de-biased z, lands on the numerator the node kept), written out in
    numerators X and weights W with the mixing matrix of each round:

        X_i <- X_i / (k_i + 1) - gamma * grad f_i(X_i / W_i) + sum_{j -> i} X_j / (k_j + 1)
        W_i <- W_i / (k_i + 1) + sum_{j -> i} W_j / (k_j + 1)

    The simulator runs the rule on the de-biased z = X / W; after every round z and W must equal the
    recurrence's to 1e-12. (Before the numerator step, dpwa scaled node i's step by W_i.)"""
    pattern = [[[1, 2], [2], [0]], [[2], [0], [0, 1]], [[1], [0, 2], [1]]]  # out-degrees 0..2, in-degrees vary
    n, gamma = 3, 0.1
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(n, 4))
    start = rng.normal(size=(n, 4))
    sim = Simulation([[s.copy()] for s in start], PushSumRule, lambda: FixedTargets(pattern), seed=0)
    X, W = start.copy(), np.ones(n)
    saw = []
    for k in range(30):
        targets = pattern[k % len(pattern)]
        z = X / W[:, None]
        X_new = np.zeros_like(X)
        W_new = np.zeros(n)
        for i in range(n):
            share = 1.0 / (len(targets[i]) + 1)
            assert W[i] * share >= WEIGHT_FLOOR  # the floor does not bind here: the plain recurrence applies
            X_new[i] += share * X[i] - gamma * (z[i] - centres[i])
            W_new[i] += share * W[i]
            for j in targets[i]:
                X_new[j] += share * X[i]
                W_new[j] += share * W[i]
        X, W = X_new, W_new

        def step(node):  # type: ignore[no-untyped-def]
            i = sim.names.index(node.name)
            node.arrays[0] -= gamma * (node.arrays[0] - centres[i])

        sim.run_round(train=step)
        for i, name in enumerate(sim.names):
            np.testing.assert_allclose(sim[name].arrays[0], X[i] / W[i], rtol=0, atol=1e-12)
            assert sim[name].state.extras["weight"] == pytest.approx(W[i], abs=1e-12)
        saw.append(float(np.ptp(W)))
    assert max(saw) > 0.3  # the weights really moved away from 1


@pytest.mark.parametrize("schedule", [ExponentialSchedule, RingSchedule])
def test_on_a_regular_graph_in_lock_step_the_weights_stay_one(schedule):
    """Each node receives exactly one push a round: w = 1/2 + 1/2, whatever the training does."""
    sim = cluster(8, schedule, seed=2)
    step = noise(3)
    for _ in range(200):
        sim.run_round(train=step)
        assert all(abs(w - 1.0) < 1e-9 for w in weights(sim))


def test_refused_pushes_keep_every_weight_at_or_above_the_floor_and_the_mass_exact():
    """Random peers (in-degrees vary) and a third of the pushes refused: weights swing, but never below
    WEIGHT_FLOOR (so a step is scaled by at most 1/WEIGHT_FLOOR), and the mass stays exactly N."""
    n = 8
    sim = cluster(n, RandomSchedule, seed=4)
    step = noise(5)
    refuse = np.random.default_rng(6)
    lowest, highest, scales = 1.0, 1.0, []
    for _ in range(300):
        out = sim.run_round(train=step, lose=lambda s, p: "rejected" if refuse.random() < 0.33 else None)
        w = weights(sim)
        assert math.fsum(w) == pytest.approx(n, abs=1e-9)
        lowest, highest = min(lowest, *w), max(highest, *w)
        scales += [o.metrics["step_scale"] for o in out.values()]
    assert lowest >= WEIGHT_FLOOR - 1e-12 and lowest < 0.5  # the floor was reached, never passed
    assert max(scales) <= 1.0 / WEIGHT_FLOOR + 1e-9
    assert highest > 1.5 and sum(sim[m].rule.held for m in sim.names) > 0


def test_late_pushes_keep_the_mass_exact_the_weights_bounded_and_the_point_unweighted():
    """Pushes delayed by 1-3 rounds on purpose (a third of them), with training toward each node's own centre:
    sum(w) + the mass in flight is N to 1e-9 at every round, every weight stays at or above the floor, and once
    the delays stop the nodes agree on the mean of the centres (the unweighted minimizer)."""
    n, dim = 6, 3
    rng = np.random.default_rng(11)
    centres = rng.normal(scale=3.0, size=(n, dim))
    sim = Simulation([[np.zeros(dim)] for _ in range(n)], PushSumRule, ExponentialSchedule, seed=1)
    late = np.random.default_rng(12)

    def step(node):  # type: ignore[no-untyped-def]
        x = node.arrays[0]
        x -= 0.5 / (1.0 + node.step / 20.0) * (x - centres[sim.names.index(node.name)])

    lowest = highest = 1.0
    for k in range(1500):
        delays = (lambda s, p: int(late.integers(1, 4)) if late.random() < 0.33 else 0) if k < 500 else None
        sim.run_round(train=step, delay=delays)
        w = weights(sim)
        assert math.fsum(w) + sim.mass_in_flight() == pytest.approx(n, abs=1e-9)
        lowest, highest = min(lowest, *w), max(highest, *w)
    assert not sim.in_flight
    assert WEIGHT_FLOOR - 1e-12 <= lowest < 0.5 and highest > 1.5  # the delays really moved the weights
    target = centres.mean(axis=0)
    scale = float(np.mean(np.linalg.norm(centres - target, axis=1)))
    mean = np.mean(sim.flats(), axis=0)
    assert np.linalg.norm(mean - target) / scale < 1e-3  # bias: the sum is kept, late or not
    assert sim.spread() / scale < 0.05
