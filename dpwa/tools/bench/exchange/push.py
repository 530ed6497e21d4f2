"""(d) ``push``: a second pair of nodes, float32 wire, running ``pushsum``; its figures go in the float32 row.

The trainer's node pushes its model to the peer's (:class:`PushNode`): ``push ms`` is the push from its
start to its ACK (send, receive into an inbox slot, validate; ``last_exchange["push_ms"]``), and ``fold
ms`` the peer's ``update_wait`` folding it in (its ``mix_ms``, :func:`fold_and_push_back`). The peer then
pushes half of its mass back, acknowledged before the next round, so nothing else is on the wire and both
weights stay near 1 however many rounds run. ``(push+fold)/(fetch+mix)`` compares it with (b) float32,
round by round. With shared memory on, a second pair pushes co-located (the receiver reads the pusher's
segment), shown in the ``float32+shm`` row against memcpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpwa.config import parse_config
from dpwa.tools.bench.exchange.control import PeerProcess

__all__ = ["PushNode", "fold_and_push_back", "receiving_node"]


class PushNode:
    """The trainer's node of (d), pushing a copy of ``params`` to the peer's receiving node ``index``."""

    def __init__(self, peer: PeerProcess, config: str, params: list[np.ndarray], timeout_s: float, index: int) -> None:
        from dpwa.node.connection import DpwaConnection

        self.peer = peer
        self.index = index
        self.timeout_s = timeout_s
        self.params = [a.copy() for a in params]
        self.conn: Any = DpwaConnection("t", parse_config(config), seed=1)

    def push(self) -> dict[str, float]:
        """(d): one push of the trainer's model to the peer (start to ACK), and the peer folding it in."""
        conn = self.conn
        conn.update_send(self.params, 1.0)
        conn.update_wait(1.0)  # pushsum, overlap 0: returns once the push is acknowledged
        record = conn.last_exchange or {}
        if record.get("pushed") != 1 or record.get("returned") or record.get("unacked"):
            raise RuntimeError(f"dpwa push was not delivered: {record}")
        fold = self.peer.call("fold", self.timeout_s, index=self.index)
        if fold.get("received") != 1:
            raise RuntimeError(f"the peer folded {fold.get('received')} pushes, expected 1")
        return {"push_ms": float(record["push_ms"]), "fold_ms": float(fold["mix_ms"])}

    def close(self) -> None:
        """Close the node."""
        self.conn.close()


def receiving_node(config: str, model: list[np.ndarray]) -> Any:
    """The peer's node of (d): published, pushed to ``t``, and that push settled, so each round starts clean."""
    from dpwa.node.connection import DpwaConnection

    conn = DpwaConnection("p", parse_config(config), seed=2)
    try:
        conn.update_send(model, 1.0)
        conn.update_wait(1.0)
    except BaseException:
        conn.close()
        raise
    return conn


def fold_and_push_back(conn: Any, model: list[np.ndarray]) -> dict[str, Any]:
    """Fold the trainer's push in, then push half of the mass back; the fold's ``mix_ms`` and pushes received."""
    conn.update_wait(1.0)
    record = conn.last_exchange or {}
    answer = {"mix_ms": record.get("mix_ms"), "received": record.get("received", 0)}
    conn.update_send(model, 1.0)
    conn.update_wait(1.0)  # its ACK: nothing is on the wire when the trainer pushes next
    if (conn.last_exchange or {}).get("pushed") != 1:
        raise RuntimeError(f"the peer's push back did not go: {conn.last_exchange}")
    return answer
