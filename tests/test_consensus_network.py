"""The consensus point of every rule over the network: 4 processes under ``dpwa run``, real timing.

The same problem as tests/test_consensus.py (node ``i`` minimizes ``1/2 ||x - c_i||^2``, a decaying local
step), run by ``tests/quadratic_worker.py`` in 4 processes on 127.0.0.1: 400 steps of 3 ms (a sleep, the
compute a real step would take), after every node has seen its peers up. The figures, relative to the
centres' mean distance to their mean: *bias*, the distance of the nodes' mean to the minimizer of the average
objective (the mean of the centres); *spread*, the farthest node's distance to the nodes' mean.

Each node keeps serving its peers after its last step until they stop fetching (``close(linger=...)``, as the
demo's nodes do), so a node that steps slower than the others still mixes on its last steps. Real timing moves
the figures (which peer answers when, and how stale), so the bounds are measured: 30 runs of every rule here
(nothing else running), the largest figures seen in MEASURED and each bound 1.5x that (see there). Push-sum,
D-PSGD and group, which mix with fixed neighbours, have no tail (their largest spread 2-6x below the pull rules' on
random peers, whose tails come from one-sided pulls). The rules
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

#: rule -> (extra cluster settings, the largest (bias, spread) in 30 runs, the bounds asserted).
#: Measured on 2026-11-28, 2 cores, 30 runs of the module alone (`scripts/test.sh --stress 30
#: tests/test_consensus_network.py`), the nodes lingering after their last step (quadratic_worker.py). Before they
#: lingered, the node that stepped slowest trained its last dozens of steps alone, pulled to its own centre: group's
#: spread then reached 0.58-0.67 in 5 of 75 runs (bound 0.53). Lingering, the rules that mix with fixed neighbours
#: every step are tighter (group: spread below 0.033; dpsgd 0.0448-0.0453, 30 more runs after it took its whole local
#: step as the paper does; synchronous push-sum the same figures in all 30 runs). The pull rules on random peers
#: keep heavy tails (a one-sided pull moves only the puller): constant, clock,
#: adpsgd and gem are bounded at 1.5x the largest figure of these 30 runs and of the 30 runs per rule of
#: 2026-11-26/27 (without lingering), whichever is larger. The others: 1.5x these 30 runs, rounded up; push-sum and
#: OSGP keep their earlier bounds where those are wider (set from 110 runs and a CI run, without lingering).
MEASURED: dict[str, tuple[dict[str, Any], tuple[float, float], tuple[float, float]]] = {
    "pushsum": ({}, (1.8e-8, 0.056), (0.043, 0.11)),
    "pushsum-osgp": ({"pushsum": {"overlap": 1}}, (0.029, 0.144), (0.07, 0.22)),
    "constant": ({}, (0.219, 0.429), (0.33, 0.65)),  # 2026-11-26/27: (0.131, 0.304)
    "clock": ({}, (0.150, 0.486), (0.23, 0.73)),  # 2026-11-26/27: (0.101, 0.353)
    "adpsgd": ({}, (0.285, 0.545), (0.43, 0.82)),  # 2026-11-27: (0.151, 0.472)
    "dpsgd": ({}, (0.052, 0.0453), (0.078, 0.068)),  # taking its whole local step (2026-11-28); before: (0.036, 0.016)
    # Taking its whole local step (2026-11-29, as dpsgd above; it kept 1/(S+1) of it before): 60 runs alone read
    # bias 0.003-0.059 (mean 0.016), spread 0.079-0.098 (mean 0.087): the decaying local steps' pull toward each
    # node's own centre, as dpsgd's. Bounds 1.5x the largest. (Before the change, a CI run read (0.049, 0.099)
    # against 0.027-0.034 in 80 runs here, a tail whose cause was not found.)
    "group": ({"group": {"group_size": 2, "sync_every": 11}}, (0.059, 0.098), (0.089, 0.147)),
    # 2026-11-26: (0.285, 0.380). 2026-11-28: a CI run read (0.196, 0.576), beyond the bound of 0.57; 50 runs of it
    # alone that evening: bias 0.035-0.159, spread 0.041-0.42 (mean 0.14, sd 0.09): a heavy tail, so the spread is
    # bounded at 1.5x that CI run's, as push-sum's and OSGP's bounds count a CI run.
    "gem": ({}, (0.160, 0.576), (0.43, 0.87)),
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
