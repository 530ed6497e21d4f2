"""The ``dpwa bench exchange`` command: its options, :func:`run_exchange`, and what it prints and writes.

:func:`run_exchange` starts the peer process (:mod:`~dpwa.tools.bench.exchange.control`), joins the gloo
group with it when (c) is measured (:mod:`~dpwa.tools.bench.exchange.gloo`) and measures each model size in
turn (:mod:`~dpwa.tools.bench.exchange.measure`). :func:`exchange` then writes ``exchange.json`` (rows with
every sample, settings, machine), prints the two tables (:mod:`~dpwa.tools.bench.exchange.table`) and, with
``--plot``, writes ``exchange.png``. Ctrl-C or SIGTERM stops the peer and exits with status 130.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import click
import zmq

from dpwa.node import sharedmem
from dpwa.tools.bench.exchange.control import running_peer
from dpwa.tools.bench.exchange.gloo import gloo_group, gloo_usable
from dpwa.tools.bench.exchange.measure import WARMUP_ROUNDS, measure_size
from dpwa.tools.bench.exchange.memory import COLUMNS as MEMORY_COLUMNS
from dpwa.tools.bench.exchange.memory import EXTRA_ROWS, RULES, STEPS, measure_memory
from dpwa.tools.bench.exchange.plot import plot_rows
from dpwa.tools.bench.exchange.table import TARGETS, finite_or_none, render
from dpwa.tools.bench.report import Report, bench_run_dir, render_table
from dpwa.utils import dtypes

__all__ = ["WIRE_DTYPES", "exchange", "parse_count", "run_exchange"]

WIRE_DTYPES = ("float32", *(name for name in dtypes.WIRE_DTYPES if name != "float32"))
"""The wire dtypes measured, in the order the table prints them: float32 first, the full-width baseline the
narrower rows (16-bit, and int8: blockwise quantized) are compared with, then the others as
:data:`dpwa.utils.dtypes.WIRE_DTYPES` lists them. Each row shows the bytes that travelled (``wire MB``)."""
_SUFFIXES = {"": 1, "k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6, "g": 10**9, "G": 10**9}


def parse_count(text: str) -> int:
    """``"25M"`` -> 25_000_000, ``"1.5k"`` -> 1500, ``"10000"`` -> 10000; ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgG]?)\s*", text)
    if not match:
        raise ValueError(f"not a count: {text!r} (e.g. 10000, 1M, 2.5M)")
    value = float(match.group(1)) * _SUFFIXES[match.group(2)]
    if value < 1 or value != int(value):
        raise ValueError(f"not a positive whole count: {text!r}")
    return int(value)


