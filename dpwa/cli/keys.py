"""``dpwa keys generate NAME... [--dir DIR] [--force]``: CurveZMQ key pairs for the nodes of a cluster.

The files and their format are :mod:`dpwa.security.keys` and :mod:`dpwa.security.keyfiles`;
errors print one ``error: ...`` line and exit 2.
"""

from __future__ import annotations

import click

from dpwa.cli.common import fail
from dpwa.security.keys import generate_keys

__all__ = ["keys"]


@click.group()
def keys() -> None:
    """CurveZMQ keys for `security: {curve: true, keys: DIR}` in a cluster file."""


@keys.command()
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
@click.option("--dir", "directory", default="keys", show_default=True, help="Directory for the key files.")
@click.option("--force", is_flag=True, help="Replace existing key files.")
def generate(names: tuple[str, ...], directory: str, force: bool) -> None:
    """Write NAME.key (public) and NAME.key_secret (secret, mode 0600) for every node NAME.

    Copy every NAME.key to every machine of the cluster, and each NAME.key_secret only to the
    machine that runs NAME. Existing files are kept unless --force. Exit status 2 on a bad name,
    an existing file or a directory that cannot be written.
    """
    try:
        written = generate_keys(names, directory, force=force)
    except (ValueError, FileExistsError) as err:
        fail(err)
    except OSError as err:
        fail(f"{directory}: cannot write keys: {err.strerror or err}")
    for path in written:
        click.echo(str(path))
