"""CurveZMQ key files of dpwa nodes: names, paths, reading and writing (stdlib only, no sockets).

A node ``NAME`` has two files in the cluster's key directory, in the certificate format of
``zmq.auth`` (so ``zmq.auth.load_certificate`` reads them too)::

    NAME.key          public key, mode 0644: every node that talks to NAME needs it
    NAME.key_secret   public and secret key, mode 0600: only the machine that runs NAME needs it

Keys are Z85 text, 40 characters for 32 bytes. Files are written atomically and never
half-written: a temporary file (created 0600) is linked or renamed into place.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from dpwa.utils.atomic import write_atomically
from dpwa.utils.settings import NAME_PATTERN

__all__ = [
    "PUBLIC_SUFFIX",
    "SECRET_SUFFIX",
    "KeyFileError",
    "name_problem",
    "public_path",
    "read_key_file",
    "secret_path",
    "write_key_pair",
]

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
Z85_ALPHABET = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")
Z85_KEY_CHARS = 40
_PUBLIC_BANNER = """#   ****  Generated on {now} by dpwa keys generate  ****
#   ZeroMQ CURVE Public Certificate of dpwa node {name}
#   Copy it to every machine that runs a node of the cluster.

"""
_SECRET_BANNER = """#   ****  Generated on {now} by dpwa keys generate  ****
#   ZeroMQ CURVE **Secret** Certificate of dpwa node {name}
#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.

"""


class KeyFileError(ValueError):
    """A key file that is missing, unreadable or holds no valid key; ``str()`` names the file."""


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name key files (None when it can): letters, digits, ``.``, ``_``, ``-``,
    not starting with ``.`` or ``-`` (so it never names a path outside the key directory)."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        return f"{name!r} cannot name a key file: use letters, digits, '.', '_', '-', starting with a letter or digit"
    return None


def public_path(directory: str | os.PathLike[str], name: str) -> Path:
    """``DIR/NAME.key``."""
    return Path(directory) / f"{name}{PUBLIC_SUFFIX}"


def secret_path(directory: str | os.PathLike[str], name: str) -> Path:
    """``DIR/NAME.key_secret``."""
    return Path(directory) / f"{name}{SECRET_SUFFIX}"


def _z85_key(value: str, what: str, path: Path) -> bytes:
    if len(value) != Z85_KEY_CHARS or not set(value) <= Z85_ALPHABET:
        raise KeyFileError(f"{path}: {what} is not a {Z85_KEY_CHARS}-character Z85 CurveZMQ key")
    return value.encode("ascii")


def read_key_file(path: str | os.PathLike[str], *, secret: bool = False) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) of a certificate file, both Z85 bytes.

    With ``secret=True`` the secret key must be there. Raises :class:`KeyFileError`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such key file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise KeyFileError(f"{path}: cannot read key file: {getattr(err, 'strerror', None) or err}") from None
    found: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        for field in ("public-key", "secret-key"):
            if line.startswith(field) and "=" in line:
                found.setdefault(field, line.split("=", 1)[1].strip(" \t'\""))
    if "public-key" not in found:
        raise KeyFileError(f"{path}: no public-key line; not a CurveZMQ certificate")
    public = _z85_key(found["public-key"], "public-key", path)
    if "secret-key" not in found:
        if secret:
            raise KeyFileError(f"{path}: no secret-key line; a node needs its own .key_secret file")
        return public, None
    return public, _z85_key(found["secret-key"], "secret-key", path)


def _text(name: str, public: bytes, secret: bytes | None) -> str:
    now = datetime.datetime.now().isoformat(timespec="seconds")
    banner = (_SECRET_BANNER if secret else _PUBLIC_BANNER).format(now=now, name=name)
    lines = [banner + "metadata", "curve", f'    public-key = "{public.decode("ascii")}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return "\n".join(lines) + "\n"


def write_key_pair(
    directory: str | os.PathLike[str], name: str, public: bytes, secret: bytes, *, replace: bool = False
) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600) in ``directory``; return their paths.

    Without ``replace`` an existing file is a FileExistsError (checked before either file is written).
    """
    problem = name_problem(name)
    if problem:
        raise ValueError(problem)
    directory = Path(directory)
    pub, sec = public_path(directory, name), secret_path(directory, name)
    if not replace:
        for path in (pub, sec):
            if os.path.lexists(path):
                raise FileExistsError(f"{path} exists")
    write_atomically(sec, _text(name, public, secret), durable=True, mode=0o600, overwrite=replace)
    write_atomically(pub, _text(name, public, None), durable=True, mode=0o644, overwrite=replace)
    return pub, sec
