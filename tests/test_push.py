"""PUSH on the network: push-sum's mass, phase-locking, OSGP's lag bound, AD-PSGD's conserved mean, D-PSGD.

Nodes run in this process (one thread per trainer, as in tests/test_connection.py), on free ports of
127.0.0.1. Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import free_ports, in_threads, wait_until, write_cluster
from fakes import Faults
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpwa.config import load_config
from dpwa.node import wire
from dpwa.node.connection import DpwaConnection
from dpwa.rules import ConstantRule, DpsgdRule
from dpwa.rules.dpsgd import neighbours
from dpwa.rules.schedules import NeighboursSchedule
from dpwa.tools.simulation import Simulation

pytestmark = [pytest.mark.integration, pytest.mark.timing]


def cluster(
    tmp_path: Path, n: int, label: str = "c", *, faults: Sequence[Faults] | None = None, **settings: Any
) -> list[DpwaConnection]:
    """``n`` nodes on free ports; ``faults``: node i runs a transport doing what ``faults[i]`` says."""
    cfg = load_config(write_cluster(tmp_path / f"{label}.yaml", free_ports(n), **settings))
    if faults is None:
        return [DpwaConnection(f"w{i + 1}", cfg, seed=i) for i in range(n)]
    return [DpwaConnection(f"w{i + 1}", cfg, seed=i, transport=faults[i].factory) for i in range(n)]


def start_params(n: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=300), rng.normal(size=(4, 5))] for _ in range(n)]


def run_threads(
    conns: Sequence[DpwaConnection],
    params: Sequence[list[np.ndarray]],
    steps: int,
    step_s: Callable[[int, int], float],
    on_wait: Callable[[int, DpwaConnection], None] | None = None,
    train: Callable[[int, list[np.ndarray]], None] | None = None,
) -> None:
    """Every node: ``steps`` rounds of update_send, a "step" of ``step_s(node, k)`` seconds (and ``train(node,
    params)``, a local step on the arrays), update_wait."""
    barrier = threading.Barrier(len(conns))

    def node(i: int) -> None:
        barrier.wait(timeout=10)
        for k in range(steps):
            conns[i].update_send(params[i], 1.0)
            time.sleep(step_s(i, k))
            if train is not None:
                train(i, params[i])
            conns[i].update_wait(1.0)
            if on_wait is not None:
                on_wait(i, conns[i])

    in_threads(len(conns), node)


def quiesce(conns: Sequence[DpwaConnection], timeout: float = 20.0) -> None:
    """Let every push settle and every inbox drain (update_wait without update_send folds what arrived). Quiet:
    no push open and no slot taken when the stats were read; the update_wait after that reading collects what
    settled or arrived before it (a push settled after an update_wait but before the reading would be missed)."""

    def quiet() -> bool:
        stats = [c.stats() for c in conns]
        for c in conns:
            c.update_wait(1.0)
        return all(s.get("pushes_unsettled", 0) == 0 and s.get("inbox_occupied", 0) == 0 for s in stats)

    wait_until(quiet, timeout, message="pushes settled and inboxes drained")


def weights(conns: Sequence[DpwaConnection]) -> list[float]:
    return [c.dpwa_state().extras["weight"] for c in conns]


def weighted_mean(conns: Sequence[DpwaConnection], params: Sequence[list[np.ndarray]]) -> np.ndarray:
    flat = [np.concatenate([a.ravel() for a in p]) for p in params]
    return sum(w * f for w, f in zip(weights(conns), flat)) / len(conns)


def close_all(conns: Sequence[DpwaConnection]) -> None:
    for c in conns:
        c.close()


# --------------------------------------------------------------------------- push-sum


@pytest.mark.slow
def test_two_nodes_never_phase_lock_and_keep_their_mass(tmp_path: Path) -> None:
    """10 two-node runs of 500 steps, half in exact lock-step (fixed 2 ms step, no jitter), half jittered:
    every node mixes on at least 90 % of its steps, and the weights sum to 2 within 1e-9 once quiet.

    (Measured: at least 98 % in every run. Two clocks drift, so now and then two pushes of the peer land in
    one step and none in the next; the inbox keeps the second one for the next step (inbox_per_sender 2).
    With inbox_per_sender 1 it is refused instead, and the jittered runs mixed 91-96 %.)"""
    rates = []
    for run in range(10):
        conns = cluster(tmp_path, 2, f"run{run}", interpolation="pushsum", timeout_ms=2000)
        try:
            params = start_params(2, seed=run)
            mixed = [0, 0]

            def count(i: int, conn: DpwaConnection, mixed: list[int] = mixed) -> None:
                mixed[i] += conn.last_exchange["received"] > 0

            rngs = [random.Random(run * 2 + i) for i in range(2)]
            jitter = 0.0005 if run % 2 else 0.0  # odd runs: each step 2 to 2.5 ms, drawn per node
            run_threads(conns, params, 500, lambda i, k, r=rngs, j=jitter: 0.002 + r[i].random() * j, count)
            rates += [m / 500 for m in mixed]
            assert min(mixed) >= 450, (run, mixed)
            quiesce(conns)
            assert math.fsum(weights(conns)) == pytest.approx(2.0, abs=1e-9)
        finally:
            close_all(conns)
    assert len(rates) == 20


def test_streamed_pushes_back_to_back_are_never_cut_short(tmp_path: Path) -> None:
    """A model of several chunks pushed round after round both ways: libzmq's writer learns late that its
    queue emptied (every half high-water mark), so the DEALER's mark must fit a push beside a stale count.
    Every push goes out whole and is acknowledged at once (with a mark that fits one push exactly, the second
    push is cut short and waits a whole timeout_ms for its SETTLE)."""
    conns = cluster(tmp_path, 2, interpolation="pushsum", timeout_ms=30000, inbox_slots=2)
    try:
        floats = 14 * wire.CHUNK_BYTES // 4 + 1000  # 15 chunks of 4 MiB: a mark of 20 fails from 13 on
        params = [[np.full(floats, float(i), np.float32)] for i in range(2)]
        for c, p in zip(conns, params):  # both publish first: no push meets a node without a layout
            c.update_send(p, 1.0)
        for c in conns:
            c.update_wait(1.0)
        records: list[dict] = []
        # both nodes step at once (synchronous SGP: each update_wait also waits for the other's push of the round)
        run_threads(conns, params, 4, lambda i, k: 0.0, on_wait=lambda i, c: records.append(dict(c.last_exchange)))
        assert len(records) == 8
        # overlap 0: update_wait returns once this push is answered (an ACK, or refused busy: with two slots a
        # push of the peer's next round may fill the inbox while the node still folds this one's)
        for record in records:
            assert (record["pushed"], record["unacked"]) == (1, 0), record
            assert record["wait_ms"] + record["sources_wait_ms"] < 10_000, "a push waited for its SETTLE"
        for c in conns:
            stats = c.stats()
            assert stats["push_send_queue_full"] == 0 and stats["pushes_unknown"] == 0, stats
    finally:
        close_all(conns)


def test_pushsum_weights_sum_to_n_and_the_average_is_exact(tmp_path: Path) -> None:
    """Four nodes, no local steps: sum(w) == N and sum(w*x)/N == the initial mean once quiet."""
    conns = cluster(tmp_path, 4, interpolation="pushsum", timeout_ms=2000)
    try:
        params = start_params(4)
        mean0 = np.mean([np.concatenate([a.ravel() for a in p]) for p in params], axis=0)
        rng = random.Random(1)
        run_threads(conns, params, 150, lambda i, k: rng.random() * 0.003)
        quiesce(conns)
        assert math.fsum(weights(conns)) == pytest.approx(4.0, abs=1e-9)
        np.testing.assert_allclose(weighted_mean(conns, params), mean0, atol=1e-9)
        flat = [np.concatenate([a.ravel() for a in p]) for p in params]
        assert max(float(np.abs(f - mean0).max()) for f in flat) < 1e-3  # and they agree on it
        assert sum(c.stats()["pushes_delivered"] for c in conns) > 400
    finally:
        close_all(conns)


def test_every_local_step_lands_whole_on_the_numerator_over_the_network(tmp_path: Path) -> None:
    """SGP's invariant with training, whatever the timing: once quiet, sum_i w_i x_i equals the initial sum plus
    every local step taken (each node adds its own d_i every step). Before the numerator step, node i's steps
    counted w_i times, and the sum missed by far more than 1e-9."""
    n, steps = 3, 60
    conns = cluster(tmp_path, n, interpolation="pushsum", timeout_ms=2000)
    try:
        params = start_params(n)
        total0 = sum(np.concatenate([a.ravel() for a in p]) for p in params)
        rng = np.random.default_rng(3)
        moves = [[rng.normal(scale=0.01, size=a.shape) for a in params[0]] for _ in range(n)]

        def train(i: int, arrays: list[np.ndarray]) -> None:
            for a, d in zip(arrays, moves[i]):
                a += d

        jitter = random.Random(2)
        run_threads(conns, params, steps, lambda i, k: jitter.random() * 0.003, train=train)
        quiesce(conns)
        assert math.fsum(weights(conns)) == pytest.approx(n, abs=1e-9)
        expected = total0 + steps * sum(np.concatenate([d.ravel() for d in m]) for m in moves)
        np.testing.assert_allclose(weighted_mean(conns, params) * n, expected, rtol=0, atol=1e-9)
    finally:
        close_all(conns)


@pytest.mark.slow  # 6 s here
def test_pushsum_mass_survives_dropped_pushes_and_dropped_acks(tmp_path: Path) -> None:
    """A faulty transport loses pushes (the receiver never sees them) and ACKs (it took the push, the sender never
    hears): SETTLE queries settle each one, and the weights still sum to N within 1e-9, the average exact.

    60 steps of 4 nodes, a fifth of the pushes and of the ACKs lost: 5 runs (2026-11-28) each lost 48 pushes and 35
    ACKs, queried 83 and had 50 pushes returned, against the bounds of 5-10 asserted (a step whose push waits out
    the 150 ms timeout is most of the test's time)."""

    def lossy(seed: int) -> Faults:
        rng = random.Random(seed)
        return Faults(drop=lambda kind: rng.random() < 0.2)

    faults = [lossy(100 + i) for i in range(4)]
    conns = cluster(tmp_path, 4, interpolation="pushsum", timeout_ms=150, faults=faults)
    try:
        params = start_params(4, seed=3)
        mean0 = np.mean([np.concatenate([a.ravel() for a in p]) for p in params], axis=0)
        rng = random.Random(2)
        run_threads(conns, params, 60, lambda i, k: rng.random() * 0.003)
        for f in faults:
            f.drop = None
        quiesce(conns)
        stats = [c.stats() for c in conns]
        assert sum(f.counts["pushes_dropped"] for f in faults) > 5
        assert sum(f.counts["acks_dropped"] for f in faults) > 5
        assert sum(s["push_queries"] for s in stats) >= sum(s["pushes_unknown"] for s in stats) > 10
        assert sum(s["pushes_returned"] for s in stats) > 5  # the lost pushes' mass came back
        assert math.fsum(weights(conns)) == pytest.approx(4.0, abs=1e-9)
        np.testing.assert_allclose(weighted_mean(conns, params), mean0, atol=1e-9)
    finally:
        close_all(conns)


@pytest.mark.slow  # ~8 s here: the receiver is slow on purpose
def test_osgp_keeps_at_most_overlap_pushes_unacknowledged_under_a_slow_receiver(tmp_path: Path) -> None:
    """OSGP (overlap 2) against receivers that hold every ACK 0.2 s: update_wait returns with at most two
    pushes unacknowledged, blocking only beyond; with overlap 0 every push is acknowledged by its step's end."""
    for overlap in (2, 0):
        slow = [Faults(ack_delay_s=0.2) for _ in range(5)]
        conns = cluster(
            tmp_path,
            5,
            f"o{overlap}",
            interpolation="pushsum",
            peers="random",
            timeout_ms=3000,
            pushsum={"overlap": overlap},
            faults=slow,
        )
        try:
            params = start_params(5)
            lags, waits = [], []

            def record(i: int, conn: DpwaConnection, lags: list[int] = lags, waits: list[float] = waits) -> None:
                if i == 0:
                    ledger = conn._node.transfer.ledger
                    lags.append(sum(p.status == "sending" for p in ledger.unresolved()))
                    waits.append(conn.last_exchange["wait_ms"])

            run_threads(conns, params, 20, lambda i, k: 0.01, record)
            assert max(lags) <= overlap, lags
            if overlap:
                assert lags.count(overlap) >= 3, lags  # the overlap is used, not only allowed
            assert max(waits) > 100  # a slow receiver does block once the bound is reached
            quiesce(conns)
        finally:
            close_all(conns)


def test_a_pull_only_peer_answers_unsupported_and_is_never_pushed_again(tmp_path: Path) -> None:
    cfg = load_config(write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="pushsum", timeout_ms=2000))
    with DpwaConnection("w1", cfg, seed=1) as pusher, DpwaConnection("w2", cfg, seed=2, rule=ConstantRule()) as old:
        mine, theirs = start_params(2)
        before = [a.copy() for a in theirs]
        old.update_send(theirs, 1.0)  # publishes; its fetch of w1 may find nothing yet
        for _ in range(5):
            pusher.update_send(mine, 1.0)
            pusher.update_wait(1.0)
        s = pusher.stats()
        assert s["pushes_sent"] == 1 and s["pushes_returned"] == 1 and s["pushes_skipped"] == 4
        assert old.stats()["pushes_unsupported"] == 1
        assert pusher.dpwa_state().extras["weight"] == 1.0  # the mass came back
        assert all(np.array_equal(a, b) for a, b in zip(theirs, before))  # a push never touched w2


