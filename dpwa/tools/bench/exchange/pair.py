"""What both sides of ``dpwa bench exchange`` build alike: the model and the cluster file of a pair of nodes.

Every dpwa pair of the benchmark is the trainer's node ``t`` and the peer's node ``p`` on loopback; the
trainer builds its model with seed 1, the peer with seed 2, so a mix always moves the values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import numpy as np

from dpwa.config import ClusterConfig, yaml12

__all__ = ["SHARED", "make_model", "pair_config", "wire_of"]

SHARED = "float32+shm"
"""The variant of (b) whose pair exchanges through shared memory (float32 wire); every other pair uses sockets."""


def wire_of(variant: str) -> str:
    """The wire dtype of a variant of (b): its name, or float32 for :data:`SHARED`."""
    return "float32" if variant == SHARED else variant


def pair_config(wire: str, ports: Sequence[int], n: int, fetch_probability: float = 1.0, push: bool = False) -> str:
    """The YAML cluster file of the trainer node ``t`` and the peer node ``p`` for wire dtype ``wire`` (or the
    variant :data:`SHARED`: float32 through shared memory; every other pair has shared memory off).

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
    if "transport" in ClusterConfig.__dataclass_fields__:
        doc["transport"] = {"shared_memory": "auto" if wire == SHARED else "off"}
    elif wire == SHARED:
        raise click.UsageError("this dpwa has no shared memory (transport.shared_memory)")
    wire = wire_of(wire)
    if "wire_dtype" in {f for f in ClusterConfig.__dataclass_fields__}:
        doc["wire_dtype"] = wire
    elif wire != "float32":
        raise click.UsageError(f"this dpwa has no wire_dtype setting; --wire-dtype {wire} is not possible")
    return yaml12.dump(doc, sort_keys=False)


def make_model(n: int, seed: int) -> list[np.ndarray]:
    """A float32 model of ``n`` floats in a few arrays of a realistic spread of sizes (normal values, std 0.05)."""
    rng = np.random.default_rng(seed)
    sizes = [n // 2, n // 4, n // 8]
    sizes.append(n - sum(sizes))
    return [(rng.standard_normal(s, dtype=np.float32) * np.float32(0.05)) for s in sizes if s > 0]
