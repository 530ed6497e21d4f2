"""``dpwa bench train``: dpwa's rules (``--rules``, default constant 0.5, pushsum, adpsgd) against
synchronous DDP over gloo, in the same processes.

For every straggler factor K given (``--straggler 1,4``; 1 = no straggler) one *scenario* runs:
N worker processes (:mod:`dpwa.tools.bench.trainworker`) each train the demo job's MLP on its shard with
dpwa, once per rule (phase ``dpwa-<rule>``, each on ports of its own), then with torch DDP (``--order``
puts DDP first), from the same initial weights, on the same
shards (``--partition``, default ``iid``; each worker writes ``<name>.data.json``) and batch order, for the
same total number of samples (``N x steps x batch``) and the same
learning-rate schedule per sample.  With K > 1 the last worker is a straggler: after every step it
sleeps K - 1 times the median duration of its own recent steps (communication included), so its
steps take K times as long while the CPU stays free for the others; under DDP everyone waits for it.
With ``--repeats R`` each scenario runs R times, reversing the order of the methods every other run
(the machine's load drifts), and median rows follow.

Figures per scenario and method (all from the same run on the same machine):

samples/s
    samples trained by all nodes together / (last node's end - first node's start of the loop).
model loss over time
    every node appends its flat parameters every 10 steps (DDP: rank 0, all ranks hold the same);
    at up to 400 moments of the run the bench takes each node's latest parameters, averages them
    (the dpwa model one would deliver at that moment; DDP's model as is) and measures its
    cross-entropy on a fixed subset of the training set (the first 8,192 samples).
time to target
    wall time from the start until that model loss first drops to the target.  The target is
    ``--target-loss``; or with ``--target-at F`` the loss DDP's model had after the fraction F of
    its steps; by default the *lowest loss every method reaches*: the largest of the curves'
    minima.  So all always reach it, and the method that ends highest reaches it at its end.
final loss
    the model loss at the end (dpwa: the average of the final node models).
accuracy
    held-out accuracy of DDP's model (rank 0) and of the average of the dpwa nodes' final models
    (the demo's ``average_states``).

The nodes' own batch losses are kept too (``final_batch_loss``: the mean loss of the last
``N x 50`` batches any node trained).

Output: a table on stdout, ``train.json`` (rows, settings, machine) and with ``--plot``
``train.png`` (model loss against time) in the run directory; each scenario's worker logs,
timelines and models under ``<run_dir>/straggler-<K>x/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from dpwa.tools.bench.fingerprint import SUFFIX, mean_state_at, read_records
from dpwa.tools.bench.procs import BenchInterrupted, WorkerFailed, free_ports, node_names, run_workers, write_cluster
from dpwa.tools.bench.report import Column, Report, bench_run_dir, comma_list, render_table
from dpwa.tools.bench.trainplot import plot_curves
from dpwa.tools.options import check_partition
from dpwa.utils.partition import PARTITION_HELP

log = logging.getLogger(__name__)

__all__ = ["PhaseResult", "common_target", "pooled_loss", "time_to_target", "train"]

WORKER_MODULE = "dpwa.tools.bench.trainworker"
LOSS_WINDOW_PER_NODE = 50  # = dpwa.tools.demo.FINAL_LOSS_WINDOW
DEFAULT_RULES = "constant,pushsum,adpsgd"
DDP = "ddp"
DEFAULT_STEPS = 3000
TIMEOUT_MS = 2500.0  # the cluster file's default fetch deadline
COUNTER_FILE = "samples.counter"  # a dpwa phase's shared sample count (dpwa.tools.bench.trainworker.SharedCounter)
RECORD_EVERY = 10  # a node records its parameters every this many steps
EVAL_SAMPLES = 8192  # the model loss is measured on the first this-many training samples
MAX_CURVE_POINTS = 400
COLLECTIVE_TIMEOUT_S = 300.0  # gloo barriers and all-reduces give up after this (a stuck peer ends the run)

COLUMNS = [
    Column("scenario", "straggler"),
    Column("method", "method"),
    Column("run", "run"),
    Column("samples", "samples", ".0f"),
    Column("wall_s", "wall s", ".2f"),
    Column("samples_per_s", "samples/s", ".0f"),
    Column("x_samples_per_s", "x ddp", ".2f"),
    Column("target_loss", "target", ".4f"),
    Column("time_to_target_s", "to target s", ".2f"),
    Column("x_time_to_target", "x ddp", ".2f"),
    Column("final_loss", "final loss", ".4f"),
    Column("accuracy", "accuracy", ".4f"),
    Column("accuracy_points", "acc - ddp", "+.2f"),
    Column("straggler_steps", "slow node steps", ".0f"),
    Column("mixes_per_step", "mixes/step", ".2f"),
]


# --------------------------------------------------------------------------- analysis (pure)


@dataclasses.dataclass
class PhaseResult:
    """One method's run in one scenario, read back from the workers' files.

    ``curve_t`` / ``curve_loss``: the training loss of the *model* (DDP's; dpwa's nodes averaged) at
    moments of the run (seconds since ``start``); ``batch_t`` / ``batch_loss``: the pooled loss of
    the batches the nodes trained (:func:`pooled_loss`).
    """

    method: str
    start: float
    end: float
    samples: int
    steps: dict[str, int]
    nodes: list[dict[str, Any]]
    records: list[np.ndarray]
    batch_t: np.ndarray
    batch_loss: np.ndarray
    curve_t: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0))
    curve_loss: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0))

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def final_loss(self) -> float:
        return float(self.curve_loss[-1]) if len(self.curve_loss) else math.nan

    @property
    def final_batch_loss(self) -> float:
        return float(self.batch_loss[-1]) if len(self.batch_loss) else math.nan

    def time_at_step(self, step: float) -> float:
        """Seconds from the start until the first record of at least ``step`` steps (of the first node)."""
        rec = self.records[0]
        hits = np.flatnonzero(rec["step"] >= step)
        return float(rec["time"][hits[0] if len(hits) else -1]) - self.start


def pooled_loss(
    times: Sequence[np.ndarray], losses: Sequence[np.ndarray], window: int
) -> tuple[np.ndarray, np.ndarray]:
    """The batches of every node merged in time order, and the mean loss of the last ``window`` of them.

    Returns (times, means), one entry per batch from the ``window``-th on (all batches, averaged
    cumulatively, when there are fewer).
    """
    t = np.concatenate([np.asarray(a, dtype=np.float64) for a in times]) if times else np.empty(0)
    v = np.concatenate([np.asarray(a, dtype=np.float64) for a in losses]) if losses else np.empty(0)
    if not len(t):
        return t, v
    order = np.argsort(t, kind="stable")
    t, v = t[order], v[order]
    window = max(1, min(window, len(v)))
    csum = np.concatenate([[0.0], np.cumsum(v)])
    means = (csum[window:] - csum[:-window]) / window
    return t[window - 1 :], means


def common_target(phases: Iterable[PhaseResult]) -> float:
    """The lowest model loss every one of ``phases`` reaches: the largest of their curves' minima."""
    return max(float(np.min(p.curve_loss)) for p in phases)


