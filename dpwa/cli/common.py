"""What every ``dpwa`` command shares: the one way to fail with exit status 2 and one line on stderr."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

__all__ = ["EXIT_USAGE", "fail"]

EXIT_USAGE = 2
"""Exit status of a bad cluster file, bad arguments or an input the command cannot use."""


def fail(message: object) -> NoReturn:
    """Print ``error: <message>`` as exactly one line on stderr (no traceback) and exit with status 2.

    ``message`` may be an exception (a ConfigError names file:line:key); its lines are joined.
    """
    click.echo("error: " + " ".join(str(message).splitlines()), err=True)
    sys.exit(EXIT_USAGE)
