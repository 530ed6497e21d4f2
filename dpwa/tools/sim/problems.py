"""The models ``dpwa simulate`` trains: each node holds one flat parameter vector (a row of one matrix).

* ``quadratic`` -- node ``i`` minimizes ``1/2 ||x - c_i||^2`` with gradient noise (std 1 per coordinate), in
  ``dim`` coordinates from ``x = 0``. ``iid``: one shared centre; any other partition: each node its own centre,
  ``c_i ~ N(0, 9 I)`` (the consensus problem of the tests). The answer is known: the minimizer of the average
  objective is the mean of the centres; "loss" is the average objective at the nodes' mean model, less its minimum.
* ``logistic`` -- softmax regression on the handwritten digits shipped with dpwa (1,797 8x8 images, 10 classes;
  ``dpwa/tools/sim/data/README.md``): 360 held out, the other 1,437 split among the nodes by ``--partition``
  (tiled so that every node holds at least ``MIN_PER_NODE`` samples: beyond ~90 nodes samples are shared).
* ``demo`` -- the same model on the built-in demo's data: a 10-class Gaussian mixture in 32 features (40,000
  samples to train on, 10,000 held out).

A step is one SGD step on a mini-batch of the node's shard (drawn with replacement from the node's own seeded
stream) at the learning rate ``lr`` with a cosine decay over ``steps``.
"""

from __future__ import annotations

import abc
import math
from importlib import resources

import numpy as np

from dpwa.tools.mixture import DataSpec, gaussian_mixture
from dpwa.tools.simtrain import softmax_sgd_step
from dpwa.utils.partition import parse_partition, partition_indices

__all__ = ["MIN_PER_NODE", "MODELS", "Problem", "make_problem"]

MODELS = ("quadratic", "logistic", "demo")
MIN_PER_NODE = 16
HELD_OUT = 360


class Problem(abc.ABC):
    """A model and every node's data; ``shapes``: the arrays a node's flat vector splits into."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    has_accuracy: bool = True
    default_lr: float = 0.5

    def __init__(self, nodes: int, partition: str, seed: int, batch_size: int) -> None:
        self.nodes, self.partition, self.seed, self.batch_size = nodes, partition, seed, batch_size
        self.size = sum(math.prod(s) for s in self.shapes)
        self.streams: list[np.random.Generator] = []
        self.add_nodes(nodes)

    def add_nodes(self, count: int) -> None:
        """Streams for ``count`` more nodes (a join): each its own, seeded by its index."""
        first = len(self.streams)
        self.streams += [np.random.default_rng([self.seed, 0xDA7A, i]) for i in range(first, first + count)]

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """``flat`` split into arrays of :attr:`shapes` (views: a rule mixing them writes ``flat``)."""
        out, at = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[at : at + n].reshape(shape))
            at += n
        return out

    def initial(self) -> np.ndarray:
        """Where every node starts: zeros."""
        return np.zeros(self.size)

    @abc.abstractmethod
    def step(self, node: int, flat: np.ndarray, lr: float) -> float:
        """One local SGD step of node ``node`` on ``flat`` in place; the batch's loss before it."""

    def step_batch(self, nodes: np.ndarray, params: np.ndarray, lrs: np.ndarray) -> np.ndarray:
        """One local step of each of ``nodes`` on its row of ``params`` (``lrs``: each one's rate), in place; the
        batches' losses. Each node's step uses its own row and stream alone (so any batch gives the same draws)."""
        return np.array([self.step(int(i), params[i], float(lr)) for i, lr in zip(nodes, lrs)])

    @abc.abstractmethod
    def evaluate(self, flat: np.ndarray) -> tuple[float, float | None]:
        """(loss, accuracy or None) of the model ``flat``: held-out for a classifier, the average objective's
        excess for the quadratic."""


class Quadratic(Problem):
    """Module doc-string; ``dim`` coordinates."""

    name = "quadratic"
    has_accuracy = False
    default_lr = 0.1
    dim = 100

    def __init__(self, nodes: int, partition: str, seed: int, batch_size: int) -> None:
        self.shapes = ((self.dim,),)
        self.shared = parse_partition(partition).kind == "iid"
        super().__init__(nodes, partition, seed, batch_size)

    def centre(self, node: int) -> np.ndarray:
        """Node ``node``'s centre (a pure function of the seed and, unless iid, the node)."""
        key = [self.seed, 0xC3, 0 if self.shared else node]
        return np.random.default_rng(key).normal(scale=3.0, size=self.dim)

    def add_nodes(self, count: int) -> None:
        super().add_nodes(count)
        self.centres = np.array([self.centre(i) for i in range(len(self.streams))])

    def step(self, node: int, flat: np.ndarray, lr: float) -> float:
        diff = flat - self.centres[node]
        loss = 0.5 * float(diff @ diff)
        flat -= lr * (diff + self.streams[node].standard_normal(self.dim) / math.sqrt(self.batch_size))
        return loss

    def step_batch(self, nodes: np.ndarray, params: np.ndarray, lrs: np.ndarray) -> np.ndarray:
        diff = params[nodes] - self.centres[nodes]
        losses = 0.5 * np.einsum("ij,ij->i", diff, diff)
        noise = np.stack([self.streams[i].standard_normal(self.dim) for i in nodes.tolist()])
        params[nodes] -= lrs[:, None] * (diff + noise / math.sqrt(self.batch_size))
        return losses

    def evaluate(self, flat: np.ndarray) -> tuple[float, float | None]:
        optimum = self.centres[: self.nodes].mean(axis=0)
        return 0.5 * float(np.sum((flat - optimum) ** 2)), None


