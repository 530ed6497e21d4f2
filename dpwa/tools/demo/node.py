"""One node of the demo, as ``dpwa run`` starts it: ``python -m dpwa.tools.demo [--steps N] ...``.

Its name, cluster file and run directory come from the environment (``DPWA_NODE``, ``DPWA_CONFIG``,
``DPWA_RUN_DIR``), its torch thread count from ``DPWA_TORCH_THREADS`` (:func:`set_threads`).
:func:`run_node` then

1. takes its shard of the generated data (its index in the cluster file's ``nodes``) and writes
   ``<run_dir>/<node>.data.json``;
2. builds the model and optimizer, then its :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter`, which waits
   (at most ``PEERS_WAIT_S``) until every peer's node is up, so that nodes started together also start
   training together;
3. resumes from its checkpoint when there is one (``dpwa run --resume`` / ``--restart-failed``:
   ``adapter.restore()``), trains to ``--steps`` (:func:`~dpwa.tools.demo.training.train`), and checkpoints
   once more at the end when the cluster file asks for checkpoints;
4. reports its held-out accuracy (``conn.report(accuracy=..., final_loss=...)``), keeps serving its final
   parameters while peers still fetch them (``close(linger=...)``), and writes ``<run_dir>/<node>.model.npz``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from dpwa.tools.demo.config import TrainConfig
from dpwa.tools.demo.data import Dataset, make_dataset, node_indices, write_data_file
from dpwa.tools.demo.modelfiles import MODEL_SUFFIX
from dpwa.tools.demo.sgd import OptimizerLike
from dpwa.tools.demo.training import TrainResult, build_model, evaluate, make_optimizer, train
from dpwa.utils.partition import class_histogram

if TYPE_CHECKING:
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter
    from dpwa.config import ClusterConfig

__all__ = [
    "ENV_CONFIG",
    "ENV_LOG_LEVEL",
    "ENV_NODE",
    "ENV_RUN_DIR",
    "ENV_THREADS",
    "LINGER_IDLE_S",
    "LINGER_MAX_S",
    "linger_idle_s",
    "PEERS_WAIT_S",
    "run_node",
    "set_threads",
]

log = logging.getLogger("dpwa.tools.demo")  # one logger for the whole demo

ENV_NODE = "DPWA_NODE"
ENV_CONFIG = "DPWA_CONFIG"
ENV_RUN_DIR = "DPWA_RUN_DIR"
ENV_THREADS = "DPWA_TORCH_THREADS"
ENV_LOG_LEVEL = "DPWA_LOG_LEVEL"

PEERS_WAIT_S = 30.0  # before training, wait at most this long until every peer's node is up
LINGER_IDLE_S = 0.5  # keep serving until no peer fetched for this long (at least; see linger_idle_s) ...
LINGER_MAX_S = 60.0  # ... but never longer than this


def linger_idle_s(peers: int, seconds: float, steps: int, served: int) -> float:
    """How long a node done training keeps serving after the last fetch it served (it trained ``steps`` steps in
    ``seconds`` and served ``served`` fetches): at least :data:`LINGER_IDLE_S`, three times the steps in which a
    peer that fetches one of its ``peers`` a step comes to it once on average, and three times the mean interval
    between the fetches it served (a straggler fetches it less often than its own steps say). A node that leaves
    announces it, so a peer still training loses a partner, not a timeout."""
    per_step = seconds / max(1, steps)
    per_fetch = seconds / served if served > 0 else 0.0
    return max(LINGER_IDLE_S, 3.0 * peers * per_step, 3.0 * per_fetch)


def set_threads() -> None:
    """torch.set_num_threads(DPWA_TORCH_THREADS) when set (``dpwa run`` gives each node its share of cores)."""
    value = os.environ.get(ENV_THREADS)
    if value:
        try:
            torch.set_num_threads(int(value))
        except ValueError:
            log.warning("ignoring %s=%r: not an integer", ENV_THREADS, value)


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where this node stands: its name, the cluster, its index among the cluster's ``count`` nodes, the run
    directory (None: nothing written)."""

    name: str
    cluster: ClusterConfig
    index: int
    count: int
    run_dir: Path | None


def _locate() -> _Place | None:
    """This node's :class:`_Place`, from the environment and the cluster file; None (error logged) when unknown."""
    from dpwa.config import ConfigError, load_config

    name, cluster_file = os.environ.get(ENV_NODE), os.environ.get(ENV_CONFIG)
    if not name or not cluster_file:
        log.error("%s and %s must be set (start the demo with `dpwa run CLUSTER.yaml`)", ENV_NODE, ENV_CONFIG)
        return None
    try:
        cluster = load_config(cluster_file)
        names = [node.name for node in cluster.nodes]
        index = names.index(cluster.node(name).name)
    except ConfigError as err:
        log.error("%s", err)
        return None
    run_dir = Path(os.environ[ENV_RUN_DIR]) if os.environ.get(ENV_RUN_DIR) else None
    if run_dir is None:
        log.warning("%s is not set: no metrics and no model file will be written", ENV_RUN_DIR)
    return _Place(name, cluster, index, len(names), run_dir)


