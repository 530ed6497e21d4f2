"""The front: the most steps a node has heard of, gossiped as a maximum (``DpwaConnection.front``), and the
``progress`` the PyTorch adapter derives from it for learning-rate schedules (tests/test_schedule_lag.py says why).

Nodes of this process on 127.0.0.1, stepped one at a time from the test's thread: a D-PSGD ring of 4, where
w1 fetches only from w2 and w4, so what it knows of w3 can only come through them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_ports, write_cluster

from adapters.pytorch import DpwaPyTorchAdapter
from dpwa.config import load_config
from dpwa.node.connection import DpwaConnection

pytestmark = pytest.mark.integration


def _step(conn: DpwaConnection, params: list[np.ndarray]) -> None:
    conn.update_send(params, 1.0)
    conn.update_wait(1.0)


def test_the_front_reaches_a_node_through_peers_that_heard_of_it(tmp_path: Path) -> None:
    """w3 runs 10 steps ahead; w2 fetches from it, then publishes; w1, which never fetches from w3, learns
    w3's front from w2. A node's own front counts its update_send calls."""
    cfg = load_config(write_cluster(tmp_path / "c.yaml", free_ports(4), interpolation="dpsgd", timeout_ms=5000))
    conns = [DpwaConnection(f"w{i + 1}", cfg, seed=i) for i in range(4)]
    params = [[np.full(50, float(i))] for i in range(4)]
    try:
        assert [c.front for c in conns] == [0, 0, 0, 0]
        for c, p in zip(conns, params):
            _step(c, p)
        w1, w2, w3, _ = conns
        for _ in range(10):
            _step(w3, params[2])
        assert w3.front == 11 and w1.front < 11
        _step(w2, params[1])  # fetches w3's snapshot (published with front 11)
        assert w2.front == 11
        _step(w2, params[1])  # ... and publishes it
        _step(w1, params[0])  # fetches w2 and w4, never w3
        assert w1.front == 11
        assert "w3" not in w1.stats()["by_peer"]
    finally:
        for c in conns:
            c.close()


def test_the_adapters_progress_is_its_step_or_the_furthest_nodes(tmp_path: Path) -> None:
    """``progress`` before a node's step ``k`` is ``k`` (``step``), unless a peer has started a later step, whose
    index it then is: w2 after w1's 7 steps (w1 is starting its step 7; w2 is about to start its step 0)."""
    cfg = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="constant", timeout_ms=5000)
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    adapters = [DpwaPyTorchAdapter(m, f"w{i + 1}", str(cfg), wait_for_peers_s=0) for i, m in enumerate(models)]
    try:
        w1, w2 = adapters
        for k in range(7):
            assert w1.progress == w1.step == k
            w1.update_send(1.0)
            w1.update_wait(1.0)
        w1.update_send(1.0)  # starts step 7: front 8
        assert w2.progress == 0
        w2.update_send(1.0)
        w2.update_wait(1.0)  # fetched w1's snapshot of its step 7
        assert (w2.step, w2.progress) == (1, 7)
        w1.update_wait(1.0)
    finally:
        for a in adapters:
            a.close()
