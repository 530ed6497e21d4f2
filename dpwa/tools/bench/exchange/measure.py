"""One model size of ``dpwa bench exchange``: every method set up on both sides, warmed up, then timed in rounds.

:class:`_Size` holds the trainer's side of each measurement family for one size and has the peer build its
side (the ``setup`` command). :data:`WARMUP_ROUNDS` untimed rounds come first, so every snapshot and receive
buffer has its pages. Then :class:`_Rounds` runs ``--repeat`` rounds of every task -- memcpy, (a), (a2), (a3),
(d), (b) per wire dtype, the overlap per wire dtype, (c) -- each round starting one task further down the
list than the one before, so no method always runs first or right after the same other one; each task
appends its samples. :func:`measure_size` turns them into one table row per wire dtype.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from dpwa.rules.mixing import interpolate_
from dpwa.rules.workers import MixWorkers
from dpwa.tools.bench.exchange.control import PeerProcess
from dpwa.tools.bench.exchange.fetch import FetchNodes
from dpwa.tools.bench.exchange.gloo import timed_all_reduce, to_tensor
from dpwa.tools.bench.exchange.overlap import step_seconds
from dpwa.tools.bench.exchange.pair import SHARED, make_model, pair_config
from dpwa.tools.bench.exchange.push import PushNode
from dpwa.tools.bench.exchange.raw import RawClient, TcpClient
from dpwa.tools.bench.exchange.table import push_key, table_row
from dpwa.tools.bench.procs import free_ports
from dpwa.utils.cores import mix_thread_count

__all__ = ["WARMUP_ROUNDS", "measure_size"]

WARMUP_ROUNDS = 3
"""Untimed rounds first: every snapshot buffer and receive buffer gets its pages."""
COMMON_KEYS = (
    "memcpy_ms",
    "mix1_ms",
    "mixn_ms",
    "a_ms",
    "a2_ms",
    "a3_ms",
    "c_ms",
    "push_ms",
    "fold_ms",
    "shm_push_ms",
    "shm_fold_ms",
)
"""The samples measured once per round for the whole size, shown in each of its rows."""
PER_WIRE_KEYS = ("send_ms", "fetch_ms", "mix_ms", "step_ms", "wait_ms", "bytes", "ready_ms")
"""The samples measured once per round and wire dtype."""


class _Size:
    """Everything the trainer side holds for one model size, the peer's side set up too; memcpy and (c) here."""

    def __init__(self, ctx: zmq.Context, peer: PeerProcess, n: int, wires: Sequence[str], gloo: bool) -> None:
        self.n = n
        self.nbytes = n * 4
        self.peer = peer
        self.timeout_s = max(10.0, self.nbytes / 1e6)
        self.src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        self.mix_threads = mix_thread_count("auto")
        """The threads the trainer's nodes mix on (``mix_threads: auto``), and the kernel rows' second figure."""
        self.workers = MixWorkers(self.mix_threads, name="dpwa-bench-mix")
        self.mix_x, self.mix_peer = make_model(n, seed=3), make_model(n, seed=4)
        push_variants = [w for w in ("float32", SHARED) if w in wires and "float32" in wires]
        ports = free_ports(2 + 2 * (len(wires) + len(push_variants)))  # (a), (a3), then two per pair
        pairs = [ports[2 + 2 * i : 4 + 2 * i] for i in range(len(wires) + len(push_variants))]
        configs = [pair_config(w, p, n) for w, p in zip(wires, pairs)]
        peer_configs = [pair_config(w, p, n, 0.0) for w, p in zip(wires, pairs)]
        push_configs = [pair_config(w, p, n, push=True) for w, p in zip(push_variants, pairs[len(wires) :])]
        self.fetch = FetchNodes(peer, make_model(n, seed=1))
        self.pushes: dict[str, PushNode] = {}
        """(d) per variant: over the socket (float32), co-located (float32+shm)."""
        self.raw: RawClient | None = None
        self.tcp: TcpClient | None = None
        try:
            self.fetch.open(wires, configs)
            for i, (w, text) in enumerate(zip(push_variants, push_configs)):
                self.pushes[w] = PushNode(peer, text, self.fetch.params, self.timeout_s, i)
            peer.call(
                "setup", floats=n, raw_port=ports[0], tcp_port=ports[1], configs=peer_configs, push_configs=push_configs
            )
            self.raw = RawClient(ctx, ports[0], self.nbytes, self.timeout_s)
            self.tcp = TcpClient(ports[1], self.nbytes, self.timeout_s)
        except BaseException:
            self.close()
            raise
        self.tensor = to_tensor(self.src) if gloo else None

    def memcpy(self) -> float:
        """The trainer-side reference: ``np.copyto`` of the model's bytes; its milliseconds."""
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return (time.perf_counter() - t0) * 1000.0

    def kernel_mix(self, split: bool) -> float:
        """The mix kernel alone (``interpolate_`` at f = 0.5, the trainer's model layout) on one thread, or
        (``split``) over ``mix_threads``; its milliseconds."""
        t0 = time.perf_counter()
        with self.workers.active() if split else contextlib.nullcontext():
            interpolate_(self.mix_x, self.mix_peer, 0.5)
        return (time.perf_counter() - t0) * 1000.0

    def gloo(self) -> float:
        """(c): one all-reduce of the model's tensor with the peer; its milliseconds."""
        return timed_all_reduce(self.peer, self.tensor, self.timeout_s)

    def close(self) -> None:
        """Close the trainer's nodes and sockets, and have the peer drop its side (if it still runs)."""
        self.workers.close()
        self.fetch.close()
        for node in self.pushes.values():
            node.close()
        self.pushes = {}
        if self.raw is not None:
            self.raw.close()
            self.raw = None
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None
        with contextlib.suppress(Exception):
            if self.peer.proc.poll() is None:
                self.peer.call("teardown", timeout_s=30)


