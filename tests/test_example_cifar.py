"""examples/pytorch-cifar/train.py --synthetic: two gossiping ResNet-18 nodes for a few steps, without torchvision.

The node processes run with a stand-in ``torchvision`` package first on ``PYTHONPATH`` that records its
import in a marker file and raises, so any import of torchvision on the ``--synthetic`` path fails the test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import free_ports, processes, wait_all, write_cluster

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pytorch-cifar"
STEPS = 3
BATCH = 4
SYNTHETIC = ["--synthetic", "--synthetic-size", "64", "--batch-size", str(BATCH), "--workers", "0"]

GUARD = """\
import os, pathlib
pathlib.Path(os.environ["TORCHVISION_GUARD_MARKER"]).write_text("torchvision was imported")
raise ImportError("this test forbids importing torchvision")
"""


def _load_example(module: str) -> ModuleType:
    """``examples/pytorch-cifar/<module>.py`` imported under a private name."""
    spec = importlib.util.spec_from_file_location(f"example_cifar_{module}", EXAMPLE / f"{module}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _guarded_env(tmp_path: Path, marker: Path, **extra: str) -> dict[str, str]:
    guard = tmp_path / "guard"
    (guard / "torchvision").mkdir(parents=True, exist_ok=True)
    (guard / "torchvision" / "__init__.py").write_text(GUARD)
    path = os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TORCHVISION_GUARD_MARKER": str(marker), **extra}


def _run_nodes(names: list[str], env: dict[str, str], run_dir: Path, args: list[str]) -> None:
    """Start ``train.py`` once per node name and wait for all of them (60 s each at most)."""
    with processes() as procs:
        for name in names:
            with open(run_dir / f"{name}.log", "ab") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, str(EXAMPLE / "train.py"), *args],
                    env={**env, "DPWA_NODE": name},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        wait_all(procs, run_dir)


def test_the_guard_catches_a_torchvision_import(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    result = subprocess.run(
        [sys.executable, "-c", "import torchvision"], env=_guarded_env(tmp_path, marker), capture_output=True
    )
    assert result.returncode != 0 and marker.exists()


@pytest.mark.integration
@pytest.mark.slow  # 11 s here
def test_synthetic_two_nodes_write_loadable_checkpoints(tmp_path: Path) -> None:
    marker = tmp_path / "torchvision-imported"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cluster = write_cluster(tmp_path / "cluster.yaml", free_ports(2), timeout_ms=5000)
    env = _guarded_env(tmp_path, marker, DPWA_CONFIG=str(cluster), DPWA_RUN_DIR=str(run_dir), DPWA_TORCH_THREADS="1")
    _run_nodes(["w1", "w2"], env, run_dir, [*SYNTHETIC, "--steps", str(STEPS), "--checkpoint-every", "2"])
    assert not marker.exists(), "train.py --synthetic imported torchvision"

    resnet = _load_example("resnet")
    for name in ("w1", "w2"):
        state = torch.load(run_dir / f"{name}.checkpoint.pt", weights_only=True)
        assert state["step"] == STEPS and state["node"] == name
        model = resnet.resnet18()
        model.load_state_dict(state["model"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer.load_state_dict(state["optimizer"])
        assert optimizer.state_dict()["state"], "momentum buffers were saved"
        records = [json.loads(line) for line in (run_dir / f"{name}.metrics.jsonl").read_text().splitlines()]
        exchanges = [r for r in records if "event" not in r]
        reports = [r for r in records if r.get("event") == "report"]
        assert len(exchanges) == STEPS and len(reports) == 1
        assert 0.0 <= reports[0]["accuracy"] <= 1.0 and reports[0]["final_loss"] > 0
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")], "a temporary checkpoint was left"


@pytest.mark.slow  # ~7 s here: three runs of the example
@pytest.mark.integration
def test_resume_continues_from_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "torchvision-imported"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))  # train.py puts its own folder first on sys.path
    train = _load_example("train")
    model = train.resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train.save_checkpoint(run_dir / "w1.checkpoint.pt", model, optimizer, step=2, node="w1")

    solo = write_cluster(tmp_path / "solo.yaml", free_ports(1), timeout_ms=5000)
    env = _guarded_env(tmp_path, marker, DPWA_CONFIG=str(solo), DPWA_RUN_DIR=str(run_dir), DPWA_TORCH_THREADS="1")
    _run_nodes(["w1"], env, run_dir, [*SYNTHETIC, "--steps", "3", "--resume"])
    assert not marker.exists()
    assert "resumed from" in (run_dir / "w1.log").read_text()
    assert torch.load(run_dir / "w1.checkpoint.pt", weights_only=True)["step"] == 3
    records = [json.loads(line) for line in (run_dir / "w1.metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "event" not in r]) == 1  # only step 3 was trained