def time_to_target(curve_t: np.ndarray, curve_loss: np.ndarray, target: float) -> float | None:
    """The first time in ``curve_t`` at which ``curve_loss <= target``; None if it never is."""
    hits = np.flatnonzero(np.asarray(curve_loss) <= target)
    return float(curve_t[hits[0]]) if len(hits) else None


def curve_times(records: Sequence[np.ndarray], start: float, max_points: int) -> np.ndarray:
    """Seconds since ``start`` at which to evaluate the model: the records' times, thinned to ``max_points``."""
    t = np.unique(np.concatenate([r["time"] for r in records])) - start
    if len(t) > max_points:
        t = t[np.unique(np.linspace(0, len(t) - 1, max_points).round().astype(int))]
    return t


def load_phase(directory: Path, names: Sequence[str], recorded: Sequence[str], nodes: int, size: int) -> PhaseResult:
    """Read the files of every node in ``directory`` (records of the ``recorded`` ones) into a PhaseResult."""
    infos = [json.loads((directory / f"{name}.json").read_text()) for name in names]
    times, losses = [], []
    for name in names:
        with np.load(directory / f"{name}.timeline.npz") as npz:
            times.append(npz["time"])
            losses.append(npz["loss"])
    start = min(i["start"] for i in infos)
    batch_t, batch_loss = pooled_loss(times, losses, nodes * LOSS_WINDOW_PER_NODE)
    return PhaseResult(
        method=directory.name,
        start=start,
        end=max(i["end"] for i in infos),
        samples=sum(int(i["samples"]) for i in infos),
        steps={i["node"]: int(i["steps"]) for i in infos},
        nodes=infos,
        records=[read_records(directory / f"{name}{SUFFIX}", size) for name in recorded],
        batch_t=batch_t - start,
        batch_loss=batch_loss,
    )


