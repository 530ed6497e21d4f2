"""``dpwa keys generate NAME... [--dir DIR] [--force]``: CurveZMQ key pairs for the nodes of a cluster.

Each NAME gets ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (secret, mode 0600); see
:mod:`dpwa.keyfiles`. Nothing is written unless every name is valid and, without ``--force``,
none of the files exists yet. Errors print one ``error: ...`` line and exit 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import click
import zmq

from .keyfiles import name_problem, public_path, secret_path, write_key_pair

EXIT_USAGE = 2


def _die(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def generate_keys(
    names: list[str] | tuple[str, ...], directory: str | os.PathLike[str], *, force: bool = False
) -> list[Path]:
    """Write a fresh key pair per name into ``directory`` (created 0700 if missing); return the files written.

    Raises ValueError (bad or repeated name), FileExistsError (a file exists and not ``force``), OSError.
    """
    if not names:
        raise ValueError("give at least one node name")
    seen: set[str] = set()
    for name in names:
        problem = name_problem(name)
        if problem:
            raise ValueError(problem)
        if name in seen:
            raise ValueError(f"{name!r} is given twice")
        seen.add(name)
    directory = Path(directory)
    if not force:
        existing = [str(p) for n in names for p in (public_path(directory, n), secret_path(directory, n)) if p.exists()]
        if existing:
            raise FileExistsError(
                f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
                "use --force to replace (every machine then needs the new public keys)"
            )
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    written: list[Path] = []
    for name in names:
        public, secret = zmq.curve_keypair()
        written.extend(write_key_pair(directory, name, public, secret, replace=force))
    return written


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
        _die(str(err))
    except OSError as err:
        _die(f"{directory}: cannot write keys: {err.strerror or err}")
    for path in written:
        click.echo(str(path))
