"""``dpwa bench``: speed and scale measured side by side in one run, printed as tables and written as JSON.

Each benchmark lives in its own module and prints figures and ratios taken in
the same run on the same machine; none of them is a pass/fail test.
"""

from __future__ import annotations

import click

from dpwa.cli import LazyGroup

BENCHMARKS: dict[str, str] = {
    "exchange": "dpwa.bench.exchange:exchange",
    "train": "dpwa.bench.train:train",
    "scale": "dpwa.bench.scale:scale",
}


@click.group("bench", cls=LazyGroup, lazy=BENCHMARKS, context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: exchange (data path vs raw pyzmq and gloo), train (dpwa vs DDP, stragglers), scale (N nodes)."""
