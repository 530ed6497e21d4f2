"""Training in the simulator: N nodes fit a softmax classifier to their part of the demo's data, gossiping
with any rule, in synchronous rounds, deterministic for a seed (numpy only).

    result = simulate_training("pushsum", partition="classes:3", nodes=4, rounds=600)
    result.averaged_accuracy, result.node_accuracy

The data is the demo's Gaussian mixture (:mod:`dpwa.tools.mixture`), split by ``partition`` (``iid``,
``dirichlet:ALPHA``, ``classes:K``: :mod:`dpwa.utils.partition`). Every node starts from the same zero
weights and runs SGD on the cross-entropy of a linear model ``softmax(x W + b)``: a mini-batch of its own
samples per round (a seeded stream), learning rate ``lr`` with a cosine decay over ``rounds``. The
simulator (:class:`~dpwa.tools.simulation.Simulation`) runs the rule's own code around every step, as the
network path does, without any timing; the local step happens between publish and mix, as in
``update_send`` / ``update_wait``. A linear model keeps the comparison of rules about the rules: the one
process baseline is the same model on all the data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dpwa.rules import RULES, make_rule
from dpwa.rules.outer import outer_rule, outer_schedule, outer_settings
from dpwa.rules.schedules import make_schedule
from dpwa.tools.mixture import DataSpec, MixtureData, gaussian_mixture
from dpwa.tools.simulation import SimNode, Simulation
from dpwa.utils.partition import class_histogram, partition_indices

__all__ = ["SimTrainResult", "accuracy", "one_process", "simulate_training", "softmax_sgd_step"]


@dataclasses.dataclass(frozen=True)
class SimTrainResult:
    """Held-out accuracies after ``rounds``: each node's model, and the average of the nodes' models."""

    rule: str
    partition: str
    rounds: int
    node_accuracy: dict[str, float]
    averaged_accuracy: float
    classes: dict[str, list[int]]
    """Each node's class histogram."""

    @property
    def mean_node_accuracy(self) -> float:
        return float(np.mean(list(self.node_accuracy.values())))


