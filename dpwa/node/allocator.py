"""The C library's allocator and the messages libzmq allocates: reused in ``transport: {memory: normal}``, handed
back in ``low``.

libzmq allocates a message for each 4 MiB chunk it receives over TCP and frees it once the chunk is copied into
place. glibc decides what happens to such a freed block by two thresholds it moves on its own: a block at or above
the *mmap threshold* is mapped fresh and unmapped when freed, and free space above the *trim threshold* at the top
of a heap goes back to the kernel. So the next chunk's pages are often new to the process, and the kernel faults
every one of them in (zeroed) while libzmq receives into it: measured at 10M and 25M floats, 39-45 % of the pages of
every push received over TCP, about 1 us of the receiving thread's CPU per 4 KiB page. And free space below the
trim threshold at the top of a thread's heap stays resident, out of ``malloc_trim``'s reach: 8 MiB when two chunks
were freed last.

:func:`set_up_allocator` fixes both thresholds once per process, for the first node's ``transport.memory``:

- ``normal``: where glibc's own heuristic would end up (mmap 32 MiB, its ceiling for the dynamic threshold; trim
  twice that), so every chunk reuses a block freed before;
- ``low``: at glibc's defaults (128 KiB both), so a chunk's block is unmapped when freed and nothing is kept; with
  :func:`give_back_freed` after each mix (``malloc_trim(0)``: the free pages of every arena's bins to the kernel, a
  few microseconds when there is nothing to return).

A process whose user tuned malloc (``GLIBC_TUNABLES`` with ``glibc.malloc.``, or one of the ``MALLOC_*_``
variables) is left as it is; where the C library is not glibc nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping

__all__ = [
    "KEPT_MMAP_THRESHOLD",
    "KEPT_TRIM_THRESHOLD",
    "LOW_THRESHOLD",
    "give_back_freed",
    "set_up_allocator",
    "user_tuned_malloc",
]

log = logging.getLogger(__name__)

KEPT_MMAP_THRESHOLD = 32 << 20
"""Bytes (``normal``): smaller blocks come from a heap (glibc's ceiling for its dynamic threshold,
DEFAULT_MMAP_THRESHOLD_MAX)."""
KEPT_TRIM_THRESHOLD = 2 * KEPT_MMAP_THRESHOLD
"""Bytes of free space a heap keeps at its top (``normal``; glibc sets twice the mmap threshold when it raises that)."""
LOW_THRESHOLD = 128 << 10
"""Bytes (``low``): both thresholds at glibc's defaults, never raised."""
_THRESHOLDS = {"normal": (KEPT_MMAP_THRESHOLD, KEPT_TRIM_THRESHOLD), "low": (LOW_THRESHOLD, LOW_THRESHOLD)}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_lock = threading.Lock()
_applied: str | None = None  # the memory mode the process's allocator was set up for ("" : left alone)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library this process runs on, or None."""
    try:
        return ctypes.CDLL(None)  # the process's own symbols, its C library's among them
    except OSError:  # pragma: no cover - no dynamic loader
        return None


@functools.cache
def _function(name: str, argtypes: tuple[type, ...]) -> Callable[..., int] | None:
    """The C library's ``name`` taking ``argtypes`` and returning an int, or None where it has none (not glibc);
    looked up and typed once (``malloc_trim`` runs after every mix of a ``low`` node)."""
    libc = _libc()
    function = getattr(libc, name, None) if libc is not None else None
    if function is None:  # pragma: no cover - not glibc
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


def give_back_freed() -> bool:
    """Return the allocator's free pages to the kernel where the C library can (glibc); True when some went."""
    trim = _function("malloc_trim", (ctypes.c_size_t,))
    return bool(trim(0)) if trim is not None else False


def user_tuned_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the process's user set glibc's malloc tunables: ``GLIBC_TUNABLES`` naming ``glibc.malloc.``, or a
    ``MALLOC_*_`` variable glibc reads (they are then left alone)."""
    return "glibc.malloc." in environ.get("GLIBC_TUNABLES", "") or any(v in environ for v in _USER_VARIABLES)


def set_up_allocator(memory: str) -> bool:
    """Fix glibc's mmap and trim thresholds for ``memory`` (``normal``: :data:`KEPT_MMAP_THRESHOLD` and
    :data:`KEPT_TRIM_THRESHOLD`; ``low``: :data:`LOW_THRESHOLD`), once per process: the first node's mode holds (a
    later node of the other mode is told so in the log). True when the process's allocator is set up for ``memory``;
    False where the user tuned malloc (:func:`user_tuned_malloc`) or the C library is not glibc."""
    global _applied
    mmap_threshold, trim_threshold = _THRESHOLDS[memory]
    with _lock:
        if _applied is None:
            _applied = ""
            mallopt = _function("mallopt", (ctypes.c_int, ctypes.c_int))
            if user_tuned_malloc():
                log.info("malloc left as the environment tunes it (GLIBC_TUNABLES / MALLOC_*_)")
            elif (
                mallopt is not None
                and mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
                and mallopt(_M_TRIM_THRESHOLD, trim_threshold)
            ):
                _applied = memory
                log.debug(
                    "malloc set up for memory %s: mmap threshold %d, trim threshold %d bytes",
                    memory,
                    mmap_threshold,
                    trim_threshold,
                )
        elif _applied and _applied != memory:
            log.warning("malloc stays set up for memory %s (this process's first node), not %s", _applied, memory)
        return _applied == memory
