"""Writing a file so that a reader -- or a crash -- sees the old file or the new one, never a torn one.

One helper, :func:`write_atomically`, for every file dpwa writes while others may read it:
checkpoints, key files, the run directory's JSON and YAML files, the demo's model files.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["TEMP_SUFFIX", "fsync_directory", "temp_path", "write_atomically"]

TEMP_SUFFIX = ".tmp"
"""Temporary files are ``.<name>.<pid>.<random>.tmp`` beside the target (hidden, and easy to sweep)."""


def temp_path(path: Path) -> Path:
    """A fresh temporary name beside ``path``: ``.<name>.<pid>.<random>.tmp``."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def fsync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def write_atomically(
    path: str | os.PathLike[str],
    content: bytes | str | Callable[[IO[bytes]], None],
    *,
    durable: bool = False,
    mode: int | None = None,
    overwrite: bool = True,
    before_rename: Callable[[], None] | None = None,
) -> Path:
    """Write ``content`` (bytes, UTF-8 text, or a function filling a binary file) to ``path`` atomically.

    The data goes to a temporary file in ``path``'s directory, which then replaces ``path`` in one rename
    (``overwrite=False``: a hard link instead, FileExistsError if ``path`` exists). ``durable``: the file is
    fsync'ed before and its directory after the rename, so a power cut keeps the old or the new file.
    ``mode``: the file's permission bits (the temporary file is created 0600 then); default the umask's.
    ``before_rename`` runs just before the rename (a checkpoint keeps its previous file there). The
    temporary file never outlives the call, whatever fails. Returns ``path`` as a Path.
    """
    target = Path(path)
    tmp = temp_path(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if mode is not None else 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode("utf-8") if isinstance(content, str) else content)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        if before_rename is not None:
            before_rename()
        if overwrite:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if durable:
        fsync_directory(target.parent)
    return target
