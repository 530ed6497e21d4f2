"""The overlap measurement: a simulated training step between ``update_send`` and ``update_wait``.

The step lasts ``--step-factor`` times the median fetch measured so far (:func:`step_seconds`), so the
fetch should be over before ``update_wait``; the exchange record's ``wait_ms`` over the step's length is
the ``wait/step`` ratio. The step is a sleep or, with ``--step busy``, one thread computing numpy ``exp``
(no BLAS threads), which takes one of the cores the exchange would use (:func:`simulated_step`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["simulated_step", "step_seconds"]

_STEP_INPUT = np.random.default_rng(5).standard_normal(1 << 14).astype(np.float32)


def step_seconds(fetches_ms: Sequence[float], step_factor: float) -> float:
    """The step's length: ``step_factor`` x the median of ``fetches_ms`` (10 ms when empty), at least 5 ms."""
    fetched = fetches_ms or [10.0]
    return max(0.005, step_factor * statistics.median(fetched) / 1000.0)


def simulated_step(seconds: float, busy: bool) -> None:
    """The simulated training step: a sleep, or ``busy``: one thread computing (numpy ``exp``, no BLAS threads)."""
    if not busy:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    out = np.empty_like(_STEP_INPUT)
    while time.perf_counter() < end:
        np.exp(_STEP_INPUT, out=out)
