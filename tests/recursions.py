"""Heterogeneous quadratics, and a lock-step check: for the tests that hold a rule's iterates, step by step, against
a direct transcription of its paper's recursion (tests/test_gt.py, tests/test_choco.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["Quadratics", "assert_follows"]


@dataclasses.dataclass(frozen=True)
class Quadratics:
    """Node ``i`` (named ``w<i+1>``) minimizes ``a_i/2 ||x - c_i||^2``: curvatures ``a_i`` in [0.5, 2], centres of
    scale 3, starts of scale 1, all drawn from one seed."""

    curvature: np.ndarray
    centres: np.ndarray
    start: np.ndarray

    @classmethod
    def drawn(cls, seed: int, nodes: int, dim: int) -> Quadratics:
        rng = np.random.default_rng(seed)
        curvature = rng.uniform(0.5, 2.0, size=nodes)
        centres = rng.normal(scale=3.0, size=(nodes, dim))
        return cls(curvature, centres, rng.normal(size=(nodes, dim)))

    def grad(self, i: int, x: np.ndarray) -> np.ndarray:
        """``a_i (x - c_i)``."""
        return self.curvature[i] * (x - self.centres[i])

    def sgd(self, lr: float) -> Callable[[Any], None]:
        """A simulated node's training step: ``x <- x - lr * grad_i(x)``, in place."""

        def train(node: Any) -> None:
            i = int(node.name[1:]) - 1
            node.arrays[0] -= lr * self.grad(i, node.arrays[0])

        return train


def assert_follows(sim: Any, train: Callable[[Any], None], expected: Sequence[np.ndarray], atol: float = 1e-12) -> None:
    """Run ``sim`` one lock-step round per entry of ``expected`` (the nodes' iterates after that step, one row per
    node), ``train`` between send and wait, each round's iterates within ``atol`` of it; and the iterates moved
    (the comparison is not vacuous)."""
    for k, want in enumerate(expected):
        sim.run_round(1.0, train=train)
        np.testing.assert_allclose(np.array(sim.flats()), want, rtol=0, atol=atol, err_msg=f"step {k}")
    assert np.abs(expected[-1] - expected[0]).max() > 0.5
