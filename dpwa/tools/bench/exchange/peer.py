"""The peer process of ``dpwa bench exchange``: it serves (a) and (b), receives (d) and joins (c), on command.

Started as ``python -m dpwa.tools.bench.exchange peer ENDPOINT PARENT_PID`` (:mod:`dpwa.tools.bench.exchange.control`
describes the channel), it answers one command at a time:

``gloo_init`` (``port``)
    join the gloo group as rank 1 (every later ``setup`` then makes a tensor for (c));
``setup`` (``floats``, ``raw_port``, ``tcp_port``, ``configs``, ``push_config``)
    drop the previous size, then build this one: the model (seed 2), the raw server of (a) on ``raw_port``,
    the plain TCP server of (a3) on ``tcp_port``,
    one serving node per cluster file in ``configs`` (b), the receiving node of (d) when ``push_config``
    is not empty, and (c)'s tensor;
``publish`` (``index``)
    a fresh snapshot on the ``index``-th serving node; answers ``ready_ms``;
``fold``
    (d): fold the trainer's push in and push half back; answers ``mix_ms`` and ``received``;
``gloo``
    the peer's side of one all-reduce;
``teardown``
    drop the current size;
``quit``
    exit (no answer).

It exits on ``quit``, when its parent is gone, or after :data:`~dpwa.tools.bench.exchange.control.PEER_IDLE_S`
without a command.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from dpwa.tools.bench.exchange.control import PEER_IDLE_S, send_message
from dpwa.tools.bench.exchange.fetch import publish, serving_node
from dpwa.tools.bench.exchange.gloo import all_reduce, init_gloo, to_tensor
from dpwa.tools.bench.exchange.pair import make_model
from dpwa.tools.bench.exchange.push import fold_and_push_back, receiving_node
from dpwa.tools.bench.exchange.raw import RawServer, TcpServer

log = logging.getLogger(__name__)

__all__ = ["peer_main"]


class _PeerState:
    """What the peer holds: whether it joined the gloo group, and everything for the current model size."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.gloo = False
        self.conns: list[Any] = []
        self.raw: RawServer | None = None
        self.tcp: TcpServer | None = None
        self.tensor: Any = None
        self.model: list[np.ndarray] = []
        self.pushes: list[tuple[Any, list[np.ndarray]]] = []
        """(d)'s receiving nodes, each with its model: over the socket, then (with shared memory) co-located."""

    def close(self) -> None:
        """Drop the current model size: its nodes, its raw and TCP servers and its tensor."""
        for conn in self.conns:
            conn.close()
        self.conns = []
        for conn, _ in self.pushes:
            conn.close()
        self.pushes = []
        if self.raw is not None:
            self.raw.stop()
            self.raw = None
        if self.tcp is not None:
            self.tcp.stop()
            self.tcp = None
        self.tensor = None


def _gloo_init(state: _PeerState, message: dict[str, Any]) -> dict[str, Any]:
    """Join the gloo group as rank 1."""
    init_gloo(1, message["port"])
    state.gloo = True
    return {}


def _setup(state: _PeerState, message: dict[str, Any]) -> dict[str, Any]:
    """Drop the previous model size and build this one: the raw and TCP servers, the serving nodes, (d)'s node, the
    tensor."""
    state.close()
    model = make_model(message["floats"], seed=2)
    flat = np.concatenate(model)
    state.raw = RawServer(state.ctx, message["raw_port"], flat)
    state.raw.start()
    state.tcp = TcpServer(message["tcp_port"], flat)
    state.tcp.start()
    for text in message["configs"]:
        state.conns.append(serving_node(text, model))
    state.model = model
    for text in message.get("push_configs", ()):
        pushed = [a.copy() for a in model]
        state.pushes.append((receiving_node(text, pushed), pushed))
    if state.gloo:
        state.tensor = to_tensor(flat)
    return {}


def _publish(state: _PeerState, message: dict[str, Any]) -> dict[str, Any]:
    """A fresh snapshot on one serving node; how long it took to be ready on the wire."""
    return {"ready_ms": publish(state.conns[message["index"]], state.model)}


def _fold(state: _PeerState, message: dict[str, Any]) -> dict[str, Any]:
    """(d): fold the trainer's push in (on receiving node ``index``), then push half of the mass back."""
    return fold_and_push_back(*state.pushes[message["index"]])


def _gloo(state: _PeerState, message: dict[str, Any]) -> dict[str, Any]:
    """The peer's side of one all-reduce."""
    all_reduce(state.tensor)
    return {}


def _teardown(state: _PeerState, message: dict[str, Any]) -> dict[str, Any]:
    """Drop the current model size."""
    state.close()
    return {}


_COMMANDS: dict[str, Callable[[_PeerState, dict[str, Any]], dict[str, Any]]] = {
    "gloo_init": _gloo_init,
    "setup": _setup,
    "publish": _publish,
    "fold": _fold,
    "gloo": _gloo,
    "teardown": _teardown,
}


def _answer(state: _PeerState, op: str, message: dict[str, Any]) -> dict[str, Any]:
    """Run command ``op``; its answer, or ``ok`` false with the error when it raised."""
    try:
        command = _COMMANDS.get(op)
        if command is None:
            raise ValueError(f"unknown command {op!r}")
        return {"ok": True, **command(state, message)}
    except Exception as exc:  # report it to the trainer side, which stops the run
        log.exception("bench peer: %s failed", op)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _serve(sock: zmq.Socket, state: _PeerState, parent: int) -> None:
    """Answer commands until ``quit``, until process ``parent`` is gone, or until PEER_IDLE_S without one."""
    idle_since = time.monotonic()
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
        send_message(sock, _answer(state, op, message))


def peer_main(endpoint: str, parent: int) -> None:
    """The peer: serves (a) and (b) and joins (c), on command from ``endpoint``; exits with its parent."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    state = _PeerState(ctx)
    send_message(sock, {"ok": True})
    try:
        _serve(sock, state, parent)
    except KeyboardInterrupt:
        pass
    finally:
        state.close()
        if state.gloo:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        sock.close(linger=0)
        ctx.term()