def _warm_up(size: _Size, wires: Sequence[str], gloo: bool) -> None:
    """One untimed round of every method (the overlap aside)."""
    assert size.raw is not None and size.tcp is not None
    size.memcpy()
    size.kernel_mix(True)
    size.raw.fetch()
    size.raw.fetch_chunked()
    size.tcp.fetch()
    for w in wires:
        size.fetch.exchange(w)
    for node in size.pushes.values():
        node.push()
    if gloo:
        size.gloo()


def _rotate(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` starting at its ``k``-th (modulo its length), the ones before it moved to the end."""
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


class _Rounds:
    """The timed rounds of one size: :attr:`tasks` in their order, :attr:`common` and :attr:`per` their samples."""

    def __init__(self, size: _Size, wires: Sequence[str], gloo: bool, step_factor: float, busy: bool) -> None:
        self.size = size
        self.step_factor = step_factor
        self.busy = busy
        self.common: dict[str, list[float]] = {k: [] for k in COMMON_KEYS}
        self.per: dict[str, dict[str, list[float]]] = {w: {k: [] for k in PER_WIRE_KEYS} for w in wires}
        self.tasks: list[Callable[[], None]] = [self.memcpy, self.kernel_mix, self.raw, self.raw_chunked, self.tcp]
        self.tasks += [functools.partial(self.push, w) for w in size.pushes]
        self.tasks += [functools.partial(self.fetch, w) for w in wires]
        self.tasks += [functools.partial(self.overlap, w) for w in wires]
        if gloo:
            self.tasks.append(self.gloo)

    def run(self, repeat: int) -> None:
        """``repeat`` rounds, the k-th starting with task k (modulo their number); each task once the trainer's
        nodes are done with the previous one (:meth:`FetchNodes.settle`)."""
        for r in range(repeat):
            for task in _rotate(self.tasks, r):
                self.size.fetch.settle()
                task()

    def memcpy(self) -> None:
        """The memcpy reference."""
        self.common["memcpy_ms"].append(self.size.memcpy())

    def kernel_mix(self) -> None:
        """The mix kernel on one thread, then split over the node's mix threads."""
        self.common["mix1_ms"].append(self.size.kernel_mix(False))
        self.common["mixn_ms"].append(self.size.kernel_mix(True))

    def raw(self) -> None:
        """(a): one frame."""
        assert self.size.raw is not None
        self.common["a_ms"].append(self.size.raw.fetch())

    def raw_chunked(self) -> None:
        """(a2): one message per chunk."""
        assert self.size.raw is not None
        self.common["a2_ms"].append(self.size.raw.fetch_chunked())

    def tcp(self) -> None:
        """(a3): the bytes over a plain TCP socket."""
        assert self.size.tcp is not None
        self.common["a3_ms"].append(self.size.tcp.fetch())

    def gloo(self) -> None:
        """(c): one all-reduce."""
        self.common["c_ms"].append(self.size.gloo())

    def push(self, variant: str) -> None:
        """(d): one push and the peer's fold, over the socket or (``variant`` SHARED) co-located."""
        got = self.size.pushes[variant].push()
        for key in ("push_ms", "fold_ms"):
            self.common[push_key(variant, key)].append(got[key])

    def fetch(self, wire: str) -> None:
        """(b): one exchange in wire dtype ``wire``, back to back."""
        got = self.size.fetch.exchange(wire)
        for key in ("send_ms", "fetch_ms", "mix_ms", "bytes", "ready_ms"):
            self.per[wire][key].append(got[key])

    def overlap(self, wire: str) -> None:
        """One exchange with a step longer than the exchange between its send and its wait."""
        step_s = step_seconds(self.per[wire]["fetch_ms"], self.step_factor)
        got = self.size.fetch.exchange(wire, step_s, self.busy)
        self.per[wire]["step_ms"].append(step_s * 1000.0)
        self.per[wire]["wait_ms"].append(got["wait_ms"])


def measure_size(
    ctx: zmq.Context,
    peer: PeerProcess,
    n: int,
    wires: Sequence[str],
    repeat: int,
    gloo: bool,
    step_factor: float,
    busy: bool = False,
    shared: bool = False,
) -> list[dict[str, Any]]:
    """Every measurement for one model size, interleaved; one row (medians and samples) per wire dtype, and with
    ``shared`` one more: (b) through shared memory (:data:`~dpwa.tools.bench.exchange.pair.SHARED`)."""
    wires = [*wires, SHARED] if shared else list(wires)
    size = _Size(ctx, peer, n, wires, gloo)
    try:
        rounds = _Rounds(size, wires, gloo, step_factor, busy)
        for _ in range(WARMUP_ROUNDS):
            _warm_up(size, wires, gloo)
        rounds.run(repeat)
        return [table_row(n, w, rounds.per[w], rounds.common) | {"mix_threads": size.mix_threads} for w in wires]
    finally:
        size.close()
