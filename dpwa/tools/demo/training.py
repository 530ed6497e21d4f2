"""The built-in demo job of ``dpwa run`` (no SCRIPT): gossip-train a small classifier on generated data.

Node mode (``dpwa run`` starts one per node; name, cluster file and run directory come from
``DPWA_NODE`` / ``DPWA_CONFIG`` / ``DPWA_RUN_DIR``, torch threads from ``DPWA_TORCH_THREADS``)::

    python -m dpwa.tools.demo [--steps N] [--batch-size B] [--lr LR] [--momentum M] [--seed S] [--partition P]

Evaluation mode (after the nodes are done)::

    python -m dpwa.tools.demo --evaluate RUN_DIR

Both log to stderr at ``DPWA_LOG_LEVEL`` (default INFO); ``--evaluate`` prints its result on stdout.

The data
    A 10-class Gaussian mixture in 32 features, generated from ``--seed`` (no download): every
    class owns 4 random centres, a sample is a centre plus Gaussian noise (features have unit
    variance).  Classes overlap: the Bayes-optimal classifier scores 94-95% on the held-out split
    (seeds 0-3), a linear model about 60%, the demo's MLP about 92% with the defaults.  40,000
    training and 10,000 held-out samples.

The shards
    ``--partition`` (default ``iid``) splits the training set between the nodes; node ``i`` of ``n`` is
    its index in the cluster file's ``nodes``. ``iid``: samples ``i, i+n, i+2n, ...`` (a random shard:
    the samples are in random order); ``dirichlet:ALPHA``: class proportions drawn per node from
    ``Dir(ALPHA * p)`` (0.1: one or two classes dominate each node); ``classes:K``: ``K`` classes per
    node (:mod:`dpwa.utils.partition`). Shards are disjoint: no two nodes train on the same sample.
    Each node writes its class histogram to ``<run_dir>/<node>.data.json``.

The node
    The same 32-64-64-10 ReLU MLP everywhere (same seed, so every node starts from the same
    weights), SGD with momentum 0.9 (``--momentum``) and a cosine learning-rate decay over
    ``--steps``, indexed by ``adapter.progress``: the node's own step, or the furthest node's if one is
    ahead. Asynchronous nodes drift apart (100-250 steps of 3,000 on 2 shared cores); indexed by its own
    step, a node that lags takes steps several times larger than its peers' near the end, and with data
    split by class its classes win the final average (2-14 points lost on ``classes:3``).
    Before the first batch it waits (at most ``PEERS_WAIT_S``) until every peer's node
    is up, so that nodes started together also start training together.  Around every batch:
    ``update_send(previous loss)``, one SGD step, ``update_wait(loss)``.  At the end
    it reports its own held-out accuracy (``conn.report(accuracy=..., final_loss=...)``), writes
    ``<run_dir>/<node>.model.npz`` (parameters, buffers and a ``__meta__`` JSON string; no pickle)
    and keeps serving its final parameters while peers still fetch them (``close(linger=...)``),
    so peers that are still training do not wait on a closed node.

Restarts
    With ``checkpoint_every: K`` in the cluster file the adapter checkpoints model, optimizer and
    gossip state every K steps (and the demo once more at the end).  Started by ``dpwa run
    --resume`` or restarted by ``--restart-failed``, a node first calls ``adapter.restore()``: it
    resumes from its checkpoint's step (same batches and learning rates as an uninterrupted run)
    and copies a peer's model if that peer is ahead, then trains on to ``--steps``.

The evaluation
    Averages every ``<node>.model.npz`` of the run, evaluates that averaged model, and trains a
    *baseline*: one process, all the training data, the same model, optimizer, initial weights,
    batch size, learning rate and schedule, for as many samples as all nodes together.  Both
    held-out accuracies go to ``<run_dir>/demo.json`` and stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from dpwa.adapters.torch_state import model_arrays
from dpwa.modelfile import ModelFile, average_models, disagreement, read_model, run_models, write_model
from dpwa.tools.mixture import DataSpec, gaussian_mixture
from dpwa.utils.atomic import write_atomically
from dpwa.utils.partition import PARTITION_HELP, class_histogram, parse_partition, partition_indices

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_LR",
    "DEFAULT_SEED",
    "DEFAULT_STEPS",
    "DEMO_JSON",
    "ENV_CONFIG",
    "ENV_LOG_LEVEL",
    "ENV_NODE",
    "ENV_RUN_DIR",
    "ENV_THREADS",
    "EVALUATE_THREADS",
    "FINAL_LOSS_WINDOW",
    "HIDDEN",
    "LINGER_IDLE_S",
    "LINGER_MAX_S",
    "META_KEY",
    "DATA_SUFFIX",
    "MODEL_SUFFIX",
    "node_indices",
    "write_data_file",
    "MOMENTUM",
    "PEERS_WAIT_S",
    "BatchStream",
    "DataSpec",
    "Dataset",
    "Exchange",
    "NoExchange",
    "TrainConfig",
    "TrainResult",
    "average_states",
    "build_model",
    "configure_logging",
    "evaluate",
    "evaluate_run",
    "headline",
    "load_model_file",
    "lr_at",
    "main",
    "make_dataset",
    "make_optimizer",
    "parse_args",
    "run_node",
    "save_model",
    "set_threads",
    "shard_indices",
    "train",
]

log = logging.getLogger("dpwa.tools.demo")

ENV_NODE = "DPWA_NODE"
ENV_CONFIG = "DPWA_CONFIG"
ENV_RUN_DIR = "DPWA_RUN_DIR"
ENV_THREADS = "DPWA_TORCH_THREADS"
ENV_LOG_LEVEL = "DPWA_LOG_LEVEL"

MODEL_SUFFIX = ".model.npz"
DATA_SUFFIX = ".data.json"
DEMO_JSON = "demo.json"
META_KEY = "__meta__"

# Defaults, chosen for `dpwa run samples/localhost.yaml` (4 nodes sharing 2 cores, 1 torch thread each).
# 3000 steps x 32 samples x 4 nodes = 384,000 samples (9.6 passes over the training set): enough for the
# averaged model to come within ~1 point of the sample-matched baseline, which takes 4x as many (smaller)
# optimizer steps.  Measured with `dpwa run`: 0.7-0.9 points apart (0.913-0.916 vs 0.922), 30-35 s in all
# (~4 ms per gossip step, 6.5 s of baseline); an in-process simulation over seeds 0-3 gave 0.4-0.8 points,
# 0.7-1.1 at 2000 steps and 1.4-2.0 at 1000.  lr 0.1: at 0.2 the batch-32 baseline diverges (43%).
DEFAULT_STEPS = 3000
DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 0.1
DEFAULT_SEED = 0
MOMENTUM = 0.9
HIDDEN = 64
FINAL_LOSS_WINDOW = 50  # final_loss = mean training loss of the last this-many batches
PEERS_WAIT_S = 30.0  # before training, wait at most this long until every peer's node is up
LINGER_IDLE_S = 2.0  # keep serving until no peer fetched for this long ...
LINGER_MAX_S = 60.0  # ... but never longer than this
# --evaluate trains the baseline on one thread whatever DPWA_TORCH_THREADS says: the MLP's matrices are too small
# for intra-op threads, and on 2 shared cores 2 OpenMP threads made the 12,000-step baseline 8x slower (26 s vs 3 s).
EVALUATE_THREADS = 1


# --------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Training and held-out splits as torch tensors (float32 features, int64 labels)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def make_dataset(seed: int, spec: DataSpec | None = None) -> Dataset:
    """The Gaussian-mixture problem of ``spec`` (default ``DataSpec()``), a pure function of ``seed``
    (:func:`~dpwa.tools.mixture.gaussian_mixture`)."""
    data = gaussian_mixture(seed, spec if spec is not None else DataSpec())
    return Dataset(*(torch.from_numpy(a) for a in (data.x_train, data.y_train, data.x_test, data.y_test)))


def shard_indices(n: int, index: int, count: int) -> np.ndarray:
    """Node ``index`` of ``count``'s training samples: ``index, index+count, ...`` (disjoint, covering)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} not in [0, {count})")
    return np.arange(index, n, count)