def accuracy(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """The share of ``x`` that ``argmax(x W + b)`` labels ``y``."""
    return float(np.mean(np.argmax(x @ w + b, axis=1) == y))


def softmax_sgd_step(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray, lr: float) -> float:
    """One SGD step on the mean cross-entropy of ``softmax(x W + b)``, in place; the batch's loss before it."""
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = -float(np.mean(np.log(p[np.arange(len(y)), y] + 1e-12)))
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    w -= lr * (x.T @ p)
    b -= lr * p.sum(axis=0)
    return loss


def simulate_training(
    rule: str,
    *,
    nodes: int = 4,
    partition: str = "iid",
    rounds: int = 600,
    batch_size: int = 32,
    lr: float = 0.5,
    seed: int = 0,
    schedule: str | None = None,
    settings: Any = None,
    data: MixtureData | None = None,
    outer: Any = None,
) -> SimTrainResult:
    """``rounds`` synchronous rounds of ``nodes`` nodes training with ``rule`` (its ``settings``: a dataclass,
    a mapping or None) on ``partition``; ``schedule`` defaults to the rule's own. ``rule="none"``: no gossip.
    ``outer``: the rule and schedule under that outer optimizer (an OuterSettings or a mapping of its fields)."""
    data = data if data is not None else gaussian_mixture(seed, DataSpec())
    classes = int(data.y_train.max()) + 1
    shards = partition_indices(data.y_train, nodes, partition, seed, classes)
    names = [f"w{i + 1}" for i in range(nodes)]
    gossip = rule != "none"
    sim = _simulation(
        rule if gossip else "constant", names, data.x_train.shape[1], classes, settings, schedule, seed, outer
    )
    batches = _Batches(names, shards, batch_size, seed)
    losses: dict[str, float] = dict.fromkeys(names, math.log(classes))

    def train(node: SimNode) -> float:
        k = node.step
        step_lr = 0.5 * lr * (1.0 + math.cos(math.pi * k / rounds))
        idx = batches.next(node.name)
        loss = softmax_sgd_step(node.arrays[0], node.arrays[1], data.x_train[idx], data.y_train[idx], step_lr)
        losses[node.name] = loss
        return loss

    for _ in range(rounds):
        if gossip:
            sim.run_round(dict(losses), train=train)
        else:
            for node in sim.nodes.values():
                train(node)
                node.step += 1
    return _result(rule, str(partition), rounds, sim, data, shards, classes)


def _simulation(
    rule: str,
    names: list[str],
    features: int,
    classes: int,
    settings: Any,
    schedule: str | None,
    seed: int,
    outer: Any = None,
) -> Simulation:
    """The nodes ``names``, each with zero weights ``(features, classes)`` and biases, ``rule`` (with
    ``settings``) and ``schedule`` (default: the rule's own), under the outer optimizer ``outer`` if given."""
    start = [np.zeros((features, classes)), np.zeros(classes)]
    checked = outer_settings(outer)
    return Simulation(
        [[a.copy() for a in start] for _ in names],
        lambda: outer_rule(make_rule(rule, settings, 0.0), checked),
        lambda: outer_schedule(make_schedule(schedule or RULES[rule].default_schedule, settings, names), checked),
        seed=seed,
    )


class _Batches:
    """Each node's mini-batches: ``batch_size`` indices of its shard at a time, the shard in a fresh order of
    the node's seeded stream whenever the rest of the current order is shorter than a batch."""

    def __init__(self, names: list[str], shards: list[np.ndarray], batch_size: int, seed: int) -> None:
        self._shards = dict(zip(names, shards))
        self._streams = {name: np.random.default_rng([seed, 0xBA7C, i]) for i, name in enumerate(names)}
        self._orders: dict[str, np.ndarray] = {}
        self._cursor = dict.fromkeys(names, 0)
        self._size = batch_size

    def next(self, name: str) -> np.ndarray:
        """Node ``name``'s next batch of sample indices."""
        shard = self._shards[name]
        if name not in self._orders or self._cursor[name] + self._size > len(shard):
            self._orders[name] = shard[self._streams[name].permutation(len(shard))]
            self._cursor[name] = 0
        out = self._orders[name][self._cursor[name] : self._cursor[name] + self._size]
        self._cursor[name] += self._size
        return out


def _result(
    rule: str,
    partition: str,
    rounds: int,
    sim: Simulation,
    data: MixtureData,
    shards: list[np.ndarray],
    classes: int,
) -> SimTrainResult:
    """The held-out accuracy of each of ``sim``'s nodes and of their averaged model, with the nodes' histograms
    of the ``classes`` classes (node ``i`` holds ``shards[i]``)."""
    models = {name: sim[name].arrays for name in sim.names}
    node_accuracy = {name: accuracy(m[0], m[1], data.x_test, data.y_test) for name, m in models.items()}
    mean_w = np.mean([m[0] for m in models.values()], axis=0)
    mean_b = np.mean([m[1] for m in models.values()], axis=0)
    return SimTrainResult(
        rule=rule,
        partition=partition,
        rounds=rounds,
        node_accuracy=node_accuracy,
        averaged_accuracy=accuracy(mean_w, mean_b, data.x_test, data.y_test),
        classes={name: class_histogram(data.y_train, shards[i], classes) for i, name in enumerate(sim.names)},
    )


def one_process(
    *, rounds: int, batch_size: int = 32, lr: float = 0.5, seed: int = 0, data: MixtureData | None = None
) -> float:
    """The baseline: one model on all the data for ``rounds`` steps of ``batch_size``; its held-out accuracy."""
    result = simulate_training("none", nodes=1, rounds=rounds, batch_size=batch_size, lr=lr, seed=seed, data=data)
    return result.averaged_accuracy
