"""Nodes in separate processes on 127.0.0.1: convergence, late start, silent and broken peers, restart."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import free_ports, port_is_free, wait_until, write_cluster
from test_connection import FakePeer, state_reply

pytestmark = [pytest.mark.integration, pytest.mark.timing]


def spread(vectors: list[np.ndarray]) -> float:
    """Largest distance of a node's parameters to the nodes' mean."""
    mean = np.mean(vectors, axis=0)
    return max(float(np.linalg.norm(v - mean)) for v in vectors)


def flat(answer: dict) -> np.ndarray:
    return np.concatenate([np.asarray(a) for a in answer["params"]])


def run_all(procs, rounds: int) -> list[dict]:
    """Run ``rounds`` on every node at once; return their answers."""
    for p in procs:
        p.send(f"run {rounds}")
    return [p.read(timeout=120) for p in procs]


@pytest.mark.outcome
def test_four_processes_converge(tmp_path: Path, nodes, record_property: Callable[[str, object], None]):
    ports = free_ports(4)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=1000, interpolation="constant", constant={"value": 0.5})
    procs = [nodes(f"w{i + 1}", cfg, seed=i + 1) for i in range(4)]
    before = spread([flat(p.call("params")) for p in procs])
    answers = run_all(procs, 40)
    after = spread([flat(p.call("params")) for p in procs])
    record_property("after_over_before", after / before)
    assert before > 1.0
    assert after <= before / 100, (before, after)
    mixed = [f for a in answers for f in a["factors"] if f > 0]
    assert mixed and all(f == 0.5 for f in mixed)
    for p in procs:
        p.quit()
    assert all(port_is_free(port) for port in ports)


def test_late_node_is_picked_up(tmp_path: Path, nodes):
    ports = free_ports(4)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=300)
    early = [nodes(f"w{i + 1}", cfg, seed=i + 1) for i in range(3)]
    run_all(early, 15)
    assert all(p.call("stats")["by_peer"].get("w4", {}).get("ok", 0) == 0 for p in early)
    late = nodes("w4", cfg, seed=4)
    everyone = [*early, late]

    def w4_mixed_in() -> bool:
        run_all(everyone, 5)
        return all(p.call("stats")["by_peer"].get("w4", {}).get("ok", 0) > 0 for p in early)

    wait_until(w4_mixed_in, timeout=60, interval=0, message="every early node fetched from w4")
    assert late.call("stats")["fetches_ok"] > 0


def test_stopped_peer_costs_at_most_timeout_and_comes_back(tmp_path: Path, nodes):
    ports = free_ports(2)
    timeout_ms = 400
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=timeout_ms)
    w1, w2 = nodes("w1", cfg, seed=1), nodes("w2", cfg, seed=2)
    run_all([w1, w2], 3)
    os.kill(w2.proc.pid, signal.SIGSTOP)  # its socket stays open; it just never answers
    try:
        answer = w1.call("run 6")
        assert max(answer["wait_ms"]) <= timeout_ms + 250, answer["wait_ms"]
        assert w1.call("stats")["by_peer"]["w2"].get("timeout", 0) >= 1
    finally:
        os.kill(w2.proc.pid, signal.SIGCONT)

    def mixes_again() -> bool:  # both step: a resumed peer that published nothing new would be a repeat
        return any(f > 0 for f in run_all([w1, w2], 5)[0]["factors"])

    wait_until(mixes_again, timeout=60, interval=0.1, message="w1 mixes with w2 again after it resumed")


def test_wrong_layout_peer_changes_nothing(tmp_path: Path, nodes):
    ports = free_ports(3)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=1000)
    w1, w2 = nodes("w1", cfg, seed=1), nodes("w2", cfg, seed=2)
    odd = nodes("w3", cfg, seed=3, size=999)
    odd_before = flat(odd.call("params"))
    run_all([w1, w2, odd], 20)
    assert np.array_equal(flat(odd.call("params")), odd_before)
    s1, s3 = w1.call("stats"), odd.call("stats")
    assert s3["mixes"] == 0 and s3["fetches_refused"] >= 1
    assert s1["by_peer"].get("w3", {}).get("refused", 0) >= 1
    assert s1["by_peer"].get("w3", {}).get("ok", 0) == 0


@pytest.mark.parametrize("kind", ["truncated", "wrong-layout"])
def test_broken_reply_from_another_process_is_counted(tmp_path: Path, nodes, kind):
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=1000)
    w1 = nodes("w1", cfg, seed=1, size=10)
    before = flat(w1.call("params"))
    fake = FakePeer(ports[1])
    shapes = [(10,), (3, 7)] if kind == "truncated" else [(11,), (3, 7)]
    payload = [np.ones(s, np.float32) for s in shapes]
    fake.respond = (
        (lambda h: state_reply(h, payload)[:-1]) if kind == "truncated" else (lambda h: state_reply(h, payload))
    )
    try:
        answer = w1.call("run 3")
    finally:
        fake.close()
    assert answer["factors"] == [0.0, 0.0, 0.0]
    assert np.array_equal(flat(w1.call("params")), before)
    reasons = w1.call("stats")["rejected_by_reason"]
    assert reasons.get("frames" if kind == "truncated" else "layout", 0) >= 1, reasons


def test_node_restarts_on_the_same_port(tmp_path: Path, nodes):
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports)
    w2 = nodes("w2", cfg, seed=2)
    for attempt in range(3):
        w1 = nodes("w1", cfg, seed=1)
        run_all([w1, w2], 3)
        w1.quit()
        assert w1.proc.returncode == 0
        assert port_is_free(ports[0]), attempt
    w2.quit()
