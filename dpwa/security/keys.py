"""Generating CurveZMQ key pairs for the nodes of a cluster (``dpwa keys generate``, :mod:`dpwa.cli.keys`).

Each name gets ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (secret, mode 0600); see
:mod:`dpwa.security.keyfiles`. Nothing is written unless every name is valid and, unless
``force``, none of the files exists yet.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from dpwa.security.keyfiles import name_problem, public_path, secret_path, write_key_pair

__all__ = ["generate_keys"]


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
