"""``dpwa bench``: the group of benchmarks; each subcommand is defined beside its benchmark in
:mod:`dpwa.tools.bench` and imported only when invoked (torch and matplotlib load only then)."""

from __future__ import annotations

import click

from dpwa.cli.lazy import LazyGroup

__all__ = ["BENCHMARKS", "bench"]

BENCHMARKS: dict[str, str] = {
    "exchange": "dpwa.tools.bench.exchange:exchange",
    "train": "dpwa.tools.bench.train:train",
    "scale": "dpwa.tools.bench.scale:scale",
    "simulate": "dpwa.tools.bench.simulate:simulate",
}


@click.group("bench", cls=LazyGroup, lazy=BENCHMARKS, context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks: exchange (data path vs raw pyzmq and gloo), train (dpwa vs DDP, stragglers), scale (N nodes),
    simulate (the simulator's cost from 64 to 4,096 nodes)."""
