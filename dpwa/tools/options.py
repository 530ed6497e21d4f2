"""Command-line options the tools and ``dpwa run`` share (click callbacks; the parsing lives with its concept)."""

from __future__ import annotations

import click

from dpwa.utils.partition import parse_partition

__all__ = ["check_partition"]


def check_partition(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``--partition``'s value in canonical form (None stays None); a bad one is a usage error (exit 2)."""
    if value is None:
        return None
    try:
        return str(parse_partition(value))
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
