"""TensorBoard scalars from a run directory (dpwa/tools/tensorboard.py): what becomes a scalar, the event files
read back record by record, ``dpwa plot --tensorboard`` and ``dpwa run --tensorboard`` for real."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_launcher import NODE_SCRIPT

from dpwa.cli import app as cli
from dpwa.launcher.rundir import RunDir
from dpwa.metrics import MetricsWriter
from dpwa.tools.tensorboard import scalars, write_tensorboard

tensorboardX = pytest.importorskip("tensorboardX", reason="the dpwa[tensorboard] extra is not installed")
from tensorboardX.proto.event_pb2 import Event  # noqa: E402 - after the skip

EXCHANGE = {"time": 10.0, "node": "w1", "step": 3, "clock": 3.5, "loss": 0.25, "factor": 0.5, "peer": "w2",
            "status": "ok", "bytes": 4000, "fetch_ms": 2.0, "wait_ms": 0.1, "mix_ms": 0.2, "clock_gap": None,
            "weight": 0.75, "mixes": 2, "failed": 0}  # fmt: skip


def read_events(directory: Path) -> list[Event]:
    """Every event of the one event file in ``directory`` (TFRecord: length, its CRC, data, its CRC)."""
    (path,) = directory.glob("events.out.tfevents.*")
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        event = Event()
        event.ParseFromString(data[at + 12 : at + 12 + length])
        events.append(event)
        at += 12 + length + 4
    return events


def scalar_series(directory: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for event in read_events(directory):
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_which_record_values_become_scalars() -> None:
    assert scalars(EXCHANGE) == {"clock": 3.5, "loss": 0.25, "factor": 0.5, "fetch_ms": 2.0, "wait_ms": 0.1,
                                 "mix_ms": 0.2, "weight": 0.75, "mixes": 2.0, "failed": 0.0,
                                 "mb_per_s": 2.0, "fetch_ms/w2": 2.0}  # fmt: skip
    assert scalars({"event": "member", "member": "j1", "state": "joined", "members": 4}) == {"members": 4.0}
    assert scalars({"event": "report", "time": 1.0, "node": "w1", "accuracy": 0.9, "note": "x"}) == {
        "report/accuracy": 0.9
    }
    assert scalars({"event": "resume", "step": 3}) == {}
    assert "mb_per_s" not in scalars({**EXCHANGE, "bytes": 0})
    assert "fetch_ms/w2" not in scalars({**EXCHANGE, "status": "timeout"})
    assert "loss" not in scalars({**EXCHANGE, "loss": float("nan")})


def test_one_tensorboard_run_per_node_with_every_scalar_at_its_step(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    for name, loss in (("w1", 1.0), ("w2", 2.0)):
        with MetricsWriter(run.metrics_path(name)) as writer:
            writer.write({"time": 1.0, "event": "member", "member": name, "state": "started", "members": 2})
            for step in (1, 2, 3):
                writer.write({**EXCHANGE, "node": name, "step": step, "loss": loss / step})
            writer.write({"time": 5.0, "event": "report", "accuracy": 0.5})
    written = write_tensorboard(run)
    assert [d.name for d in written] == ["w1", "w2"] and all(d.parent == run.path / "tensorboard" for d in written)
    for name, loss in (("w1", 1.0), ("w2", 2.0)):
        series = scalar_series(run.path / "tensorboard" / name)
        assert series["dpwa/loss"] == [(s, pytest.approx(loss / s)) for s in (1, 2, 3)]
        assert series["dpwa/mb_per_s"] == [(s, pytest.approx(2.0)) for s in (1, 2, 3)]
        assert series["dpwa/members"] == [(0, 2.0)] and series["dpwa/weight"][0][1] == pytest.approx(0.75)
    write_tensorboard(run)  # again: each node keeps one event file, replaced
    assert all(len(list(d.glob("events.out.tfevents.*"))) == 1 for d in written)


def test_dpwa_plot_tensorboard_and_its_errors(tmp_path: Path, monkeypatch) -> None:
    run = RunDir(tmp_path / "run")
    with MetricsWriter(run.metrics_path("w1")) as writer:
        writer.write(EXCHANGE)
    result = CliRunner().invoke(cli.main, ["plot", str(run.path), "--tensorboard", "-o", str(tmp_path / "tb")])
    assert result.exit_code == 0 and result.output.strip() == str(tmp_path / "tb" / "w1")
    assert scalar_series(tmp_path / "tb" / "w1")["dpwa/factor"] == [(3, 0.5)]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(cli.main, ["plot", str(empty), "--tensorboard"])
    assert result.exit_code == 2 and "no *.metrics.jsonl files" in result.stderr
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if the extra were not installed
    result = CliRunner().invoke(cli.main, ["plot", str(run.path), "--tensorboard"])
    assert result.exit_code == 2 and result.stderr == "error: TensorBoard files need tensorboardX: pip install " \
        "'dpwa[tensorboard]'\n"  # fmt: skip


@pytest.mark.slow  # several seconds: kept out of the fast subset
@pytest.mark.integration
def test_dpwa_run_tensorboard_writes_each_nodes_scalars(tmp_path: Path) -> None:
    script = tmp_path / "gossip_node.py"
    script.write_text(NODE_SCRIPT)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPWA_", "SLURM_"))}
    done = subprocess.run(
        [sys.executable, "-m", "dpwa.cli", "run", "-n", "2", "--tensorboard", "-q", "--run-dir", str(run_dir),
         str(script), "--steps", "12", "--barrier"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}" in done.stdout
    for name in ("w1", "w2"):
        series = scalar_series(run_dir / "tensorboard" / name)
        assert [step for step, _ in series["dpwa/factor"]] == list(range(1, 13)), series.keys()