def node_indices(config: TrainConfig, data: Dataset, index: int, count: int) -> np.ndarray:
    """Node ``index`` of ``count``'s training samples under ``config.partition`` (seeded by ``config.seed``)."""
    labels = data.y_train.numpy()
    return partition_indices(labels, count, config.partition, config.seed, config.data.classes)[index]


def write_data_file(run_dir: Path, name: str, config: TrainConfig, histogram: Sequence[int]) -> Path:
    """``<run_dir>/<name>.data.json``: the partition, the node's sample count and its class histogram."""
    record = {"node": name, "partition": config.partition, "samples": int(sum(histogram)), "classes": list(histogram)}
    path = run_dir / f"{name}{DATA_SUFFIX}"
    write_atomically(path, json.dumps(record) + "\n")
    return path


class BatchStream:
    """Endless mini-batches of indices from ``indices``: a fresh seeded permutation every epoch."""

    def __init__(self, indices: np.ndarray, batch_size: int, seed: Sequence[int]) -> None:
        if batch_size > len(indices):
            raise ValueError(f"batch size {batch_size} exceeds the {len(indices)} samples available")
        self.indices = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(int(np.random.SeedSequence(list(seed)).generate_state(1)[0]))
        self.order = self.indices
        self.pos = len(self.indices)  # start with a new epoch

    def __next__(self) -> torch.Tensor:
        if self.pos + self.batch_size > len(self.indices):
            self.order = self.indices[torch.randperm(len(self.indices), generator=self.generator)]
            self.pos = 0
        batch = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch


