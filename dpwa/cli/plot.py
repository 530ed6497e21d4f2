"""``dpwa plot RUN_DIR``: draw a run's metrics into one PNG (:mod:`dpwa.tools.plot`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from dpwa.cli.common import fail
from dpwa.launcher.rundir import RunDir
from dpwa.tools.plot import DEFAULT_NAME, MISSING_MATPLOTLIB, plot_run

__all__ = ["plot"]

T = TypeVar("T")


@click.command("plot", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"PNG to write  [default: RUN_DIR/{DEFAULT_NAME}]; with --tensorboard, the directory to write to",
)
@click.option(
    "--tensorboard",
    is_flag=True,
    help="Write TensorBoard scalars instead, one run per node  [default directory: RUN_DIR/tensorboard]",
)
def plot(run_dir: Path, output: Path | None, tensorboard: bool) -> None:
    """Plot a run: loss vs step per node, mixing factor over time, fetch-latency histogram (one PNG).

    With --tensorboard: each node's metrics as TensorBoard scalars (loss, factor, fetch ms, MB/s, the rule's
    metrics), one TensorBoard run per node: `tensorboard --logdir RUN_DIR/tensorboard` shows the cluster
    side by side (pip install 'dpwa[tensorboard]').

    Needs matplotlib (pip install 'dpwa[plot]'); without it, or for a directory with no metrics,
    prints one `error: ...` line and exits 2.
    """
    if not run_dir.is_dir():
        fail(f"{run_dir}: not a directory")
    if tensorboard:
        _tensorboard(run_dir, output)
        return
    target = output if output is not None else run_dir / DEFAULT_NAME
    click.echo(str(_writing(lambda: plot_run(RunDir(run_dir), target), MISSING_MATPLOTLIB, target)))


def _tensorboard(run_dir: Path, output: Path | None) -> None:
    from dpwa.tools.tensorboard import MISSING_TENSORBOARDX, write_tensorboard

    written = _writing(lambda: write_tensorboard(RunDir(run_dir), output), MISSING_TENSORBOARDX, output or run_dir)
    for directory in written:
        click.echo(str(directory))


def _writing(write: Callable[[], T], missing: str, target: Path) -> T:
    """``write()``'s result; its failures as one `error: ...` line and exit 2: ``missing`` (the optional extra it
    needs is not installed), the reason (no metrics), or ``target`` and the OS's reason."""
    try:
        return write()
    except ImportError:
        fail(missing)
    except ValueError as err:
        fail(err)
    except OSError as err:
        fail(f"{target}: {err.strerror or err}")
