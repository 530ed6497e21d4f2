"""The compute model: how long each node's step takes, in simulated seconds.

A node's step ``k`` takes ``base_s * factor_i * e_ik``: ``factor_i`` is the straggler factor for the nodes drawn
as stragglers (``straggler_share`` of them, chosen by a seeded permutation) and 1 for the others; ``e_ik`` is 1
(``sigma = 0``) or a lognormal of mean 1, ``exp(sigma * z - sigma^2 / 2)``. Every node has its own seeded
stream, so a node's times do not depend on how many others there are.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dpwa.tools.sim.units import parse_duration

__all__ = ["StepTimes", "parse_step_time", "parse_straggler"]


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Each node's compute time per step (module doc-string)."""

    base_s: float = 0.05
    sigma: float = 0.0
    straggler_share: float = 0.0
    straggler_factor: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_s) and self.base_s > 0):
            raise ValueError(f"step time must be > 0 seconds, got {self.base_s}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"lognormal sigma must be >= 0, got {self.sigma}")
        if not 0 <= self.straggler_share <= 1:
            raise ValueError(f"straggler share must be in [0, 1], got {self.straggler_share}")
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor >= 1):
            raise ValueError(f"straggler factor must be >= 1, got {self.straggler_factor}")

    def stragglers(self, n: int, seed: int) -> np.ndarray:
        """Which of ``n`` nodes are stragglers: ``round(share * n)`` of them, a seeded choice."""
        count = int(round(self.straggler_share * n))
        mask = np.zeros(n, dtype=bool)
        mask[np.random.default_rng([seed, 0x57A6]).permutation(n)[:count]] = True
        return mask

    def table(self, n: int, steps: int, seed: int, first: int = 0) -> np.ndarray:
        """The step times of nodes ``first .. first + n - 1``, ``(n, steps)`` seconds; a node's row depends only on
        the seed and its index (a joined node beyond the first ``n`` is a straggler with probability ``share``)."""
        slow = self.stragglers(first + n, seed)[first:] if first == 0 else self._joined_stragglers(n, seed, first)
        factor = np.where(slow, self.straggler_factor, 1.0)
        rows = np.empty((n, steps))
        for row, i in enumerate(range(first, first + n)):
            if self.sigma > 0:
                z = np.random.default_rng([seed, 0x5E9, i]).standard_normal(steps)
                rows[row] = np.exp(self.sigma * z - 0.5 * self.sigma**2)
            else:
                rows[row] = 1.0
        return self.base_s * factor[:, None] * rows

    def _joined_stragglers(self, n: int, seed: int, first: int) -> np.ndarray:
        return np.array([np.random.default_rng([seed, 0x501, i]).random() < self.straggler_share for i in
                         range(first, first + n)], dtype=bool)  # fmt: skip


def parse_step_time(text: str) -> tuple[float, float]:
    """``50ms`` (fixed) or ``lognormal:50ms:0.3`` (mean 50 ms, sigma 0.3): (base seconds, sigma)."""
    parts = text.split(":")
    if len(parts) == 1:
        return parse_duration(parts[0]), 0.0
    if len(parts) == 3 and parts[0] == "lognormal":
        return parse_duration(parts[1]), float(parts[2])
    raise ValueError(f"step time {text!r}: expected DURATION or lognormal:DURATION:SIGMA")


def parse_straggler(text: str) -> tuple[float, float]:
    """``0.1:4``: (share of the nodes, how many times slower)."""
    share, sep, factor = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return float(share), float(factor)
    except ValueError:
        raise ValueError(f"straggler {text!r}: expected SHARE:FACTOR, e.g. 0.1:4") from None
