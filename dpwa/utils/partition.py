"""How a labelled training set is split between nodes: ``iid``, ``dirichlet:ALPHA`` or ``classes:K``.

The three splits of the decentralized-learning literature, each a pure function of the labels, the
number of nodes and a seed; every split is disjoint (no sample on two nodes).

``iid``
    Node ``i`` of ``n`` gets samples ``i, i+n, i+2n, ...`` (disjoint, covering, equal sizes within one;
    on a shuffled data set that is a random shard).
``dirichlet:ALPHA`` (Hsu, Qi and Brown 2019)
    Node ``i`` draws its class proportions ``q_i ~ Dir(ALPHA * p)`` (``p``: the classes' share of the
    data) and takes ``n_train // n`` samples (the first ``n_train % n`` nodes one more), class after class
    as ``q_i`` says, without replacement; a class that runs out is dropped from ``q_i`` and the rest
    renormalised (once all of ``q_i``'s classes are gone, ``p`` over what is left). Small ``ALPHA``
    (0.1) gives each node one or two dominant classes, large ``ALPHA`` (100) approaches ``iid``.
    Equal sizes, covering.
``classes:K``
    Every node holds exactly ``K`` distinct classes: a seeded permutation of the classes is dealt round
    robin (node ``i`` gets slots ``i*K .. i*K+K-1``, modulo the number of classes), so the classes are
    spread as evenly as they can be; each class's samples are split evenly between the nodes holding
    it. Covering when ``n*K >= classes``; sizes differ when some classes are held by more nodes than
    others (the histogram says so).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["PARTITION_HELP", "Partition", "class_histogram", "describe", "parse_partition", "partition_indices"]

PARTITION_HELP = "iid | dirichlet:ALPHA | classes:K: how the training data is split between the nodes"

_SEED_SALT = 0x5917


@dataclasses.dataclass(frozen=True)
class Partition:
    """A parsed ``--partition``: ``kind`` is ``iid``, ``dirichlet`` (with ``alpha``) or ``classes`` (with ``k``)."""

    kind: str = "iid"
    alpha: float = 0.0
    k: int = 0

    def __str__(self) -> str:
        if self.kind == "dirichlet":
            return f"dirichlet:{self.alpha:g}"
        if self.kind == "classes":
            return f"classes:{self.k}"
        return "iid"


def parse_partition(text: str | Partition) -> Partition:
    """``iid``, ``dirichlet:ALPHA`` (ALPHA > 0, finite) or ``classes:K`` (K >= 1); ValueError naming the form."""
    if isinstance(text, Partition):
        return text
    spec = str(text).strip().lower()
    kind, _, arg = spec.partition(":")
    if kind == "iid" and not arg:
        return Partition()
    if kind == "dirichlet" and arg:
        try:
            alpha = float(arg)
        except ValueError:
            alpha = math.nan
        if math.isfinite(alpha) and alpha > 0:
            return Partition("dirichlet", alpha=alpha)
        raise ValueError(f"partition {text!r}: dirichlet:ALPHA needs a finite ALPHA > 0")
    if kind == "classes" and arg:
        try:
            k = int(arg)
        except ValueError:
            k = 0
        if k >= 1:
            return Partition("classes", k=k)
        raise ValueError(f"partition {text!r}: classes:K needs an integer K >= 1")
    raise ValueError(f"partition {text!r}: expected iid, dirichlet:ALPHA or classes:K")


def partition_indices(
    labels: np.ndarray, nodes: int, partition: str | Partition, seed: int, classes: int | None = None
) -> list[np.ndarray]:
    """Each node's training-sample indices (sorted int64 arrays), a pure function of the arguments.

    ``labels``: one integer class in ``[0, classes)`` per sample (``classes`` defaults to ``max + 1``).
    Raises ValueError for fewer than one node, ``classes:K`` with ``K`` above the number of classes,
    or a split that leaves a node without samples.
    """
    part = parse_partition(partition)
    labels = np.asarray(labels)
    if nodes < 1:
        raise ValueError(f"need at least one node, got {nodes}")
    n_classes = int(classes) if classes is not None else (int(labels.max()) + 1 if labels.size else 0)
    if part.kind == "iid":
        shards = [np.arange(i, labels.size, nodes, dtype=np.int64) for i in range(nodes)]
    elif part.kind == "dirichlet":
        shards = _dirichlet(labels, nodes, part.alpha, n_classes, seed)
    else:
        if part.k > n_classes:
            raise ValueError(f"partition {part}: only {n_classes} classes")
        shards = _by_class(labels, nodes, part.k, n_classes, seed)
    for i, shard in enumerate(shards):
        if shard.size == 0:
            raise ValueError(f"partition {part} leaves node {i} of {nodes} without samples")
    return shards


def class_histogram(labels: np.ndarray, indices: np.ndarray, classes: int) -> list[int]:
    """How many of ``indices`` fall in each class ``0 .. classes-1``."""
    return [int(c) for c in np.bincount(np.asarray(labels)[indices], minlength=classes)[:classes]]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, _SEED_SALT])


def _pools(labels: np.ndarray, n_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each class's sample indices, in a seeded random order."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(n_classes)]


def _dirichlet(labels: np.ndarray, nodes: int, alpha: float, n_classes: int, seed: int) -> list[np.ndarray]:
    rng = _rng(seed)
    pools = _pools(labels, n_classes, rng)
    taken = [0] * n_classes
    prior = np.array([p.size for p in pools], dtype=np.float64)
    prior /= max(prior.sum(), 1.0)
    base, extra = divmod(labels.size, nodes)
    shards = []
    for i in range(nodes):
        want = base + (i < extra)
        q = rng.dirichlet(np.maximum(alpha * prior, 1e-300)) if n_classes else np.zeros(0)
        counts = np.zeros(n_classes, dtype=np.int64)
        while want > 0:
            left = np.array([p.size - t for p, t in zip(pools, taken)], dtype=np.float64) - counts
            weights = np.where(left > 0, q, 0.0)
            if weights.sum() <= 0.0:  # every class of q is used up: the data's own mix over what is left
                weights = np.where(left > 0, prior, 0.0)
            draw = rng.multinomial(want, weights / weights.sum())
            draw = np.minimum(draw, left.astype(np.int64))
            counts += draw
            want -= int(draw.sum())
        parts = []
        for c in range(n_classes):
            parts.append(pools[c][taken[c] : taken[c] + counts[c]])
            taken[c] += int(counts[c])
        shards.append(np.sort(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, np.int64))
    return shards


def _by_class(labels: np.ndarray, nodes: int, k: int, n_classes: int, seed: int) -> list[np.ndarray]:
    rng = _rng(seed)
    pools = _pools(labels, n_classes, rng)
    order = rng.permutation(n_classes)
    held: list[list[int]] = [[int(order[(i * k + j) % n_classes]) for j in range(k)] for i in range(nodes)]
    holders: dict[int, list[int]] = {}
    for i, cls in enumerate(held):
        for c in cls:
            holders.setdefault(c, []).append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(nodes)]
    for c, who in holders.items():
        for piece, i in zip(np.array_split(pools[c], len(who)), who):
            parts[i].append(piece)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def describe(histogram: Sequence[int], min_share: float = 0.05) -> str:
    """A short label for a node's class histogram: the classes holding at least ``min_share`` of it."""
    total = sum(histogram)
    if total == 0:
        return "-"
    major = [c for c, n in enumerate(histogram) if n >= min_share * total]
    if len(major) == len(histogram):
        return f"all {len(histogram)}"
    return ",".join(str(c) for c in major)
