"""The consensus point of every rule, in the simulator: heterogeneity in its purest form.

Node ``i`` minimizes ``f_i(x) = 1/2 ||x - c_i||^2`` with its own centre ``c_i`` (a local step
``x <- x - eta_t * (x - c_i)``, ``eta_t = ETA0 / (1 + t / T)``: decaying, with an infinite sum). The
minimizer of the average objective ``1/N sum_i f_i`` is the mean of the centres; a rule that averages
brings every node there, a rule that optimizes a weighted objective ``sum_i p_i f_i`` brings them to
``sum_i p_i c_i``. The simulator is deterministic, so every figure below is exact for its seed; the
error is the largest distance of a node to the mean of the centres, relative to the centres' mean
distance to it.

Two figures, relative to the centres' mean distance to their mean: the *bias*, how far the nodes' mean is from
the minimizer, and the *spread*, how far the farthest node is from the nodes' mean. Measured (6 nodes, 3
dimensions, ROUNDS rounds, seeds 0-2, clean and with 5% of the messages lost in the first third): every
averaging rule has a bias below 0.03 (push-sum, AD-PSGD, D-PSGD, group: below 0.01, their mixing keeps the
sum; the pull rules on random peers 0.008-0.051, the drift of one-sided averaging; gradient tracking 2e-13
clean and 2e-9 with losses, its running sums keep the tracker's sum) and a spread below 0.053 (push-sum on
random peers 0.033-0.050, whose weight floor holds some mass back; CHOCO with int8 compression 0.041-0.052: its
consensus step 0.5 trails the decaying local steps; D-PSGD 0.021-0.026 on the ring and 0.015-0.020 on the directed
ring, taking its whole local step as the paper does; on the directed ring CHOCO int8 0.029-0.040),
so BIAS_TOL = 0.04 and SPREAD_TOL = 0.06 (AD-PSGD split into active and passive nodes: BIPARTITE_SPREAD). The rules
that do not average by design have a larger bias, recorded here and on the Mixing rules page: ``loss`` 0.71-1.12 (it
pulls toward the nodes with the lowest loss), ``leader`` 0.77-1.08 (toward the best node); ``gem`` (its element-wise
factors weight each node by its own motion) 0.024-0.118 over seeds 0-29, a mean compared with the pull rule's.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

from dpwa.rules import make_rule
from dpwa.rules.adpsgd import AdpsgdSettings
from dpwa.rules.choco import ChocoSettings
from dpwa.rules.dpsgd import DpsgdSettings
from dpwa.rules.group import GroupSettings
from dpwa.rules.outer import OuterSettings, outer_rule, outer_schedule
from dpwa.rules.schedules import make_schedule
from dpwa.tools.simulation import Simulation

NODES = 6
DIM = 3
ROUNDS = 1500
ETA0, T = 0.5, 20.0
BIAS_TOL = 0.04
SPREAD_TOL = 0.06
SEEDS = (0, 1, 2)
SEED_PARAMS = [0, *(pytest.param(seed, marks=pytest.mark.slow) for seed in SEEDS[1:])]  # the fast subset: seed 0
LOSS_RATE = 0.05  # of the messages lost (a fetch's reply times out; a push is refused) in the first third
RANDOM_PEERS: dict[tuple[str, str], tuple[float, float]] = {
    ("constant", "random"): (0.08, SPREAD_TOL),
    ("clock", "random"): (0.08, SPREAD_TOL),
    ("pushsum", "random"): (BIAS_TOL, 0.17),
}
"""(bias, spread) bounds of the cases whose figures depend on flow control's random choice of peers, set from seeds
0-29, clean and lossy (2026-11-27): the one-sided pull rules' bias has mean 0.018-0.020 and a tail to 0.054 (seeds
2 and 23; seeds 0-2 alone showed at most 0.051); push-sum on random peers keeps its bias below 0.017 but its spread
reaches 0.112 (its weight floor holds mass back). Bounds 1.5x the largest."""


BIPARTITE_SPREAD = 0.11
"""AD-PSGD split into active and passive nodes (``bipartite: true``): each node is in at most one exchange a step
(the unsplit rule: up to two), so it meets the decaying local steps later. Seeds 0-29 (2026-11-27): bias below 5e-5
clean and lossy (the exchanges keep the sum), spread 0.035 on average, at most 0.063 clean and 0.074 lossy (the
unsplit rule: 0.034 and 0.046). Bound 1.5x the largest."""


def bounds(case: tuple[str, str, Any]) -> tuple[float, float]:
    """The (bias, spread) bounds of an averaging case: BIAS_TOL and SPREAD_TOL unless RANDOM_PEERS (or
    BIPARTITE_SPREAD) widens them."""
    if getattr(case[2], "bipartite", False):
        return BIAS_TOL, BIPARTITE_SPREAD
    return RANDOM_PEERS.get((case[0], case[1]), (BIAS_TOL, SPREAD_TOL))


AVERAGING: list[tuple[str, str, Any]] = [
    ("constant", "random", None),
    ("constant", "exponential", None),
    ("constant", "ring", None),
    ("clock", "random", None),
    ("pushsum", "exponential", None),
    ("pushsum", "random", None),
    ("pushsum", "ring", None),
    ("pushsum", "exponential", {"overlap": 1}),
    ("adpsgd", "random", None),
    ("adpsgd", "exponential", None),
    ("adpsgd", "random", AdpsgdSettings(bipartite=True)),
    ("dpsgd", "neighbours", None),
    ("dpsgd", "neighbours", DpsgdSettings(graph="directed-ring")),
    ("group", "groups", GroupSettings(group_size=2, sync_every=11)),
    ("gt", "neighbours", None),
    ("choco", "neighbours", ChocoSettings(compressor="int8")),
    ("choco", "neighbours", ChocoSettings(compressor="int8", graph="directed-ring")),
]
NOT_AVERAGING = [("loss", "random", None), ("leader", "leader", None)]
GEM_SEEDS = range(6)
"""GEM's bias varies with the seed far more than the others' (0.024-0.118 over seeds 0-29, mean 0.067, 1,500
rounds): 7 of the 30 seeds land among the averaging rules (below 0.04), so its bias is compared as a mean over
seeds against the pull rule it extends."""


def consensus_error(
    rule: str,
    schedule: str,
    settings: Any,
    seed: int,
    loss_rate: float = 0.0,
    rounds: int = ROUNDS,
    outer: OuterSettings | None = None,
) -> tuple[float, float, float]:
    """(largest node distance to the mean of the centres, largest node distance to the nodes' mean, distance of
    the nodes' mean to the mean of the centres), relative to the centres' mean distance to their mean; ``outer``:
    the rule and schedule under that outer optimizer (tests/test_outer.py)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(NODES, DIM))
    start = rng.normal(size=DIM)
    names = [f"w{i + 1}" for i in range(NODES)]
    index = {name: i for i, name in enumerate(names)}
    sim = Simulation(
        [[start.copy()] for _ in names],
        lambda: outer_rule(make_rule(rule, settings, 0.0), outer),
        lambda: outer_schedule(make_schedule(schedule, settings), outer),
        seed=seed,
    )
    dropped = np.random.default_rng(seed + 1000)

    def f(name: str, x: np.ndarray) -> float:
        d = x - centres[index[name]]
        return 0.5 * float(d @ d)

    def train(node: Any) -> float:
        x = node.arrays[0]
        x -= ETA0 / (1.0 + node.step / T) * (x - centres[index[node.name]])
        return f(node.name, x)

    kind = "rejected" if rule == "pushsum" else "timeout"

    def lose(_sender: str, _peer: str) -> Any:
        return kind if sim.rounds < rounds // 3 and dropped.random() < loss_rate else None

    for _ in range(rounds):
        losses: Mapping[str, float] = {name: f(name, sim[name].arrays[0]) for name in names}
        sim.run_round(losses, train=train, lose=lose if loss_rate else None)
    target = centres.mean(axis=0)
    scale = float(np.mean(np.linalg.norm(centres - target, axis=1)))
    flats = sim.flats()
    mean = np.mean(flats, axis=0)
    to_target = max(float(np.linalg.norm(x - target)) for x in flats) / scale
    spread = max(float(np.linalg.norm(x - mean)) for x in flats) / scale
    return to_target, spread, float(np.linalg.norm(mean - target)) / scale


