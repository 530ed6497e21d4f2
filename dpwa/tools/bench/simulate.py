"""``dpwa bench simulate``: what ``dpwa simulate`` costs as the cluster grows, on this machine.

For every N of ``--nodes 64,256,1024,4096`` one run of ``--steps`` steps (``--model``, the rule of ``--config``,
the simulator's defaults otherwise: 50 ms steps, 1 Gbit/s links of 1 ms) without a run directory (the metrics
lines are not written: the engine is measured). Per N: the real time, the time per node step and its ratio to the
smallest N's (1.0: the cost grows linearly with the node steps), the peak resident memory of this process so far,
the simulated time and the mean model's accuracy and consensus distance. The target of the simulator, 1,024 nodes
x 200 steps of logistic regression in at most 60 s on a 2-core machine, is checked on the row it applies to.

Output: a table on stdout and ``simulate.json`` (rows, settings, machine) in the run directory.
"""

from __future__ import annotations

import resource
from pathlib import Path

import click

from dpwa.config import ClusterConfig, ConfigError, load_config
from dpwa.tools.bench.report import Column, Report, bench_run_dir, comma_list, render_table
from dpwa.tools.sim.problems import MODELS
from dpwa.tools.sim.runner import SimOptions
from dpwa.tools.sim.runner import simulate as run_simulation

__all__ = ["TARGET_NODES", "TARGET_S", "TARGET_STEPS", "simulate"]

TARGET_NODES, TARGET_STEPS, TARGET_S = 1024, 200, 60.0
"""1,024 nodes x 200 steps of logistic regression in at most 60 s (the row it applies to says whether it holds)."""

COLUMNS = [
    Column("nodes", "nodes", "d"),
    Column("node_steps", "node steps", "d"),
    Column("wall_s", "real s", ".1f"),
    Column("us_per_step", "us/node step", ".0f"),
    Column("ratio", "x smallest N", ".2f"),
    Column("peak_rss_mb", "peak RSS MB", ".0f"),
    Column("sim_s", "simulated s", ".2f"),
    Column("accuracy", "accuracy", ".3f"),
    Column("consensus", "consensus", ".3g"),
    Column("target", "<= 60 s (1024x200)"),
]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kilobytes on Linux


@click.command("simulate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nodes", "nodes_text", default="64,256,1024,4096", show_default=True, help="Cluster sizes.")
@click.option("--steps", type=int, default=200, show_default=True)
@click.option("--model", type=click.Choice(MODELS), default="logistic", show_default=True)
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="The rule's cluster file.")
@click.option("--run-dir", default=None, help="[default: runs/bench-simulate-<time>]")
def simulate(nodes_text: str, steps: int, model: str, config_path: Path | None, run_dir: str | None) -> None:
    """The simulator's cost from the smallest to the largest N (module doc-string)."""
    sizes = comma_list(nodes_text, int, lambda n: n >= 2, "node counts >= 2, e.g. 64,256")
    try:
        config = load_config(config_path) if config_path is not None else ClusterConfig()
    except ConfigError as err:
        raise click.UsageError(str(err)) from None
    out = bench_run_dir("simulate", run_dir)
    report = Report("simulate", settings={"nodes": sizes, "steps": steps, "model": model,
                                          "rule": config.interpolation})  # fmt: skip
    first = None
    for n in sizes:
        click.echo(f"simulating {n} nodes x {steps} steps ...", err=True)
        result = run_simulation(SimOptions(config, nodes=n, steps=steps, model=model))
        per_step = 1e6 * result.wall_s / max(1, result.node_steps)
        first = per_step if first is None else first
        last = result.evaluations[-1]
        applies = n == TARGET_NODES and steps == TARGET_STEPS and model == "logistic"
        report.rows.append({
            "nodes": n, "node_steps": result.node_steps, "wall_s": result.wall_s, "us_per_step": per_step,
            "ratio": per_step / first, "peak_rss_mb": _peak_rss_mb(), "sim_s": result.sim_time,
            "accuracy": last.accuracy, "consensus": last.consensus,
            "target": ("met" if result.wall_s <= TARGET_S else "MISSED") if applies else "-",
        })  # fmt: skip
    click.echo(render_table(report.rows, COLUMNS))
    click.echo(f"written: {report.write(out)}")