# --------------------------------------------------------------------------- AD-PSGD and D-PSGD


def mean_drift_and_spread(tmp_path: Path, rule: str, steps: int = 150) -> tuple[float, float]:
    conns = cluster(tmp_path, 4, rule, interpolation=rule, timeout_ms=3000)
    try:
        params = start_params(4, seed=7)
        mean0 = [np.mean([p[j] for p in params], axis=0) for j in range(2)]
        rng = random.Random(5)
        run_threads(conns, params, steps, lambda i, k: rng.random() * 0.003)
        quiesce(conns)
        mean1 = [np.mean([p[j] for p in params], axis=0) for j in range(2)]
        drift = max(float(np.abs(a - b).max()) for a, b in zip(mean0, mean1))
        spread = max(float(np.abs(p[0] - mean1[0]).max()) for p in params)
        if rule == "adpsgd":
            stats = [c.stats() for c in conns]
            assert sum(s["exchanges_committed"] for s in stats) > 100
        return drift, spread
    finally:
        close_all(conns)


@pytest.mark.outcome
def test_adpsgd_conserves_the_mean_where_constant_drifts(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Four nodes, no local steps, random peers, jittered timing: AD-PSGD's symmetric exchanges keep the mean
    of the models (1e-6) and reach consensus; the one-sided constant pull reaches consensus elsewhere."""
    drift, spread = mean_drift_and_spread(tmp_path, "adpsgd")
    record_property("adpsgd_spread", spread)
    assert drift < 1e-6 and spread < 1e-3
    drift_constant, spread_constant = mean_drift_and_spread(tmp_path, "constant")
    record_property("constant_spread", spread_constant)
    record_property("constant_drift", drift_constant)
    assert spread_constant < 1e-3 and drift_constant > 1e-3


@pytest.mark.outcome
def test_dpsgd_reaches_consensus_over_the_network(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    conns = cluster(tmp_path, 4, interpolation="dpsgd", timeout_ms=3000)
    try:
        params = start_params(4, seed=2)
        rng = random.Random(3)
        run_threads(conns, params, 80, lambda i, k: rng.random() * 0.003)
        flat = [np.concatenate([a.ravel() for a in p]) for p in params]
        mean = np.mean(flat, axis=0)
        record_property("spread", max(float(np.abs(f - mean).max()) for f in flat))
        assert max(float(np.abs(f - mean).max()) for f in flat) < 1e-3
        assert all(c.last_exchange["neighbours_mixed"] == 2.0 for c in conns)  # ring: both neighbours
        assert conns[0].stats()["fetches_started"] == 160
    finally:
        close_all(conns)


def test_neighbours_of_the_ring_and_the_exponential_graph() -> None:
    assert neighbours(0, 5, "ring") == [1, 4] and neighbours(0, 2, "ring") == [1]
    assert neighbours(0, 8, "exponential") == [1, 2, 4, 6, 7]  # +-1, +-2, +-4 (4 once)
    assert all(len(neighbours(i, 8, "exponential")) == 5 for i in range(8))  # regular
    assert neighbours(0, 1, "ring") == []
    with pytest.raises(ValueError, match="unknown graph"):
        neighbours(0, 4, "star")


@pytest.mark.parametrize("graph", ["ring", "exponential"])
def test_dpsgd_rounds_are_doubly_stochastic(graph: str) -> None:
    """Synchronous D-PSGD rounds keep the mean exactly (W doubly stochastic) and reach consensus."""
    rng = np.random.default_rng(0)
    sim = Simulation(
        [[rng.normal(size=20)] for _ in range(8)], lambda: DpsgdRule(graph=graph), lambda: NeighboursSchedule(graph)
    )
    mean = np.mean(sim.flats(), axis=0)
    outcomes = sim.run_round()
    d = len(neighbours(0, 8, graph))
    assert all(o.factor == pytest.approx(d / (d + 1)) for o in outcomes.values())
    for _ in range(150):  # the ring mixes slowly: spectral gap ~ 1 - cos(2*pi/8)
        sim.run_round()
        np.testing.assert_allclose(np.mean(sim.flats(), axis=0), mean, atol=1e-12)
    assert sim.spread() < 1e-6


def test_dpsgd_leaves_a_stale_neighbour_out_and_keeps_its_weight() -> None:
    from dpwa.rules import NodeState, PeerSnapshot

    rule = DpsgdRule(graph="ring", max_staleness=5.0)
    own = NodeState("w1", clock=20.0, extras=rule.initial_extras("w1", ["w1", "w2", "w3", "w4"]))
    rule.on_publish(own, [np.array([3.0])])  # x_sent
    x = [np.array([2.5])]  # the local step since: -0.5
    fresh = PeerSnapshot(NodeState("w2", 18.0), [np.array([6.0])])
    stale = PeerSnapshot(NodeState("w4", 10.0), [np.array([-100.0])])
    out = rule.mix(own, x, [fresh, stale])
    assert x[0][0] == (3.0 + 6.0 + 3.0) / 3 - 0.5  # the stale neighbour's third stays with x; the step stays whole
    assert out.peers == ("w2",) and rule.left_out == 1 and out.metrics["left_out"] == 1.0


@pytest.mark.parametrize("graph", ["ring", "exponential", "directed-ring"])
def test_dpsgd_in_lock_step_is_the_papers_step_the_average_then_the_whole_local_step(graph: str) -> None:
    """Lian et al. 2017, Algorithm 1: ``x(k+1) = W x(k) - lr * grad f_i(x_i(k))``, the gradient at the model each
    node published, applied whole after the average. 8 nodes in lock-step on ``f_i(x) = 1/2 |x - c_i|^2`` against
    that recurrence computed with the matrix W; and nodes that start equal and take the same step of -1 a round move
    by exactly -1 a round (averaging ``x_now`` in kept only ``1/(d+1)`` of it: -1/3 a round on the ring)."""
    n, lr = 8, 0.1
    rng = np.random.default_rng(3)
    centres, start = rng.normal(size=(n, 4)), rng.normal(size=(n, 4))
    w = np.zeros((n, n))
    for i in range(n):
        around = neighbours(i, n, graph)
        for j in [i, *around]:
            w[i, j] = 1.0 / (len(around) + 1)
    sim = Simulation([[row.copy()] for row in start], lambda: DpsgdRule(graph=graph), lambda: NeighboursSchedule(graph))
    index = {f"w{i + 1}": i for i in range(n)}
    expected = start.copy()

    def train(node: Any) -> float:
        node.arrays[0] -= lr * (node.arrays[0] - centres[index[node.name]])
        return 1.0

    for _ in range(30):
        sim.run_round(train=train)
        expected = w @ expected - lr * (expected - centres)
    np.testing.assert_allclose(np.array(sim.flats()), expected, rtol=0, atol=1e-12)

    def step_back(node: Any) -> None:
        node.arrays[0] -= 1.0

    same = Simulation(
        [[np.zeros(3)] for _ in range(n)], lambda: DpsgdRule(graph=graph), lambda: NeighboursSchedule(graph)
    )
    for _ in range(10):
        same.run_round(train=step_back)
    np.testing.assert_array_equal(np.array(same.flats()), -10.0)


# --------------------------------------------------------------------------- floods of pushes at a live node


FLOOD_KINDS = (
    "valid",
    "whole",
    "bad_layout",
    "unknown_sender",
    "stray_chunk",
    "nonfinite",
    "short_chunk",
    "whole_nonfinite",
    "whole_but_streamed",
    "unstreamed_alone",
    "garbage",
    "settle",
)
"""valid / whole: a good streamed / whole push (busy once the sender has ``inbox_per_sender`` here)."""


class FakePusher:
    """A raw DEALER that speaks PUSH to a live node as peer ``w2`` (no CURVE: any client may claim a name)."""

    def __init__(self, endpoint: str, layout: wire.Layout) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.layout = layout
        self.seq = 0

    def header(
        self, node: str = "w2", w_given: float = 0.5, layout: wire.Layout | None = None, whole: bool = False
    ) -> bytes:
        self.seq += 1
        return wire.encode_push(
            node, self.seq, clock=3.0, loss=1.0, extras={"w_given": w_given}, layout=layout or self.layout, whole=whole
        )

    def chunk(self, payload: bytes, seq: int | None = None, index: int = 0) -> None:
        tag = wire.encode_chunk_tag(self.seq if seq is None else seq, index)
        self.sock.send_multipart([tag, payload], flags=self.zmq.NOBLOCK)

    def send(self, frame: bytes) -> None:
        self.sock.send(frame, flags=self.zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("per_sender", [1, 2])
def test_a_sender_fills_at_most_inbox_per_sender_and_its_oldest_push_is_mixed_first(
    tmp_path: Path, per_sender: int
) -> None:
    """Three whole pushes of one sender (models 1, 2, 3): the inbox keeps the first ``inbox_per_sender`` and
    refuses the rest busy; push-sum's update_wait folds every one kept, the oldest first (a late push of an
    in-neighbour is folded with the round's)."""
    cfg = load_config(
        write_cluster(
            tmp_path / "c.yaml",
            free_ports(2),
            interpolation="pushsum",
            inbox_per_sender=per_sender,
            fetch_probability=0.0,  # it pushes nothing itself: nobody runs w2 (nor waits on it at update_wait, close)
        )
    )
    node = DpwaConnection("w1", cfg, seed=1)
    params = [np.zeros(40, np.float32)]
    node.update_send(params, 1.0)  # publishes
    node.update_wait(1.0)
    weight = node.dpwa_state().extras["weight"]
    fake = FakePusher(node.endpoint, wire.Layout.of(params))
    try:
        for value in (1.0, 2.0, 3.0):
            payload = np.full(fake.layout.total_bytes // 4, value, np.float32).tobytes()  # 40 floats + padding
            fake.sock.send_multipart([fake.header(whole=True), payload])
        wait_until(
            lambda: node.stats()["pushes_received"] + node.stats()["pushes_busy"] == 3, 10, message="3 pushes answered"
        )
        assert (node.stats()["pushes_received"], node.stats()["pushes_busy"]) == (per_sender, 3 - per_sender)
        want = params[0].astype(np.float64)
        for value in (1.0, 2.0)[:per_sender]:  # folded in this order: x <- (w*x + 0.5*value) / (w + 0.5)
            want = (weight * want + 0.5 * value) / (weight + 0.5)
            weight += 0.5
        node.update_wait(1.0)
        assert node.dpwa_state().extras["weight"] == weight
        np.testing.assert_allclose(params[0], want, rtol=1e-6)
        assert node.stats()["inbox_occupied"] == 0
    finally:
        fake.close()
        node._node.close(announce=False)  # no leave: it would wait out a hand-off to w2, which nobody runs


@given(kinds=st.lists(st.sampled_from(FLOOD_KINDS), min_size=1, max_size=25), fill=st.floats(-1e3, 1e3))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_flood_of_pushes_never_touches_the_params_and_is_counted(tmp_path: Path, kinds: list[str], fill: float):
    """Valid, busy, malformed, oversized-in-count, non-finite, stray and unknown-sender pushes at a live node:
    nothing reaches the parameters before update_wait, every message is counted by reason, the inbox holds
    at most two pushes of the sender, and the next update_wait folds exactly the accepted ones, oldest first."""
    path = tmp_path / f"f{random.random()}.yaml"  # fetch_probability 0: it pushes nothing to w2, which nobody runs
    cfg = load_config(write_cluster(path, free_ports(2), interpolation="pushsum", fetch_probability=0.0))
    node = DpwaConnection("w1", cfg, seed=1)
    params = [np.linspace(-1, 1, 120).astype(np.float32)]
    node.update_send(params, 1.0)  # publishes
    node.update_wait(1.0)
    before = params[0].copy()
    weight0 = node.dpwa_state().extras["weight"]
    fake = FakePusher(node.endpoint, wire.Layout.of(params))
    good = np.full(fake.layout.total_bytes // 4, fill, np.float32).tobytes()
    expected: dict[str, int] = {}

    def count(key: str) -> None:
        expected[key] = expected.get(key, 0) + 1

    held = 0  # pushes of the sender in the inbox (at most inbox_per_sender = 2 by default)
    try:
        for kind in kinds:
            if kind in ("valid", "nonfinite", "short_chunk"):  # streamed: the header, then its chunk
                fake.send(fake.header())
                if held == 2:  # busy: the chunk that follows belongs to no push
                    fake.chunk(good)
                    count("pushes_busy")
                    count("push_stale_chunks")
                    continue
                bad = np.full(len(good) // 4, np.nan, np.float32).tobytes() if kind == "nonfinite" else good[:8]
                fake.chunk(good if kind == "valid" else bad)
                held += kind == "valid"
                count("pushes_received" if kind == "valid" else "pushes_rejected")
            elif kind in ("whole", "whole_nonfinite"):  # header and chunk in one message
                bad = np.full(len(good) // 4, np.inf, np.float32).tobytes()
                fake.sock.send_multipart([fake.header(whole=True), good if kind == "whole" else bad])
                if held == 2:
                    count("pushes_busy")
                    continue
                held += kind == "whole"
                count("pushes_received" if kind == "whole" else "pushes_rejected")
            elif kind == "whole_but_streamed":  # a streamed header may not carry its payload
                fake.sock.send_multipart([fake.header(), good])
                count("pushes_rejected")
            elif kind == "unstreamed_alone":  # a whole push's header without its payload
                fake.send(fake.header(whole=True))
                count("pushes_rejected")
            elif kind == "bad_layout":
                fake.send(fake.header(layout=wire.Layout(("<f4",), ((7,),))))
                count("pushes_rejected")
            elif kind == "unknown_sender":
                fake.send(fake.header(node="w9"))
                count("pushes_rejected")
            elif kind == "stray_chunk":
                fake.chunk(good, seq=10**6 + fake.seq)
                count("push_stale_chunks")
            elif kind == "garbage":
                fake.send(wire.MAGIC + wire.PROTOCOL_VERSION.to_bytes(2, "little") + b"\x04{not json")
                count("requests_rejected")
            else:  # a settle about a push that never came: closes that sequence number, answers not-delivered
                fake.seq += 1
                fake.send(wire.encode_settle("w2", fake.seq, "query"))

        def counted() -> bool:
            s = node.stats()
            return all(s[k] >= v for k, v in expected.items())

        wait_until(counted, 10, message=f"counters reach {expected}")
        stats = node.stats()
        assert {k: stats[k] for k in expected} == expected
        assert np.array_equal(params[0], before)  # nothing is mixed before update_wait
        assert stats["inbox_occupied"] == held and stats["thread_errors"] == {}
        want = params[0].astype(np.float64)
        for _ in range(held):  # every accepted push, one after the other: x <- (w*x + 0.5*fill) / (w + 0.5)
            want = (weight0 * want + 0.5 * np.float32(fill)) / (weight0 + 0.5)
            weight0 += 0.5
        node.update_wait(1.0)
        assert node.dpwa_state().extras["weight"] == weight0
        np.testing.assert_allclose(params[0], want, rtol=1e-5, atol=1e-4)
        node.update_wait(1.0)  # nothing is left
        assert node.dpwa_state().extras["weight"] == weight0 and node.stats()["inbox_occupied"] == 0
        if not held:
            assert np.array_equal(params[0], before)
    finally:
        fake.close()
        node._node.close(announce=False)  # no leave: it would wait out a hand-off to w2, which nobody runs
