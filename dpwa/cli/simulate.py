"""``dpwa simulate``: a large asynchronous cluster on one machine, on the rules' own code (:mod:`dpwa.tools.sim`)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import TextIO

import click

from dpwa.cli.common import fail
from dpwa.config import ClusterConfig, ConfigError, load_config
from dpwa.launcher.rundir import default_run_dir
from dpwa.tools.sim.churn import check_churn, parse_churn
from dpwa.tools.sim.links import LINK_MODES, LinkModel
from dpwa.tools.sim.problems import MODELS
from dpwa.tools.sim.runner import Evaluation, SimOptions, SimResult, simulate
from dpwa.tools.sim.timing import StepTimes, parse_step_time, parse_straggler
from dpwa.tools.sim.units import parse_duration, parse_rate
from dpwa.utils.partition import parse_partition

__all__ = ["SimProgress", "simulate_command", "summary_lines"]

BAR = 30


class SimProgress:
    """A progress bar on a terminal (redrawn in place), else a line every ``interval_s`` seconds."""

    def __init__(self, stream: TextIO, interval_s: float = 5.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.interval_s = 0.2 if self.tty else interval_s
        self.started = time.monotonic()
        self.drawn = 0.0

    def __call__(self, evaluation: Evaluation, done: int, total: int, finished: bool) -> None:
        now = time.monotonic()
        if now - self.drawn < self.interval_s and not finished:
            return
        self.drawn = now
        share = 1.0 if finished else min(1.0, done / max(1, total))
        bar = "#" * int(BAR * share) + "." * (BAR - int(BAR * share))
        accuracy = f" acc {evaluation.accuracy:.3f}" if evaluation.accuracy is not None else ""
        line = (
            f"[{bar}] {100 * share:5.1f}%  steps {done}/{total}  sim {evaluation.time:8.2f} s  "
            f"loss {evaluation.loss:.4g}{accuracy}  consensus {evaluation.consensus:.3g}  "
            f"wall {now - self.started:.0f} s"
        )
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def summary_lines(options: SimOptions, result: SimResult) -> list[str]:
    """The end-of-run table."""
    s = result.summary()
    accuracy = f"{s['accuracy']:.4f}" if s["accuracy"] is not None else "-"
    rows = [
        ("nodes x steps", f"{options.nodes} x {options.steps} ({s['node_steps']} node steps)"),
        ("rule", options.config.interpolation + f" ({options.config.schedule} peers)"),
        ("loss (mean model)", f"{s['loss']:.4g}"),
        ("accuracy (mean model, held out)", accuracy),
        ("consensus distance (RMS to the mean)", f"{s['consensus_distance']:.4g}"),
        ("bytes sent", f"{s['bytes_sent'] / 1e6:.1f} MB ({s['bytes_per_step'] / 1e3:.1f} kB per node step)"),
        ("mixes per step", f"{s['mixes_per_step']:.3f}"),
        ("messages lost", f"{s['messages_lost']} of {s['messages']}"),
        ("simulated wall time", f"{s['sim_time_s']:.2f} s"),
        ("real time", f"{s['wall_s']:.1f} s ({1e6 * s['wall_s'] / max(1, s['node_steps']):.0f} us per node step)"),
    ]
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def _options(
    config_path: Path | None, nodes: int, steps: int, model: str, partition: str, seed: int, step_time: str,
    straggler: str, bandwidth: str, per: str, latency: str, loss: float, churn: str, lr: float | None,
    batch_size: int,
) -> SimOptions:  # fmt: skip
    """The options, every value checked; ``fail`` (exit 2, one line) on the first bad one."""
    try:
        config = load_config(config_path) if config_path is not None else ClusterConfig()
    except ConfigError as err:
        fail(err)
    try:
        parse_partition(partition)
        base, sigma = parse_step_time(step_time)
        share, factor = parse_straggler(straggler)
        link = LinkModel(parse_duration(latency), parse_rate(bandwidth), per, loss)
        events = tuple(parse_churn(churn))
        check_churn(events, nodes)
        times = StepTimes(base, sigma, share, factor)
    except ValueError as err:
        fail(err)
    if nodes < 2 or steps < 1 or batch_size < 1:
        fail("--nodes must be at least 2, --steps and --batch-size at least 1")
    if lr is not None and not 0 < lr < math.inf:
        fail(f"--lr must be a finite number above 0, got {lr}")
    return SimOptions(config, nodes, steps, model, partition, seed, times, link, events, lr, batch_size)


@click.command("simulate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nodes", "-n", type=int, default=64, show_default=True, help="Nodes at the start.")
@click.option("--steps", type=int, default=200, show_default=True, help="Steps each node trains.")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="A cluster file: its rule, "
              "peers, timeout_ms, fetch_probability, inbox and wire settings (its nodes are not used).  "
              "[default: the defaults: constant 0.5 on random peers]")  # fmt: skip
@click.option("--model", type=click.Choice(MODELS), default="logistic", show_default=True)
@click.option("--partition", default="iid", show_default=True, help="iid, dirichlet:ALPHA or classes:K.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--step-time", default="50ms", show_default=True, help="DURATION or lognormal:DURATION:SIGMA.")
@click.option("--straggler", default="0:1", show_default=True, help="SHARE:FACTOR, e.g. 0.1:4 (10 %% of the "
              "nodes 4x slower).")  # fmt: skip
@click.option("--bandwidth", default="1gbit", show_default=True, help="e.g. 100mbit, 10gbit, 1GB/s.")
@click.option("--bandwidth-per", "per", type=click.Choice(LINK_MODES), default="node", show_default=True,
              help="node: each node's uplink and downlink; link: each pair of nodes.")  # fmt: skip
@click.option("--latency", default="1ms", show_default=True)
@click.option("--loss", type=float, default=0.0, show_default=True, help="Share of the messages lost.")
@click.option("--churn", default="", help="KIND:NODE@TIME,... with KIND crash, restart, leave or join.")
@click.option("--lr", type=float, default=None, help="Learning rate (cosine decay)  [default: the model's]")
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--run-dir", type=click.Path(path_type=Path), default=None, help="[default: runs/sim-<time>]")
def simulate_command(
    nodes: int, steps: int, config_path: Path | None, model: str, partition: str, seed: int, step_time: str,
    straggler: str, bandwidth: str, per: str, latency: str, loss: float, churn: str, lr: float | None,
    batch_size: int, run_dir: Path | None,
) -> None:  # fmt: skip
    """Simulate NODES asynchronous nodes training MODEL with the rule of --config, on simulated time: each node
    alternates its step (--step-time, --straggler) and the exchange its rule asks for, over links of --latency
    and --bandwidth; timeouts and flow control act on simulated time. The same seed gives the same result, bit
    for bit. Writes a run directory that `dpwa plot` reads, and prints a summary table."""
    options = _options(config_path, nodes, steps, model, partition, seed, step_time, straggler, bandwidth, per,
                       latency, loss, churn, lr, batch_size)  # fmt: skip
    out = run_dir if run_dir is not None else default_run_dir(prefix="sim-")
    progress = SimProgress(sys.stderr)
    try:
        result = simulate(options, out, progress)
    except ValueError as err:
        fail(err)
    finally:
        progress.close()
    for line in summary_lines(options, result):
        click.echo(line)
    click.echo(f"run directory: {out}  (dpwa plot {out})")