class ModelLoss:
    """The loss of given flat parameters on a fixed subset of the training set (the demo's MLP)."""

    def __init__(self, config: dict[str, Any], samples: int) -> None:
        import torch

        from dpwa.tools import demo

        self.torch = torch
        self.demo = demo
        self.config = demo.TrainConfig.from_dict(config)
        self.data = demo.make_dataset(self.config.seed, self.config.data)
        self.model = demo.build_model(self.config)
        self.size = sum(p.numel() for p in self.model.parameters())
        self.x = self.data.x_train[:samples]
        self.y = self.data.y_train[:samples]

    def __call__(self, flat: np.ndarray) -> float:
        vector = self.torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        self.torch.nn.utils.vector_to_parameters(vector, self.model.parameters())
        return self.demo.evaluate(self.model, self.x, self.y)[1]

    def curve(self, phase: PhaseResult, max_points: int = MAX_CURVE_POINTS) -> None:
        """Fill ``phase.curve_t`` / ``curve_loss``: the loss of the (averaged) model over the run."""
        t = curve_times(phase.records, phase.start, max_points)
        phase.curve_t = t
        phase.curve_loss = np.array([self(mean_state_at(phase.records, phase.start + x)[1]) for x in t])

    def at(self, phase: PhaseResult, seconds: float) -> float:
        return self(mean_state_at(phase.records, phase.start + seconds)[1])


def accuracies(directory: Path, names: Sequence[str]) -> dict[str, float]:
    """Held-out accuracy of the average of the node models in ``directory`` and of each node model."""
    import torch  # only here: the command itself starts without torch

    from dpwa.tools import demo

    loaded = [demo.load_model_file(directory / f"{name}{demo.MODEL_SUFFIX}") for name in names]
    config = demo.TrainConfig.from_dict(loaded[0][1]["config"])
    data = demo.make_dataset(config.seed, config.data)
    model = demo.build_model(config)
    out: dict[str, float] = {}
    for name, (arrays, _) in zip(names, loaded):
        model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
        out[name] = demo.evaluate(model, data.x_test, data.y_test)[0]
    model.load_state_dict(demo.average_states([arrays for arrays, _ in loaded]))
    out["averaged"] = demo.evaluate(model, data.x_test, data.y_test)[0]
    return out


def scenario_rows(
    label: str, phases: dict[str, PhaseResult], acc: dict[str, float], target: float, straggler: str | None
) -> list[dict[str, Any]]:
    """The table rows of one scenario: DDP first, then each dpwa rule with its ratios to DDP."""
    rows: dict[str, dict[str, Any]] = {}
    for method in [DDP] + [m for m in phases if m != DDP]:
        p = phases[method]
        dpwa = method != DDP
        mixes = sum(int(n.get("mixes", 0)) for n in p.nodes)
        rows[method] = {
            "scenario": label,
            "method": method,
            "nodes": len(p.steps),
            "samples": p.samples,
            "wall_s": p.wall_s,
            "samples_per_s": p.samples_per_s,
            "target_loss": target,
            "time_to_target_s": time_to_target(p.curve_t, p.curve_loss, target),
            "final_loss": p.final_loss,
            "final_batch_loss": p.final_batch_loss,
            "accuracy": acc[method],
            "cpu_s": sum(float(n.get("cpu_s", 0.0)) for n in p.nodes),
            "steps": p.steps,
            "straggler_steps": p.steps.get(straggler) if straggler is not None else None,
            "slept_s": sum(float(n.get("slept_s", 0.0)) for n in p.nodes),
            "mixes_per_step": mixes / sum(p.steps.values()) if dpwa else None,
            "fetches_timed_out": sum(int(n.get("fetches_timed_out", 0)) for n in p.nodes) if dpwa else None,
            "mean_fetch_ms": _mean([n.get("mean_fetch_ms") for n in p.nodes]) if dpwa else None,
        }
    b = rows[DDP]
    for method, d in rows.items():
        if method == DDP:
            continue
        d["x_samples_per_s"] = d["samples_per_s"] / b["samples_per_s"]
        if d["time_to_target_s"] is not None and b["time_to_target_s"]:
            d["x_time_to_target"] = d["time_to_target_s"] / b["time_to_target_s"]
        d["accuracy_points"] = 100.0 * (d["accuracy"] - b["accuracy"])
    return list(rows.values())


