"""The evaluation of a finished demo run: ``python -m dpwa.tools.demo --evaluate RUN_DIR``.

:func:`evaluate_run` averages every ``<node>.model.npz`` of the run (weighted by the nodes' push-sum
weights: their consensus point), evaluates that averaged model, and trains a *baseline*: one process, all
the training data, the same model, optimizer, initial weights, batch size, learning rate and schedule, for
as many samples as all nodes together.  Both held-out accuracies, each node's, and how far apart the node
models were go to ``<run_dir>/demo.json``; :func:`headline` puts the result in three lines for stdout.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpwa.modelfile import ModelFile, average_models, disagreement, run_models
from dpwa.tools.demo.config import TrainConfig
from dpwa.tools.demo.data import Dataset, make_dataset
from dpwa.tools.demo.modelfiles import MODEL_SUFFIX
from dpwa.tools.demo.training import TrainResult, build_model, evaluate, make_optimizer, train
from dpwa.utils.atomic import write_atomically

__all__ = ["DEMO_JSON", "EVALUATE_THREADS", "evaluate_run", "headline"]

log = logging.getLogger("dpwa.tools.demo")  # one logger for the whole demo

DEMO_JSON = "demo.json"
# --evaluate trains the baseline on one thread whatever DPWA_TORCH_THREADS says: the MLP's matrices are too small
# for intra-op threads, and on 2 shared cores 2 OpenMP threads made the 12,000-step baseline 8x slower (26 s vs 3 s).
EVALUATE_THREADS = 1


def _node_models(run_dir: Path) -> tuple[list[ModelFile], TrainConfig]:
    """The run's node models and the settings they were all trained with (OSError, ValueError, KeyError)."""
    models = run_models(run_dir)
    if not models:
        raise FileNotFoundError(f"no *{MODEL_SUFFIX} in {run_dir}: did the demo nodes finish?")
    configs = {json.dumps(model.user["config"], sort_keys=True) for model in models}
    if len(configs) != 1:
        raise ValueError(f"the node models in {run_dir} were trained with different settings: {sorted(configs)}")
    return models, TrainConfig.from_dict(models[0].user["config"])


def _node_accuracies(model: nn.Module, models: list[ModelFile], data: Dataset) -> dict[str, float]:
    """Each node model's held-out accuracy, by node name (``model`` is loaded with each in turn)."""
    accuracy: dict[str, float] = {}
    for node in models:
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in node.arrays.items()})
        accuracy[node.user["node"]] = evaluate(model, data.x_test, data.y_test)[0]
    return accuracy


def _train_baseline(config: TrainConfig, data: Dataset, steps: int) -> tuple[nn.Module, TrainResult]:
    """The baseline: ``steps`` steps on all the training data, the nodes' model, optimizer and schedule."""
    baseline = build_model(config)
    log.info(
        "baseline: %d steps of %d on all %d training samples, %d torch thread(s)",
        steps,
        config.batch_size,
        config.data.n_train,
        torch.get_num_threads(),
    )
    result = train(
        baseline,
        make_optimizer(baseline, config),
        data,
        np.arange(config.data.n_train),
        config,
        steps,
        (config.seed, 0),
        on_progress=lambda step, loss, _f, lr: log.info(
            "baseline: step %d/%d  loss %.4f  lr %.4f", step, steps, loss, lr
        ),
    )
    return baseline, result


def evaluate_run(run_dir: Path) -> dict[str, Any]:
    """Average the run's node models, train the baseline, write and return ``demo.json``'s content."""
    models, config = _node_models(run_dir)
    data = make_dataset(config.seed, config.data)
    expected = models[0].user["nodes"]
    if len(models) != expected:
        log.warning("%d of %d node models found in %s; averaging those", len(models), expected, run_dir)

    model = build_model(config)
    node_accuracy = _node_accuracies(model, models, data)
    mean = average_models(models)  # push-sum: weighted by the nodes' weights, its consensus point
    spread = disagreement(models, mean)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in mean.items()})
    averaged_accuracy, averaged_loss = evaluate(model, data.x_test, data.y_test)

    total_samples = sum(int(node.user["samples"]) for node in models)
    baseline_steps = max(1, total_samples // config.batch_size)
    baseline, result = _train_baseline(config, data, baseline_steps)
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
        "nodes": len(models),
        "node_steps": {node.user["node"]: int(node.user["samples"]) // config.batch_size for node in models},
        "baseline_steps": baseline_steps,
        "baseline_seconds": result.seconds,
        "config": config.to_dict(),
    }
    write_atomically(run_dir / DEMO_JSON, json.dumps(summary, indent=2) + "\n")
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
