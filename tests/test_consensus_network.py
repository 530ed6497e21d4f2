"""The consensus point of every rule over the network: 4 processes under ``dpwa run``, real timing.

The same problem as tests/test_consensus.py (node ``i`` minimizes ``1/2 ||x - c_i||^2``, a decaying local
step), run by ``tests/quadratic_worker.py`` in 4 processes on 127.0.0.1: 400 steps of 3 ms (a sleep, the
compute a real step would take), after every node has seen its peers up. The figures, relative to the
centres' mean distance to their mean: *bias*, the distance of the nodes' mean to the minimizer of the average
objective (the mean of the centres); *spread*, the farthest node's distance to the nodes' mean.

Real timing moves the figures (which peer answers when; how many steps a node trains after the others have
stopped), so the bounds are measured: 30 runs of every rule here (seeds 0-29, nothing else running), the
largest figures seen in MEASURED and each bound 1.5x that (more runs where a tail showed later: see there).
Push-sum, whose mixing keeps the sum, is 3-10x tighter than the pull rules: their tails come from one-sided
pulls and from a node that trains on alone after its peers stopped (a few dozen steps at the end). The rules
that do not average by design (leader, loss) are recorded with their bias (the least of 30 runs, and half of it
asserted); the simulator's test separates the rules sharply, this one checks that they behave so with real
processes too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import free_ports, write_cluster

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.outcome, pytest.mark.timing]

WORKER = Path(__file__).with_name("quadratic_worker.py")
STEPS = 400
STEP_MS = 3.0

#: rule -> (extra cluster settings, the largest (bias, spread) in 30 runs, the bounds asserted: 1.5x, rounded up).
#: Measured on 2026-11-26, 2 cores, seeds 0-29 (300 runs, none failed); medians in docs/rules.md.
MEASURED: dict[str, tuple[dict[str, Any], tuple[float, float], tuple[float, float]]] = {
    # pushsum, pushsum-osgp: 30 runs gave biases up to 0.014 and 0.024; a CI run (the whole suite before it) then
    # gave osgp 0.046, and 50 more runs alone (2026-11-28) osgp up to 0.031 (mean 0.015, sd 0.008), pushsum 30 more
    # up to 0.019 (mean 0.004, sd 0.006): a heavier tail than 30 runs showed, heavier still after the suite's load
    # (0.046 / 0.031 = 1.5). osgp's bound: 1.5x the 0.046 seen; pushsum's: 1.5x its 0.019 times that 1.5 of load.
    # Beside two CPU-spinning processes (heavier than the suite's load; 2026-11-28, 30 runs, all passed) osgp
    # reached bias 0.060 (mean 0.017) and spread 0.142: within these bounds, but without their 1.5x margin.
    "pushsum": ({}, (0.019, 0.067), (0.043, 0.11)),
    "pushsum-osgp": ({"pushsum": {"overlap": 1}}, (0.046, 0.116), (0.07, 0.17)),
    "constant": ({}, (0.131, 0.304), (0.20, 0.46)),
    "clock": ({}, (0.101, 0.353), (0.16, 0.53)),
    "adpsgd": ({}, (0.151, 0.472), (0.23, 0.71)),  # re-measured 2026-11-27 (30 runs): one exchange per snapshot
    "dpsgd": ({}, (0.180, 0.364), (0.27, 0.55)),
    # group: 30 runs gave (0.102, 0.231); a CI run then gave bias 0.189, and 61 more runs (seeds 0, 2026-11-26/27)
    # biases 0.011-0.132 and spreads up to 0.353: a heavier tail than 30 runs showed. In the runs of largest bias
    # one node found no fresh group member on 8-14 of its last 50 steps (peers left out as stale, or a fetch that
    # timed out at 100 ms on a loaded machine) and trained on alone meanwhile. Bounds from all 92 runs.
    "group": ({"group": {"group_size": 2, "sync_every": 11}}, (0.189, 0.353), (0.29, 0.53)),
    "gem": ({}, (0.285, 0.380), (0.43, 0.58)),  # its 5-8 % bias (simulator) is within real timing's noise here
}
#: rule -> (extra settings, the least bias in 30 runs); asserted: above half of it (the rule still pulls away
#: from the mean of the centres: toward the best node, or the nodes of lowest loss).
NOT_AVERAGING: dict[str, tuple[dict[str, Any], float]] = {"leader": ({}, 0.247), "loss": ({}, 0.283)}


def run_cluster(tmp_path: Path, rule: str, settings: dict[str, Any], seed: int) -> tuple[float, float]:
    """One 4-node run of the worker; (bias, spread)."""
    config = write_cluster(tmp_path / "c.yaml", free_ports(4), interpolation=rule, **settings)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "dpwa.cli", "run", str(config), "--run-dir", str(run_dir), "--timeout-s", "120"]
    command += [str(WORKER), "--steps", str(STEPS), "--seed", str(seed), "--step-ms", str(STEP_MS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(f.read_text()) for f in sorted(run_dir.glob("*.x.json"))]
    assert len(results) == 4, [f.name for f in run_dir.iterdir()]
    centres = np.array(results[0]["centres"])
    xs = np.array([r["x"] for r in results])
    target = centres.mean(axis=0)
    scale = float(np.mean(np.linalg.norm(centres - target, axis=1)))
    mean = xs.mean(axis=0)
    bias = float(np.linalg.norm(mean - target)) / scale
    spread = float(np.max(np.linalg.norm(xs - mean, axis=1))) / scale
    return bias, spread


@pytest.mark.parametrize("rule", list(MEASURED))
def test_an_averaging_rule_reaches_the_minimizer_over_the_network(
    tmp_path: Path, rule: str, record_property: Callable[[str, object], None]
) -> None:
    settings, _, (bias_bound, spread_bound) = MEASURED[rule]
    bias, spread = run_cluster(tmp_path, rule.split("-")[0], settings, seed=0)
    record_property("bias", bias)
    record_property("spread", spread)
    assert bias < bias_bound and spread < spread_bound, (bias, spread)


@pytest.mark.parametrize("rule", list(NOT_AVERAGING))
def test_a_rule_that_does_not_average_is_recorded_over_the_network(
    tmp_path: Path, rule: str, record_property: Callable[[str, object], None]
) -> None:
    settings, least_bias = NOT_AVERAGING[rule]
    bias, spread = run_cluster(tmp_path, rule, settings, seed=0)
    record_property("bias", bias)
    assert bias > least_bias / 2, "this rule averages after all: move it to MEASURED and fix the docs"
