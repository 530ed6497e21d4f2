"""A user's own script, start to finish (examples/own-script/train.py: dpwa.shard, DpwaOptimizer, report,
save_model), run for real: `dpwa run -n 2`, a one-process baseline under `dpwa run -n 1`, then `dpwa average RUN_DIR
--evaluate ... --baseline ...`. Asserted: what timing cannot change -- every node trained its own disjoint half of
the data for every step and saved its model; the averaged file is exactly the weighted mean of the node files; the
evaluation ran on the average, on every node's model and on the baseline's. (The figures themselves depend on the
run's timing; docs/own-script.md shows a measured one.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpwa.metrics import read_metrics
from dpwa.modelfile import AVERAGED_MODEL, average_models, read_model, run_models

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "own-script" / "train.py"


def dpwa(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPWA_", "SLURM_"))}
    done = subprocess.run(
        [sys.executable, "-m", "dpwa.cli", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.integration
def test_an_own_script_under_dpwa_run_then_dpwa_average_evaluates_the_average_beside_a_baseline(
    tmp_path: Path,
) -> None:
    steps = 150
    two = dpwa(tmp_path, "run", "-n", "2", "-q", "--run-dir", "two", "--evaluate", f"{SCRIPT}:evaluate", str(SCRIPT),
               "--steps", str(steps))  # fmt: skip
    one = dpwa(tmp_path, "run", "-n", "1", "-q", "--run-dir", "one", str(SCRIPT), "--steps", str(2 * steps))
    line = next(x for x in two.stdout.splitlines() if x.startswith("models: "))
    assert re.fullmatch(r"models: 2 saved, \S+ % apart \(relative distance to their mean\); averaged model accuracy "
                        r"0\.\d{4} \(nodes 0\.\d{4} to 0\.\d{4}\)", line), line  # fmt: skip
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["models"]["saved"] == 2 and set(summary["models"]["node_figures"]) == {"w1", "w2"}
    assert "models: 1 saved, 0 % apart" in one.stdout and "--evaluate MODULE:FUNCTION` evaluates" in one.stdout
    logs = {name: (tmp_path / "two" / f"{name}.log").read_text() for name in ("w1", "w2")}
    shards = {name: re.search(r"rank (\d) of 2, (\d+) samples", text).groups() for name, text in logs.items()}  # type: ignore[union-attr]
    assert shards == {"w1": ("0", "20000"), "w2": ("1", "20000")}  # dpwa.shard: half of the 40,000 each
    for name in ("w1", "w2"):
        report = [r for r in read_metrics(tmp_path / "two" / f"{name}.metrics.jsonl") if r.get("event") == "report"]
        assert report[-1]["steps"] == steps and 0.0 <= report[-1]["accuracy"] <= 1.0

    done = dpwa(tmp_path, "average", "two", "--evaluate", f"{SCRIPT}:evaluate", "--baseline", "one")
    lines = done.stdout.splitlines()
    assert lines[2].startswith("accuracy: averaged model ") and "(nodes: w1 " in lines[2], done.stdout
    assert lines[3].startswith("accuracy: baseline (1 node(s), one) "), done.stdout
    result = json.loads((tmp_path / "two" / "average.json").read_text())
    assert set(result["node_figures"]) == {"w1", "w2"} and 0.0 <= result["baseline"]["accuracy"] <= 1.0
    models = run_models(tmp_path / "two")
    assert [m.node for m in models] == ["w1", "w2"] and all(m.step == steps for m in models)
    averaged = read_model(tmp_path / "two" / AVERAGED_MODEL)
    expected = average_models(models)
    assert all(np.array_equal(averaged.arrays[k], expected[k]) for k in expected)
