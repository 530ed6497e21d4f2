"""(b) ``dpwa``: one exchange through dpwa per wire dtype -- the peer serves, the trainer fetches and mixes.

For each wire dtype there is a pair of nodes: the peer's (:func:`serving_node`, fetch probability 0, so it
only serves) and the trainer's (:class:`FetchNodes`). Before each timed exchange the peer publishes a fresh
snapshot (:func:`publish`, untimed: ``peer ready ms``, the serving side's cost, spent during its step in
training); then the trainer times ``update_send`` and reads the fetch and the mix from the exchange record
(``last_exchange["fetch_ms"]``, validation included, and ``["mix_ms"]``). With a simulated step between
``update_send`` and ``update_wait`` (:mod:`dpwa.tools.bench.exchange.overlap`) the record's ``wait_ms`` says
how long ``update_wait`` still waited for the fetch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpwa.config import parse_config
from dpwa.tools.bench.exchange.control import CONTROL_TIMEOUT_S, PeerProcess
from dpwa.tools.bench.exchange.overlap import simulated_step

__all__ = ["FetchNodes", "publish", "serving_node"]


class FetchNodes:
    """The trainer's node per wire dtype, each fetching from its partner on the peer; ``params``: its model."""

    def __init__(self, peer: PeerProcess, params: list[np.ndarray]) -> None:
        self.peer = peer
        self.params = params
        self.conns: dict[str, Any] = {}

    def open(self, wires: Sequence[str], configs: Sequence[str]) -> None:
        """Start the trainer's node ``t`` of each wire dtype's cluster file (in the order the peer gets them)."""
        from dpwa.node.connection import DpwaConnection

        for wire, text in zip(wires, configs):
            self.conns[wire] = DpwaConnection("t", parse_config(text), seed=1)

    def settle(self) -> None:
        """Wait (bounded) until no trainer node still rounds its last snapshot into a narrower wire dtype in the
        background: a converter left running by one exchange would share the cores and the memory bus with the
        next timed one (it slowed the co-located mix, whose fetch takes 2 ms, by 30-50 %)."""
        for wire, conn in self.conns.items():
            if not conn.wait_published(CONTROL_TIMEOUT_S / 2):
                raise TimeoutError(f"the {wire} trainer node's snapshot never became ready on the wire")

    def exchange(self, wire: str, step_s: float = 0.0, busy: bool = False) -> dict[str, float]:
        """One update_send (+ a step of ``step_s``) + update_wait; the exchange record's timings."""
        conn = self.conns[wire]
        ready_ms = self.peer.call("publish", index=list(self.conns).index(wire))["ready_ms"]
        t0 = time.perf_counter()
        conn.update_send(self.params, 1.0)
        send_ms = (time.perf_counter() - t0) * 1000.0
        if step_s > 0:
            simulated_step(step_s, busy)
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

    def close(self) -> None:
        """Close every node."""
        for conn in self.conns.values():
            conn.close()
        self.conns = {}


def serving_node(config: str, model: list[np.ndarray]) -> Any:
    """The peer's node ``p`` of cluster file ``config``, its first snapshot of ``model`` published."""
    from dpwa.node.connection import DpwaConnection

    conn = DpwaConnection("p", parse_config(config), seed=2)
    try:
        conn.update_send(model, 1.0)
    except BaseException:
        conn.close()
        raise
    return conn


def publish(conn: Any, model: list[np.ndarray]) -> float:
    """A fresh snapshot of ``model``, ready on the wire (rounded) as after a step; the milliseconds that took."""
    t0 = time.perf_counter()
    conn.update_send(model, 1.0)
    if not conn.wait_published(CONTROL_TIMEOUT_S / 2):
        raise TimeoutError("the snapshot never became ready on the wire")
    return (time.perf_counter() - t0) * 1000.0
