"""``dpwa bench exchange``: one exchange of a model through dpwa against what the transport allows.

Two local processes: this one (the *trainer*) and a peer started as
``python -m dpwa.tools.bench.exchange peer ENDPOINT``, driven over a ZeroMQ PAIR control
socket. For every model size (``--floats``) and in the same run, interleaved round
by round, medians over ``--repeat`` rounds of:

* ``memcpy``: ``np.copyto`` of the model's bytes -- the trainer-side reference;
* (a) ``raw``: one zero-copy pyzmq frame of the model's float32 bytes fetched over
  loopback TCP into a preallocated buffer -- the transport's limit: what moving the
  bytes costs with no framing at all; and (a2) ``raw chunked``: the same bytes as one zero-copy message per
  4 MiB chunk (dpwa's framing, without validation), each received into its place
  -- a stricter limit, since libzmq receives one 100 MB frame into a freshly
  mapped buffer (page faults on every byte) but 4 MiB ones into reused heap memory;
* (b) ``dpwa``, per ``--wire-dtype``: the peer publishes a fresh snapshot (untimed,
  and rounded into its wire dtype -- ``peer ready ms``, the serving side's
  cost, spent during its step in training), then
  ``update_send`` (its duration), the fetch
  (``last_exchange["fetch_ms"]``, validation included), the mix
  (``last_exchange["mix_ms"]``); then, with a simulated step of ``--step-factor`` x
  the fetch between ``update_send`` and ``update_wait`` (``--step sleep``, or
  ``busy``: one thread computing numpy ``exp``, which takes one of the cores the
  exchange would use), how long ``update_wait`` waited for the fetch (``wait_ms``);
* (c) ``gloo``: ``torch.distributed.all_reduce`` of the same float32 tensor across
  the two processes (skipped when torch is missing);
* (d) ``push`` (float32 wire, in the float32 row): a second pair of nodes running ``pushsum``.
  The trainer's node pushes its model to the peer's: ``push ms`` is the push from its start
  to its ACK (send, receive into an inbox slot, validate; ``last_exchange["push_ms"]``), and
  ``fold ms`` the peer's ``update_wait`` folding it in (its ``mix_ms``). The peer then pushes
  half of its mass back (acknowledged before the next round, so nothing else is on the wire),
  which keeps both weights near 1 however many rounds run. ``(push+fold)/(fetch+mix)``
  compares it with (b) float32, round by round.

The table shows absolute figures (medians) and the ratios checked against
``TARGETS`` (per round, then the median: a round takes about a second, so load from
other jobs that changes between rounds cancels out) with a check mark:
informational, never a test. JSON goes to ``<run dir>/exchange.json``,
a bar chart to ``exchange.png`` with ``--plot``.

The peer exits when told to, when this process goes away, or after
:data:`PEER_IDLE_S` without a command; this process stops it (SIGTERM, then SIGKILL)
whatever happens, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np
import yaml
import zmq

from dpwa.config import ClusterConfig, parse_config
from dpwa.node.wire import CHUNK_BYTES
from dpwa.tools.bench.procs import free_ports
from dpwa.tools.bench.report import Column, Report, bench_run_dir, render_table
from dpwa.utils import dtypes

log = logging.getLogger(__name__)

__all__ = ["WIRE_DTYPES", "exchange", "parse_count", "peer_main", "run_exchange"]

WIRE_DTYPES = ("float32", *(name for name in dtypes.WIRE_DTYPES if name != "float32"))
"""The wire dtypes measured, in the order the table prints them: float32 first, the full-width baseline the
16-bit rows are compared with, then the others as :data:`dpwa.utils.dtypes.WIRE_DTYPES` lists them."""
CONTROL_TIMEOUT_S = 120.0
"""Longest wait for the peer's answer to one command (setting up 25M floats takes about a second)."""
PEER_IDLE_S = 600.0
"""The peer exits after this long without a command."""
STOP_GRACE_S = 3.0
WARMUP_ROUNDS = 3
"""Untimed rounds first: every snapshot buffer and receive buffer gets its pages."""
TARGETS = {
    "fetch_a": 1.15,  # (b) fetch <= 1.15 x (a), float32 wire
    "fm_c_32": 1.1,  # (b) fetch + mix <= 1.1 x (c), float32 wire
    "fm_c_16": 0.7,  # ... <= 0.7 x (c), 16-bit wire
    "send_memcpy": 1.2,  # update_send <= 1.2 x memcpy
    "mix_memcpy": 1.5,  # mix <= 1.5 x memcpy
    "block": 0.05,  # update_wait's wait < 5 % of a step longer than the exchange
    "push_fetch": 1.1,  # (d) push + fold <= 1.1 x (b) fetch + mix, float32 wire
}
_SUFFIXES = {"": 1, "k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6, "g": 10**9, "G": 10**9}


# --------------------------------------------------------------------------- options


def parse_count(text: str) -> int:
    """``"25M"`` -> 25_000_000, ``"1.5k"`` -> 1500, ``"10000"`` -> 10000; ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgG]?)\s*", text)
    if not match:
        raise ValueError(f"not a count: {text!r} (e.g. 10000, 1M, 2.5M)")
    value = float(match.group(1)) * _SUFFIXES[match.group(2)]
    if value < 1 or value != int(value):
        raise ValueError(f"not a positive whole count: {text!r}")
    return int(value)


def _counts(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return [parse_count(part) for part in value.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _dtypes(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    names = [part.strip() for part in value.split(",") if part.strip()]
    bad = [n for n in names if n not in WIRE_DTYPES]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) or 'nothing'}: allowed: {', '.join(WIRE_DTYPES)}")
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------- control channel


def _send(sock: zmq.Socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _recv(sock: zmq.Socket, timeout_s: float, what: str) -> dict[str, Any]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no answer from the peer within {timeout_s:g} s ({what})")
    answer = json.loads(sock.recv())
    if not answer.get("ok"):
        raise RuntimeError(f"peer failed ({what}): {answer.get('error')}")
    return answer


class PeerProcess:
    """The peer subprocess and its control socket; :meth:`call` sends one command and waits for the answer."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._sock = ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
        argv = [sys.executable, "-m", "dpwa.tools.bench.exchange", "peer", f"tcp://127.0.0.1:{port}", str(os.getpid())]
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        log.info("peer started, pid %d", self.proc.pid)
        try:
            _recv(self._sock, CONTROL_TIMEOUT_S, "start")
        except BaseException:
            self.stop()
            raise

    def call(self, op: str, timeout_s: float = CONTROL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Send ``op`` and wait for the peer's answer; TimeoutError / RuntimeError if it fails."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the peer exited with status {self.proc.returncode}")
        _send(self._sock, {"op": op, **args})
        return _recv(self._sock, timeout_s, op)

    def send(self, op: str, **args: Any) -> None:
        """Send ``op`` without waiting (read the answer with :meth:`answer`)."""
        _send(self._sock, {"op": op, **args})

    def answer(self, what: str, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        return _recv(self._sock, timeout_s, what)

    def stop(self) -> None:
        """Ask the peer to quit; SIGTERM then SIGKILL if it does not within the grace period. Idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                _send(self._sock, {"op": "quit"})
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(STOP_GRACE_S)
        self._sock.close(linger=0)


# --------------------------------------------------------------------------- the two sides' pieces


def _pair_config(wire: str, ports: Sequence[int], n: int, fetch_probability: float = 1.0, push: bool = False) -> str:
    """The YAML cluster file of the trainer node ``t`` and the peer node ``p`` for wire dtype ``wire``.

    The peer gets ``fetch_probability`` 0: it only serves, so nothing else moves while (b) is timed.
    ``push``: the pair of (d), rule ``pushsum`` with the smallest inbox (two slots), on random peers: there
    push-sum is asynchronous (``update_wait`` waits for the ACK, not for the peer's push of the round, which in
    (d) comes only after it).
    """
    doc: dict[str, Any] = {
        "nodes": [{"name": name, "host": "127.0.0.1", "port": port} for name, port in zip("tp", ports)],
        "fetch_probability": fetch_probability,
        "timeout_ms": max(5000.0, n * 4 / 1e6 * 200),  # generous: 200 ms per MB, this is a benchmark not a test
    }
    if push:
        doc.update(interpolation="pushsum", peers="random", inbox_slots=2)
    if "wire_dtype" in {f for f in ClusterConfig.__dataclass_fields__}:
        doc["wire_dtype"] = wire
    elif wire != "float32":
        raise click.UsageError(f"this dpwa has no wire_dtype setting; --wire-dtype {wire} is not possible")
    return yaml.safe_dump(doc, sort_keys=False)


def _model(n: int, seed: int) -> list[np.ndarray]:
    """A float32 model of ``n`` floats in a few arrays of a realistic spread of sizes (normal values, std 0.05)."""
    rng = np.random.default_rng(seed)
    sizes = [n // 2, n // 4, n // 8]
    sizes.append(n - sum(sizes))
    return [(rng.standard_normal(s, dtype=np.float32) * np.float32(0.05)) for s in sizes if s > 0]


class RawServer(threading.Thread):
    """(a)'s server: a ROUTER answering every request with ``buffer`` as one zero-copy frame."""

    def __init__(self, ctx: zmq.Context, port: int, buffer: np.ndarray) -> None:
        super().__init__(name="bench-raw", daemon=True)
        from dpwa.node.transport import tune_data_socket

        raw = buffer.reshape(-1).view(np.uint8)
        self._buffer = raw
        self._chunks = [memoryview(raw[s : s + CHUNK_BYTES]) for s in range(0, raw.size, CHUNK_BYTES)]
        self._stop_flag = threading.Event()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        tune_data_socket(self._sock)
        self._sock.bind(f"tcp://127.0.0.1:{port}")

    def run(self) -> None:
        try:
            while not self._stop_flag.is_set():
                if self._sock.poll(100):
                    identity, what = self._sock.recv_multipart()
                    if what == b"chunks":  # (a2): one message per chunk
                        for chunk in self._chunks:
                            self._sock.send(identity, zmq.SNDMORE)
                            self._sock.send(zmq.Frame(chunk, copy=False), copy=False)
                        continue
                    self._sock.send(identity, zmq.SNDMORE)
                    self._sock.send(zmq.Frame(memoryview(self._buffer), copy=False), copy=False)
        finally:
            self._sock.close(linger=0)

    def stop(self) -> None:
        self._stop_flag.set()
        self.join(2.0)


def _gloo_init(rank: int, port: int, timeout_s: float = 60.0) -> None:
    """Join the two-process gloo group; torch gets one intra-op thread per process (one core per node)."""
    import datetime

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


# --------------------------------------------------------------------------- peer process


class _PeerState:
    """What the peer holds for one model size."""

    def __init__(self) -> None:
        self.conns: list[Any] = []
        self.raw: RawServer | None = None
        self.tensor: Any = None
        self.model: list[np.ndarray] = []
        self.push: Any = None
        self.push_model: list[np.ndarray] = []

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns = []
        if self.push is not None:
            self.push.close()
            self.push = None
        if self.raw is not None:
            self.raw.stop()
            self.raw = None
        self.tensor = None


def peer_main(endpoint: str, parent: int) -> None:
    """The peer: serves (a) and (b) and joins (c), on command from ``endpoint``; exits with its parent."""
    from dpwa.node.connection import DpwaConnection

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    state = _PeerState()
    gloo = False
    _send(sock, {"ok": True})
    idle_since = time.monotonic()
    try:
        while True:
            if not sock.poll(500):
                if os.getppid() != parent or time.monotonic() - idle_since > PEER_IDLE_S:
                    log.warning("bench peer: parent gone or idle; exiting")
                    return
                continue
            idle_since = time.monotonic()
            message = json.loads(sock.recv())
            op = message.pop("op")
            if op == "quit":
                return
            try:
                answer: dict[str, Any] = {}
                if op == "gloo_init":
                    _gloo_init(1, message["port"])
                    gloo = True
                elif op == "setup":
                    state.close()
                    n = message["floats"]
                    model = _model(n, seed=2)
                    flat = np.concatenate(model)
                    state.raw = RawServer(ctx, message["raw_port"], flat)
                    state.raw.start()
                    for text in message["configs"]:
                        conn = DpwaConnection("p", parse_config(text), seed=2)
                        conn.update_send(model, 1.0)
                        state.conns.append(conn)
                    state.model = model
                    if message.get("push_config"):  # (d): publish, push to t, and have that push settled
                        state.push_model = [a.copy() for a in model]
                        state.push = DpwaConnection("p", parse_config(message["push_config"]), seed=2)
                        state.push.update_send(state.push_model, 1.0)
                        state.push.update_wait(1.0)
                    if gloo:
                        import torch

                        state.tensor = torch.from_numpy(flat.copy())
                elif op == "publish":  # a fresh snapshot, ready on the wire (rounded) as after a step
                    conn = state.conns[message["index"]]
                    t0 = time.perf_counter()
                    conn.update_send(state.model, 1.0)
                    if not conn.wait_published(CONTROL_TIMEOUT_S / 2):
                        raise TimeoutError("the snapshot never became ready on the wire")
                    answer["ready_ms"] = (time.perf_counter() - t0) * 1000.0
                elif op == "fold":  # (d): fold the trainer's push in, then push half of the mass back
                    conn = state.push
                    conn.update_wait(1.0)
                    record = conn.last_exchange or {}
                    answer.update(mix_ms=record.get("mix_ms"), received=record.get("received", 0))
                    conn.update_send(state.push_model, 1.0)
                    conn.update_wait(1.0)  # its ACK: nothing is on the wire when the trainer pushes next
                    if (conn.last_exchange or {}).get("pushed") != 1:
                        raise RuntimeError(f"the peer's push back did not go: {conn.last_exchange}")
                elif op == "gloo":
                    import torch.distributed as dist

                    dist.barrier()
                    dist.all_reduce(state.tensor)
                elif op == "teardown":
                    state.close()
                else:
                    raise ValueError(f"unknown command {op!r}")
                _send(sock, {"ok": True, **answer})
            except Exception as exc:  # report it to the trainer side, which stops the run
                log.exception("bench peer: %s failed", op)
                _send(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    except KeyboardInterrupt:
        pass
    finally:
        state.close()
        if gloo:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        sock.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------- trainer side


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


class _Size:
    """Everything the trainer side holds for one model size, and one measurement per method."""

    def __init__(self, ctx: zmq.Context, peer: PeerProcess, n: int, wires: Sequence[str], gloo: bool) -> None:
        from dpwa.node.connection import DpwaConnection
        from dpwa.node.transport import tune_data_socket

        self.n = n
        self.nbytes = n * 4
        self.peer = peer
        self.src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        self.raw_buffer = np.zeros(self.nbytes, np.uint8)
        ports = free_ports(3 + 2 * len(wires))
        configs = [_pair_config(w, ports[1 + 2 * i : 3 + 2 * i], n) for i, w in enumerate(wires)]
        peer_configs = [_pair_config(w, ports[1 + 2 * i : 3 + 2 * i], n, 0.0) for i, w in enumerate(wires)]
        push_config = _pair_config("float32", ports[-2:], n, push=True) if "float32" in wires else ""
        self.params = _model(n, seed=1)
        self.push_params = [a.copy() for a in self.params]
        self.conns: dict[str, Any] = {}
        self.push_conn: Any = None
        self.raw: zmq.Socket | None = None
        try:
            for wire, text in zip(wires, configs):
                self.conns[wire] = DpwaConnection("t", parse_config(text), seed=1)
            if push_config:
                self.push_conn = DpwaConnection("t", parse_config(push_config), seed=1)
            peer.call("setup", floats=n, raw_port=ports[0], configs=peer_configs, push_config=push_config)
            self.raw = ctx.socket(zmq.DEALER)
            self.raw.setsockopt(zmq.LINGER, 0)
            tune_data_socket(self.raw)
            self.raw.connect(f"tcp://127.0.0.1:{ports[0]}")
        except BaseException:
            self.close()
            raise
        self.tensor = None
        if gloo:
            import torch

            self.tensor = torch.from_numpy(self.src.copy())
        self.timeout_s = max(10.0, self.nbytes / 1e6)

    def memcpy(self) -> float:
        return _timed(lambda: np.copyto(self.dst, self.src))

    def raw_fetch(self) -> float:
        """(a): one frame of the whole model."""
        assert self.raw is not None
        t0 = time.perf_counter()
        self.raw.send(b"get")
        if not self.raw.poll(int(self.timeout_s * 1000)):
            raise TimeoutError("raw fetch: no reply")
        got = self.raw.recv_into(self.raw_buffer)
        ms = (time.perf_counter() - t0) * 1000.0
        if got != self.nbytes:
            raise RuntimeError(f"raw fetch: {got} bytes, expected {self.nbytes}")
        return ms

    def raw_chunked(self) -> float:
        """(a2): one message per chunk, each received into its place as it lands."""
        assert self.raw is not None
        t0 = time.perf_counter()
        self.raw.send(b"chunks")
        for start in range(0, self.nbytes, CHUNK_BYTES):
            if not self.raw.poll(int(self.timeout_s * 1000)):
                raise TimeoutError("raw chunked fetch: no reply")
            end = min(start + CHUNK_BYTES, self.nbytes)
            if self.raw.recv_into(self.raw_buffer[start:end]) != end - start:
                raise RuntimeError("raw chunked fetch: a chunk of the wrong size")
        return (time.perf_counter() - t0) * 1000.0

    def gloo(self) -> float:
        import torch.distributed as dist

        self.peer.send("gloo")
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(self.tensor)
        ms = (time.perf_counter() - t0) * 1000.0
        self.peer.answer("gloo", self.timeout_s)
        return ms

    def exchange(self, wire: str, step_s: float = 0.0, busy: bool = False) -> dict[str, float]:
        """One update_send (+ a step of ``step_s``) + update_wait; the exchange record's timings."""
        conn = self.conns[wire]
        ready_ms = self.peer.call("publish", index=list(self.conns).index(wire))["ready_ms"]
        send_ms = _timed(lambda: conn.update_send(self.params, 1.0))
        if step_s > 0:
            _step(step_s, busy)
        factor = conn.update_wait(1.0)
        record = conn.last_exchange or {}
        if factor != 0.5 or record.get("status") != "ok":
            raise RuntimeError(f"dpwa exchange ({wire}) did not mix: {record}")
        return {
            "send_ms": send_ms,
            "fetch_ms": float(record["fetch_ms"]),
            "mix_ms": float(record.get("mix_ms", math.nan)),
            "wait_ms": float(record.get("wait_ms", math.nan)),
            "bytes": float(record["bytes"]),
            "ready_ms": float(ready_ms),
        }

    def push(self) -> dict[str, float]:
        """(d): one push of the trainer's model to the peer (start to ACK), and the peer folding it in."""
        conn = self.push_conn
        conn.update_send(self.push_params, 1.0)
        conn.update_wait(1.0)  # pushsum, overlap 0: returns once the push is acknowledged
        record = conn.last_exchange or {}
        if record.get("pushed") != 1 or record.get("returned") or record.get("unacked"):
            raise RuntimeError(f"dpwa push was not delivered: {record}")
        fold = self.peer.call("fold", self.timeout_s)
        if fold.get("received") != 1:
            raise RuntimeError(f"the peer folded {fold.get('received')} pushes, expected 1")
        return {"push_ms": float(record["push_ms"]), "fold_ms": float(fold["mix_ms"])}

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns = {}
        if self.push_conn is not None:
            self.push_conn.close()
            self.push_conn = None
        if self.raw is not None:
            self.raw.close(linger=0)
            self.raw = None
        with contextlib.suppress(Exception):
            if self.peer.proc.poll() is None:
                self.peer.call("teardown", timeout_s=30)


_STEP_INPUT = np.random.default_rng(5).standard_normal(1 << 14).astype(np.float32)


def _step(seconds: float, busy: bool) -> None:
    """The simulated training step: a sleep, or ``busy``: one thread computing (numpy ``exp``, no BLAS threads)."""
    if not busy:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    out = np.empty_like(_STEP_INPUT)
    while time.perf_counter() < end:
        np.exp(_STEP_INPUT, out=out)


def _rotate(items: Sequence[Any], k: int) -> list[Any]:
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


def measure_size(
    ctx: zmq.Context,
    peer: PeerProcess,
    n: int,
    wires: Sequence[str],
    repeat: int,
    gloo: bool,
    step_factor: float,
    busy: bool = False,
) -> list[dict[str, Any]]:
    """Every measurement for one model size, interleaved; one row (medians and samples) per wire dtype."""
    size = _Size(ctx, peer, n, wires, gloo)
    try:
        common: dict[str, list[float]] = {
            "memcpy_ms": [],
            "a_ms": [],
            "a2_ms": [],
            "c_ms": [],
            "push_ms": [],
            "fold_ms": [],
        }
        per: dict[str, dict[str, list[float]]] = {
            w: {k: [] for k in ("send_ms", "fetch_ms", "mix_ms", "step_ms", "wait_ms", "bytes", "ready_ms")}
            for w in wires
        }
        for _ in range(WARMUP_ROUNDS):
            size.memcpy()
            size.raw_fetch()
            size.raw_chunked()
            for w in wires:
                size.exchange(w)
            if size.push_conn is not None:
                size.push()
            if gloo:
                size.gloo()
        tasks: list[tuple[str, str | None]] = [("memcpy", None), ("a", None), ("a2", None)]
        if size.push_conn is not None:
            tasks.append(("d", None))
        tasks += [("b", w) for w in wires] + [("step", w) for w in wires]
        if gloo:
            tasks.append(("c", None))
        for r in range(repeat):
            for kind, w in _rotate(tasks, r):
                if kind == "memcpy":
                    common["memcpy_ms"].append(size.memcpy())
                elif kind == "a":
                    common["a_ms"].append(size.raw_fetch())
                elif kind == "a2":
                    common["a2_ms"].append(size.raw_chunked())
                elif kind == "c":
                    common["c_ms"].append(size.gloo())
                elif kind == "d":
                    got = size.push()
                    common["push_ms"].append(got["push_ms"])
                    common["fold_ms"].append(got["fold_ms"])
                elif kind == "b":
                    assert w is not None
                    got = size.exchange(w)
                    for key in ("send_ms", "fetch_ms", "mix_ms", "bytes", "ready_ms"):
                        per[w][key].append(got[key])
                else:  # a step longer than the exchange: the fetch should be over before update_wait
                    assert w is not None
                    fetched = per[w]["fetch_ms"] or [10.0]
                    step_s = max(0.005, step_factor * _median(fetched) / 1000.0)
                    got = size.exchange(w, step_s, busy)
                    per[w]["step_ms"].append(step_s * 1000.0)
                    per[w]["wait_ms"].append(got["wait_ms"])
        return [_row(n, w, {k: _median(v) for k, v in common.items()}, per[w], common) for w in wires]
    finally:
        size.close()


def _median_ratio(top: Sequence[float], bottom: Sequence[float]) -> float:
    """The median of ``top[i] / bottom[i]`` over the rounds both were measured in (NaN when none)."""
    return _median([t / b for t, b in zip(top, bottom) if b > 0 and math.isfinite(t) and math.isfinite(b)])


def _ok(value: float, limit: float) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return "✓" if value <= limit else "✗"


def _row(
    n: int, wire: str, med: dict[str, float], samples: dict[str, list[float]], common: dict[str, list[float]]
) -> dict[str, Any]:
    m = {k: _median(v) for k, v in samples.items()}
    nbytes = n * 4
    fetch, mix = m["fetch_ms"], m["mix_ms"]
    c = med["c_ms"]
    row: dict[str, Any] = {
        "floats": n,
        "wire": wire,
        "model_mb": nbytes / 1e6,
        "wire_mb": m["bytes"] / 1e6,
        "memcpy_ms": med["memcpy_ms"],
        "a_ms": med["a_ms"],
        "a_mbs": nbytes / 1e3 / med["a_ms"],
        "a2_ms": med["a2_ms"],
        "send_ms": m["send_ms"],
        "ready_ms": m["ready_ms"],
        "fetch_ms": fetch,
        "fetch_mbs": m["bytes"] / 1e3 / fetch,
        "mix_ms": mix,
        "c_ms": c,
        "c_mbs": nbytes / 1e3 / c if c == c else math.nan,
        "step_ms": m["step_ms"],
        "wait_ms": m["wait_ms"],
        "push_ms": med["push_ms"] if wire == "float32" else math.nan,
        "fold_ms": med["fold_ms"] if wire == "float32" else math.nan,
    }
    # Ratios: the median over rounds of each round's ratio. A round measures everything within a second or
    # so, so a load change on the shared machine between rounds cancels out of its ratios.
    fetches, mixes = samples["fetch_ms"], samples["mix_ms"]
    row["fetch_a"] = _median_ratio(fetches, common["a_ms"])
    row["fetch_a2"] = _median_ratio(fetches, common["a2_ms"])
    row["fm_c"] = _median_ratio([f + x for f, x in zip(fetches, mixes)], common["c_ms"])
    row["send_memcpy"] = _median_ratio(samples["send_ms"], common["memcpy_ms"])
    row["mix_memcpy"] = _median_ratio(mixes, common["memcpy_ms"])
    row["block"] = _median_ratio(samples["wait_ms"], samples["step_ms"])
    pushes = [p + f for p, f in zip(common["push_ms"], common["fold_ms"])]
    row["push_fetch"] = (
        _median_ratio(pushes, [f + x for f, x in zip(fetches, mixes)]) if wire == "float32" else math.nan
    )
    row["ok_fetch_a"] = _ok(row["fetch_a"], TARGETS["fetch_a"]) if wire == "float32" else "-"
    row["ok_fetch_a2"] = _ok(row["fetch_a2"], TARGETS["fetch_a"]) if wire == "float32" else "-"
    row["ok_fm_c"] = _ok(row["fm_c"], TARGETS["fm_c_32" if wire == "float32" else "fm_c_16"])
    row["ok_send"] = _ok(row["send_memcpy"], TARGETS["send_memcpy"])
    row["ok_mix"] = _ok(row["mix_memcpy"], TARGETS["mix_memcpy"])
    row["ok_block"] = _ok(row["block"], TARGETS["block"])
    row["ok_push"] = _ok(row["push_fetch"], TARGETS["push_fetch"])
    row["samples"] = {**common, **samples}
    return row


ABSOLUTE = [
    Column("floats", "floats", ","),
    Column("wire", "wire"),
    Column("wire_mb", "wire MB", ".1f"),
    Column("memcpy_ms", "memcpy ms", ".1f"),
    Column("a_ms", "(a) raw ms", ".1f"),
    Column("a_mbs", "(a) MB/s", ".0f"),
    Column("a2_ms", "(a2) ms", ".1f"),
    Column("fetch_ms", "(b) fetch ms", ".1f"),
    Column("fetch_mbs", "fetch MB/s", ".0f"),
    Column("mix_ms", "mix ms", ".1f"),
    Column("send_ms", "send ms", ".1f"),
    Column("ready_ms", "peer ready ms", ".1f"),
    Column("c_ms", "(c) gloo ms", ".1f"),
    Column("c_mbs", "(c) MB/s", ".0f"),
    Column("push_ms", "(d) push ms", ".1f"),
    Column("fold_ms", "fold ms", ".1f"),
    Column("step_ms", "step ms", ".1f"),
    Column("wait_ms", "wait ms", ".2f"),
]
RATIOS = [
    Column("floats", "floats", ","),
    Column("wire", "wire"),
    Column("fetch_a", "fetch/a", ".2f"),
    Column("ok_fetch_a", "<=1.15"),
    Column("fetch_a2", "fetch/a2", ".2f"),
    Column("ok_fetch_a2", "<=1.15 "),
    Column("fm_c", "(fetch+mix)/c", ".2f"),
    Column("ok_fm_c", "<=1.1|0.7"),
    Column("send_memcpy", "send/memcpy", ".2f"),
    Column("ok_send", "<=1.2"),
    Column("mix_memcpy", "mix/memcpy", ".2f"),
    Column("ok_mix", "<=1.5"),
    Column("block", "wait/step", ".3f"),
    Column("ok_block", "<0.05"),
    Column("push_fetch", "(push+fold)/(fetch+mix)", ".2f"),
    Column("ok_push", "<=1.1"),
]


def _finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinity (a skipped measurement) replaced by None: strict JSON."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The two tables: absolute figures (medians), then the target ratios."""
    return render_table(rows, ABSOLUTE) + "\n\n" + render_table(rows, RATIOS)


def plot_rows(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """A bar chart (ms, log scale) per model size: memcpy, (a), (b) fetch+mix per wire dtype, (c)."""
    from matplotlib.figure import Figure  # the optional extra

    sizes = sorted({r["floats"] for r in rows})
    fig = Figure(figsize=(4 + 3 * len(sizes), 4.5))
    ax = fig.add_subplot()
    labels: list[str] = ["memcpy", "(a) raw", "(a2) raw chunked"]
    labels += [f"(b) {w}" for w in dict.fromkeys(r["wire"] for r in rows)] + ["(c) gloo"]
    width = 0.8 / len(labels)
    for i, n in enumerate(sizes):
        these = [r for r in rows if r["floats"] == n]
        first = these[0]
        values = [first["memcpy_ms"], first["a_ms"], first["a2_ms"]]
        values += [r["fetch_ms"] + r["mix_ms"] for r in these] + [first["c_ms"]]
        for j, v in enumerate(values):
            ax.bar(i + j * width, v, width, color=f"C{j}", label=labels[j] if i == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [f"{n:,} floats" for n in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("ms (median)")
    ax.set_title("one exchange: dpwa fetch+mix vs raw pyzmq and gloo all_reduce")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


@contextlib.contextmanager
def _peer(ctx: zmq.Context) -> Iterator[PeerProcess]:
    """The peer process, stopped on the way out whatever happened (SIGTERM too)."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, on_term)
    peer = PeerProcess(ctx)
    try:
        yield peer
    finally:
        peer.stop()
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def run_exchange(
    floats: Sequence[int],
    repeat: int,
    wires: Sequence[str],
    *,
    gloo: bool = True,
    step_factor: float = 2.0,
    busy: bool = False,
    echo: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run the whole benchmark; returns one row per (size, wire dtype)."""
    if gloo:
        try:
            import torch.distributed as dist

            gloo = dist.is_available() and dist.is_gloo_available()
        except ImportError:
            gloo = False
        if not gloo:
            echo("torch.distributed with gloo is not available: (c) is skipped")
    rows: list[dict[str, Any]] = []
    ctx = zmq.Context()
    try:
        with _peer(ctx) as peer, _gloo_group(peer, gloo):
            for n in floats:
                echo(f"measuring {n:,} floats ...")
                t0 = time.monotonic()
                got = measure_size(ctx, peer, n, wires, repeat, gloo, step_factor, busy)
                rows.extend(got)
                echo(f"{n:,} floats: {len(got)} rows in {time.monotonic() - t0:.1f} s")
    finally:
        ctx.destroy(linger=0)  # never blocks, even if an interrupt left a socket open
    return rows


@contextlib.contextmanager
def _gloo_group(peer: PeerProcess, gloo: bool) -> Iterator[None]:
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
        _gloo_init(0, port)
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


@click.command("exchange")
@click.option("--floats", "floats", default="1M,10M,25M", show_default=True, callback=_counts,
              help="Model sizes in float32 elements, comma-separated; k/M/G suffixes.")  # fmt: skip
@click.option("--repeat", default=9, show_default=True, type=click.IntRange(1, 1000), help="Timed rounds per size.")
@click.option("--wire-dtype", "wires", default=",".join(WIRE_DTYPES), show_default=True, callback=_dtypes,
              help="Wire dtypes of (b), comma-separated.")  # fmt: skip
@click.option("--step-factor", default=2.0, show_default=True, type=click.FloatRange(1.0, 100.0),
              help="The simulated step of the overlap measurement, in multiples of the median fetch.")  # fmt: skip
@click.option("--step", "step_kind", type=click.Choice(["sleep", "busy"]), default="sleep", show_default=True,
              help="The simulated step: a sleep, or one thread computing (it takes a core).")  # fmt: skip
@click.option("--no-gloo", is_flag=True, help="Skip (c).")
@click.option("--run-dir", default=None, type=click.Path(file_okay=False), help="Default runs/bench-exchange-<time>.")
@click.option("--plot", is_flag=True, help="Also write exchange.png (needs matplotlib).")
def exchange(
    floats: list[int],
    repeat: int,
    wires: list[str],
    step_factor: float,
    step_kind: str,
    no_gloo: bool,
    run_dir: str | None,
    plot: bool,
) -> None:
    """One exchange through dpwa vs raw pyzmq (a) and gloo all_reduce (c), and a push (d), two local processes."""
    if plot:
        try:
            import matplotlib  # noqa: F401 - the optional extra
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'dpwa[plot]'") from None
    directory = bench_run_dir("exchange", run_dir)
    settings = {"floats": floats, "repeat": repeat, "wire_dtypes": wires, "step_factor": step_factor, "step": step_kind,
                "gloo": not no_gloo, "warmup_rounds": WARMUP_ROUNDS, "targets": TARGETS}  # fmt: skip
    try:
        rows = run_exchange(
            floats, repeat, wires, gloo=not no_gloo, step_factor=step_factor, busy=step_kind == "busy", echo=click.echo
        )
    except KeyboardInterrupt:
        click.echo("interrupted: the peer process has been stopped", err=True)
        sys.exit(130)
    settings["casts"] = "torch" if "torch" in sys.modules else "numpy"  # dpwa.node.wire's 16-bit rounding backend
    report = Report("exchange", rows=[_finite_or_none(r) for r in rows], settings=settings)
    path = report.write(directory)
    click.echo("")
    click.echo(render(rows))
    click.echo(f"\nwrote {path}")
    if plot:
        click.echo(f"wrote {plot_rows(rows, directory / 'exchange.png')}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "peer":
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s peer %(levelname)s %(name)s: %(message)s")
        peer_main(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(
            "usage: python -m dpwa.tools.bench.exchange peer ENDPOINT PARENT_PID (started by `dpwa bench exchange`)"
        )
