"""The cores a process may use, and the share of them ``dpwa run`` gives each node it starts.

``dpwa run`` sets :data:`ENV_TORCH_THREADS` (with ``OMP_NUM_THREADS`` and its kin) to each node's share of the
usable cores, ``max(1, cores // local_nodes)``; torch's intra-op threads and the node's mix workers use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV_TORCH_THREADS", "MAX_AUTO_MIX_THREADS", "auto_threads", "mix_thread_count", "usable_cores"]

ENV_TORCH_THREADS = "DPWA_TORCH_THREADS"
"""The variable ``dpwa run`` sets to each node's share of the cores."""

MAX_AUTO_MIX_THREADS = 4
"""``auto`` never takes more threads than this: a mix reads memory, which a few cores already saturate."""


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a SLURM allocation), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS
        return max(1, os.cpu_count() or 1)


def auto_threads(environ: Mapping[str, str] | None = None, cores: int | None = None) -> int:
    """The threads ``auto`` stands for: the process's share of the cores -- ``DPWA_TORCH_THREADS`` (set by ``dpwa
    run``), else ``OMP_NUM_THREADS`` (torchrun sets it to 1 for several processes a host), when a positive integer
    -- else the usable cores; at most :data:`MAX_AUTO_MIX_THREADS`."""
    environ = os.environ if environ is None else environ
    for name in (ENV_TORCH_THREADS, "OMP_NUM_THREADS"):
        share = environ.get(name, "").strip()
        if share.isascii() and share.isdigit() and int(share) > 0:
            return min(MAX_AUTO_MIX_THREADS, int(share))
    threads = usable_cores() if cores is None else cores
    return max(1, min(MAX_AUTO_MIX_THREADS, threads))


def mix_thread_count(setting: str | int, environ: Mapping[str, str] | None = None) -> int:
    """The threads a node's mix may split over for its ``transport: {mix_threads: ...}`` setting (already
    validated): the number given, or for ``auto`` :func:`auto_threads`."""
    return auto_threads(environ) if setting == "auto" else int(setting)
