"""Synchronous SGP and OSGP on the network: update_wait waits for the in-neighbours of the round.

Push-sum on a fixed schedule (the exponential graph, the ring): at ``update_wait`` of round ``k`` a node
waits, at most ``timeout_ms``, until each in-neighbour of round ``k - overlap`` has a push of that round
settled in its inbox; a push that comes late is folded at the next step. The schedules' ``sources`` (the
in-neighbours) are checked against their ``targets`` without sockets; the waits with nodes of this process
on 127.0.0.1, a trainer thread each, whose progress the test gates on conditions (never on sleeps).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import free_ports, in_threads, wait_until, write_cluster

from dpwa.config import load_config
from dpwa.node.connection import DpwaConnection
from dpwa.rules.base import NodeState
from dpwa.rules.schedules import (
    ExponentialSchedule,
    GroupsSchedule,
    NeighboursSchedule,
    RandomSchedule,
    RingSchedule,
    Round,
    Schedule,
)


def _round(me: str, names: tuple[str, ...], k: int) -> Round:
    return Round(me, names, k, NodeState(me))


@pytest.mark.parametrize(
    "schedule",
    [ExponentialSchedule(), RingSchedule(), NeighboursSchedule("ring"), NeighboursSchedule("exponential")]
    + [GroupsSchedule(2, 0), GroupsSchedule(3, 4)],
    ids=lambda s: f"{s.name}-{getattr(s, 'graph', getattr(s, 'group_size', ''))}",
)
def test_sources_are_exactly_the_nodes_whose_targets_name_me(schedule: Schedule) -> None:
    """For every cluster size 1-17 and round 0-11: ``j in sources(i, k)`` iff ``i in targets(j, k)``."""
    for n in range(1, 18):
        names = tuple(f"n{i}" for i in range(n))
        for k in range(12):
            pushes_to = {j: set(schedule.targets(_round(j, names, k)) or ()) for j in names}
            for i in names:
                want = sorted(j for j in names if i in pushes_to[j])
                assert sorted(schedule.sources(_round(i, names, k)) or ()) == want, (n, k, i)


def test_a_schedule_flow_control_chooses_has_no_known_sources() -> None:
    assert RandomSchedule().sources(_round("a", ("a", "b", "c"), 3)) is None


# --------------------------------------------------------------------------- on the network


def _cluster(tmp_path: Path, n: int, **settings: Any) -> list[DpwaConnection]:
    cfg = load_config(write_cluster(tmp_path / "c.yaml", free_ports(n), interpolation="pushsum", **settings))
    return [DpwaConnection(f"w{i + 1}", cfg, seed=i) for i in range(n)]


def _params(n: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [[rng.normal(size=200)] for _ in range(n)]


def _run(
    conns: Sequence[DpwaConnection],
    params: Sequence[list[np.ndarray]],
    steps: int,
    before_send: Callable[[int, int], None] | None = None,
    after_wait: Callable[[int, int, dict[str, Any]], None] | None = None,
    timeout_s: float = 120.0,
) -> list[list[dict[str, Any]]]:
    """Every node in its own thread: ``steps`` iterations of update_send, update_wait; each one's record.

    ``before_send(node, k)`` runs before iteration ``k``'s update_send (a gate the test controls),
    ``after_wait(node, k, record)`` after its update_wait."""
    records: list[list[dict[str, Any]]] = [[] for _ in conns]

    def node(i: int) -> None:
        for k in range(steps):
            if before_send is not None:
                before_send(i, k)
            conns[i].update_send(params[i], 1.0)
            conns[i].update_wait(1.0)
            records[i].append(dict(conns[i].last_exchange or {}))
            if after_wait is not None:
                after_wait(i, k, records[i][-1])

    in_threads(len(conns), node, timeout_s)
    return records


def _weights(conns: Sequence[DpwaConnection]) -> list[float]:
    return [c.dpwa_state().extras["weight"] for c in conns]


def _publish_all(conns: Sequence[DpwaConnection], params: Sequence[list[np.ndarray]]) -> None:
    """Every node publishes a layout before any pushes (a push to a node without one is refused, not late)."""
    for c, p in zip(conns, params):
        c.update_send(p, 1.0)
    for c in conns:
        c.update_wait(1.0)
    _quiesce(conns)


def _quiesce(conns: Sequence[DpwaConnection]) -> None:
    def quiet() -> bool:  # the stats first, then a wait that collects what settled before them (test_push.quiesce)
        stats = [c.stats() for c in conns]
        for c in conns:
            c.update_wait(1.0)
        return all(s["pushes_unsettled"] == 0 and s["inbox_occupied"] == 0 for s in stats)

    wait_until(quiet, 20, message="pushes settled and inboxes drained")


@pytest.mark.integration
@pytest.mark.parametrize("n", [4, 8])
def test_in_lock_step_on_the_exponential_graph_every_weight_is_one(tmp_path: Path, n: int) -> None:
    """``n`` nodes, a power of two, on SGP's exponential graph: once every node has heard every in-neighbour
    (the first ``log2 n`` rounds are not yet synchronous), each round folds exactly the round's push, and after
    ``log2 n`` such rounds every weight is exactly 1 (the one-peer exponential graph averages exactly in
    ``log2 n`` rounds). Checked from round 4 * log2 n to 40; mass stays ``n`` within 1e-9.

    ``timeout_ms`` is 30 s so that no push of a live node is ever late: a late one would be a bug here."""
    conns = _cluster(tmp_path, n, timeout_ms=30000)
    try:
        params = _params(n)
        _publish_all(conns, params)
        records = _run(conns, params, 40)
        hops = int(math.log2(n))
        for i, node_records in enumerate(records):
            for k, record in enumerate(node_records[4 * hops :], start=4 * hops):
                assert record["sources_late"] == 0, (i, k, record)
                assert record["received"] == 1, (i, k, record)  # exactly the round's push
                assert abs(record["weight"] - 1.0) <= 1e-9, (i, k, record["weight"])
        _quiesce(conns)
        assert math.fsum(_weights(conns)) == pytest.approx(n, abs=1e-9)
    finally:
        for c in conns:
            c.close()


@pytest.mark.integration
@pytest.mark.parametrize("given", [True, False], ids=["params-at-start", "params-at-first-send"])
def test_a_push_before_the_receivers_first_update_send_is_taken_when_it_gave_its_params(
    tmp_path: Path, given: bool
) -> None:
    """4 nodes on the exponential graph, all past ``wait_for_peers``; node ``i`` sends its first push only once
    node ``i-1``'s round-0 push (to ``i``) has its verdict, so every round-0 push but one reaches a node that
    has not called ``update_send`` yet. Given its params at construction (as the PyTorch adapter does) a node
    takes it: every round folds exactly its push and every weight is exactly 1 from round 0 on. Without
    them the push is refused "not ready", its mass goes back, and the receiver's weight leaves 1."""
    n = 4
    params = _params(n)
    cfg = load_config(write_cluster(tmp_path / "c.yaml", free_ports(n), interpolation="pushsum", timeout_ms=30000))
    conns = [DpwaConnection(f"w{i + 1}", cfg, seed=i, params=params[i] if given else None) for i in range(n)]
    try:
        for c in conns:
            assert all(c.wait_for_peers(30).values())

        def pushed(c: DpwaConnection) -> bool:
            s = c.stats()
            return s["pushes_sent"] >= 1 and s["pushes_unsettled"] == 0

        def gate(i: int, k: int) -> None:
            if k == 0 and i > 0:
                wait_until(lambda: pushed(conns[i - 1]), 30, message=f"w{i}'s round-0 push settled")

        records = _run(conns, params, 12, before_send=gate)
        weights = [[r["weight"] for r in node_records] for node_records in records]
        if given:
            assert all(abs(w - 1.0) <= 1e-9 for ws in weights for w in ws), weights
            assert all(r["received"] == 1 for node_records in records for r in node_records), records
            assert sum(c.stats()["pushes_returned"] for c in conns) == 0
        else:  # the contrast: the same gating refuses the pushes and moves the weights
            assert min(min(ws) for ws in weights) <= 0.5 + 1e-9, weights
        _quiesce(conns)
        assert math.fsum(_weights(conns)) == pytest.approx(n, abs=1e-9)
    finally:
        for c in conns:
            c.close()


