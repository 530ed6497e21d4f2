"""Giving freed memory back to the kernel: what a node in ``transport: {memory: low}`` does after each mix.

glibc keeps freed blocks for reuse. Among them are the messages libzmq allocates for each 4 MiB chunk received over
TCP: once one such block was freed, glibc raises its threshold for handing blocks straight back to the kernel to
that size (up to 32 MiB), so later ones stay in the process, 13-50 MB whatever the model's size. ``malloc_trim(0)``
returns the free pages of every arena to the kernel, a few microseconds when there is nothing to return. Where the
C library has no ``malloc_trim`` (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["give_back_freed"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` from the C library this process runs on, or None."""
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, its C library's among them
    except OSError:  # pragma: no cover - no dynamic loader
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:  # pragma: no cover - not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def give_back_freed() -> bool:
    """Return the allocator's free pages to the kernel where the C library can (glibc); True when some went."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