def _counts(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """``--floats``: comma-separated counts (:func:`parse_count`)."""
    try:
        return [parse_count(part) for part in value.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _dtypes(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """``--wire-dtype``: comma-separated names among :data:`WIRE_DTYPES`, each once, in the order given."""
    names = [part.strip() for part in value.split(",") if part.strip()]
    bad = [n for n in names if n not in WIRE_DTYPES]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) or 'nothing'}: allowed: {', '.join(WIRE_DTYPES)}")
    return list(dict.fromkeys(names))


def run_exchange(
    floats: Sequence[int],
    repeat: int,
    wires: Sequence[str],
    *,
    gloo: bool = True,
    step_factor: float = 2.0,
    busy: bool = False,
    shared: bool = True,
    echo: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run the whole benchmark; returns one row per (size, wire dtype), and per size one through shared memory
    (``shared``, where this machine has it)."""
    shared = shared and sharedmem.supported()
    if gloo:
        gloo = gloo_usable(echo)
    rows: list[dict[str, Any]] = []
    ctx = zmq.Context()
    try:
        with running_peer(ctx) as peer, gloo_group(peer, gloo):
            for n in floats:
                echo(f"measuring {n:,} floats ...")
                t0 = time.monotonic()
                got = measure_size(ctx, peer, n, wires, repeat, gloo, step_factor, busy, shared)
                rows.extend(got)
                echo(f"{n:,} floats: {len(got)} rows in {time.monotonic() - t0:.1f} s")
    finally:
        ctx.destroy(linger=0)  # never blocks, even if an interrupt left a socket open
    return rows


@click.command("exchange")
@click.option("--floats", "floats", default="1M,10M,25M", show_default=True, callback=_counts,
              help="Model sizes in float32 elements, comma-separated; k/M/G suffixes.")  # fmt: skip
@click.option("--repeat", default=9, show_default=True, type=click.IntRange(1, 1000), help="Timed rounds per size.")
@click.option("--wire-dtype", "wires", default=",".join(WIRE_DTYPES), show_default=True, callback=_dtypes,
              help="Wire dtypes of (b), comma-separated.")  # fmt: skip
@click.option("--step-factor", default=2.0, show_default=True, type=click.FloatRange(1.0, 100.0),
              help="The simulated step of the overlap measurement, in multiples of the median fetch.")  # fmt: skip
@click.option("--step", "step_kind", type=click.Choice(["sleep", "busy"]), default="sleep", show_default=True,
              help="The simulated step: a sleep, or one thread computing (it takes a core).")  # fmt: skip
@click.option("--no-gloo", is_flag=True, help="Skip (c).")
@click.option("--no-shm", is_flag=True, help="Skip the shared-memory row (b) float32+shm.")
@click.option("--no-memory", is_flag=True, help="Skip the memory rows (per rule, at the largest --floats).")
@click.option("--run-dir", default=None, type=click.Path(file_okay=False), help="Default runs/bench-exchange-<time>.")
@click.option("--plot", is_flag=True, help="Also write exchange.png (needs matplotlib).")
def exchange(
    floats: list[int],
    repeat: int,
    wires: list[str],
    step_factor: float,
    step_kind: str,
    no_gloo: bool,
    no_shm: bool,
    no_memory: bool,
    run_dir: str | None,
    plot: bool,
) -> None:
    """One exchange through dpwa vs raw pyzmq (a) and gloo all_reduce (c), and a push (d), two local processes."""
    if plot:
        try:
            import matplotlib  # noqa: F401 - the optional extra
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'dpwa[plot]'") from None
    directory = bench_run_dir("exchange", run_dir)
    settings = {"floats": floats, "repeat": repeat, "wire_dtypes": wires, "step_factor": step_factor, "step": step_kind,
                "gloo": not no_gloo, "shared_memory": not no_shm, "warmup_rounds": WARMUP_ROUNDS,
                "targets": TARGETS}  # fmt: skip
    try:
        rows = run_exchange(
            floats,
            repeat,
            wires,
            gloo=not no_gloo,
            step_factor=step_factor,
            busy=step_kind == "busy",
            shared=not no_shm,
            echo=click.echo,
        )
    except KeyboardInterrupt:
        click.echo("interrupted: the peer process has been stopped", err=True)
        sys.exit(130)
    settings["casts"] = "torch" if "torch" in sys.modules else "numpy"  # dpwa.node.wire's 16-bit rounding backend
    report = Report("exchange", rows=[finite_or_none(r) for r in rows], settings=settings)
    path = report.write(directory)
    click.echo("")
    click.echo(render(rows))
    click.echo(f"\nwrote {path}")
    if not no_memory:
        n = max(floats)
        extra = ", ".join(f"{r} {m} {w}" + "".join(f" {k}" for k in opts) for r, m, w, opts in EXTRA_ROWS)
        click.echo(f"\nmemory: {', '.join(RULES)}, then {extra}; two nodes each, {n:,} floats, {STEPS} steps ...")
        memory = measure_memory(directory, n)
        click.echo(render_table(memory, MEMORY_COLUMNS))
        click.echo(f"wrote {Report('memory', rows=memory, settings={'floats': n, 'steps': STEPS}).write(directory)}")
    if plot:
        click.echo(f"wrote {plot_rows(rows, directory / 'exchange.png')}")