def _id(case: tuple[str, str, Any]) -> str:
    rule, schedule, settings = case
    extra = f"-{next(iter(settings.values()))}" if isinstance(settings, dict) else ""
    graph = getattr(settings, "graph", "ring")
    extra += "-bipartite" if getattr(settings, "bipartite", False) else ""
    return f"{rule}{extra}-{schedule}" + ("" if graph == "ring" else f"-{graph}")


WORKERS = max(1, min(4, len(os.sched_getaffinity(0))))
"""Processes that compute the simulator's cases (:func:`averaging_figures`): the simulator is deterministic, so
a case's figures are the same in any process; only the wall time changes."""
CASE_TIMEOUT_S = 60.0
"""The longest one case may take (about 1 s on 2 cores)."""
Figures = tuple[float, float, float]


def in_processes(calls: list[tuple[Any, ...]]) -> list[Figures | Exception]:
    """``consensus_error(*call)`` for every call, in the order given, WORKERS spawned processes at a time (nothing of
    this process but its imports travels). A call that raised, or took over CASE_TIMEOUT_S, gives its exception in
    its place (:func:`checked` raises it); leaving the pool terminates its workers, also when the test's own
    timeout interrupts the wait."""
    with multiprocessing.get_context("spawn").Pool(WORKERS) as pool:
        pending = [pool.apply_async(consensus_error, call) for call in calls]
        results: list[Figures | Exception] = []
        for job in pending:
            try:
                results.append(job.get(timeout=CASE_TIMEOUT_S))
            except Exception as exc:  # that case's failure, raised in its own test (checked)
                results.append(exc)
        return results


