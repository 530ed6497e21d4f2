"""D-PSGD -- decentralized parallel SGD (Lian et al. 2017; docs/rules.md).

The paper's step, with ``d`` graph neighbours ``N(i)`` (the nodes node ``i`` reads: the ``neighbours``
schedule, ring ``i +- 1``, exponential ``i +- 2^k``, or directed ring ``i - 1``) and the uniform weights of a
regular graph, a doubly-stochastic mixing matrix ``W``::

    x_i(k+1) = (x_i(k) + sum_{j in N(i)} x_j(k)) / (d + 1)  -  lr * grad f_i(x_i(k))

averages the models of step ``k`` and takes the node's whole local step. Here ``x_i(k)`` is what node ``i``
published at ``update_send`` (``x_sent``); the trainer has taken its step since (``x_now = x_sent - lr * g``); the
neighbours' ``x_j(k)`` are their snapshots fetched this step. So ``update_wait`` adds the average's move::

    x_i <- x_now + sum_{j fresh} (x_j - x_sent) / (d + 1)

which is the paper's step exactly (in lock-step). Averaging ``x_now`` itself in, ``(x_now + sum x_j) / (d + 1)``,
would keep only ``1/(d+1)`` of the node's own step. A neighbour that did not answer in time, or whose clock lags
this node's by more than ``max_staleness``, is left out and its weight stays with ``x_i`` (counted in
``left_out``). The clock is averaged with the same weights.

``d`` is the in-degree; every graph here has the same in- and out-degree at every node, so the
columns sum to 1 as well and the average is kept. On the directed ring ``W = (I + P)/2`` is
circulant, hence normal, and not symmetric.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.mixing import add_differences_
from dpwa.utils.settings import Settings, choice, setting

__all__ = ["GRAPHS", "UNDIRECTED_GRAPHS", "DpsgdRule", "DpsgdSettings", "checked_graph", "neighbours", "readers"]

UNDIRECTED_GRAPHS = ("ring", "exponential")
"""The graphs whose every edge is read both ways (a node's readers are the nodes it reads)."""
GRAPHS = (*UNDIRECTED_GRAPHS, "directed-ring")
"""The regular graphs of the ``neighbours`` schedule (:func:`neighbours`)."""


def neighbours(rank: int, n: int, graph: str) -> list[int]:
    """The nodes ``rank`` reads among ``n``: ``ring`` ``i +- 1``; ``exponential`` ``i +- 2^k``, ``2^k < n``;
    ``directed-ring`` ``i - 1`` only.

    Unique, ascending, ``rank`` itself excluded. Every graph is regular in the nodes read and the readers
    alike, so the weights ``1/(d+1)`` make a doubly stochastic matrix: on the directed ring ``W = (I + P)/2``,
    whose columns also sum to 1 (the average is kept), circulant hence normal, but not symmetric.
    """
    if graph not in GRAPHS:
        raise ValueError(f"unknown graph {graph!r}; allowed: {', '.join(GRAPHS)}")
    if n < 2:
        return []
    if graph == "directed-ring":
        return [(rank - 1) % n]
    hops = [1] if graph == "ring" else [2**k for k in range(max(1, math.ceil(math.log2(n))))]
    out = {(rank + h) % n for h in hops} | {(rank - h) % n for h in hops}
    out.discard(rank)
    return sorted(out)


def readers(rank: int, n: int, graph: str) -> list[int]:
    """The nodes that read ``rank`` (whose :func:`neighbours` include it), ascending: its neighbours on an
    undirected graph, ``i + 1`` on the directed ring."""
    if graph == "directed-ring" and n >= 2:
        return [(rank + 1) % n]
    return neighbours(rank, n, graph)


def checked_graph(graph: str, max_staleness: float, allowed: tuple[str, ...] = GRAPHS, rule: str = "dpsgd") -> float:
    """``max_staleness`` as a float, once ``graph`` is one of ``allowed`` and it is ``>= 0``; else ValueError."""
    neighbours(0, 2, graph)  # validates the name
    if graph not in allowed:
        raise ValueError(f"{rule} needs an undirected graph, got {graph!r}; allowed: {', '.join(allowed)}")
    s = float(max_staleness)
    if not s >= 0.0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness!r}")
    return s


@dataclasses.dataclass(frozen=True)
class DpsgdSettings(Settings):
    """D-PSGD: ``x <- x + sum_j (x_j - x_sent) / (d + 1)`` (the average of the published models, plus the local
    step) on a ``ring``, ``exponential`` or ``directed-ring`` graph; a neighbour more than ``max_staleness`` steps
    behind is left out."""

    graph: str = choice("ring", GRAPHS)
    max_staleness: float = setting(10.0, lo=0)


class DpsgdRule(Rule):
    """``x <- x + sum_{j fresh} (x_j - x_sent) / (d + 1)``, ``d`` = the node's number of graph neighbours, ``x_sent``
    what this node published at ``update_send`` (its local step since is kept whole).

    ``graph``: ``ring``, ``exponential`` or ``directed-ring`` (the ``neighbours`` schedule reads it); ``max_staleness``:
    a neighbour whose clock lags by more is left out. Divergence damping scales every neighbour's
    weight by ``loss/t`` (``x`` keeps the rest).
    """

    name = "dpsgd"
    settings_class = DpsgdSettings
    allowed_schedules = ("neighbours",)  # every graph neighbour, every step
    default_schedule = "neighbours"

    def __init__(self, graph: str = "ring", max_staleness: float = 10.0, divergence_threshold: float = 0.0) -> None:
        super().__init__(divergence_threshold)
        self.graph, self.max_staleness = graph, checked_graph(graph, max_staleness)
        self.left_out = 0
        self._degree = 0
        self._published: list[np.ndarray] | None = None

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        """Keep the views of the model just published: ``x_sent``, what the neighbours average with."""
        self._published = list(published)

    def _params(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "max_staleness": self.max_staleness,
            "divergence_threshold": self.divergence_threshold,
        }

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        self.on_members(me, names, float(len(names)))
        return {}

    def on_members(self, me: str, names: Sequence[str], mass: float) -> None:
        """My degree on the graph of the current members (left-out counts follow it)."""
        self._degree = len(neighbours(list(names).index(me), len(names), self.graph)) if me in names else 0

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Average the fresh neighbours in with weight ``1/(d+1)`` each; the factor is their total weight."""
        fresh = [p for p in peers if math.isfinite(p.state.clock) and own.clock - p.state.clock <= self.max_staleness]
        self.left_out += max(0, self._degree - len(fresh))
        metrics = {"left_out": float(self.left_out), "neighbours_mixed": float(len(fresh))}
        g = self.diverge(1.0, own.loss)
        if not fresh or g == 0.0 or self._degree == 0 or self._published is None:
            return MixOutcome(0.0, (), metrics)
        d = float(self._degree + 1)
        k = len(fresh)
        add_differences_(arrays, [p.arrays for p in fresh], self._published, g / d)  # one pass over x
        own.clock = math.fsum([g * p.state.clock for p in fresh] + [(d - g * k) * own.clock]) / d
        return MixOutcome(g * k / d, tuple(p.state.name for p in fresh), metrics)