def analyze(
    directory: Path,
    methods: Sequence[str],
    names: Sequence[str],
    evaluator: ModelLoss,
    target_loss: float | None,
    target_step: float | None,
) -> tuple[dict[str, PhaseResult], float]:
    """Every method's results of one scenario run, their model-loss curves, and the target loss."""
    results = {
        m: load_phase(directory / m, names, names[:1] if m == DDP else names, len(names), evaluator.size)
        for m in methods
    }
    for phase in results.values():
        evaluator.curve(phase)
    if target_loss is not None:
        return results, target_loss
    if target_step is not None:
        return results, evaluator.at(results[DDP], results[DDP].time_at_step(target_step))
    return results, common_target(results.values())


def median_rows(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per method, the median of every numeric figure over the runs (ratios: the median of the per-run ratios)."""
    out = []
    for index in range(len(runs[0])):
        rows = [run[index] for run in runs]
        median: dict[str, Any] = {"scenario": rows[0]["scenario"], "method": rows[0]["method"], "run": "median"}
        for key in rows[0]:
            values = [r.get(key) for r in rows]
            if key not in median and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                median[key] = float(np.median(values))
        out.append(median)
    return out


def _mean(values: Sequence[Any]) -> float | None:
    clean = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(clean) / len(clean) if clean else None


# --------------------------------------------------------------------------- running a scenario


def run_scenario(
    directory: Path,
    *,
    nodes: int,
    factor: float,
    config: dict[str, Any],
    phases: Sequence[str],
    timeout_s: float,
    threads: int | None,
) -> None:
    """Start the N workers of one scenario and wait for them (see :func:`dpwa.tools.bench.procs.run_workers`).

    Every dpwa phase gets a cluster file of its rule on ports of its own (a node still lingering in one
    phase never reaches a node of the next) and a sample counter of its own."""
    directory.mkdir(parents=True, exist_ok=True)
    rules = [p for p in phases if p != DDP]
    *ports, master = free_ports(nodes * len(rules) + 1)
    clusters, counters = {}, {}
    for i, phase in enumerate(rules):
        cluster = directory / f"{phase}.yaml"
        write_cluster(cluster, ports[i * nodes : (i + 1) * nodes], interpolation=rule_of(phase), timeout_ms=TIMEOUT_MS)
        clusters[phase] = str(cluster.absolute())
    for method in phases:  # a reused run directory: nothing of an earlier run may mix into this one
        shutil.rmtree(directory / method, ignore_errors=True)
        (directory / method).mkdir()
        if method != DDP:
            counter = directory / method / COUNTER_FILE
            counter.write_bytes(bytes(8 * nodes))
            counters[method] = str(counter.absolute())
    names = node_names(nodes)
    spec = {
        "nodes": nodes,
        "names": names,
        "config": config,
        "straggler": factor,
        "phases": list(phases),
        "clusters": clusters,
        "counters": counters,
        "master_port": master,
        "collective_timeout_s": min(timeout_s, COLLECTIVE_TIMEOUT_S),
        "run_dir": str(directory.absolute()),
        "record_every": RECORD_EVERY,
    }
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1) + "\n")
    run = run_workers(
        directory, WORKER_MODULE, names, lambda rank, _n: [str(spec_path), str(rank)], timeout_s=timeout_s,
        threads=threads, config_path=Path(clusters[rules[0]]) if rules else None,
    )  # fmt: skip
    log.info("scenario %s: workers done in %.1f s", directory.name, run.wall_s)


@dataclasses.dataclass
class Plan:
    """What every scenario run of one ``dpwa bench train`` shares."""

    names: list[str]
    config: dict[str, Any]
    phases: list[str]
    target_loss: float | None
    target_step: float | None
    threads: int | None
    timeout_s: float
    evaluator: ModelLoss | None = None

    def run(
        self, directory: Path, factor: float, rep: int, repeats: int
    ) -> tuple[list[dict[str, Any]], dict[str, PhaseResult], float]:
        """Run number ``rep`` of the scenario with straggler ``factor``: (its rows, the results, the target).

        Odd runs reverse the phase order, so a drift in the machine's load hits every method alike.
        """
        order = self.phases if rep % 2 == 0 else self.phases[::-1]
        click.echo(f"  straggler {_label(factor)}, run {rep + 1}/{repeats}: {' then '.join(order)} ...", err=True)
        run_scenario(directory, nodes=len(self.names), factor=factor, config=self.config, phases=order,
                     timeout_s=self.timeout_s, threads=self.threads)  # fmt: skip
        if self.evaluator is None:
            self.evaluator = ModelLoss(self.config, EVAL_SAMPLES)
        results, target = analyze(
            directory, self.phases, self.names, self.evaluator, self.target_loss, self.target_step
        )
        acc = {m: accuracies(directory / m, self.names[:1] if m == DDP else self.names)["averaged"] for m in results}
        pair = scenario_rows(_label(factor), results, acc, target, self.names[-1] if factor > 1 else None)
        for row in pair:
            row.update(run=rep + 1, order=",".join(order))
        return pair, results, target


# --------------------------------------------------------------------------- the command


def _factors(text: str) -> list[float]:
    return comma_list(text, float, lambda k: math.isfinite(k) and k >= 1, "numbers >= 1 (e.g. 1,4)")


def _label(factor: float) -> str:
    return f"{factor:g}x" if factor > 1 else "none"


def phase_of(rule: str) -> str:
    """The phase (and run sub-directory) that trains with dpwa's rule ``rule``: ``dpwa-<rule>``."""
    return f"dpwa-{rule}"


def rule_of(phase: str) -> str:
    return phase.removeprefix("dpwa-")


def _rules(text: str) -> list[str]:
    from dpwa.rules import RULES

    rules = comma_list(text, str.strip, lambda r: r in RULES, f"rules among {', '.join(RULES)}")
    if len(set(rules)) != len(rules):
        raise click.BadParameter(f"a rule is named twice in {text!r}")
    return rules


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nodes", type=click.IntRange(min=2), default=4, show_default=True, help="Worker processes.")
@click.option("--steps", type=click.IntRange(min=1), default=DEFAULT_STEPS, show_default=True,
              help="Budget: every method trains nodes x steps x batch-size samples (DDP: steps steps).")  # fmt: skip
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--partition", default="iid", show_default=True, callback=check_partition, help=PARTITION_HELP + ".")
@click.option("--straggler", "stragglers", default="1,4", show_default=True,
              help="Straggler factors, one scenario each (1 = none, K = last node K x slower).")  # fmt: skip
@click.option("--rules", default=DEFAULT_RULES, show_default=True,
              help="dpwa's rules beside DDP, one phase each (constant: 0.5; the others: their defaults).")  # fmt: skip
@click.option("--order", type=click.Choice(["dpwa,ddp", "ddp,dpwa"]), default="dpwa,ddp", show_default=True,
              help="Which each worker runs first: the dpwa rules (in --rules order) or DDP.")  # fmt: skip
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs per scenario, alternating which method goes first; adds median rows.")  # fmt: skip
@click.option("--target-loss", type=click.FloatRange(min=0, min_open=True), help="Fixed target training loss.")
@click.option("--target-at", type=click.FloatRange(0, 1),
              help="Target: DDP's loss after this fraction of its steps [default: lowest both reach].")  # fmt: skip
@click.option("--threads", type=click.IntRange(min=1), help="Torch threads per worker [default: cores // nodes, >= 1].")
@click.option("--timeout-s", type=click.FloatRange(min=1), default=900, show_default=True,
              help="Stop a scenario's workers after this long and fail.")  # fmt: skip
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), help="[default: runs/bench-train-<time>]")
@click.option("--plot", is_flag=True, help="Also write train.png (model loss against time).")
def train(
    nodes: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    partition: str,
    stragglers: str,
    rules: str,
    order: str,
    repeats: int,
    target_loss: float | None,
    target_at: float | None,
    threads: int | None,
    timeout_s: float,
    run_dir: Path | None,
    plot: bool,
) -> None:
    """dpwa's rules vs synchronous DDP (gloo) on the demo job, in the same N processes, with and without a
    straggler.

    Prints samples/s, time to a target training loss and held-out accuracy per method, with each
    rule's ratio to DDP; writes train.json (and train.png with --plot) into the run directory.
    """
    from dpwa.tools.demo import TrainConfig  # torch is imported here, after the options were checked

    factors = _factors(stragglers)
    dpwa_phases = [phase_of(r) for r in _rules(rules)]
    config = TrainConfig(steps=steps, batch_size=batch_size, lr=lr, seed=seed, partition=partition)
    if batch_size * nodes > config.data.n_train:
        raise click.BadParameter(f"{nodes} nodes x batch {batch_size} exceed the {config.data.n_train} samples")
    directory = bench_run_dir("train", run_dir)
    phases = dpwa_phases + [DDP] if order == "dpwa,ddp" else [DDP] + dpwa_phases
    names = node_names(nodes)
    plan = Plan(names, config.to_dict(), phases, target_loss, None if target_at is None else target_at * steps,
                threads, timeout_s)  # fmt: skip
    click.echo(f"dpwa bench train: {nodes} nodes, stragglers {stragglers}, run dir {directory}", err=True)
    rows, curves = _run_scenarios(plan, directory, factors, repeats)
    settings = {
        "nodes": nodes,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "partition": config.partition,
        "stragglers": factors,
        "straggler_node": names[-1],
        "order": phases,
        "repeats": repeats,
        "target_loss": target_loss,
        "target_at": target_at,
        "target_rule": "fixed" if target_loss is not None else "ddp_at" if target_at is not None else "lowest_common",
        "loss_window_batches": nodes * LOSS_WINDOW_PER_NODE,
        "eval_samples": EVAL_SAMPLES,
        "record_every": RECORD_EVERY,
        "rules": [rule_of(p) for p in dpwa_phases],
        "constant": 0.5,
        "timeout_ms": TIMEOUT_MS,
        "threads_per_worker": threads,
        "command": " ".join(sys.argv),
    }
    _report(directory, rows, settings, curves, plot)


