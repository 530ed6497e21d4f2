"""``dpwa bench train --plot``: ``train.png``, the model's training loss against wall time, one panel per scenario.

It reads three things of each method's run (:class:`LossCurve`; :class:`dpwa.tools.bench.train.PhaseResult`
has them), so it needs nothing else of the benchmark. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["LossCurve", "plot_curves"]


class LossCurve(Protocol):
    """One method's run as the plot sees it: the model's loss at moments of the run, and its throughput."""

    @property
    def curve_t(self) -> np.ndarray: ...

    @property
    def curve_loss(self) -> np.ndarray: ...

    @property
    def samples_per_s(self) -> float: ...


def plot_curves(path: Path, scenarios: Sequence[tuple[str, Mapping[str, LossCurve], float]]) -> Path:
    """``train.png``: the model's training loss against wall time, one panel per scenario, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(scenarios))
    rows = math.ceil(len(scenarios) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(scenarios) :]:
        ax.set_visible(False)
    for ax, (label, phases, target) in zip(axes.flat, scenarios):
        for method, p in phases.items():
            ax.plot(p.curve_t, p.curve_loss, label=f"{method} ({p.samples_per_s:.0f} samples/s)")
        ax.axhline(target, linestyle="--", color="grey", label=f"target {target:.3f}")
        ax.set_title(f"straggler {label}")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("training loss of the (averaged) model")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
