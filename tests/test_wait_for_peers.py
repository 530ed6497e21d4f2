"""Starting together: the adapter's ``wait_for_peers_s`` / ``wait_for_peers`` and the demo's ``--momentum``
(the settings a user of a short run reaches for; docs: "Short runs" on the Mixing rules page)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from conftest import free_ports, port_is_free, write_cluster

from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.tools import demo


@pytest.mark.integration
def test_the_adapter_waits_for_its_peers_and_names_the_missing_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ports = free_ports(3)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=500)
    with DpwaPyTorchAdapter(torch.nn.Linear(3, 1), "w2", cfg):
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dpwa.adapters.pytorch"):
            adapter = DpwaPyTorchAdapter(torch.nn.Linear(3, 1), "w1", cfg, wait_for_peers_s=2.0)
        try:  # the waits: long enough for w2's answer on a loaded machine (w3's they wait out whole)
            assert time.monotonic() - started >= 2.0  # w3 never starts: the whole wait, then training goes on
            assert "no answer from ['w3']" in caplog.text and "w2" not in caplog.text.split("no answer from")[1]
            assert adapter.wait_for_peers(1.0) == {"w2": True, "w3": False}
        finally:
            adapter.close()
    assert all(port_is_free(p) for p in ports)


@pytest.mark.parametrize("momentum", [-0.1, 1.0, float("nan")])
def test_the_demo_refuses_a_momentum_outside_0_to_1(momentum: float) -> None:
    with pytest.raises(ValueError, match="momentum"):
        demo.TrainConfig(momentum=momentum)
    assert demo.TrainConfig(momentum=0.0).momentum == 0.0
