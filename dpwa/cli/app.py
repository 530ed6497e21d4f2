"""The ``dpwa`` command: a click group, ``dpwa validate``, and the table of the commands defined elsewhere.

Commands in other modules are listed in :data:`COMMANDS` (name -> ``"module:attribute"``) and
imported only when invoked, so ``dpwa validate`` never pays for torch or matplotlib.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import click

from dpwa.cli.common import fail
from dpwa.cli.lazy import LazyGroup
from dpwa.config import ClusterConfig, ConfigError, load_config, yaml12

__all__ = ["COMMANDS", "LOG_LEVELS", "main", "summary", "validate"]

COMMANDS: dict[str, str] = {
    "run": "dpwa.cli.run:run",
    "average": "dpwa.cli.average:average",
    "plot": "dpwa.cli.plot:plot",
    "bench": "dpwa.cli.bench:bench",
    "keys": "dpwa.cli.keys:keys",
    "simulate": "dpwa.cli.simulate:simulate_command",
}
"""Subcommands implemented in other modules of :mod:`dpwa.cli`; one line each."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="WARNING",
    show_default=True,
    help="Logging threshold; log records go to stderr.",
)
def main(log_level: str) -> None:
    """dpwa: decentralized pair-wise averaging over ZeroMQ."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def summary(config: ClusterConfig) -> str:
    """One line describing ``config``, e.g. ``4 nodes, interpolation constant (value=0.5), ...``."""
    settings: Any = config.settings
    items = dataclasses.asdict(settings).items()
    params = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in items)
    rule = f"{config.interpolation} ({params})" if params else config.interpolation
    plural = "" if len(config.nodes) == 1 else "s"
    if config.outer is not None:
        o = config.outer
        rule += f", outer (every={o.every}, lr={o.lr:g}, momentum={o.momentum:g}, nesterov={o.nesterov})"
    return (
        f"{len(config.nodes)} node{plural}, interpolation {rule}, "
        f"fetch_probability {config.fetch_probability:g}, timeout_ms {config.timeout_ms:g}, "
        f"divergence_threshold {config.divergence_threshold:g}{', security curve' if config.security.curve else ''}"
    )


def _engine_source(config: ClusterConfig, cluster: str) -> str:
    """Which engine would give ``config`` its nodes here, and the nodes when this process can compute them."""
    from dpwa.engines import EngineError, engine_nodes
    from dpwa.engines.slurm import in_slurm_step
    from dpwa.engines.variables import in_torch_launch

    if in_torch_launch(os.environ):
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        return f"torchrun / PyTorchJob: a rendezvous of {os.environ['WORLD_SIZE']} workers in the TCPStore at {where}"
    if not in_slurm_step(os.environ):
        return f"`dpwa run -n N --config {cluster}` (local), srun (SLURM), torchrun (the adapter)"
    try:
        resolved, mine, source = engine_nodes(config, os.environ)
    except EngineError as err:
        return f"srun, but {err}"
    listed = ", ".join(f"{n.name}@{n.host}:{n.port}" for n in resolved.nodes)
    return f"{source}: {listed}; this task: {mine}"


@main.command()
@click.argument("cluster", metavar="CLUSTER.yaml")
def validate(cluster: str) -> None:
    """Check a cluster file and print it resolved.

    Prints the config with every default filled in, as YAML, then a one-line summary
    as a YAML comment (and, for a file without `nodes`, where they would come from); exits 0.
    An invalid file prints one line `error: file:line: key: reason` on stderr and exits 2, and so
    does a node whose host is this machine (localhost, 127.x, this host's names and addresses) when
    another process already uses its port (nodes of other hosts are not checked).
    """
    from dpwa.launcher.placement import LocalHosts
    from dpwa.launcher.ports import busy_ports, busy_ports_message

    try:
        config = load_config(cluster)
    except ConfigError as err:
        fail(err)
    is_local = LocalHosts()
    is_local.learn(node.host for node in config.nodes)
    busy = busy_ports(config.nodes, is_local=is_local) if config.nodes else []
    if busy:
        fail(busy_ports_message(config, busy))
    click.echo(yaml12.dump(config.to_dict(), sort_keys=False, default_flow_style=None), nl=False)
    click.echo(f"# {config.source}: {summary(config)}")
    if not config.nodes:
        click.echo(f"# nodes: none in the file; they come from the engine: {_engine_source(config, cluster)}")