@pytest.mark.integration
def test_a_late_push_is_folded_at_the_next_step_once_and_mass_stays_exact(tmp_path: Path) -> None:
    """Two nodes (each the other's in-neighbour every round), ``timeout_ms`` 300: w2 holds its push of
    iteration 5 back until w1's update_wait of iteration 5 has given up on it (``sources_late`` 1). w1 goes
    on; the late push is folded at a later step, exactly once: w1 folds as many messages as w2 had
    delivered, and the two weights sum to 2 within 1e-9."""
    conns = _cluster(tmp_path, 2, timeout_ms=300)
    late_seen = threading.Event()
    try:
        params = _params(2)
        _publish_all(conns, params)

        def gate(i: int, k: int) -> None:
            if i == 1 and k == 5:
                assert late_seen.wait(30), "w1 never gave up waiting for w2's round-5 push"

        def seen(i: int, k: int, record: dict[str, Any]) -> None:
            if i == 0 and k == 5:  # w2's push of this round is held back by the gate: w1 must give up on it
                assert record["sources_late"] == 1, record
                late_seen.set()

        records = _run(conns, params, 30, before_send=gate, after_wait=seen)
        late_rounds = [k for k, r in enumerate(records[0]) if r["sources_late"]]
        assert 5 in late_rounds, late_rounds
        _quiesce(conns)
        folded = [c.last_exchange["messages_received"] for c in conns]  # the rule's count, as of the last step
        delivered = [c.stats()["pushes_delivered"] for c in conns]
        assert folded == delivered[::-1], (folded, delivered)
        assert math.fsum(_weights(conns)) == pytest.approx(2.0, abs=1e-9)
    finally:
        for c in conns:
            c.close()


