"""``dpwa bench scale``: the analysis on made-up data, and the bench with 2 nodes (shape and finiteness only)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from dpwa.cli.bench import bench
from dpwa.config import load_config
from dpwa.tools.bench.fingerprint import record_dtype, spread
from dpwa.tools.bench.procs import free_ports, read_rss_kib, write_cluster
from dpwa.tools.bench.scale import COLUMNS, _counts, spread_over_time, summarize

FINITE = (
    "startup_s", "train_s", "rss_mb_mean", "rss_mb_max", "rss_added_mb", "fetch_ms_p50", "fetch_ms_p95",
    "mixes_per_s", "mixes_per_s_node", "mixes_per_step", "cpu_ms_per_step", "spread_max", "spread_final", "accuracy",
    "fds_per_node_max",
)  # fmt: skip


def _records(t0: float, values: list[list[float]]) -> np.ndarray:
    rec = np.zeros(len(values), dtype=record_dtype(2))
    rec["time"] = t0 + np.arange(len(values))
    rec["step"] = np.arange(len(values))
    rec["params"] = np.array(values, dtype=np.float32)
    return rec


def test_spread_is_the_largest_distance_to_the_mean() -> None:
    stacked = np.array([[0.0, 0.0], [2.0, 0.0]])
    distance, relative = spread(stacked, stacked.mean(axis=0))
    assert distance == 1.0 and relative == 1.0


def test_spread_over_time_uses_each_nodes_latest_record() -> None:
    a = _records(100.0, [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    b = _records(100.0, [[1.0, 1.0], [3.0, 3.0], [1.0, 1.0]])
    buckets = spread_over_time([a, b], 100.0, 102.0, 2)
    assert [round(x["t"], 3) for x in buckets] == [1.0, 2.0]
    assert buckets[0]["relative"] == pytest.approx(math.sqrt(2) / math.sqrt(8))  # mean (2, 2), b at (3, 3)
    assert buckets[1]["distance"] == 0.0


def test_summarize_folds_metrics_rss_and_records() -> None:
    go = 1000.0
    metrics = {
        "w1": [
            {"time": go + 1, "step": 1, "status": "ok", "fetch_ms": 2.0},
            {"time": go + 2, "step": 2, "status": "timeout", "fetch_ms": 50.0},
            {"event": "report", "steps": 2, "seconds": 2.0, "cpu_s": 0.01, "mixes_total": 1, "fetches_timed_out": 1,
             "accuracy": 0.5},
        ],
        "w2": [
            {"time": go + 1, "step": 1, "status": "ok", "fetch_ms": 4.0},
            {"event": "report", "steps": 1, "seconds": 1.0, "cpu_s": 0.01, "mixes_total": 1, "accuracy": 0.7},
        ],
    }  # fmt: skip
    ready = {"w1": {"rss_base_kib": 1000}, "w2": {"rss_base_kib": 2000}}
    rss = {"w1": [1024, 2048], "w2": [3072]}
    records = [_records(go, [[1.0, 0.0]]), _records(go, [[1.0, 0.0]])]
    row = summarize(2, metrics, ready, rss, go, records)
    assert row["train_s"] == 2.0 and row["steps_total"] == 3
    assert row["fetch_ms_p50"] == 3.0 and row["fetches_ok"] == 2  # the timed-out fetch is not a latency
    assert row["mixes_per_s"] == 1.0 and row["mixes_per_s_node"] == pytest.approx(0.75)
    assert row["rss_mb_mean"] == 2.5 and row["rss_mb_max"] == 3.0
    assert row["rss_added_mb"] == pytest.approx((1048 + 1072) / 2 / 1024)
    assert row["cpu_ms_per_step"] == pytest.approx((5.0 + 10.0) / 2)
    assert row["timeouts"] == 1 and row["spread_final"] == 0.0
    assert row["node_accuracy_mean"] == pytest.approx(0.6)


def test_node_counts_parse_and_reject_bad_lists() -> None:
    assert _counts("4,8, 16") == [4, 8, 16]
    for bad in ("", "1", "x", "4,-8"):
        with pytest.raises(click.BadParameter):
            _counts(bad)


def test_helpers_write_a_valid_cluster_and_read_rss(tmp_path: Path) -> None:
    ports = free_ports(3)
    assert len(set(ports)) == 3
    config = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=100.0)
    loaded = load_config(tmp_path / "c.yaml")
    assert loaded == config and [n.port for n in loaded.nodes] == ports
    assert loaded.interpolation == "constant" and loaded.timeout_ms == 100.0
    assert (read_rss_kib(os.getpid()) or 0) > 0
    assert read_rss_kib(2**22 + 1) is None


@pytest.mark.integration
@pytest.mark.slow  # 10 s here
def test_bench_scale_two_nodes_writes_a_table_json_and_plot(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["scale", "--nodes", "2", "--steps", "30", "--record-every", "5", "--sample-s", "0.1"]
    args += ["--timeout-s", "100", "--run-dir", str(run_dir), "--plot"]  # generous: a loaded machine; usually ~10 s
    start = time.monotonic()
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "fetch ms p50" in result.output
    doc = json.loads((run_dir / "scale.json").read_text())
    assert doc["benchmark"] == "scale" and doc["settings"]["nodes"] == [2]
    assert {"cores", "date"} <= set(doc["machine"])
    shared, plain = doc["rows"]  # side by side: shared memory on, then off
    assert (shared["shared_memory"], plain["shared_memory"]) == ("auto", "off")
    for row in (shared, plain):
        assert {c.key for c in COLUMNS} <= set(row)
        assert row["nodes"] == 2 and row["steps_total"] == 60
        for key in FINITE:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row[key])
        assert len(row["spread_over_time"]) == 20
        assert all(math.isfinite(b["relative"]) for b in row["spread_over_time"])
        reports = [
            r
            for name in ("w1", "w2")
            for r in map(
                json.loads,
                (run_dir / f"nodes-2-shm-{row['shared_memory']}" / f"{name}.metrics.jsonl").read_text().splitlines(),
            )  # fmt: skip
            if r.get("event") == "report"
        ]
        fetched = [r["shm_fetched"] for r in reports]
        assert len(reports) == 2 and (all(f > 0 for f in fetched) if row is shared else fetched == [0, 0]), reports
    assert shared["total_s"] + plain["total_s"] <= time.monotonic() - start
    assert (run_dir / "scale.png").stat().st_size > 0


def test_spread_over_time_counts_a_visiting_node_only_while_it_is_a_member() -> None:
    a = _records(100.0, [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    visitor = _records(100.5, [[5.0, 5.0]])  # joined at 100.5, left at once
    alone, counted = (spread_over_time([a, visitor], 100.0, 102.0, 2, visiting) for visiting in ([1], []))
    assert alone[1]["distance"] == 0.0  # at 102 the visitor has left: a alone
    assert counted[1]["distance"] > 0.0  # without the window its last model would still count


@pytest.mark.slow
@pytest.mark.integration
def test_bench_scale_with_churn_joins_and_leaves_mid_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["scale", "--nodes", "4", "--churn", "2", "--steps", "60", "--record-every", "5", "--sample-s", "0.1"]
    args += ["--shared-memory", "auto"]
    result = CliRunner().invoke(bench, [*args, "--timeout-s", "150", "--run-dir", str(run_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    still, row = json.loads((run_dir / "scale.json").read_text())["rows"]  # side by side: without, with churn
    assert (still["churn"], still["steps_total"]) == (0, 4 * 60)
    assert row["churn"] == 2 and row["steps_total"] == 2 * 60 + 2 * 20
    steps = run_dir / "nodes-4-churn-2-shm-auto"
    for joiner in ("j1", "j2"):
        report = [r for r in map(json.loads, (steps / f"{joiner}.metrics.jsonl").read_text().splitlines())
                  if r.get("event") == "report"]  # fmt: skip
        assert report and report[0]["joined"] and report[0]["mixes_total"] > 0, report
    events = [r for r in map(json.loads, (steps / "w1.metrics.jsonl").read_text().splitlines())
              if r.get("event") == "member"]  # fmt: skip
    seen = {(e["member"], e["state"]) for e in events}
    assert {("j1", "joined"), ("j2", "joined"), ("j1", "left"), ("j2", "left")} <= seen, seen
    assert math.isfinite(row["spread_max"]) and "churn" in result.output