# --------------------------------------------------------------------------- model and training


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that must be equal between the nodes and the baseline."""

    steps: int = DEFAULT_STEPS
    batch_size: int = DEFAULT_BATCH_SIZE
    lr: float = DEFAULT_LR
    seed: int = DEFAULT_SEED
    momentum: float = MOMENTUM
    hidden: int = HIDDEN
    data: DataSpec = DataSpec()
    partition: str = "iid"

    def __post_init__(self) -> None:
        object.__setattr__(self, "partition", str(parse_partition(self.partition)))  # canonical; ValueError
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ValueError(
                f"need steps >= 1, batch_size >= 1, lr > 0, 0 <= momentum < 1; got {self.steps}, "
                f"{self.batch_size}, {self.lr}, {self.momentum}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return cls(**{**d, "data": DataSpec(**d["data"])})


def build_model(config: TrainConfig) -> nn.Module:
    """The demo's MLP, initialised from ``config.seed`` (identical on every node and in the baseline)."""
    torch.manual_seed(config.seed)
    spec = config.data
    return nn.Sequential(
        nn.Linear(spec.features, config.hidden),
        nn.ReLU(),
        nn.Linear(config.hidden, config.hidden),
        nn.ReLU(),
        nn.Linear(config.hidden, spec.classes),
    )