@functools.cache
def averaging_figures(seed: int, loss_rate: float) -> dict[str, Figures | Exception]:
    """``consensus_error`` of every AVERAGING case (by its id) for ``seed`` and ``loss_rate``, computed once."""
    figures = in_processes([(*case, seed, loss_rate) for case in AVERAGING])
    return {_id(case): f for case, f in zip(AVERAGING, figures)}


def checked(figures: Figures | Exception) -> Figures:
    """The figures :func:`in_processes` gave, or the exception their computation raised."""
    if isinstance(figures, Exception):
        raise figures
    return figures


def figures_of(case: tuple[str, str, Any], seed: int, loss_rate: float) -> Figures:
    """The case's figures from :func:`averaging_figures` (:func:`checked`)."""
    return checked(averaging_figures(seed, loss_rate)[_id(case)])


@pytest.mark.parametrize("case", AVERAGING, ids=_id)
@pytest.mark.parametrize("seed", SEED_PARAMS)
def test_an_averaging_rule_reaches_the_minimizer_of_the_average_objective(
    case: tuple[str, str, Any], seed: int, record_property: Callable[[str, object], None]
) -> None:
    _, spread, bias = figures_of(case, seed, 0.0)
    record_property("bias", bias)
    record_property("spread", spread)
    bias_tol, spread_tol = bounds(case)
    assert bias < bias_tol and spread < spread_tol, (bias, spread)


@pytest.mark.slow
@pytest.mark.parametrize("case", AVERAGING, ids=_id)
@pytest.mark.parametrize("seed", SEEDS)
def test_lost_messages_do_not_move_the_consensus_point(
    case: tuple[str, str, Any], seed: int, record_property: Callable[[str, object], None]
) -> None:
    """Replies lost and pushes refused in the first third: push-sum's mass comes back, a pull rule only mixes
    less; either way the point stays the unweighted mean."""
    _, spread, bias = figures_of(case, seed, LOSS_RATE)
    record_property("bias", bias)
    bias_tol, spread_tol = bounds(case)
    assert bias < bias_tol and spread < spread_tol, (bias, spread)


@pytest.mark.parametrize("case", NOT_AVERAGING, ids=_id)
@pytest.mark.parametrize("seed", SEED_PARAMS)
def test_a_rule_that_does_not_average_reaches_another_point_and_it_is_recorded(
    case: tuple[str, str, Any], seed: int, record_property: Callable[[str, object], None]
) -> None:
    _, spread, bias = consensus_error(*case, seed)
    record_property("bias", bias)
    record_property("spread", spread)
    assert bias > BIAS_TOL, "this rule averages after all: move it to AVERAGING and fix the docs"
    assert spread < bias, "the nodes are not even near one point"


@pytest.mark.slow
def test_gem_weighs_the_nodes_by_their_motion_a_bias_the_pull_rule_does_not_have(
    record_property: Callable[[str, object], None],
) -> None:
    """GEM is ``constant`` with element-wise factors from each node's own motion: over the same seeds (exact: the
    simulator), its mean bias is more than twice the plain pull rule's (measured 0.066 against 0.021), and its
    nodes still meet (spread below the averaging rules' bound)."""
    calls = [(rule, "random", None, seed) for rule in ("gem", "constant") for seed in GEM_SEEDS]
    figures = [checked(f) for f in in_processes(calls)]
    gem, pull = figures[: len(GEM_SEEDS)], figures[len(GEM_SEEDS) :]
    gem_bias, pull_bias = float(np.mean([b for _, _, b in gem])), float(np.mean([b for _, _, b in pull]))
    record_property("gem_bias", gem_bias)
    record_property("constant_bias", pull_bias)
    assert gem_bias > 2.0 * pull_bias, (gem_bias, pull_bias)
    assert max(spread for _, spread, _ in gem) < SPREAD_TOL


@pytest.mark.xfail(strict=True, reason="AD-PSGD on an even ring in lock-step: each node is in two exchanges a step")
def test_adpsgd_on_an_even_ring_in_lock_step_reaches_the_minimizer() -> None:
    """Recorded, not hidden: every node both starts an exchange with i+1 and serves one of i-1 each step, each
    moving it half-way from the same snapshot, so ``x_i <- (x_{i-1} + x_{i+1}) / 2`` plus the step: the
    alternating mode (eigenvalue -1) never decays and the step's ``-eta`` makes it grow (docs: adpsgd)."""
    _, spread, bias = consensus_error("adpsgd", "ring", None, 0)
    assert bias < BIAS_TOL and spread < SPREAD_TOL, (bias, spread)
