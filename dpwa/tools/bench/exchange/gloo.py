"""(c) ``gloo``: ``torch.distributed.all_reduce`` of the model's float32 tensor across the two processes.

Both processes join one two-process gloo group over loopback (:func:`gloo_group` on the trainer, rank 0;
the peer's ``gloo_init`` command, rank 1), each with one torch intra-op thread (one core per node). A
timed all-reduce starts after a barrier, so neither side's setup is in it. Skipped when torch, or its
gloo backend, is missing (:func:`gloo_usable`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dpwa.tools.bench.exchange.control import PeerProcess
from dpwa.tools.bench.procs import free_ports

__all__ = ["all_reduce", "gloo_group", "gloo_usable", "init_gloo", "timed_all_reduce", "to_tensor"]


def gloo_usable(echo: Callable[[str], None]) -> bool:
    """Whether torch.distributed with gloo can be used; says so through ``echo`` when it cannot."""
    try:
        import torch.distributed as dist

        usable = dist.is_available() and dist.is_gloo_available()
    except ImportError:
        usable = False
    if not usable:
        echo("torch.distributed with gloo is not available: (c) is skipped")
    return usable


def init_gloo(rank: int, port: int, timeout_s: float = 60.0) -> None:
    """Join the two-process gloo group; torch gets one intra-op thread per process (one core per node)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


@contextlib.contextmanager
def gloo_group(peer: PeerProcess, gloo: bool) -> Iterator[None]:
    """The two-process gloo group over loopback for (c); this process's environment and torch threads restored."""
    if not gloo:
        yield
        return
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        port = free_ports(1)[0]
        peer.send("gloo_init", port=port)
        init_gloo(0, port)
        peer.answer("gloo_init")
        yield
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved


def to_tensor(flat: np.ndarray) -> Any:
    """A torch tensor of its own holding a copy of ``flat``: what each side all-reduces."""
    import torch

    return torch.from_numpy(flat.copy())


def timed_all_reduce(peer: PeerProcess, tensor: Any, timeout_s: float) -> float:
    """The trainer's side of one all-reduce, the peer told to join it; its milliseconds after the barrier."""
    import torch.distributed as dist

    peer.send("gloo")
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(tensor)
    ms = (time.perf_counter() - t0) * 1000.0
    peer.answer("gloo", timeout_s)
    return ms


def all_reduce(tensor: Any) -> None:
    """The peer's side of one all-reduce: the barrier, then the all-reduce."""
    import torch.distributed as dist

    dist.barrier()
    dist.all_reduce(tensor)