def _log_start(place: _Place, config: TrainConfig, indices: np.ndarray, histogram: list[int]) -> None:
    log.info(
        "node %s: shard %d/%d (%s, %d samples, classes %s), %d steps of %d, lr %g cosine, momentum %g, "
        "%d torch thread(s)",
        place.name,
        place.index + 1,
        place.count,
        config.partition,
        len(indices),
        histogram,
        config.steps,
        config.batch_size,
        config.lr,
        config.momentum,
        torch.get_num_threads(),
    )


def _train_node(
    conn: DpwaPyTorchAdapter,
    place: _Place,
    model: nn.Module,
    optimizer: OptimizerLike,
    data: Dataset,
    indices: np.ndarray,
    config: TrainConfig,
) -> TrainResult:
    """Resume from a checkpoint if there is one, train to ``config.steps``, checkpoint the end."""
    name = place.name

    def progress(step: int, loss: float, factor: float, lr: float) -> None:
        log.info(
            "node %s: step %d/%d  loss %.4f  mean factor %.3f  lr %.4f", name, step, config.steps, loss, factor, lr
        )

    restored = conn.restore()  # dpwa run --resume / --restart-failed: checkpoint, then a peer's model
    if restored.checkpoint is not None and restored.meta.get("config", config.to_dict()) != config.to_dict():
        log.warning("node %s: the checkpoint was written with other settings; resuming anyway", name)
    start = min(restored.step, config.steps)
    result = train(
        model, optimizer, data, indices, config, config.steps, (config.seed, place.index + 1), conn, progress,
        start_step=start, start_loss=restored.loss,
    )  # fmt: skip
    if conn.checkpoint_path is not None and place.cluster.checkpoint_every > 0:
        conn.save_checkpoint(meta={"config": config.to_dict()})  # the end, so a resumed run has nothing to redo
    return result


def _finish(
    conn: DpwaPyTorchAdapter, place: _Place, model: nn.Module, data: Dataset, config: TrainConfig, result: TrainResult
) -> None:
    """Evaluate and report, serve the peers still training, then write the model file."""
    accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
    stats = conn.stats()
    log.info(
        "node %s: done in %.1fs (%.1f ms/step), held-out accuracy %.4f, final loss %.4f, "
        "%d mixes, %d fetches timed out, %d refused, mean fetch %.1f ms",
        place.name,
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
    if place.count > 1:
        idle = linger_idle_s(place.count - 1, result.seconds, result.steps, stats["served"])
        conn.close(linger=LINGER_MAX_S, idle=idle)  # serve peers still training, then leave
    if place.run_dir is not None:  # after leaving: a push-sum node's weight then says where its mass went
        meta = {"node": place.name, "index": place.index, "nodes": place.count, "samples": result.samples}
        conn.save_model(place.run_dir / f"{place.name}{MODEL_SUFFIX}", {**meta, "config": config.to_dict()})


def run_node(config: TrainConfig) -> int:
    """One node of the demo (name, cluster file and run directory from the environment); exit status."""
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter  # imported here: `--evaluate` needs no network
    from dpwa.node.transport import PortInUseError

    place = _locate()
    if place is None:
        return 2
    data = make_dataset(config.seed, config.data)
    indices = node_indices(config, data, place.index, place.count)
    histogram = class_histogram(data.y_train.numpy(), indices, config.data.classes)
    if place.run_dir is not None:
        write_data_file(place.run_dir, place.name, config, histogram)
    model = build_model(config)
    optimizer = make_optimizer(model, config)
    _log_start(place, config, indices, histogram)
    seed = config.seed * 1000 + place.index
    wait_s = PEERS_WAIT_S if place.count > 1 else 0.0  # nodes started together start training together
    try:
        adapter = DpwaPyTorchAdapter(
            model,
            place.name,
            place.cluster,
            seed=seed,
            run_dir=place.run_dir,
            optimizer=optimizer,
            wait_for_peers_s=wait_s,
        )
    except PortInUseError as err:  # taken since `dpwa run` checked it: one line, not a traceback
        log.error("%s", err)
        return 1
    with adapter as conn:
        result = _train_node(conn, place, model, optimizer, data, indices, config)
        _finish(conn, place, model, data, config, result)
    return 0
