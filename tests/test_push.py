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
from conftest import free_ports, wait_until, write_cluster
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


def cluster(tmp_path: Path, n: int, label: str = "c", **settings: Any) -> list[DpwaConnection]:
    cfg = load_config(write_cluster(tmp_path / f"{label}.yaml", free_ports(n), **settings))
    return [DpwaConnection(f"w{i + 1}", cfg, seed=i) for i in range(n)]


def start_params(n: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=300), rng.normal(size=(4, 5))] for _ in range(n)]


def run_threads(
    conns: Sequence[DpwaConnection],
    params: Sequence[list[np.ndarray]],
    steps: int,
    step_s: Callable[[int, int], float],
    on_wait: Callable[[int, DpwaConnection], None] | None = None,
) -> None:
    """Every node: ``steps`` rounds of update_send, a "step" of ``step_s(node, k)`` seconds, update_wait."""
    barrier = threading.Barrier(len(conns))
    errors: list[BaseException] = []

    def node(i: int) -> None:
        try:
            barrier.wait(timeout=10)
            for k in range(steps):
                conns[i].update_send(params[i], 1.0)
                time.sleep(step_s(i, k))
                conns[i].update_wait(1.0)
                if on_wait is not None:
                    on_wait(i, conns[i])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(len(conns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a trainer thread hung"
    assert not errors, errors


def quiesce(conns: Sequence[DpwaConnection], timeout: float = 20.0) -> None:
    """Let every push settle and every inbox drain (update_wait without update_send folds what arrived)."""

    def quiet() -> bool:
        for c in conns:
            c.update_wait(1.0)
        stats = [c.stats() for c in conns]
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
    """20 two-node runs of 500 steps, half in exact lock-step (fixed 2 ms step, no jitter), half jittered:
    every node mixes on at least 90 % of its steps, and the weights sum to 2 within 1e-9 once quiet.

    (A step does not mix when no push of the peer landed inside it: with steps of 2 to 4 ms drawn at
    random that happens on ~12 % of the steps, a property of two unsynchronised clocks, not of dpwa.)"""
    rates = []
    for run in range(20):
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
    assert len(rates) == 40


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


def test_pushsum_mass_survives_dropped_pushes_and_dropped_acks(tmp_path: Path) -> None:
    """A test hook loses pushes (the receiver never sees them) and ACKs (it took the push, the sender never
    hears): SETTLE queries settle each one, and the weights still sum to N within 1e-9, the average exact."""
    conns = cluster(tmp_path, 4, interpolation="pushsum", timeout_ms=150)
    try:
        for i, c in enumerate(conns):
            rng = random.Random(100 + i)
            c._node.inbox.drop = lambda kind, rng=rng: rng.random() < 0.2
        params = start_params(4, seed=3)
        mean0 = np.mean([np.concatenate([a.ravel() for a in p]) for p in params], axis=0)
        rng = random.Random(2)
        run_threads(conns, params, 120, lambda i, k: rng.random() * 0.003)
        for c in conns:
            c._node.inbox.drop = None
        quiesce(conns)
        stats = [c.stats() for c in conns]
        assert sum(s["pushes_dropped_by_hook"] for s in stats) > 5
        assert sum(s["acks_dropped_by_hook"] for s in stats) > 5
        assert sum(s["push_queries"] for s in stats) >= sum(s["pushes_unknown"] for s in stats) > 10
        assert sum(s["pushes_returned"] for s in stats) > 5  # the lost pushes' mass came back
        assert math.fsum(weights(conns)) == pytest.approx(4.0, abs=1e-9)
        np.testing.assert_allclose(weighted_mean(conns, params), mean0, atol=1e-9)
    finally:
        close_all(conns)


def test_osgp_keeps_at_most_overlap_pushes_unacknowledged_under_a_slow_receiver(tmp_path: Path) -> None:
    """OSGP (overlap 2) against receivers that hold every ACK 0.2 s: update_wait returns with at most two
    pushes unacknowledged, blocking only beyond; with overlap 0 every push is acknowledged by its step's end."""
    for overlap in (2, 0):
        conns = cluster(
            tmp_path,
            5,
            f"o{overlap}",
            interpolation="pushsum",
            peers="random",
            timeout_ms=3000,
            pushsum={"overlap": overlap},
        )
        try:
            params = start_params(5)
            for c in conns:
                c._node.inbox.ack_delay_s = 0.2
            lags, waits = [], []

            def record(i: int, conn: DpwaConnection, lags: list[int] = lags, waits: list[float] = waits) -> None:
                if i == 0:
                    ledger = conn._node.ledger
                    lags.append(sum(p.status == "sending" for p in ledger.unresolved()))
                    waits.append(conn.last_exchange["wait_ms"])

            run_threads(conns, params, 30, lambda i, k: 0.01, record)
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


def test_adpsgd_conserves_the_mean_where_constant_drifts(tmp_path: Path) -> None:
    """Four nodes, no local steps, random peers, jittered timing: AD-PSGD's symmetric exchanges keep the mean
    of the models (1e-6) and reach consensus; the one-sided constant pull reaches consensus elsewhere."""
    drift, spread = mean_drift_and_spread(tmp_path, "adpsgd")
    assert drift < 1e-6 and spread < 1e-3
    drift_constant, spread_constant = mean_drift_and_spread(tmp_path, "constant")
    assert spread_constant < 1e-3 and drift_constant > 1e-3


def test_dpsgd_reaches_consensus_over_the_network(tmp_path: Path) -> None:
    conns = cluster(tmp_path, 4, interpolation="dpsgd", timeout_ms=3000)
    try:
        params = start_params(4, seed=2)
        rng = random.Random(3)
        run_threads(conns, params, 80, lambda i, k: rng.random() * 0.003)
        flat = [np.concatenate([a.ravel() for a in p]) for p in params]
        mean = np.mean(flat, axis=0)
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
    x = [np.array([3.0])]
    fresh = PeerSnapshot(NodeState("w2", 18.0), [np.array([6.0])])
    stale = PeerSnapshot(NodeState("w4", 10.0), [np.array([-100.0])])
    out = rule.mix(own, x, [fresh, stale])
    assert x[0][0] == pytest.approx((3.0 + 6.0 + 3.0) / 3)  # the stale neighbour's third stays with x
    assert out.peers == ("w2",) and rule.left_out == 1 and out.metrics["left_out"] == 1.0


# --------------------------------------------------------------------------- floods of pushes at a live node


FLOOD_KINDS = ("valid", "bad_layout", "unknown_sender", "stray_chunk", "nonfinite", "short_chunk", "garbage", "settle")


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

    def header(self, node: str = "w2", w_given: float = 0.5, layout: wire.Layout | None = None) -> bytes:
        self.seq += 1
        return wire.encode_push(
            node, self.seq, clock=3.0, loss=1.0, extras={"w_given": w_given}, layout=layout or self.layout
        )

    def chunk(self, payload: bytes, seq: int | None = None, index: int = 0) -> None:
        tag = wire.encode_chunk_tag(self.seq if seq is None else seq, index)
        self.sock.send_multipart([tag, payload], flags=self.zmq.NOBLOCK)

    def send(self, frame: bytes) -> None:
        self.sock.send(frame, flags=self.zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@given(kinds=st.lists(st.sampled_from(FLOOD_KINDS), min_size=1, max_size=25), fill=st.floats(-1e3, 1e3))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_flood_of_pushes_never_touches_the_params_and_is_counted(tmp_path: Path, kinds: list[str], fill: float):
    """Valid, busy, malformed, oversized-in-count, non-finite, stray and unknown-sender pushes at a live node:
    nothing reaches the parameters before update_wait, every message is counted by reason, the inbox holds
    at most one push of the sender, and update_wait folds exactly the one accepted push."""
    cfg = load_config(
        write_cluster(tmp_path / f"f{random.random()}.yaml", free_ports(2), interpolation="pushsum", timeout_ms=300)
    )
    node = DpwaConnection("w1", cfg, seed=1)
    params = [np.linspace(-1, 1, 120).astype(np.float32)]
    node.update_send(params, 1.0)  # publishes (its own push to w2 is refused: nobody there)
    node.update_wait(1.0)
    before = params[0].copy()
    weight0 = node.dpwa_state().extras["weight"]
    fake = FakePusher(node.endpoint, wire.Layout.of(params))
    good = np.full(fake.layout.total_bytes // 4, fill, np.float32).tobytes()
    expected: dict[str, int] = {}
    occupied = False  # the sender's one unmixed push is in the inbox
    try:
        for kind in kinds:
            if kind in ("valid", "nonfinite", "short_chunk"):
                fake.send(fake.header())
                if occupied:  # busy: the chunk that follows belongs to no push
                    fake.chunk(good)
                    expected["pushes_busy"] = expected.get("pushes_busy", 0) + 1
                    expected["push_stale_chunks"] = expected.get("push_stale_chunks", 0) + 1
                    continue
                if kind == "valid":
                    fake.chunk(good)
                    occupied = True
                    expected["pushes_received"] = expected.get("pushes_received", 0) + 1
                else:
                    bad = np.full(len(good) // 4, np.nan, np.float32).tobytes() if kind == "nonfinite" else good[:8]
                    fake.chunk(bad)
                    expected["pushes_rejected"] = expected.get("pushes_rejected", 0) + 1
            elif kind == "bad_layout":
                fake.send(fake.header(layout=wire.Layout(("<f4",), ((7,),))))
                expected["pushes_rejected"] = expected.get("pushes_rejected", 0) + 1
            elif kind == "unknown_sender":
                fake.send(fake.header(node="w9"))
                expected["pushes_rejected"] = expected.get("pushes_rejected", 0) + 1
            elif kind == "stray_chunk":
                fake.chunk(good, seq=10**6 + fake.seq)
                expected["push_stale_chunks"] = expected.get("push_stale_chunks", 0) + 1
            elif kind == "garbage":
                fake.send(b"DPWA\x01\x00\x04{not json")
                expected["requests_rejected"] = expected.get("requests_rejected", 0) + 1
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
        assert stats["inbox_occupied"] == int(occupied) and stats["thread_errors"] == {}
        node.update_wait(1.0)
        weight = node.dpwa_state().extras["weight"]
        if occupied:  # exactly the accepted push: x <- (w*x + 0.5*fill) / (w + 0.5)
            assert weight == weight0 + 0.5
            want = (weight0 * before.astype(np.float64) + 0.5 * np.float32(fill)) / (weight0 + 0.5)
            np.testing.assert_allclose(params[0], want, rtol=1e-5, atol=1e-4)
        else:
            assert weight == weight0 and np.array_equal(params[0], before)
    finally:
        fake.close()
        node.close()
