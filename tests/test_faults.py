"""Faults: a node killed with SIGKILL mid-run. The survivors keep training at their old pace.

Four node processes (tests/fault_worker.py: a 20 ms simulated step, a fetch per
step, timeout_ms 300) train for a while; one is SIGKILLed in the middle. Every
survivor's update_wait stays below timeout_ms + slack throughout, flow control
marks the dead node down (its score falls, it leaves ``peers_up``), and the
survivors' steps/s once it is down are within 10 % of before.

Measuring steps/s on a shared 2-core machine: the rate of a window is the
inverse of its median step duration (a step being update_send, the simulated
step and update_wait). The median ignores the few steps that a down node's
probes cost (one timeout after 1 s, 2 s, 4 s, ... of backoff) and the scheduler's
hiccups; the mean rate, probes included, is reported and checked more loosely.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeProcess, free_ports, write_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timing]

HERE = Path(__file__).resolve().parent
FAULT_WORKER = HERE / "fault_worker.py"
TIMEOUT_MS = 300
SLACK_MS = 250


class FaultNode(NodeProcess):
    """tests/fault_worker.py in a subprocess (optionally under a command prefix such as ``ip netns exec NS``)."""

    def __init__(
        self,
        name: str,
        config: Path,
        *,
        seed: int,
        prefix: Sequence[str] = (),
        step_ms: float = 20.0,
        drift: float = 0.0,
        size: int = 1000,
    ) -> None:
        argv = [*prefix, sys.executable, str(FAULT_WORKER), "--name", name, "--config", str(config)]
        argv += ["--seed", str(seed), "--size", str(size), "--step-ms", str(step_ms), "--drift", str(drift)]
        self._spawn(name, argv, env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_all(nodes: Sequence[FaultNode], seconds: float) -> list[list[list[Any]]]:
    """Every node trains for ``seconds`` at once; their step records."""
    for n in nodes:
        n.send(f"run_for {seconds}")
    return [n.read(timeout=seconds + 60)["steps"] for n in nodes]


def step_rate(
    steps: Sequence[Sequence[Any]], start: float, end: float, probes_of: str = ""
) -> tuple[float, float, float, int]:
    """Steps/s of the steps inside [start, end): (from the median step, mean, mean without probes, count).

    A step lasts from its update_send to the next one. "Without probes" leaves out the steps that fetched
    ``probes_of`` (a dead node's probes: one timeout each, by design).
    """
    inside = [s for s in steps if s[0] >= start and s[1] < end]
    if len(inside) < 20:
        return 0.0, 0.0, 0.0, len(inside)
    durations = [(b[0] - a[0], a[4]) for a, b in zip(inside, inside[1:])]
    mean = len(durations) / sum(d for d, _ in durations)
    rest = [d for d, peer in durations if peer != probes_of or not probes_of]
    return 1.0 / statistics.median(d for d, _ in durations), mean, len(rest) / sum(rest), len(inside)


def down_time(steps: Sequence[Sequence[Any]], dead: str, after: float) -> float | None:
    """When this node's flow control marked ``dead`` down: the end of its 3rd failed fetch of it after ``after``."""
    failures = 0
    for s in steps:
        if s[0] >= after - 1.0 and s[4] == dead and s[5] != "ok" and s[1] > after:
            failures += 1
            if failures == 3:
                return s[1]
    return None


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[FaultNode]]:
    ports = free_ports(4)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=TIMEOUT_MS)
    started: list[FaultNode] = []
    try:
        for i in range(4):
            started.append(FaultNode(f"w{i + 1}", cfg, seed=i + 1))
        yield started
    finally:
        for node in started:
            node.kill()


@pytest.mark.slow  # 17 s here
def test_sigkill_survivors_keep_training_at_their_pace(cluster: list[FaultNode]) -> None:
    *survivors, victim = cluster
    run_all(cluster, 1.0)  # warm-up: connections, snapshot pools, receive buffers
    total_s, kill_after_s = 16.0, 5.0
    for n in cluster:
        n.send(f"run_for {total_s}")
    t0 = time.monotonic()
    time.sleep(kill_after_s)
    os.kill(victim.proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    victim.proc.wait(10)
    records = [n.read(timeout=total_s + 60)["steps"] for n in survivors]
    stats = [n.call("stats") for n in survivors]

    report = []
    for node, steps, s in zip(survivors, records, stats):
        name = node.name
        after_kill = [st for st in steps if st[0] >= t_kill]
        waits = [st[2] for st in steps]
        assert max(waits) <= TIMEOUT_MS + SLACK_MS, (name, sorted(waits)[-5:])
        # it keeps training and mixing with the live peers
        assert len(after_kill) > 200, (name, len(after_kill))
        assert any(st[3] > 0 and st[4] != victim.name for st in after_kill), name
        # flow control moved away from the dead node
        t_down = down_time(steps, victim.name, t_kill)
        assert t_down is not None, (name, [st[4:] for st in after_kill[:20]])
        assert victim.name not in s["peers_up"] and set(s["peers_up"]) == {n.name for n in survivors} - {name}
        live_scores = [score for peer, score in s["scores"].items() if peer != victim.name]
        assert s["scores"][victim.name] <= 1000 - 3 * 100 < min(live_scores), s["scores"]
        assert s["by_peer"][victim.name].get("timeout", 0) >= 3, s["by_peer"]
        # steps/s: before the kill vs once the dead node is down
        before, before_mean, _, n_before = step_rate(steps, t0 + 1.0, t_kill)
        after, after_mean, after_unprobed, n_after = step_rate(steps, t_down + 0.5, t0 + total_s, victim.name)
        probes = sum(1 for st in steps if st[0] >= t_down + 0.5 and st[4] == victim.name)
        report.append(
            f"{name}: down {t_down - t_kill:.2f}s after the kill; steps/s median {before:.1f} -> {after:.1f}, "
            f"mean {before_mean:.1f} -> {after_mean:.1f} ({after_unprobed:.1f} without its {probes} probes of "
            f"{victim.name}; {n_before} / {n_after} steps)"
        )
        assert n_before >= 50 and n_after >= 200, report
        assert abs(after - before) <= 0.10 * before, report
        assert abs(after_unprobed - before_mean) <= 0.10 * before_mean, report
        # each probe of the dead node (after 1, 2, 4, ... s of backoff) costs one timeout: 3-4 in this window
        assert probes <= 5 and after_mean >= 0.70 * before_mean, report
    print("\n".join(report))
