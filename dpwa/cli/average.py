"""``dpwa average RUN_DIR``: the average of the models a run's nodes saved, their disagreement, an evaluation
(:mod:`dpwa.tools.average`)."""

from __future__ import annotations

from pathlib import Path

import click

from dpwa.cli.common import fail
from dpwa.tools.average import AverageError, average_run, headline

__all__ = ["average"]


@click.command("average", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option(
    "--evaluate",
    metavar="MODULE:FUNCTION",
    help="Call FUNCTION(state_dict) on the averaged model and on each node's; it returns a number or a dict of "
    "numbers. MODULE: importable from here, or path/to/file.py.",
)
@click.option(
    "--baseline",
    metavar="OTHER_RUN_DIR",
    type=click.Path(path_type=Path),
    help="With --evaluate: evaluate that run's (averaged) model too, e.g. the script under `dpwa run -n 1`.",
)
@click.option(
    "--node",
    "nodes",
    multiple=True,
    metavar="NAME",
    help="Average only this node's model; repeatable  [default: every <node>.model.npz in RUN_DIR]",
)
def average(run_dir: Path, evaluate: str | None, baseline: Path | None, nodes: tuple[str, ...]) -> None:
    """Average the models a run's nodes saved (RUN_DIR/<node>.model.npz, push-sum weights honoured) into
    RUN_DIR/averaged.model.npz and print how far apart they were (relative distance to their mean).

    With --evaluate, the averaged model's figure beside every node's (and a baseline run's). Everything also
    goes to RUN_DIR/average.json. A run without model files, or models that differ, prints one `error: ...`
    line and exits 2.
    """
    if not run_dir.is_dir():
        fail(f"{run_dir}: not a directory")
    try:
        result = average_run(run_dir, evaluate=evaluate, baseline=baseline, nodes=nodes)
    except AverageError as err:
        fail(err)
    click.echo(headline(result))
