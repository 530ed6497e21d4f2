"""Gradient tracking (``gt``): the exact minimizer under heterogeneous data, the tracker's invariant, and the
tracker travelling with the model over the network.

The problem is tests/test_consensus.py's, with a CONSTANT step: node ``i`` minimizes ``1/2 ||x - c_i||^2``
with the local step ``x <- x - ETA * (x - c_i)``. Everything is linear, so D-PSGD's fixed point is off the
minimizer of the average (the mean of the centres) by an error exactly proportional to the centres' spread,
and gradient tracking's is the minimizer itself. Measured (6 nodes, 3 dimensions, 600 rounds, ETA 0.1, seeds
0-2): ``gt`` 0.7e-15 to 3.6e-15 on the ring and the exponential graph; ``dpsgd`` 0.65-1.22 on the ring, 0.35-0.75
on the exponential graph (largest distance of a node to the minimizer, absolute; D-PSGD taking its whole local
step, as the paper does: 0.25-0.47 and 0.08-0.16 when it kept only ``1/(d+1)`` of it, before 2026-11-28).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import free_ports, write_cluster
from recursions import Quadratics, assert_follows

from dpwa import DpwaConnection
from dpwa.rules import GtRule, make_rule
from dpwa.rules.base import NodeState, PeerSnapshot
from dpwa.rules.dpsgd import DpsgdSettings
from dpwa.rules.schedules import make_schedule
from dpwa.tools.simulation import Simulation

NODES, DIM, ROUNDS, ETA = 6, 3, 600, 0.1


def largest_error(rule: str, graph: str, seed: int, scale: float = 1.0) -> float:
    """Largest distance of a node to the mean of the centres after ROUNDS rounds (centres scaled by ``scale``)."""
    rng = np.random.default_rng(seed)
    centres = scale * rng.normal(scale=3.0, size=(NODES, DIM))
    start = rng.normal(size=DIM)
    names = [f"w{i + 1}" for i in range(NODES)]
    index = {name: i for i, name in enumerate(names)}
    settings = DpsgdSettings(graph=graph)
    sim = Simulation(
        [[start.copy()] for _ in names],
        lambda: make_rule(rule, {"graph": graph}, 0.0),
        lambda: make_schedule("neighbours", settings),
        seed=seed,
    )

    def train(node: Any) -> float:
        x = node.arrays[0]
        x -= ETA * (x - centres[index[node.name]])
        return 0.5 * float(np.sum((x - centres[index[node.name]]) ** 2))

    for _ in range(ROUNDS):
        sim.run_round(1.0, train=train)
    target = centres.mean(axis=0)
    return max(float(np.linalg.norm(x - target)) for x in sim.flats())


@pytest.mark.parametrize("graph", ["ring", "exponential"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gt_reaches_the_exact_minimizer_where_dpsgd_keeps_a_bias(
    graph: str, seed: int, record_property: Callable[[str, object], None]
) -> None:
    gt, dpsgd = largest_error("gt", graph, seed), largest_error("dpsgd", graph, seed)
    record_property("gt", gt)
    record_property("dpsgd", dpsgd)
    assert gt < 1e-6, gt
    assert dpsgd > 0.05, dpsgd  # the bias floor of D-PSGD under heterogeneous data, same step


def test_dpsgd_bias_is_proportional_to_the_heterogeneity_and_gt_has_none() -> None:
    """Twice the spread of the centres: D-PSGD's error doubles (the problem is linear), gt's stays at zero."""
    once, twice = largest_error("dpsgd", "ring", 0), largest_error("dpsgd", "ring", 0, scale=2.0)
    assert twice == pytest.approx(2.0 * once, rel=1e-6)
    assert largest_error("gt", "ring", 0, scale=2.0) < 1e-6


def test_the_trackers_sum_is_the_sum_of_the_local_steps() -> None:
    """``sum_i z_i = sum_i u_i`` after every round (the mixing matrix is doubly stochastic): what makes the fixed
    point unbiased."""
    rng = np.random.default_rng(3)
    names = [f"w{i + 1}" for i in range(5)]
    sim = Simulation(
        [[rng.normal(size=4)] for _ in names],
        lambda: GtRule(graph="exponential"),
        lambda: make_schedule("neighbours", DpsgdSettings(graph="exponential")),
    )
    for _ in range(20):
        steps = {n: rng.normal(size=4) for n in names}

        def train(node: Any, steps: dict[str, np.ndarray] = steps) -> None:
            node.arrays[0] += steps[node.name]

        sim.run_round(1.0, train=train)
        trackers = sum(sim[n].rule.state_arrays()["gt_z/0"] for n in names)
        np.testing.assert_allclose(trackers, sum(steps.values()), atol=1e-12)


def test_alone_the_tracker_replaces_the_local_step() -> None:
    """A node alone (no neighbour to offer to or hear from): ``z <- z + u - u_prev``, ``x <- x_sent + z``."""
    rule = GtRule(graph="ring")
    own = NodeState("w1", extras=rule.initial_extras("w1", ["w1"]))
    x = [np.array([1.0, 2.0])]
    for u in (np.array([0.5, -1.0]), np.array([0.25, 0.0])):
        published = [np.array(a, copy=True) for a in rule.public_arrays(x)]
        rule.on_publish(own, published)
        x[0] += u
        rule.mix(own, x, [])
    # z_0 = u_0; x_1 = x_0 + z_0; z_1 = z_0 + u_1 - u_0 = u_1; x_2 = x_1 + z_1
    np.testing.assert_array_equal(x[0], np.array([1.0, 2.0]) + np.array([0.5, -1.0]) + np.array([0.25, 0.0]))
    np.testing.assert_array_equal(rule.state_arrays()["gt_z/0"], np.array([0.25, 0.0]))


def test_a_neighbour_mixes_in_its_model_and_its_offers_arrive_through_its_running_sum() -> None:
    rule = GtRule(graph="ring")
    own = NodeState("w1", clock=1.0, extras=rule.initial_extras("w1", ["w1", "w2"]))
    x = [np.array([0.0, 0.0])]
    rule.on_publish(own, [np.array(a, copy=True) for a in rule.public_arrays(x)])
    x[0] += np.array([1.0, 1.0])  # u = 1
    offered = np.array([1.0, -1.0])  # w2's running sum: what it offered its neighbours so far
    peer = PeerSnapshot(NodeState("w2", clock=1.0, extras={"gt_epoch": 5}), [np.array([4.0, 2.0]), offered])
    outcome = rule.mix(own, x, [peer])
    assert outcome.factor == 0.5 and outcome.peers == ("w2",)
    z = offered + np.array([1.0, 1.0])  # its first message counts from zero, then the step u - u_prev
    np.testing.assert_array_equal(rule.state_arrays()["gt_z/0"], z)
    np.testing.assert_array_equal(x[0], 0.5 * np.array([4.0, 2.0]) + z)
    # the same sum again (a repeat, or a message that brought no new offer) adds nothing
    rule.on_publish(own, [np.array(a, copy=True) for a in rule.public_arrays(x)])  # offers z/2: z <- z/2
    rule.mix(own, x, [peer])
    np.testing.assert_array_equal(rule.state_arrays()["gt_z/0"], z / 2 - np.array([1.0, 1.0]))  # u - u_prev = -1


def test_lost_messages_keep_the_trackers_sum_with_what_is_in_flight() -> None:
    """Replies lost at random: ``sum_i z_i`` plus the offers not collected yet is ``sum_i u_i``, every round;
    then the lossy consensus problem still reaches the minimizer (tests/test_consensus.py covers it too)."""
    rng = np.random.default_rng(8)
    names = [f"w{i + 1}" for i in range(5)]
    sim = Simulation(
        [[rng.normal(size=4)] for _ in names],
        lambda: GtRule(graph="ring"),
        lambda: make_schedule("neighbours", DpsgdSettings(graph="ring")),
    )
    lose = np.random.default_rng(9)
    total = np.zeros(4)
    for _ in range(40):
        steps = {n: rng.normal(size=4) for n in names}

        def train(node: Any, steps: dict[str, np.ndarray] = steps) -> None:
            node.arrays[0] += steps[node.name]

        sim.run_round(1.0, train=train, lose=lambda _a, _b: "timeout" if lose.random() < 0.3 else None)
        total = sum(steps.values())
        rules = {n: sim[n].rule for n in names}
        trackers = sum(r.state_arrays()["gt_z/0"] for r in rules.values())
        in_flight = sum(
            rules[j].state_arrays()["gt_rho/0"] - rules[i].state_arrays().get(f"gt_rho:{j}/0", 0.0)
            for i in names
            for j in (names[(names.index(i) - 1) % 5], names[(names.index(i) + 1) % 5])
        )
        np.testing.assert_allclose(trackers + in_flight, total, atol=1e-9)


def test_checkpoint_round_trip_restores_the_tracker() -> None:
    rule = GtRule()
    own = NodeState("w1", extras=rule.initial_extras("w1", ["w1", "w2", "w3"]))
    x = [np.zeros(3, np.float32), np.zeros((2, 2), np.float16)]
    rule.on_publish(own, [np.array(a, copy=True) for a in rule.public_arrays(x)])
    x[0] += 1.0
    rule.mix(own, x, [])
    saved = rule.state_arrays()
    assert saved["gt_z/1"].dtype == np.float32  # half-precision parameters keep a float32 tracker
    assert saved["gt_rho/1"].dtype == np.float64  # running sums in float64
    fresh = GtRule()
    assert fresh.load_state_arrays(saved, x)
    for key, value in fresh.state_arrays().items():
        np.testing.assert_array_equal(value, saved[key])
    assert not GtRule().load_state_arrays(saved, [np.zeros(4, np.float32), np.zeros((2, 2), np.float16)])


@pytest.mark.integration
def test_the_tracker_travels_with_the_model_over_the_network(tmp_path: Path) -> None:
    """Two nodes in lock-step: the snapshot holds x then the running sum of the offers, and the second round
    collects what the peer offered (``w z_b = u_b / 2``, whatever the first round's race): DIGing's
    ``z <- W z + u - u_prev``."""
    config = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="gt", timeout_ms=2000)
    a = DpwaConnection("w1", config, seed=1)
    b = DpwaConnection("w2", config, seed=2)
    try:
        pa, pb = [np.zeros(8, np.float32)], [np.zeros(8, np.float32)]
        ua = [np.full(8, 1.0, np.float32), np.full(8, 3.0, np.float32)]
        ub = np.full(8, 2.0, np.float32)
        for r in range(2):
            b.update_send(pb, 1.0)
            a.update_send(pa, 1.0)
            pa[0] += ua[r]
            pb[0] += ub
            assert a.update_wait(1.0) == 0.5
            b.update_wait(1.0)
        assert a._node.layout is not None and a._node.layout.dtypes == ("<f4", "<f8")  # x and the running sum
        # round 1: z_a = u_a1 (z_b published 0); round 2: z_a += (z_b - z_a)/2 + u_a2 - u_a1, z_b = u_b
        z1 = ua[0]
        z2 = z1 + 0.5 * (ub - z1) + ua[1] - ua[0]
        np.testing.assert_allclose(a._node.rule.state_arrays()["gt_z/0"], z2, rtol=1e-6)
    finally:
        a.close()
        b.close()


def take_step(steps: dict[str, np.ndarray], node: Any) -> None:
    """The local step ``steps[node]`` (the simulator's ``train``)."""
    node.arrays[0] += steps[node.name]


def ring_sim(rng: np.random.Generator, names: list[str]) -> Simulation:
    return Simulation(
        [[rng.normal(size=4)] for _ in names],
        lambda: GtRule(graph="ring"),
        lambda: make_schedule("neighbours", DpsgdSettings(graph="ring")),
    )


def sum_error(sim: Simulation, names: list[str], steps: dict[str, np.ndarray]) -> float:
    """``|sum_i z_i + offers not collected yet - sum_i u_i|`` (largest element), on a ring of ``names``."""
    rules = {n: sim[n].rule.state_arrays() for n in names}
    trackers = sum(r["gt_z/0"] for r in rules.values())
    in_flight = sum(
        rules[j]["gt_rho/0"] - rules[i].get(f"gt_rho:{j}/0", 0.0)
        for k, i in enumerate(names)
        for j in (names[(k - 1) % len(names)], names[(k + 1) % len(names)])
    )
    return float(np.abs(trackers + in_flight - sum(steps.values())).max())


@pytest.mark.parametrize("rounds_before", [5, 20])
def test_a_cluster_resumed_from_its_checkpoints_keeps_the_trackers_sum(rounds_before: int) -> None:
    """Every node's gossip state through the checkpoint path (``export_state`` / ``restore_state``: extras come
    back as floats), into new rules: the running sums go on where they stopped, nothing collected twice or lost."""
    from dpwa.node import recovery

    rng = np.random.default_rng(3)
    names = [f"w{i + 1}" for i in range(5)]
    sim = ring_sim(rng, names)
    steps: dict[str, np.ndarray] = {}

    def rounds(sim: Simulation, k: int) -> None:
        nonlocal steps
        for _ in range(k):
            steps = {n: rng.normal(size=4) for n in names}
            sim.run_round(1.0, train=partial(take_step, steps))
            assert sum_error(sim, names, steps) < 1e-12

    rounds(sim, rounds_before)
    saved = {n: recovery.export_state(sim[n].state, sim[n].step, sim[n].rule) for n in names}
    resumed = ring_sim(rng, names)
    for n in names:
        node = resumed[n]
        np.copyto(node.arrays[0], sim[n].arrays[0])
        node.step = recovery.restore_state(node.state, node.rule, saved[n], node.arrays)
    assert isinstance(resumed["w1"].state.extras["gt_epoch"], float)  # as a checkpoint gives it back
    rounds(resumed, 30)


def test_a_neighbours_first_message_counts_from_zero_however_late() -> None:
    """w1 hears nothing from w2 for 5 rounds (flow control then backs off): the first message that arrives
    still brings everything w2 offered since its sums started."""
    rng = np.random.default_rng(4)
    names = [f"w{i + 1}" for i in range(5)]
    sim = ring_sim(rng, names)
    steps: dict[str, np.ndarray] = {}
    for _ in range(40):
        steps = {n: rng.normal(size=4) for n in names}
        sim.run_round(
            1.0,
            train=partial(take_step, steps),
            lose=lambda a, b: "timeout" if sim.rounds < 5 and (a, b) == ("w1", "w2") else None,
        )
        assert sum_error(sim, names, steps) < 1e-12
    assert "w2" in sim["w1"].rule._last  # heard from at last


def test_bfloat16_parameters_are_computed_in_float32() -> None:
    from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32

    def bf16(values: list[float]) -> np.ndarray:
        out = np.zeros(len(values), BFLOAT16)
        from_float32(np.array(values, np.float32), out)
        return out

    rule = GtRule(graph="ring")
    own = NodeState("w1", clock=1.0, extras=rule.initial_extras("w1", ["w1", "w2"]))
    x = [bf16([1.0, 3.0])]
    rule.on_publish(own, [np.array(a, copy=True) for a in rule.public_arrays(x)])
    peer = PeerSnapshot(NodeState("w2", clock=1.0, extras={"gt_epoch": 1}), [bf16([-1.0, 1.0]), np.zeros(2)])
    rule.mix(own, x, [peer])
    np.testing.assert_array_equal(to_float32(x[0], np.empty(2, np.float32)), [0.0, 2.0])


# --------------------------------------------------------------------------- the neighbours change


def publish(rule: GtRule, own: NodeState, x: list[np.ndarray]) -> PeerSnapshot:
    """update_send's part: the snapshot (with the extras it goes out with) and the rule told it went out."""
    extras = dict(own.extras)  # as Node.publish: the extras are copied before the arrays are made
    arrays = [np.array(a, copy=True) for a in rule.public_arrays(x)]
    rule.on_publish(own, arrays)
    return PeerSnapshot(NodeState(own.name, own.clock, 0.0, extras), arrays)


def tracked_sender(steps: int = 40) -> tuple[GtRule, NodeState, list[np.ndarray], GtRule, NodeState]:
    """w1 of a ring of 5 offering for ``steps`` rounds (a step of ``k`` in round ``k``), w2 collecting them."""
    names = [f"w{i + 1}" for i in range(5)]
    sender, receiver = GtRule(graph="ring"), GtRule(graph="ring")
    own = NodeState("w1", extras=sender.initial_extras("w1", names))
    mine = NodeState("w2", extras=receiver.initial_extras("w2", names))
    x, y = [np.zeros(3)], [np.ones(3)]
    for k in range(1, steps + 1):
        snapshot = publish(sender, own, x)
        publish(receiver, mine, y)
        x[0] += k
        sender.mix(own, x, [])
        receiver.mix(mine, y, [snapshot])
    return sender, own, x, receiver, mine


def test_a_change_of_neighbours_in_the_middle_of_a_publish_takes_out_exactly_the_offer_made() -> None:
    """The members change on another thread between the snapshot's arrays and its publish: the offer made (to
    the epoch's 2 receivers, ``w = 1/3``) is what is taken out, ``z <- z - 2 z/3``. Before, the change zeroed the
    running sum in between and ``z`` fell by ``2 rho`` instead: -38 where 0.5 was due."""
    sender, own, x, _, _ = tracked_sender()
    z, epoch = sender._z[0].copy(), own.extras["gt_epoch"]
    arrays = [np.array(a, copy=True) for a in sender.public_arrays(x)]
    sender.on_members("w1", ["w1", "w2", "w3", "w4"], 5.0)  # w5 left: w1's neighbours are w2 and w4 now
    sender.on_publish(own, arrays)
    np.testing.assert_allclose(sender._z[0], z / 3, rtol=1e-12)
    assert own.extras["gt_epoch"] != epoch and own.extras["gt_to"] == ["w2", "w4"]  # the next snapshot's


def test_across_a_change_of_neighbours_each_snapshot_brings_exactly_its_offer() -> None:
    """After w1's neighbours change, its next snapshot still carries the old epoch with the running sum grown by
    this publish's offer, and the one after a new epoch whose sum starts at zero: w2 collects exactly the offer
    each time. Before, the first of them carried the old epoch with the sum already zeroed: w2's tracker lost
    w1's whole running sum (40 rounds of offers)."""
    sender, own, x, receiver, mine = tracked_sender()
    sender.on_members("w1", ["w1", "w2", "w3", "w4"], 5.0)
    receiver.on_members("w2", ["w1", "w2", "w3", "w4"], 5.0)  # w2's neighbours stay w1 and w3
    y = [np.ones(3)]
    for w in (1 / 3, 1 / 3):  # the old epoch's receivers (w2, w5), then the new one's (w2, w4): 2 each
        offer = w * sender._z[0]
        snapshot = publish(sender, own, x)
        publish(receiver, mine, y)
        before = receiver._z[0].copy()
        receiver.mix(mine, y, [snapshot])
        u = receiver.state_arrays()["gt_u/0"]  # this round's step (0: y did not move), already in z
        np.testing.assert_allclose(receiver._z[0] - before - u, offer, rtol=1e-9)
        sender.mix(own, x, [])


def test_a_node_takes_no_offer_of_an_epoch_that_was_not_offered_to_it() -> None:
    """w6 joined between w5 and w1: until w1 publishes under a new epoch, its snapshot's offers are for w2 and
    w5, and w6 (its neighbour now) takes none of them -- before, it took w1's whole running sum as new."""
    sender, own, x, _, _ = tracked_sender()
    six = [f"w{i + 1}" for i in range(6)]
    stale = publish(sender, own, x)  # offered to w2 and w5
    newcomer = GtRule(graph="ring")
    mine = NodeState("w6", clock=stale.state.clock, extras=newcomer.initial_extras("w6", six))
    y = [np.zeros(3)]
    publish(newcomer, mine, y)
    newcomer.mix(mine, y, [stale])
    np.testing.assert_array_equal(newcomer._z[0], 0.0)  # the model is averaged in, the offers are not taken
    sender.on_members("w1", six, 6.0)
    sender.mix(own, x, [])
    publish(sender, own, x)  # the change takes effect here: the next snapshot's epoch is for w2 and w6
    offer = sender._z[0] / 3  # w = 1/(2+1), its sums from zero
    fresh = publish(sender, own, x)
    publish(newcomer, mine, y)
    newcomer.mix(mine, y, [fresh])
    np.testing.assert_allclose(newcomer._z[0], offer, rtol=1e-12)


def test_in_lock_step_the_iterates_are_digings_recursion() -> None:
    """Step by step against a direct transcription of DIGing (Nedic, Olshevsky & Shi 2017, eq. 3), no messages lost:
    ``x_{k+1} = W x_k - a y_k``, ``y_{k+1} = W y_k + g(x_{k+1}) - g(x_k)``, ``y_0 = g(x_0)``, W the ring's
    ``1/3`` weights. Heterogeneous quadratics ``f_i = a_i/2 ||x - c_i||^2`` (curvatures 0.5-2), so a tracker that
    only kept its sum (what the minimizer test checks) but mixed or stepped otherwise would drift off the
    recursion within a few steps."""
    n, dim, alpha, steps = 5, 3, 0.1, 40
    q = Quadratics.drawn(8, n, dim)
    w = (np.eye(n) + np.roll(np.eye(n), 1, axis=1) + np.roll(np.eye(n), -1, axis=1)) / 3
    x = q.start.copy()
    y = np.array([q.grad(i, x[i]) for i in range(n)])
    expected = []
    for _ in range(steps):
        x_next = w @ x - alpha * y
        y = w @ y + np.array([q.grad(i, x_next[i]) - q.grad(i, x[i]) for i in range(n)])
        x = x_next
        expected.append(x.copy())

    sim = Simulation(
        [[q.start[i].copy()] for i in range(n)],
        lambda: GtRule(graph="ring"),
        lambda: make_schedule("neighbours", DpsgdSettings(graph="ring")),
    )
    assert_follows(sim, q.sgd(alpha), expected)  # the optimizer's step at x_k, between send and wait