def lr_at(config: TrainConfig, step: int, steps: int) -> float:
    """Cosine decay from ``config.lr`` at step 0 to 0 at ``steps``: ``lr/2 * (1 + cos(pi * step/steps))``, ``step``
    clamped to ``[0, steps]``."""
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * min(max(step, 0), steps) / steps))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``x``, ``y``."""
    model.eval()
    logits = model(x)
    model.train()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return accuracy, nn.functional.cross_entropy(logits, y).item()


class Exchange(Protocol):
    """The two calls around a batch and the step index to schedule by: a node passes its DpwaPyTorchAdapter
    (``progress``: its step, or the furthest node's), the baseline :class:`NoExchange`."""

    @property
    def progress(self) -> int: ...

    def update_send(self, loss: float) -> None: ...

    def update_wait(self, loss: float) -> float: ...


class NoExchange:
    """The baseline's exchange: nothing published, nothing mixed (factor 0); ``progress`` counts its steps."""

    def __init__(self, progress: int = 0) -> None:
        self.progress = progress

    def update_send(self, loss: float) -> None:
        pass

    def update_wait(self, loss: float) -> float:
        self.progress += 1
        return 0.0


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` did."""

    steps: int
    samples: int
    final_loss: float
    seconds: float
    mean_factor: float


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD with momentum; its learning rate is set per step by :func:`train`.

    Build it before the adapter: the first optimizer imports ``torch._dynamo`` (over a second of CPU), and a
    node that is already serving but not yet publishing answers its peers "not ready".
    """
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Dataset,
    indices: np.ndarray,
    config: TrainConfig,
    steps: int,
    stream_seed: Sequence[int],
    exchange: Exchange | None = None,
    on_progress: Callable[[int, float, float, float], None] | None = None,
    start_step: int = 0,
    start_loss: float | None = None,
) -> TrainResult:
    """``steps`` steps of ``optimizer`` on ``data.x_train[indices]`` with the cosine schedule over ``steps``, indexed
    by ``exchange.progress`` (the baseline's is its step).

    Around each step: ``exchange.update_send(previous loss)``, the step, ``exchange.update_wait(loss)``.
    ``on_progress(step, mean loss, mean factor, lr)`` is called about ten times.  ``start_step`` > 0
    resumes a run (model and optimizer restored by the caller): steps ``start_step+1 .. steps`` are done,
    with the same batches and learning rates as an uninterrupted run; ``start_loss`` is the loss of
    step ``start_step`` (the first ``update_send`` reports it).
    """
    exchange = exchange if exchange is not None else NoExchange(start_step)
    stream = BatchStream(indices, config.batch_size, stream_seed)
    for _ in range(start_step):  # the batches the steps before start_step took
        next(stream)
    x, y = data.x_train, data.y_train
    if start_step > 0 and start_loss is not None:
        prev_loss = start_loss
    else:
        with torch.no_grad():
            first = next(BatchStream(indices, config.batch_size, stream_seed))
            prev_loss = nn.functional.cross_entropy(model(x[first]), y[first]).item()
    recent: list[float] = []
    factors = 0.0
    window_loss, window_factor, window_n = 0.0, 0.0, 0
    every = max(1, steps // 10)
    start = time.monotonic()
    for step in range(start_step, steps):
        lr = lr_at(config, exchange.progress, steps)  # the furthest node's step: see the module doc
        for group in optimizer.param_groups:
            group["lr"] = lr
        exchange.update_send(prev_loss)
        batch = next(stream)
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        prev_loss = loss.item()
        factor = exchange.update_wait(prev_loss)
        factors += factor
        recent.append(prev_loss)
        del recent[:-FINAL_LOSS_WINDOW]
        window_loss, window_factor, window_n = window_loss + prev_loss, window_factor + factor, window_n + 1
        if on_progress is not None and ((step + 1) % every == 0 or step + 1 == steps):
            on_progress(step + 1, window_loss / window_n, window_factor / window_n, lr)
            window_loss, window_factor, window_n = 0.0, 0.0, 0
    recent = recent or [prev_loss]  # resumed at the end: nothing left to train
    return TrainResult(
        steps=steps,
        samples=steps * config.batch_size,
        final_loss=sum(recent) / len(recent),
        seconds=time.monotonic() - start,
        mean_factor=factors / max(1, steps - start_step),
    )


# --------------------------------------------------------------------------- model files


def save_model(path: Path, model: nn.Module, meta: dict[str, Any], weight: float = 1.0) -> None:
    """``model.state_dict()`` (parameters and buffers) as a model file (:mod:`dpwa.modelfile`, no pickle), with
    ``meta`` (``node`` names it) and the node's push-sum ``weight``."""
    write_model(path, model_arrays(model), node=str(meta.get("node", path.name)), weight=weight, user=meta)


def load_model_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state arrays, meta) from a model file (:func:`save_model`, the adapter's ``save_model``); never unpickles."""
    model = read_model(path)
    return dict(model.arrays), dict(model.user)


def average_states(states: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating arrays (:func:`dpwa.modelfile.average_models`, equal weights: in float64, cast
    back); other arrays from the first state."""
    mean = average_models([ModelFile(str(i), state) for i, state in enumerate(states)])
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in mean.items()}


# --------------------------------------------------------------------------- node


def set_threads() -> None:
    """torch.set_num_threads(DPWA_TORCH_THREADS) when set (``dpwa run`` gives each node its share of cores)."""
    value = os.environ.get(ENV_THREADS)
    if value:
        try:
            torch.set_num_threads(int(value))
        except ValueError:
            log.warning("ignoring %s=%r: not an integer", ENV_THREADS, value)


def run_node(config: TrainConfig) -> int:
    """One node of the demo (name, cluster file and run directory from the environment); exit status."""
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter  # imported here: `--evaluate` needs no network
    from dpwa.config import ConfigError, load_config
    from dpwa.node.transport import PortInUseError

    name, cluster_file = os.environ.get(ENV_NODE), os.environ.get(ENV_CONFIG)
    if not name or not cluster_file:
        log.error("%s and %s must be set (start the demo with `dpwa run CLUSTER.yaml`)", ENV_NODE, ENV_CONFIG)
        return 2
    try:
        cluster = load_config(cluster_file)
        names = [node.name for node in cluster.nodes]
        index = names.index(cluster.node(name).name)
    except ConfigError as err:
        log.error("%s", err)
        return 2
    run_dir = Path(os.environ[ENV_RUN_DIR]) if os.environ.get(ENV_RUN_DIR) else None
    if run_dir is None:
        log.warning("%s is not set: no metrics and no model file will be written", ENV_RUN_DIR)

    data = make_dataset(config.seed, config.data)
    indices = node_indices(config, data, index, len(names))
    histogram = class_histogram(data.y_train.numpy(), indices, config.data.classes)
    if run_dir is not None:
        write_data_file(run_dir, name, config, histogram)
    model = build_model(config)
    optimizer = make_optimizer(model, config)
    log.info(
        "node %s: shard %d/%d (%s, %d samples, classes %s), %d steps of %d, lr %g cosine, momentum %g, "
        "%d torch thread(s)",
        name,
        index + 1,
        len(names),
        config.partition,
        len(indices),
        histogram,
        config.steps,
        config.batch_size,
        config.lr,
        config.momentum,
        torch.get_num_threads(),
    )

    def progress(step: int, loss: float, factor: float, lr: float) -> None:
        log.info(
            "node %s: step %d/%d  loss %.4f  mean factor %.3f  lr %.4f", name, step, config.steps, loss, factor, lr
        )

    seed = config.seed * 1000 + index
    wait_s = PEERS_WAIT_S if len(names) > 1 else 0.0  # nodes started together start training together
    try:
        adapter = DpwaPyTorchAdapter(
            model, name, cluster, seed=seed, run_dir=run_dir, optimizer=optimizer, wait_for_peers_s=wait_s
        )
    except PortInUseError as err:  # taken since `dpwa run` checked it: one line, not a traceback
        log.error("%s", err)
        return 1
    with adapter as conn:
        restored = conn.restore()  # dpwa run --resume / --restart-failed: checkpoint, then a peer's model
        if restored.checkpoint is not None and restored.meta.get("config", config.to_dict()) != config.to_dict():
            log.warning("node %s: the checkpoint was written with other settings; resuming anyway", name)
        start = min(restored.step, config.steps)
        result = train(
            model, optimizer, data, indices, config, config.steps, (config.seed, index + 1), conn, progress,
            start_step=start, start_loss=restored.loss,
        )  # fmt: skip
        if conn.checkpoint_path is not None and cluster.checkpoint_every > 0:
            conn.save_checkpoint(meta={"config": config.to_dict()})  # the end, so a resumed run has nothing to redo
        accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
        stats = conn.stats()
        log.info(
            "node %s: done in %.1fs (%.1f ms/step), held-out accuracy %.4f, final loss %.4f, "
            "%d mixes, %d fetches timed out, %d refused, mean fetch %.1f ms",
            name,
            result.seconds,
            1000 * result.seconds / result.steps,
            accuracy,
            result.final_loss,
            stats["mixes"],
            stats["fetches_timed_out"],
            stats["fetches_refused"],
            stats["mean_fetch_ms"],
        )
        conn.report(
            accuracy=accuracy,
            final_loss=result.final_loss,
            test_loss=test_loss,
            steps=result.steps,
            samples=result.samples,
            seconds=result.seconds,
        )
        if len(names) > 1:
            conn.close(linger=LINGER_MAX_S, idle=LINGER_IDLE_S)  # serve peers still training, then leave
        if run_dir is not None:  # after leaving: a push-sum node's weight then says where its mass went
            meta = {"node": name, "index": index, "nodes": len(names), "samples": result.samples}
            conn.save_model(run_dir / f"{name}{MODEL_SUFFIX}", {**meta, "config": config.to_dict()})
    return 0


# --------------------------------------------------------------------------- evaluation


def evaluate_run(run_dir: Path) -> dict[str, Any]:
    """Average the run's node models, train the baseline, write and return ``demo.json``'s content."""
    models = run_models(run_dir)
    if not models:
        raise FileNotFoundError(f"no *{MODEL_SUFFIX} in {run_dir}: did the demo nodes finish?")
    loaded = [(model.arrays, model.user) for model in models]
    configs = {json.dumps(meta["config"], sort_keys=True) for _, meta in loaded}
    if len(configs) != 1:
        raise ValueError(f"the node models in {run_dir} were trained with different settings: {sorted(configs)}")
    node_cfg = TrainConfig.from_dict(loaded[0][1]["config"])
    data = make_dataset(node_cfg.seed, node_cfg.data)
    expected = loaded[0][1]["nodes"]
    if len(loaded) != expected:
        log.warning("%d of %d node models found in %s; averaging those", len(loaded), expected, run_dir)

    model = build_model(node_cfg)
    node_accuracy: dict[str, float] = {}
    for arrays, meta in loaded:
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()})
        node_accuracy[meta["node"]] = evaluate(model, data.x_test, data.y_test)[0]
    mean = average_models(models)  # push-sum: weighted by the nodes' weights, its consensus point
    spread = disagreement(models, mean)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in mean.items()})
    averaged_accuracy, averaged_loss = evaluate(model, data.x_test, data.y_test)

    total_samples = sum(int(meta["samples"]) for _, meta in loaded)
    baseline_steps = max(1, total_samples // node_cfg.batch_size)
    baseline = build_model(node_cfg)
    log.info(
        "baseline: %d steps of %d on all %d training samples, %d torch thread(s)",
        baseline_steps,
        node_cfg.batch_size,
        node_cfg.data.n_train,
        torch.get_num_threads(),
    )
    result = train(
        baseline,
        make_optimizer(baseline, node_cfg),
        data,
        np.arange(node_cfg.data.n_train),
        node_cfg,
        baseline_steps,
        (node_cfg.seed, 0),
        on_progress=lambda step, loss, _f, lr: log.info(
            "baseline: step %d/%d  loss %.4f  lr %.4f", step, baseline_steps, loss, lr
        ),
    )
    baseline_accuracy, baseline_loss = evaluate(baseline, data.x_test, data.y_test)
    summary = {
        "averaged_accuracy": averaged_accuracy,
        "baseline_accuracy": baseline_accuracy,
        "difference_points": 100.0 * (baseline_accuracy - averaged_accuracy),
        "node_accuracy": node_accuracy,
        "disagreement": spread.overall,
        "weights": {m.node: m.weight for m in models},
        "averaged_test_loss": averaged_loss,
        "baseline_test_loss": baseline_loss,
        "total_samples": total_samples,
        "nodes": len(loaded),
        "node_steps": {meta["node"]: int(meta["samples"]) // node_cfg.batch_size for _, meta in loaded},
        "baseline_steps": baseline_steps,
        "baseline_seconds": result.seconds,
        "config": node_cfg.to_dict(),
    }
    text = json.dumps(summary, indent=2) + "\n"
    write_atomically(run_dir / DEMO_JSON, text)
    return summary


def headline(summary: dict[str, Any]) -> str:
    """The evaluation's result in three lines (how far apart the models were: their relative distance to their mean)."""
    nodes = ", ".join(f"{k} {v:.4f}" for k, v in summary["node_accuracy"].items())
    return (
        f"averaged model of {summary['nodes']} nodes: held-out accuracy {summary['averaged_accuracy']:.4f} "
        f"(nodes: {nodes}; the models {100 * summary.get('disagreement', math.nan):.2f} % apart)\n"
        f"baseline, 1 process on all data, same {summary['total_samples']} samples: "
        f"held-out accuracy {summary['baseline_accuracy']:.4f}\n"
        f"difference: {summary['difference_points']:+.2f} accuracy points (baseline - averaged)"
    )


# --------------------------------------------------------------------------- command line


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dpwa.tools.demo",
        description="dpwa's built-in demo job: each node gossip-trains an MLP on its shard of generated data. "
        "Node name, cluster file and run directory come from DPWA_NODE, DPWA_CONFIG, DPWA_RUN_DIR (set by "
        "`dpwa run`). With --evaluate RUN_DIR: average the node models, train the one-process baseline, "
        "write RUN_DIR/demo.json.",
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="batches per node (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="default %(default)s")
    parser.add_argument(
        "--lr", type=float, default=DEFAULT_LR, help="peak learning rate, cosine decay to 0 (default %(default)s)"
    )
    parser.add_argument(
        "--momentum", type=float, default=MOMENTUM, help="SGD momentum, in [0, 1) (default %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="data, initial weights and batch order (default %(default)s)"
    )
    parser.add_argument("--partition", default="iid", help=PARTITION_HELP + " (default %(default)s)")
    parser.add_argument("--evaluate", metavar="RUN_DIR", type=Path, help="evaluate a finished demo run")
    return parser.parse_args(None if argv is None else list(argv))


def configure_logging() -> None:
    """Log to stderr (``dpwa run`` keeps it in ``<node>.log``) at ``DPWA_LOG_LEVEL`` (default INFO)."""
    level = os.environ.get(ENV_LOG_LEVEL, "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        level = "INFO"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    if args.evaluate is not None:
        torch.set_num_threads(EVALUATE_THREADS)
        try:
            summary = evaluate_run(args.evaluate)
        except (OSError, ValueError, KeyError) as err:
            log.error("cannot evaluate %s: %s", args.evaluate, err)
            return 1
        print(headline(summary), flush=True)
        return 0
    set_threads()
    try:
        config = TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            momentum=args.momentum,
            partition=args.partition,
        )
    except ValueError as err:
        log.error("%s", err)
        return 2
    return run_node(config)


if __name__ == "__main__":
    sys.exit(main())
