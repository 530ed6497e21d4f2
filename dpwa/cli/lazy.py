"""A click group whose subcommands live in other modules and are imported only when invoked; an interrupt exits
130, as an interrupted shell command does (click's own answer is "Aborted!" and status 1)."""

from __future__ import annotations

import importlib
from typing import Any

import click

__all__ = ["EXIT_INTERRUPTED", "LazyGroup"]

EXIT_INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C before it trapped the signal itself (128 + SIGINT)."""


class LazyGroup(click.Group):
    """A click group that also offers the commands of its ``lazy`` table (name -> ``"module:attribute"``),
    importing each on first use, so that ``dpwa validate`` never pays for torch or matplotlib."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy if lazy is not None else {}

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

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; Ctrl-C before the launcher traps signals (a host lookup, a port check) exits
        :data:`EXIT_INTERRUPTED` with one line, not click's "Aborted!" and status 1."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
