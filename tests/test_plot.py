"""`dpwa plot RUN_DIR`: a PNG that opens, clear one-line errors, and the one line when matplotlib is missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dpwa.cli import app as cli
from dpwa.tools.plot import MISSING_MATPLOTLIB, series

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


def test_series_skips_reports_and_bad_values_and_counts_only_ok_fetches() -> None:
    records = [
        {"time": 10.0, "step": 1, "loss": 2.0, "factor": 0.5, "status": "ok", "fetch_ms": 3.0},
        {"time": 11.0, "step": 2, "loss": None, "factor": 0.0, "status": "timeout", "fetch_ms": 500.0},
        {"time": 12.0, "event": "report", "accuracy": 0.9, "loss": 1.0, "step": 9},
        {"time": 13.0, "step": 3, "loss": 1.0, "factor": 0.5, "status": "timeout,ok", "fetch_ms": 7.0},
    ]
    cols = series(records, t0=10.0)
    assert cols == {"step": [1, 3], "loss": [2.0, 1.0], "time": [0.0, 1.0, 3.0], "factor": [0.5, 0.0, 0.5],
                    "fetch_ms": [3.0, 7.0]}  # fmt: skip


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
