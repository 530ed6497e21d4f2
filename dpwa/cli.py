"""The ``dpwa`` command line: a click group whose commands live in their own modules.

Commands defined elsewhere are listed in ``LAZY_COMMANDS`` (name -> ``"module:attribute"``)
and imported only when invoked, so ``dpwa validate`` never pays for torch or matplotlib.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from typing import Any, NoReturn

import click
import yaml

from dpwa.config import ClusterConfig, ConfigError, load_config

#: Subcommands implemented in other modules, e.g. ``"run": "dpwa.launcher:run"``; one line each.
LAZY_COMMANDS: dict[str, str] = {
    "run": "dpwa.launcher:run",
    "plot": "dpwa.plot:plot",
    "bench": "dpwa.bench:bench",
    "keys": "dpwa.keys:keys",
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
EXIT_CONFIG_ERROR = 2


class LazyGroup(click.Group):
    """A click group that also offers the commands of its ``lazy`` table, importing each on first use."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = LAZY_COMMANDS if lazy is None else lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            module_name, _, attribute = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module_name), attribute)
            if not isinstance(command, click.Command):
                raise TypeError(f"{self.lazy[cmd_name]} is not a click command")
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
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


def fail(err: ConfigError) -> NoReturn:
    """Print ``error: <err>`` as exactly one line on stderr and exit with status 2."""
    click.echo("error: " + " ".join(str(err).splitlines()), err=True)
    sys.exit(EXIT_CONFIG_ERROR)


def summary(config: ClusterConfig) -> str:
    """One line describing ``config``, e.g. ``4 nodes, interpolation constant (value=0.5), ...``."""
    settings: Any = config.settings
    items = dataclasses.asdict(settings).items()
    params = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in items)
    rule = f"{config.interpolation} ({params})" if params else config.interpolation
    plural = "" if len(config.nodes) == 1 else "s"
    return (
        f"{len(config.nodes)} node{plural}, interpolation {rule}, "
        f"fetch_probability {config.fetch_probability:g}, timeout_ms {config.timeout_ms:g}, "
        f"divergence_threshold {config.divergence_threshold:g}{', security curve' if config.security.curve else ''}"
    )


@main.command()
@click.argument("cluster", metavar="CLUSTER.yaml")
def validate(cluster: str) -> None:
    """Check a cluster file and print it resolved.

    Prints the config with every default filled in, as YAML, then a one-line summary
    as a YAML comment; exits 0. An invalid file prints one line
    `error: file:line: key: reason` on stderr and exits 2.
    """
    try:
        config = load_config(cluster)
    except ConfigError as err:
        fail(err)
    click.echo(yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=None), nl=False)
    click.echo(f"# {config.source}: {summary(config)}")


if __name__ == "__main__":
    main(prog_name="dpwa")
