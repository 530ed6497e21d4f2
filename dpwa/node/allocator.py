"""The C library's allocator and the messages libzmq allocates: reused in ``transport: {memory: normal}``, given
back in ``low``.

libzmq allocates a message for each 4 MiB chunk it receives over TCP and frees it once the chunk is copied into
place. glibc decides what happens to such a freed block by two thresholds it moves on its own: a block at or above
the *mmap threshold* is mapped fresh and unmapped when freed, and free space above the *trim threshold* at the top
of a heap goes back to the kernel. Either way the next chunk's pages are new to the process, and the kernel faults
every one of them in (zeroed) while libzmq receives into it: measured at 10M and 25M floats, 39-45 % of the pages of
every push received over TCP, about 1 us of the receiving thread's CPU per 4 KiB page.

- ``memory: normal``: :func:`keep_freed_blocks` fixes both thresholds once per process where glibc's own heuristic
  would end up (mmap 32 MiB, its ceiling for the dynamic threshold; trim twice that), so every chunk reuses a block
  freed before. A process whose user tuned malloc (``GLIBC_TUNABLES`` with ``glibc.malloc.``, or one of the
  ``MALLOC_*_`` variables) is left as it is.
- ``memory: low``: :func:`give_back_freed` after each mix: ``malloc_trim(0)`` returns the free pages of every arena
  to the kernel (a few microseconds when there is nothing to return).

Where the C library is not glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable, Mapping

__all__ = ["KEPT_MMAP_THRESHOLD", "KEPT_TRIM_THRESHOLD", "give_back_freed", "keep_freed_blocks", "user_tuned_malloc"]

log = logging.getLogger(__name__)

KEPT_MMAP_THRESHOLD = 32 << 20
"""Bytes: smaller blocks come from the heap (glibc's ceiling for its dynamic threshold, DEFAULT_MMAP_THRESHOLD_MAX)."""
KEPT_TRIM_THRESHOLD = 2 * KEPT_MMAP_THRESHOLD
"""Bytes of free space a heap keeps at its top (glibc sets twice the mmap threshold when it raises that)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library this process runs on, or None."""
    try:
        return ctypes.CDLL(None)  # the process's own symbols, its C library's among them
    except OSError:  # pragma: no cover - no dynamic loader
        return None


def _function(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """The C library's ``name`` taking ``argtypes`` and returning an int, or None where it has none (not glibc)."""
    libc = _libc()
    function = getattr(libc, name, None) if libc is not None else None
    if function is None:  # pragma: no cover - not glibc
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def give_back_freed() -> bool:
    """Return the allocator's free pages to the kernel where the C library can (glibc); True when some went."""
    trim = _function("malloc_trim", [ctypes.c_size_t])
    return bool(trim(0)) if trim is not None else False


def user_tuned_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the process's user set glibc's malloc tunables: ``GLIBC_TUNABLES`` naming ``glibc.malloc.``, or a
    ``MALLOC_*_`` variable glibc reads (they are then left alone)."""
    return "glibc.malloc." in environ.get("GLIBC_TUNABLES", "") or any(v in environ for v in _USER_VARIABLES)


@functools.cache
def keep_freed_blocks() -> bool:
    """Once per process: glibc's mmap threshold fixed at :data:`KEPT_MMAP_THRESHOLD` and its trim threshold at
    :data:`KEPT_TRIM_THRESHOLD`, so freed message blocks are reused rather than faulted in again. True when set;
    False where the user tuned malloc (:func:`user_tuned_malloc`) or the C library is not glibc."""
    if user_tuned_malloc():
        log.info("malloc left as tuned by the environment (GLIBC_TUNABLES / MALLOC_*_)")
        return False
    mallopt = _function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:  # pragma: no cover - not glibc
        return False
    done = bool(mallopt(_M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD)
    )
    log.debug(
        "malloc: blocks under %d bytes reused, %d bytes kept at a heap's top: %s",
        KEPT_MMAP_THRESHOLD,
        KEPT_TRIM_THRESHOLD,
        done,
    )
    return done
