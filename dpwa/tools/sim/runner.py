"""One ``dpwa simulate`` run: the problem, the cluster, the clock, the metrics and the summary.

The run goes in slices of simulated time (``eval_every`` steps of the base step time each); after each slice the
nodes' mean model is evaluated and the consensus distance measured, and a progress callback told. Every node's
``update_wait`` becomes a line of ``<run_dir>/<node>.metrics.jsonl`` in the format of ``dpwa run`` (``time`` in
simulated seconds), so ``dpwa plot`` and ``dpwa plot --tensorboard`` read a simulation like a run; the evaluations
and the summary go to ``<run_dir>/simulation.json``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpwa.config import ClusterConfig, yaml12
from dpwa.metrics import json_safe
from dpwa.rules import make_rule
from dpwa.rules.outer import with_outer
from dpwa.rules.schedules import make_schedule
from dpwa.tools.sim.churn import ChurnEvent, ChurnKind
from dpwa.tools.sim.engine import ClusterSettings, EventSimulation, StepRecord
from dpwa.tools.sim.links import LinkModel, Network
from dpwa.tools.sim.members import Member
from dpwa.tools.sim.problems import make_problem
from dpwa.tools.sim.timing import StepTimes

__all__ = ["Evaluation", "SimOptions", "SimResult", "mean_model", "simulate"]

WIRE_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1}
"""Bytes per float element on the wire for each ``wire_dtype`` (int8's block scales, under 2 %, left out)."""
FLUSH_LINES = 50_000
"""Metrics lines held in memory before they are appended to their files (one file open at a time)."""


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """Everything a run depends on; equal options and seed give bit-identical results."""

    config: ClusterConfig
    nodes: int = 16
    steps: int = 200
    model: str = "logistic"
    partition: str = "iid"
    seed: int = 0
    step_times: StepTimes = StepTimes()
    link: LinkModel = LinkModel()
    churn: tuple[ChurnEvent, ...] = ()
    lr: float | None = None
    batch_size: int = 16
    evaluations: int = 20
    """About how many times the mean model is evaluated during the run."""
    node_step_s: tuple[float, ...] = ()
    """Each node's fixed step time (measured on a real run), instead of ``step_times``' table."""
    node_start_s: tuple[float, ...] = ()
    """When each node starts (its first ``update_send``), in seconds; () : all at 0."""
    record_every: int = 0
    """Keep every node's parameters every this many of its steps (:attr:`SimResult.snapshots`); 0: none."""


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The cluster at one simulated time: the mean model's loss and accuracy, the consensus distance (RMS of the
    live nodes' distances to their mean), the least step of the nodes still training."""

    time: float
    round: int
    loss: float
    accuracy: float | None
    consensus: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """The evaluations and the run's totals (see :meth:`summary`)."""

    evaluations: list[Evaluation]
    node_steps: int
    mixes: float
    bytes_sent: int
    messages: int
    lost: int
    sim_time: float
    wall_s: float
    final_params: np.ndarray
    snapshots: dict[int, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)
    """With ``record_every``: at each such step, every node's parameters after that step's ``update_wait``."""

    def summary(self) -> dict[str, Any]:
        """The numbers of the summary table."""
        last = self.evaluations[-1]
        return {
            "loss": last.loss,
            "accuracy": last.accuracy,
            "consensus_distance": last.consensus,
            "bytes_sent": self.bytes_sent,
            "bytes_per_step": self.bytes_sent / max(1, self.node_steps),
            "mixes_per_step": self.mixes / max(1, self.node_steps),
            "sim_time_s": self.sim_time,
            "wall_s": self.wall_s,
            "node_steps": self.node_steps,
            "messages": self.messages,
            "messages_lost": self.lost,
        }


class _Metrics:
    """Buffers every node's metrics lines and appends them to ``<run_dir>/<node>.metrics.jsonl`` in batches."""

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir
        self.lines: dict[str, list[str]] = {}
        self.held = 0
        self.distance: dict[str, float] = {}

    def add(self, node: str, record: dict[str, Any]) -> None:
        if self.run_dir is None:
            return
        self.lines.setdefault(node, []).append(json.dumps(json_safe(record), separators=(",", ":"), allow_nan=False))
        self.held += 1
        if self.held >= FLUSH_LINES:
            self.flush()

    def flush(self) -> None:
        if self.run_dir is None:
            return
        for node, lines in self.lines.items():
            if lines:
                with open(self.run_dir / f"{node}.metrics.jsonl", "a", encoding="utf-8") as handle:
                    handle.write("\n".join(lines) + "\n")
        self.lines, self.held = {}, 0


class _Recorder:
    """Turns each ``update_wait`` into a metrics line (the ``dpwa run`` format) and counts the node steps."""

    def __init__(self, metrics: _Metrics, params: np.ndarray, record_every: int) -> None:
        self.metrics = metrics
        self.params, self.record_every = params, record_every
        self.snapshots: dict[int, dict[str, np.ndarray]] = {}
        self.steps = 0
        self.last_time = 0.0
        """The simulated time of the latest ``update_wait`` (the run's simulated wall time, at the end)."""
        self.network: Network | None = None

    def __call__(self, r: StepRecord) -> None:
        m = r.member
        self.steps += 1
        self.last_time = max(self.last_time, r.time)
        if self.record_every and m.step % self.record_every == 0:
            self.snapshots.setdefault(m.step, {})[m.name] = self.params[m.index].copy()
        sent = int(self.network.bytes_sent[m.index]) if self.network is not None else 0
        fetch_ms = [1000.0 * (f.arrived - f.sent) for f in m.fetches if f.reply is not None]
        record = {
            "time": r.time, "step": m.step, "loss": m.state.loss, "factor": r.outcome.factor,
            "peer": ",".join(r.peers) or None, "status": r.status, "wait_ms": 1000.0 * r.wait_s,
            "fetch_ms": max(fetch_ms) if fetch_ms else None, "bytes_sent": sent - m.bytes_recorded,
            "clock": m.state.clock, **r.pushes, **{k: float(v) for k, v in r.outcome.metrics.items()},
        }  # fmt: skip
        m.bytes_recorded = sent
        distance = self.metrics.distance.pop(m.name, None)
        if distance is not None:
            record["distance"] = distance
        self.metrics.add(m.name, record)


def simulate(
    options: SimOptions,
    run_dir: Path | None = None,
    progress: Callable[[Evaluation, int, int, bool], None] | None = None,
) -> SimResult:
    """Run ``options`` (module doc-string); ``progress(evaluation, node_steps_done, node_steps_total, finished)``."""
    started = time.perf_counter()
    problem = make_problem(options.model, options.nodes, options.partition, options.seed, options.batch_size)
    capacity = options.nodes + sum(1 for e in options.churn if e.kind is ChurnKind.JOIN)
    params = np.tile(problem.initial().astype(np.float32), (capacity, 1))  # a model as PyTorch holds it
    metrics = _Metrics(run_dir)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        for old in run_dir.glob("*.metrics.jsonl"):
            old.unlink()
    recorder = _Recorder(metrics, params, options.record_every)
    sim = _cluster(options, problem, params, capacity, recorder)
    recorder.network = sim.network
    for event in options.churn:
        sim.at(event.at_s, _churn, sim, event, problem, params)
    sim.start(options.node_start_s)
    evaluations = _run(sim, options, problem, params, metrics, progress, recorder)
    metrics.flush()
    live = [m for m in sim.members.values() if m.phase.value != "left"]
    result = SimResult(
        evaluations=evaluations,
        node_steps=recorder.steps,
        mixes=sum(m.counters.get("mixes", 0.0) for m in sim.members.values()),  # those of nodes that left too
        bytes_sent=int(sim.network.bytes_sent.sum()),
        messages=sim.network.messages,
        lost=sim.network.lost,
        sim_time=recorder.last_time,
        wall_s=time.perf_counter() - started,
        final_params=params[[m.index for m in live]].copy(),
        snapshots=recorder.snapshots,
    )
    if run_dir is not None:
        _write_summary(run_dir, options, result)
    return result


def _cluster(
    options: SimOptions, problem: Any, params: np.ndarray, capacity: int, recorder: _Recorder
) -> EventSimulation:
    """The simulated cluster: the config's rule and schedule (under its outer optimizer) per node, the step
    times, the links, the local step at the model's learning rate with a cosine decay."""
    cfg, n = options.config, options.nodes
    lr = options.lr if options.lr is not None else problem.default_lr
    times = options.step_times.table(n, options.steps, options.seed)  # the stragglers: a share of the n first
    if capacity > n:  # joiners: each a straggler with probability share
        times = np.vstack([times, options.step_times.table(capacity - n, options.steps, options.seed, first=n)])
    if options.node_step_s:
        times[: len(options.node_step_s)] = np.array(options.node_step_s)[:, None]

    def train(members: Sequence[Member]) -> np.ndarray:
        steps = np.array([m.step - 1 for m in members], dtype=np.float64)
        lrs = (0.5 * lr * (1.0 + np.cos(np.pi * steps / options.steps))).astype(params.dtype)
        return problem.step_batch(np.array([m.index for m in members]), params, lrs)

    pairs: list[Any] = []
    names = [f"w{i + 1}" for i in range(n)]

    def rule() -> Any:  # the rule and the schedule are made together (an outer optimizer wraps both)
        made = make_rule(cfg.interpolation, cfg.settings, cfg.divergence_threshold)
        pairs.append(with_outer(made, make_schedule(cfg.schedule, cfg.settings, names), cfg.outer))
        return pairs[-1][0]

    settings = ClusterSettings(
        timeout_s=cfg.timeout_ms / 1000.0,
        fetch_probability=cfg.fetch_probability,
        inbox_slots=cfg.inbox_slots,
        inbox_per_sender=cfg.per_sender_limit,
        wire_itemsize=WIRE_ITEMSIZE.get(cfg.wire_dtype, 0),
    )
    return EventSimulation(
        names,
        [problem.views(params[i]) for i in range(n)],
        rule,
        lambda: pairs[-1][1],
        network=Network(options.link, np.random.default_rng([options.seed, 0x11E7]), capacity),
        step_time=lambda m: float(times[m.index, min(m.step - 1, options.steps - 1)]),
        train=train,
        steps=options.steps,
        settings=settings,
        seed=options.seed,
        on_step=recorder,
    )


def _churn(sim: EventSimulation, event: ChurnEvent, problem: Any, params: np.ndarray) -> None:
    """Apply one churn event (a join copies the model of the first live member)."""
    if event.kind is ChurnKind.JOIN:
        source = sim.live()[0] if sim.live() else None
        index = len(sim.members)
        problem.add_nodes(1)
        if source is not None:
            params[index] = params[source.index]
        sim.join(event.node, problem.views(params[index]))
        return
    if event.node not in sim.members:
        raise ValueError(f"churn: no node {event.node}")
    {ChurnKind.CRASH: sim.crash, ChurnKind.RESTART: sim.restart, ChurnKind.LEAVE: sim.leave}[event.kind](event.node)


def _run(
    sim: EventSimulation,
    options: SimOptions,
    problem: Any,
    params: np.ndarray,
    metrics: _Metrics,
    progress: Callable[[Evaluation, int, int, bool], None] | None,
    recorder: _Recorder,
) -> list[Evaluation]:
    """Run in slices of simulated time, evaluating after each in which a node stepped (and at the end); the
    evaluations. A slice without a step (every node finished, their pushes still settling over a lossy link)
    changed no model: evaluating it again and again made a 2-node run at 99 % loss take 36,766 evaluations."""
    slice_s = options.step_times.base_s * max(1, options.steps // max(1, options.evaluations))
    joins = sum(1 for event in options.churn if event.kind is ChurnKind.JOIN)
    total = (options.nodes + joins) * options.steps  # a joiner trains its steps too
    evaluations = []
    until, evaluated_at = 0.0, -1
    while True:
        finished = sim.run(until)
        if finished or recorder.steps != evaluated_at:
            evaluated_at = recorder.steps
            evaluation = _evaluate(sim, problem, params, metrics, until if not finished else sim.now)
            evaluations.append(evaluation)
            if progress is not None:
                progress(evaluation, recorder.steps, total, finished)
        if finished:
            return evaluations
        until += slice_s


def mean_model(rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The members' mean model: ``sum_i w_i x_i / sum_i w_i`` with their push-sum weights (1 under every other rule,
    the plain mean) -- push-sum's consensus point of the mass the members hold, as ``dpwa average`` weighs the
    saved models; the plain mean when the weights are not finite or sum to 0."""
    total = float(weights.sum())
    if not (np.all(np.isfinite(weights)) and total > 0):
        return rows.mean(axis=0)
    return (weights @ rows) / total


def _evaluate(sim: EventSimulation, problem: Any, params: np.ndarray, metrics: _Metrics, at: float) -> Evaluation:
    """The mean model of the live members (:func:`mean_model`) and their consensus distance; each one's distance to
    the mean, relative to the mean's norm, goes into its next metrics line (``distance``)."""
    live = [m for m in sim.members.values() if m.alive]
    if not live:
        return Evaluation(at, sim.rounds_done(), float("nan"), None, float("nan"))
    rows = params[[m.index for m in live]].astype(np.float64)
    mean = mean_model(rows, np.array([float(m.state.extras.get("weight", 1.0)) for m in live]))
    distances = np.linalg.norm(rows - mean, axis=1)
    scale = float(np.linalg.norm(mean)) or 1.0  # a node's line: relative, as the network's distance
    metrics.distance.update({m.name: float(d) / scale for m, d in zip(live, distances)})
    loss, accuracy = problem.evaluate(mean)
    return Evaluation(at, sim.rounds_done(), loss, accuracy, float(np.sqrt(np.mean(distances**2))))


def _write_summary(run_dir: Path, options: SimOptions, result: SimResult) -> None:
    """``simulation.json``: the options, the evaluations and the summary; ``cluster.yaml``: the rules' config."""
    data = {
        "options": {
            "nodes": options.nodes, "steps": options.steps, "model": options.model, "partition": options.partition,
            "seed": options.seed, "step_times": dataclasses.asdict(options.step_times),
            "link": dataclasses.asdict(options.link), "lr": options.lr, "batch_size": options.batch_size,
            "churn": [{"kind": e.kind.value, "node": e.node, "at_s": e.at_s} for e in options.churn],
        },
        "evaluations": [dataclasses.asdict(e) for e in result.evaluations],
        "summary": result.summary(),
    }  # fmt: skip
    text = json.dumps(json_safe(data), indent=1, allow_nan=False)  # NaN (no live node to evaluate) becomes null
    (run_dir / "simulation.json").write_text(text + "\n", encoding="utf-8")
    (run_dir / "cluster.yaml").write_text(yaml12.dump(options.config.to_dict(), sort_keys=False), encoding="utf-8")
