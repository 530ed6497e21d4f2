"""The simulator against the network: simulate a real run with its measured step times and latency, compare.

A real run of :mod:`dpwa.tools.sim.worker` under ``dpwa run`` writes each node's metrics (``compute_ms``,
``fetch_ms`` per step) and its parameters every few steps. :func:`measure` reads what the simulator needs from it:
each node's step time (the median of its ``compute_ms``), when it started (its first ``update_send``, after the
first node's) and the link latency (half the median round trip of an ok fetch, whose payload is small).
:func:`compare` simulates the same cluster -- same problem, shards, batch streams, rule, timeout -- with those
figures and puts side by side, at every recorded step ``k``, the two runs' *mean-model loss* (the nodes' parameters
after their step ``k``, averaged, evaluated held out) and *consensus distance* (RMS of the nodes' distances to that
mean). The figures it reports: the largest relative error of the loss, and the ratio of the consensus distances
summed over the steps (sim / real).

    python -m dpwa.tools.sim.validation RUN_DIR --model logistic --steps 200 [--partition iid]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from dpwa.config import load_config
from dpwa.launcher.rundir import RunDir
from dpwa.tools.sim.links import LinkModel
from dpwa.tools.sim.problems import Problem, make_problem
from dpwa.tools.sim.runner import SimOptions, simulate
from dpwa.tools.sim.worker import PARAMS_SUFFIX

__all__ = ["Comparison", "Measured", "compare", "curves", "measure"]

LOOPBACK_BYTES_PER_S = 1e9
"""The simulated links' bandwidth for a localhost run: its payloads are small, latency dominates."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a real run tells the simulator: the nodes (file order), each one's step time, the latency."""

    names: tuple[str, ...]
    step_s: tuple[float, ...]
    latency_s: float
    start_s: tuple[float, ...]
    """When each node's first ``update_send`` came, after the first node's (they start when their peers answer)."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The two runs' curves at the recorded steps, and the figures of agreement."""

    steps: list[int]
    real_loss: list[float]
    sim_loss: list[float]
    real_consensus: list[float]
    sim_consensus: list[float]
    measured: Measured

    @property
    def loss_error(self) -> float:
        """The largest ``|sim - real| / real`` of the mean-model loss over the recorded steps."""
        return max(abs(s - r) / r for s, r in zip(self.sim_loss, self.real_loss))

    @property
    def consensus_ratio(self) -> float:
        """``sum(sim consensus) / sum(real consensus)`` over the recorded steps (1: the same on the whole)."""
        return sum(self.sim_consensus) / sum(self.real_consensus)


def measure(run_dir: Path) -> Measured:
    """Each node's median ``compute_ms``, half the median ``fetch_ms`` of every node's ok fetches, and each node's
    first ``sent_at`` after the earliest one."""
    run = RunDir(run_dir)
    names = tuple(node.name for node in load_config(run.config_path).nodes)
    steps, trips, starts = [], [], []
    for name in names:
        records = [r for r in run.read_metrics(name) if r.get("event") is None]
        steps.append(statistics.median(float(r["compute_ms"]) for r in records) / 1000.0)
        trips += [float(r["fetch_ms"]) for r in records if r.get("fetch_ms") and "ok" in str(r.get("status"))]
        starts.append(float(records[0]["sent_at"]))
    latency = statistics.median(trips) / 2000.0 if trips else 1e-4
    return Measured(names, tuple(steps), latency, tuple(t - min(starts) for t in starts))


def curves(problem: Problem, snapshots: dict[int, dict[str, np.ndarray]]) -> tuple[list[int], list[float], list[float]]:
    """At every step every node recorded: the mean model's loss and the consensus distance."""
    steps, losses, consensus = [], [], []
    width = max((len(v) for v in snapshots.values()), default=0)
    for step in sorted(snapshots):
        rows = snapshots[step]
        if len(rows) < width:
            continue
        stacked = np.array([rows[n] for n in sorted(rows)], dtype=np.float64)
        mean = stacked.mean(axis=0)
        steps.append(step)
        losses.append(problem.evaluate(mean)[0])
        consensus.append(float(np.sqrt(np.mean(np.sum((stacked - mean) ** 2, axis=1)))))
    return steps, losses, consensus


def _real_snapshots(run_dir: Path, names: tuple[str, ...]) -> dict[int, dict[str, np.ndarray]]:
    out: dict[int, dict[str, np.ndarray]] = {}
    for name in names:
        with np.load(run_dir / f"{name}{PARAMS_SUFFIX}") as data:
            for key in data.files:
                out.setdefault(int(key), {})[name] = data[key]
    return out


def compare(
    run_dir: Path, *, model: str, steps: int, partition: str = "iid", seed: int = 0, record_every: int = 10,
    lr: float | None = None, batch_size: int = 16,
) -> Comparison:  # fmt: skip
    """Simulate the real run in ``run_dir`` (made by :mod:`dpwa.tools.sim.worker` with these arguments) and
    compare the two (module doc-string)."""
    measured = measure(run_dir)
    config = load_config(RunDir(run_dir).config_path)
    n = len(measured.names)
    options = SimOptions(
        config, nodes=n, steps=steps, model=model, partition=partition, seed=seed, lr=lr, batch_size=batch_size,
        link=LinkModel(latency_s=measured.latency_s, bandwidth=LOOPBACK_BYTES_PER_S), node_step_s=measured.step_s,
        node_start_s=measured.start_s, record_every=record_every,
    )  # fmt: skip
    result = simulate(options)
    problem = make_problem(model, n, partition, seed, batch_size)
    names = {f"w{i + 1}": name for i, name in enumerate(measured.names)}
    simulated = {k: {names[w]: row for w, row in rows.items()} for k, rows in result.snapshots.items()}
    sim_steps, sim_loss, sim_cons = curves(problem, simulated)
    real_steps, real_loss, real_cons = curves(problem, _real_snapshots(run_dir, measured.names))
    common = sorted(set(sim_steps) & set(real_steps))
    pick = lambda ks, vs: [vs[ks.index(k)] for k in common]  # noqa: E731 - local shorthand
    return Comparison(common, pick(real_steps, real_loss), pick(sim_steps, sim_loss), pick(real_steps, real_cons),
                      pick(sim_steps, sim_cons), measured)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare a real worker run with its simulation.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--model", default="logistic")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record-every", type=int, default=10)
    args = parser.parse_args(argv)
    c = compare(args.run_dir, model=args.model, steps=args.steps, partition=args.partition, seed=args.seed,
                record_every=args.record_every)  # fmt: skip
    doc = {**dataclasses.asdict(c), "loss_error": c.loss_error, "consensus_ratio": c.consensus_ratio}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