@pytest.mark.integration
@pytest.mark.parametrize("overlap", [0, 2])
def test_a_node_runs_at_most_overlap_rounds_ahead_of_its_in_neighbour(tmp_path: Path, overlap: int) -> None:
    """Two nodes; w2 stops after round 3 (its trainer blocks; its RX thread still ACKs). w1's update_wait
    waits for w2's push of round ``k - overlap``: rounds up to ``3 + overlap`` find it there, round
    ``4 + overlap`` waits the whole ``timeout_ms`` in vain (``sources_late`` 1), and so does every later one
    while w2 is still in the window."""
    conns = _cluster(tmp_path, 2, timeout_ms=400, pushsum={"overlap": overlap})
    release = threading.Event()
    try:
        params = _params(2)
        _publish_all(conns, params)
        records: list[list[dict[str, Any]]] = [[], []]

        w2_done = threading.Event()

        def w2() -> None:
            for _ in range(4):
                conns[1].update_send(params[1], 1.0)
                conns[1].update_wait(1.0)
                # every round's push settled before the next (with overlap > 0 a push to a peer whose previous
                # one is unanswered is skipped, and w1 would wait for the next one instead)
                wait_until(lambda: conns[1].stats()["pushes_unsettled"] == 0, 30, message="w2's push settled")
            w2_done.set()
            release.wait(60)

        thread = threading.Thread(target=w2)
        thread.start()
        try:
            assert w2_done.wait(30), "w2's four rounds did not end"  # each push settled (taken, or refused busy)
            for _ in range(6 + overlap):
                conns[0].update_send(params[0], 1.0)
                conns[0].update_wait(1.0)
                records[0].append(dict(conns[0].last_exchange or {}))
        finally:
            release.set()
            thread.join(30)
        late = [r["sources_late"] for r in records[0]]
        assert late[: 4 + overlap] == [0] * (4 + overlap), late
        assert late[4 + overlap :] == [1] * (2), late
        assert all(r["sources_wait_ms"] >= 400 for r in records[0][4 + overlap :]), records[0]
    finally:
        for c in conns:
            c.close()