class Softmax(Problem):
    """Softmax regression ``softmax(x W + b)`` on a data set split among the nodes."""

    def __init__(
        self, name: str, data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], nodes: int, partition: str,
        seed: int, batch_size: int,
    ) -> None:  # fmt: skip
        self.name = name
        self.x_train, self.y_train, self.x_test, self.y_test = data
        self.features, self.classes = self.x_train.shape[1], int(self.y_train.max()) + 1
        self.shapes = ((self.features, self.classes), (self.classes,))
        self.shards: list[np.ndarray] = []
        super().__init__(nodes, partition, seed, batch_size)

    def add_nodes(self, count: int) -> None:
        first = len(self.streams)
        super().add_nodes(count)
        total = len(self.streams)
        if first == 0:
            self.shards = self._split(total)
        else:  # a joined node: an iid shard of the whole training set
            n = len(self.y_train)
            self.shards += [np.random.default_rng([self.seed, 0x701, i]).choice(n, max(MIN_PER_NODE, n // total))
                            for i in range(first, total)]  # fmt: skip

    def _split(self, nodes: int) -> list[np.ndarray]:
        n = len(self.y_train)
        tiles = max(1, math.ceil(MIN_PER_NODE * nodes / n))
        labels = np.tile(self.y_train, tiles)
        shards = partition_indices(labels, nodes, self.partition, self.seed, self.classes)
        return [s % n for s in shards]

    def step(self, node: int, flat: np.ndarray, lr: float) -> float:
        shard = self.shards[node]
        idx = shard[self.streams[node].integers(0, len(shard), self.batch_size)]
        w, b = self.views(flat)
        return softmax_sgd_step(w, b, self.x_train[idx], self.y_train[idx], lr)

    def step_batch(self, nodes: np.ndarray, params: np.ndarray, lrs: np.ndarray) -> np.ndarray:
        """The nodes' SGD steps as batched matrix products (one set of numpy calls for the whole batch)."""
        if len(nodes) < 4:
            return super().step_batch(nodes, params, lrs)
        f, c = self.features, self.classes
        idx = np.stack([self.shards[i][self.streams[i].integers(0, len(self.shards[i]), self.batch_size)]
                        for i in nodes.tolist()])  # fmt: skip
        x, y = self.x_train[idx], self.y_train[idx]
        rows = params[nodes]
        w, b = rows[:, : f * c].reshape(-1, f, c), rows[:, f * c :]
        logits = x @ w + b[:, None, :]
        logits -= logits.max(axis=2, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=2, keepdims=True)
        batch, picked = np.arange(len(nodes))[:, None], np.arange(self.batch_size)[None, :]
        losses = -np.mean(np.log(p[batch, picked, y] + 1e-12), axis=1)
        p[batch, picked, y] -= 1.0
        p /= self.batch_size
        rows[:, : f * c] -= lrs[:, None] * (x.transpose(0, 2, 1) @ p).reshape(len(nodes), -1)
        rows[:, f * c :] -= lrs[:, None] * p.sum(axis=1)
        params[nodes] = rows
        return losses

    def evaluate(self, flat: np.ndarray) -> tuple[float, float | None]:
        w, b = self.views(flat)
        logits = self.x_test @ w + b
        logits -= logits.max(axis=1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        loss = -float(np.mean(log_p[np.arange(len(self.y_test)), self.y_test]))
        return loss, float(np.mean(np.argmax(logits, axis=1) == self.y_test))


def digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The shipped digits, standardized per feature (train statistics), ``HELD_OUT`` held out by a seeded split."""
    with resources.files("dpwa.tools.sim").joinpath("data/digits.npz").open("rb") as handle:
        data = np.load(handle)
        x, y = data["x"].astype(np.float64), data["y"].astype(np.int64)
    order = np.random.default_rng([seed, 0xD161]).permutation(len(y))
    test, train = order[:HELD_OUT], order[HELD_OUT:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0) + 1e-6
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def make_problem(model: str, nodes: int, partition: str, seed: int, batch_size: int = 16) -> Problem:
    """The problem ``model`` (:data:`MODELS`) for ``nodes`` nodes; ValueError for an unknown one or a bad split."""
    if model == "quadratic":
        return Quadratic(nodes, partition, seed, batch_size)
    if model == "logistic":
        return Softmax("logistic", digits(seed), nodes, partition, seed, batch_size)
    if model == "demo":
        mix = gaussian_mixture(seed, DataSpec())
        return Softmax("demo", (mix.x_train, mix.y_train, mix.x_test, mix.y_test), nodes, partition, seed, batch_size)
    raise ValueError(f"model {model!r}: expected one of {', '.join(MODELS)}")
