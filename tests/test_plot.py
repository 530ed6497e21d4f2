"""`dpwa plot RUN_DIR`: a PNG that opens, clear one-line errors, and the one line when matplotlib is missing."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dpwa.cli import app as cli
from dpwa.tools.plot import LATENCY_TITLES, MISSING_MATPLOTLIB, latency_kind, moving_average, reported, series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(path: Path, nodes: tuple[str, ...] = ("w2", "w10", "w1"), steps: int = 60) -> Path:
    """A run directory as `dpwa run` leaves it: cluster.yaml and one metrics file per node."""
    path.mkdir()
    doc = {"nodes": [{"name": n, "host": "localhost", "port": 46000 + i} for i, n in enumerate(nodes)]}
    (path / "cluster.yaml").write_text(yaml.safe_dump(doc))
    for i, name in enumerate(nodes):
        lines = []
        for step in range(1, steps + 1):
            ok = step % 7 != 0
            lines.append(
                json.dumps(
                    {
                        "time": 1000.0 + 0.1 * step + i,
                        "node": name,
                        "step": step,
                        "loss": 2.0 / step + 0.01 * i,
                        "factor": 0.5 if ok else 0.0,
                        "peer": "w1",
                        "status": "ok" if ok else "timeout",
                        "bytes": 4096,
                        "fetch_ms": 1.0 + (step % 5) if ok else 500.0,
                        "clock_gap": 0.0,
                    }
                )  # fmt: skip
            )
        lines.append(json.dumps({"time": 2000.0, "node": name, "event": "report", "accuracy": 0.9}))
        (path / f"{name}.metrics.jsonl").write_text("\n".join(lines) + '\n{"time": 2001, "st')  # torn last line
    return path


def test_plot_writes_a_png_that_opens(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    run_dir = fake_run(tmp_path / "run")
    result = CliRunner().invoke(cli.main, ["plot", str(run_dir)])
    assert result.exit_code == 0, result.output
    png = run_dir / "plot.png"
    assert result.stdout == f"{png}\n"
    assert png.read_bytes().startswith(PNG_MAGIC)
    pixels = image.imread(png)
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 3 * pixels.shape[0] // 2  # three panels side by side
    assert pixels.std() > 0.05  # something was drawn

    out = tmp_path / "elsewhere" / "p.png"
    assert CliRunner().invoke(cli.main, ["plot", str(run_dir), "-o", str(out)]).exit_code == 0
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_the_moving_average_takes_each_window_from_its_own_values() -> None:
    """A running sum carried one huge value's rounding into every later window (1e17 then 1.0s averaged to 0.0)
    and one infinity into all of them."""
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([1e17] + [1.0] * 40, 20)[-1] == 1.0
    assert moving_average([math.inf] + [1.0] * 5, 2)[-1] == 1.0
    assert moving_average([], 5) == [] and moving_average([2.0], 5) == [2.0]


def test_series_skips_reports_and_bad_values_and_counts_only_ok_fetches() -> None:
    records = [
        {"time": 10.0, "step": 1, "loss": 2.0, "factor": 0.5, "status": "ok", "fetch_ms": 3.0},
        {"time": 11.0, "step": 2, "loss": None, "factor": 0.0, "status": "timeout", "fetch_ms": 500.0},
        {"time": 12.0, "event": "report", "accuracy": 0.9, "loss": 1.0, "step": 9},
        {"time": 13.0, "step": 3, "loss": 1.0, "factor": 0.5, "status": "timeout,ok", "fetch_ms": 7.0,
         "distance": 0.02},
        {"time": 14.0, "step": 4, "loss": 1.0, "factor": 0.5, "status": "ok", "fetch_ms": 2.0, "distance": None},
        {"time": 15.0, "event": "report", "accuracy": 0.95, "note": "text"},
    ]  # fmt: skip
    cols = series(records, t0=10.0)
    assert cols == {"step": [1, 3, 4], "loss": [2.0, 1.0, 1.0], "time": [0.0, 1.0, 3.0, 4.0],
                    "factor": [0.5, 0.0, 0.5, 0.5], "fetch_ms": [3.0, 7.0, 2.0], "push_ms": [],
                    "distance_step": [3], "distance": [0.02]}  # fmt: skip
    assert latency_kind({"w1": cols}) == "fetch"
    # the reports' numbers, at the step the node had reached (the record before them)
    assert reported(records) == {"accuracy": ([2, 4], [0.9, 0.95]), "loss": ([2], [1.0])}  # a "step" is the axis


def test_series_of_a_push_rule_takes_the_push_latency_of_exchanges_that_found_a_push_delivered() -> None:
    """pushsum / osgp records: no fetch (status only ``pushed``), push_ms the slowest push ACKed since the last
    step; one with ``delivered`` 0 (nothing ACKed yet: push_ms 0.0) is not a latency."""
    records = [
        {"time": 10.0, "step": 1, "loss": 2.0, "factor": 0.5, "status": "pushed", "fetch_ms": 0.0,
         "pushed": 1, "delivered": 1, "push_ms": 4.5},
        {"time": 11.0, "step": 2, "loss": 1.5, "factor": 0.0, "status": None, "fetch_ms": 0.0,
         "pushed": 1, "delivered": 0, "push_ms": 0.0},
        {"time": 12.0, "step": 3, "loss": 1.0, "factor": 0.5, "status": "pushed,pushed", "fetch_ms": 0.0,
         "pushed": 1, "delivered": 2, "push_ms": 6.0},
        {"time": 13.0, "step": 4, "loss": 1.0, "factor": 0.5, "status": "pushed", "push_ms": 2.0},  # no delivered
        {"time": 14.0, "step": 5, "loss": 1.0, "factor": 0.5, "status": "pushed", "push_ms": 0.0},
    ]  # fmt: skip
    cols = series(records, t0=10.0)
    assert cols["push_ms"] == [4.5, 6.0, 2.0] and cols["fetch_ms"] == []
    assert latency_kind({"w1": cols, "w2": series([], t0=0.0)}) == "push"
    assert LATENCY_TITLES["push"].startswith("push latency") and LATENCY_TITLES["fetch"].startswith("fetch latency")
    pull = series([{"time": 1.0, "status": "ok", "fetch_ms": 3.0}], t0=0.0)
    assert latency_kind({"w1": cols, "w2": pull}) == "fetch"  # a node with fetches: the fetch latency is shown


def test_plot_of_a_push_rule_run_draws_the_push_latency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figure = pytest.importorskip("matplotlib.figure")
    drawn: list = []
    monkeypatch.setattr(figure.Figure, "savefig", lambda fig, *args, **kwargs: drawn.append(fig))  # keep the figure
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "cluster.yaml").write_text(yaml.safe_dump({"nodes": [{"name": "w1", "host": "localhost", "port": 1}]}))
    records = [
        {"time": 100.0 + step, "node": "w1", "step": step, "loss": 1.0 / step, "factor": 0.5, "status": "pushed",
         "fetch_ms": 0.0, "pushed": 1, "delivered": 1, "push_ms": 1.0 + step % 4}
        for step in range(1, 41)
    ]  # fmt: skip
    metrics = run_dir / "w1.metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert CliRunner().invoke(cli.main, ["plot", str(run_dir)]).exit_code == 0
    latency = drawn[-1].axes[2]
    assert latency.get_title() == LATENCY_TITLES["push"]
    assert len(latency.patches) == 1 and not latency.texts  # one histogram, the node's

    metrics.write_text("".join(json.dumps({**r, "delivered": 0, "push_ms": 0.0}) + "\n" for r in records))
    assert CliRunner().invoke(cli.main, ["plot", str(run_dir)]).exit_code == 0
    latency = drawn[-1].axes[2]  # no push was ever delivered: no histogram, a line saying so
    assert not latency.patches and [t.get_text() for t in latency.texts] == ["no fetch or push latency"]


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = fake_run(tmp_path / "run")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    result = CliRunner().invoke(cli.main, ["plot", str(run_dir)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {MISSING_MATPLOTLIB}\n"
    assert MISSING_MATPLOTLIB == "dpwa plot needs matplotlib: pip install 'dpwa[plot]'"
    assert not (run_dir / "plot.png").exists()


def test_plot_of_a_directory_without_metrics_is_one_error_line(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = CliRunner().invoke(cli.main, ["plot", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path}: no *.metrics.jsonl files (is it a dpwa run directory?)\n"
    result = CliRunner().invoke(cli.main, ["plot", str(tmp_path / "missing")])
    assert result.exit_code == 2 and result.stderr == f"error: {tmp_path / 'missing'}: not a directory\n"
