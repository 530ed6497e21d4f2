"""scripts/stress.py (``scripts/test.sh --stress N``): the per-test failure counts and the distribution of the
figures that outcome tests record, end to end on two throw-away tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "stress.py"

SAMPLE_TESTS = """
import os


def test_records_a_figure(record_property):
    record_property("ratio", 0.25)
    record_property("label", "not a number")  # left out of the figures


def test_fails_on_the_second_run(tmp_path_factory):
    marker = os.path.join(os.environ["STRESS_SAMPLE_DIR"], "ran-once")
    if os.path.exists(marker):
        raise AssertionError("second run")
    open(marker, "w").close()
"""


def load_stress():
    spec = importlib.util.spec_from_file_location("stress_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_describe_gives_n_mean_sd_min_max() -> None:
    assert load_stress().describe([1.0, 2.0, 3.0]) == "n 3  mean 2  sd 0.816  min 1  max 3"


@pytest.mark.integration
@pytest.mark.slow
def test_two_runs_count_failures_per_test_and_describe_the_recorded_figures(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(SAMPLE_TESTS)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "2", str(sample)],
        cwd=tmp_path, env={**_env(), "STRESS_SAMPLE_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # one test failed once
    out = done.stdout
    assert "run 1/2: 2 tests" in out and "run 2/2: 2 tests" in out and "failed: " in out
    assert "1/2 failed:" in out and "test_fails_on_the_second_run" in out
    (line,) = [x for x in out.splitlines() if "test_records_a_figure ratio:" in x]
    assert line.endswith("n 2  mean 0.25  sd 0  min 0.25  max 0.25"), line
    assert "label" not in out
    assert "3 passed, 1 failed" in out
    kept = list((tmp_path / "runs").glob("stress-*/run-2.xml"))
    assert len(kept) == 1  # the report of the run with the failure is kept


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
