"""``dpwa bench train``: the analysis on made-up data, and the whole bench at a tiny size (shape and finiteness only).

No figure is asserted here: speed ratios live in the benchmark's output, never in tests.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from dpwa.cli.bench import bench
from dpwa.tools.bench.fingerprint import ParamRecorder, mean_state_at, read_records
from dpwa.tools.bench.train import (
    COLUMNS,
    PhaseResult,
    _factors,
    _rules,
    common_target,
    curve_times,
    median_rows,
    pooled_loss,
    time_to_target,
)
from dpwa.tools.bench.trainworker import SharedCounter, Straggler

ROW_KEYS = {c.key for c in COLUMNS} - {"x_samples_per_s", "x_time_to_target", "accuracy_points", "straggler_steps"}
FINITE = ("samples_per_s", "wall_s", "final_loss", "final_batch_loss", "accuracy", "target_loss", "cpu_s")


# --------------------------------------------------------------------------- analysis


def test_pooled_loss_merges_nodes_in_time_order_and_averages_a_window() -> None:
    t, v = pooled_loss([np.array([0.0, 2.0]), np.array([1.0, 3.0])], [np.array([4.0, 2.0]), np.array([3.0, 1.0])], 2)
    assert t.tolist() == [1.0, 2.0, 3.0]
    assert v.tolist() == [3.5, 2.5, 1.5]


def test_pooled_loss_with_fewer_batches_than_the_window_averages_them_all() -> None:
    t, v = pooled_loss([np.array([0.0, 1.0])], [np.array([2.0, 4.0])], 50)
    assert t.tolist() == [1.0] and v.tolist() == [3.0]
    t, v = pooled_loss([], [], 5)
    assert len(t) == len(v) == 0


def test_time_to_target_is_the_first_crossing_or_none() -> None:
    t = np.array([0.0, 1.0, 2.0, 3.0])
    loss = np.array([2.0, 1.0, 0.5, 0.4])
    assert time_to_target(t, loss, 0.5) == 2.0
    assert time_to_target(t, loss, 5.0) == 0.0
    assert time_to_target(t, loss, 0.1) is None


def _phase(curve: list[float]) -> PhaseResult:
    empty = np.empty(0)
    return PhaseResult("x", 0.0, 1.0, 1, {}, [], [], empty, empty, np.arange(len(curve), dtype=float), np.array(curve))


def test_common_target_is_the_lowest_loss_every_method_reaches() -> None:
    a, b = _phase([2.0, 1.0, 0.3]), _phase([2.0, 0.6, 0.5, 0.55])
    target = common_target([a, b])
    assert target == 0.5
    assert time_to_target(a.curve_t, a.curve_loss, target) is not None
    assert time_to_target(b.curve_t, b.curve_loss, target) is not None


def test_median_rows_take_the_median_of_each_figure_over_runs() -> None:
    runs = [
        [{"scenario": "none", "method": "ddp", "run": i, "samples_per_s": v, "order": "a", "x": None}]
        for i, v in ((1, 1.0), (2, 5.0), (3, 2.0))
    ]
    (row,) = median_rows(runs)
    assert row == {"scenario": "none", "method": "ddp", "run": "median", "samples_per_s": 2.0}


def test_parameter_records_round_trip_and_the_mean_at_a_time(tmp_path: Path) -> None:
    recorders = [ParamRecorder(tmp_path / f"w{i}.params.bin", 3, every=2) for i in range(2)]
    for step in range(5):
        for i, rec in enumerate(recorders):
            rec.maybe_record(step, np.full(3, step + 10 * i, dtype=np.float32))
    for rec in recorders:
        rec.close()
    records = [read_records(tmp_path / f"w{i}.params.bin", 3) for i in range(2)]
    assert [r["step"].tolist() for r in records] == [[0, 2, 4], [0, 2, 4]]
    stacked, mean = mean_state_at(records, records[0]["time"][0] - 1.0)  # before any record: the first one
    assert stacked.shape == (2, 3) and mean.tolist() == [5.0, 5.0, 5.0]
    _, mean = mean_state_at(records, max(r["time"][-1] for r in records))
    assert mean.tolist() == [9.0, 9.0, 9.0]
    assert len(curve_times(records, 0.0, 2)) == 2


def test_a_torn_last_record_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "w.params.bin"
    rec = ParamRecorder(path, 4, every=1)
    rec.record(0, np.zeros(4, dtype=np.float32))
    rec.close()
    with open(path, "ab") as handle:
        handle.write(b"\0" * 7)
    assert len(read_records(path, 4)) == 1


def test_straggler_factors_parse_and_reject_bad_lists() -> None:
    assert _factors("1, 4") == [1.0, 4.0]
    for bad in ("", "0.5", "x", "1,nan"):
        with pytest.raises(click.BadParameter):
            _factors(bad)


def test_the_straggler_sleeps_k_minus_1_times_its_typical_step() -> None:
    straggler = Straggler(3.0)
    for busy in (0.05, 0.001, 0.001, 0.001, 0.001, 0.002):  # a slow first step sets the pace once only
        straggler.after_step(busy)
    assert straggler.slept == pytest.approx(2 * 0.05 + 5 * 2 * 0.001)
    assert Straggler(1.0).slept == 0.0


def test_shared_counter_sums_every_nodes_slot(tmp_path: Path) -> None:
    a, b = SharedCounter(tmp_path / "c", 2, 0), SharedCounter(tmp_path / "c", 2, 1)
    a.add(32)
    b.add(64)
    b.add(64)
    assert a.total() == b.total() == 160
    a.close()
    b.close()


# --------------------------------------------------------------------------- the bench


@pytest.mark.slow  # 10-15 s here: two gloo workers and dpwa nodes
@pytest.mark.integration
def test_bench_train_tiny_run_writes_a_table_json_and_plot(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["train", "--nodes", "2", "--steps", "30", "--straggler", "2", "--run-dir", str(run_dir), "--plot"]
    args += ["--rules", "constant,pushsum,adpsgd"]  # a pull, a push and an exchange rule beside DDP
    args += ["--timeout-s", "100"]  # generous: other jobs may load the machine; usually ~10 s
    args += ["--partition", "classes:5"]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "samples/s" in result.output and "to target s" in result.output

    doc = json.loads((run_dir / "train.json").read_text())
    assert doc["benchmark"] == "train"
    assert {"cores", "date"} <= set(doc["machine"])
    assert doc["settings"]["nodes"] == 2
    rows = doc["rows"]
    methods = [(r["scenario"], r["method"]) for r in rows]
    assert methods == [("2x", m) for m in ("ddp", "dpwa-constant", "dpwa-pushsum", "dpwa-adpsgd")]
    for row in rows:
        assert ROW_KEYS <= set(row)
        for key in FINITE:
            assert math.isfinite(row[key]), (key, row)
        assert row["samples"] >= 2 * 30 * 32
        assert row["time_to_target_s"] is not None and math.isfinite(row["time_to_target_s"])
    for row in rows[1:]:  # dpwa rows carry their ratios to DDP, and they mixed
        assert math.isfinite(row["x_samples_per_s"]) and math.isfinite(row["accuracy_points"])
        assert row["straggler_steps"] >= 1 and row["mixes_per_step"] > 0
    assert rows[0]["straggler_steps"] == 30
    assert (run_dir / "train.png").stat().st_size > 0
    assert doc["settings"]["rules"] == ["constant", "pushsum", "adpsgd"]
    assert doc["settings"]["partition"] == "classes:5"
    held = {}
    for path in sorted(run_dir.rglob("*.data.json")):  # every worker wrote its data: five classes of its own
        data = json.loads(path.read_text())
        assert data["partition"] == "classes:5" and sum(data["classes"]) == data["samples"]
        held.setdefault(data["node"], {c for c, n in enumerate(data["classes"]) if n})
        assert {c for c, n in enumerate(data["classes"]) if n} == held[data["node"]]
    assert sorted(held) == ["w1", "w2"] and all(len(c) == 5 for c in held.values())
    assert not held["w1"] & held["w2"]
    for method in ("dpwa-constant", "dpwa-pushsum", "dpwa-adpsgd", "ddp"):
        assert (run_dir / "straggler-2x" / method / "w1.model.npz").exists()
    pushsum = yaml.safe_load((run_dir / "straggler-2x" / "dpwa-pushsum.yaml").read_text())
    assert pushsum["interpolation"] == "pushsum"  # each rule trains from a cluster file of its own


def test_rules_are_checked() -> None:
    assert _rules("constant, adpsgd") == ["constant", "adpsgd"]
    for bad in ("", "constant,constant", "sgp"):
        with pytest.raises(click.BadParameter):
            _rules(bad)


def _workers_of(run_dir: Path) -> list[int]:
    """Pids of live processes whose command line mentions ``run_dir`` (the bench's workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"dpwa.tools.bench.trainworker" in cmdline and str(run_dir).encode() in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.mark.slow  # 10-15 s here: two gloo workers and dpwa nodes
@pytest.mark.integration
def test_sigint_stops_every_worker(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "dpwa.cli", "bench", "train", "--nodes", "2", "--steps", "1000000"]
    argv += ["--straggler", "1", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 40
        metrics = run_dir / "straggler-1x" / "dpwa-constant" / "w1.metrics.jsonl"
        while not (metrics.exists() and metrics.stat().st_size > 0):  # training has begun
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the workers did not start training within 40 s"
            time.sleep(0.1)
        assert len(_workers_of(run_dir)) == 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert b"interrupted" in err
    assert _workers_of(run_dir) == []