def _run_scenarios(
    plan: Plan, directory: Path, factors: Sequence[float], repeats: int
) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, PhaseResult], float]]]:
    """Every scenario's runs: (the table rows, median rows included; each run's curves); exits on a failure."""
    rows: list[dict[str, Any]] = []
    curves: list[tuple[str, dict[str, PhaseResult], float]] = []
    for factor in factors:
        runs = []
        for rep in range(repeats):
            sub = directory / (f"straggler-{factor:g}x" + (f"-run{rep + 1}" if repeats > 1 else ""))
            try:
                pair, results, target = plan.run(sub, factor, rep, repeats)
            except WorkerFailed as err:
                click.echo(f"error: straggler {_label(factor)}, run {rep + 1}: {err}", err=True)
                sys.exit(1)
            except BenchInterrupted as err:
                click.echo(f"error: {err}", err=True)
                sys.exit(128 + err.signum)
            runs.append(pair)
            curves.append((_label(factor) + (f", run {rep + 1}" if repeats > 1 else ""), results, target))
        rows += [row for pair in runs for row in pair] + (median_rows(runs) if repeats > 1 else [])
    return rows, curves


def _report(
    directory: Path,
    rows: list[dict[str, Any]],
    settings: dict[str, Any],
    curves: list[tuple[str, dict[str, PhaseResult], float]],
    plot: bool,
) -> None:
    """Write train.json, print the table, and with ``plot`` write train.png."""
    report = Report("train", rows=rows, settings=settings)
    path = report.write(directory)
    click.echo(render_table(rows, COLUMNS))
    if plot:
        click.echo(f"plot: {plot_curves(directory / 'train.png', curves)}")
    click.echo(f"json: {path}")
