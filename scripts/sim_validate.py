"""The simulator against real runs: docs/simulation.md's validation figure and tests/test_simulate.py's bounds.

    python scripts/sim_validate.py [--nodes 4,8,16] [--runs 30,5,5] [--steps 100] [--out runs/sim-validate]

For every N, ``--runs`` real runs of ``dpwa run`` (N nodes on 127.0.0.1, logistic regression on the shipped
digits, ``constant`` on random peers, ``timeout_ms: 100``, 20 ms steps: dpwa/tools/sim/worker.py), each compared
with its simulation (dpwa/tools/sim/validation.py). Writes ``validate.json`` (every run's figures and curves) and
``validate.png`` (the first run of each N: mean-model loss and consensus distance, real against simulated), and
prints the distribution of the two figures of agreement per N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dpwa.config import yaml12
from dpwa.tools.bench.procs import free_ports
from dpwa.tools.sim import worker
from dpwa.tools.sim.validation import Comparison, compare


def real_run(n: int, steps: int, seed: int, where: Path) -> Comparison:
    """One real run of ``n`` nodes and its comparison."""
    nodes = [{"name": f"w{i + 1}", "host": "127.0.0.1", "port": p} for i, p in enumerate(free_ports(n))]
    config = where / "cluster.yaml"
    config.write_text(yaml12.dump({"nodes": nodes, "interpolation": "constant", "timeout_ms": 100}))
    run_dir = where / "run"
    command = [
        sys.executable,
        "-m",
        "dpwa.cli",
        "run",
        str(config),
        "--run-dir",
        str(run_dir),
        "--timeout-s",
        "300",
        worker.__file__,
        "--model",
        "logistic",
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--step-ms",
        "20",
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return compare(run_dir, model="logistic", steps=steps, seed=seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="4,8,16")
    parser.add_argument("--runs", default="30,5,5")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("runs/sim-validate"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for n, runs in zip((int(v) for v in args.nodes.split(",")), (int(v) for v in args.runs.split(","))):
        for seed in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                c = real_run(n, args.steps, seed, Path(tmp))
            row = {**dataclasses.asdict(c), "loss_error": c.loss_error, "consensus_ratio": c.consensus_ratio}
            results.setdefault(str(n), []).append(row)
            print(
                f"{n} nodes, seed {seed}: loss error {c.loss_error:.3f}, consensus ratio {c.consensus_ratio:.3f}",
                file=sys.stderr,
                flush=True,
            )
        (args.out / "validate.json").write_text(json.dumps(results))
    for n, rows in results.items():
        errors = sorted(r["loss_error"] for r in rows)
        ratios = sorted(r["consensus_ratio"] for r in rows)
        print(
            f"{n} nodes, {len(rows)} runs: loss error median {errors[len(errors) // 2]:.3f} max {errors[-1]:.3f}; "
            f"consensus ratio {ratios[0]:.3f}-{ratios[-1]:.3f}"
        )
    figure(results, args.out / "validate.png")
    return 0


def figure(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, cons_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for n, rows in results.items():
        r = rows[0]
        line = loss_ax.plot(r["steps"], r["real_loss"], label=f"{n} nodes, real")[0]
        loss_ax.plot(r["steps"], r["sim_loss"], "--", color=line.get_color(), label=f"{n} nodes, simulated")
        cons_ax.plot(r["steps"], r["real_consensus"], color=line.get_color(), label=f"{n} nodes, real")
        cons_ax.plot(r["steps"], r["sim_consensus"], "--", color=line.get_color(), label=f"{n} nodes, simulated")
    loss_ax.set(xlabel="step", ylabel="held-out loss of the mean model", title="loss: real (solid) vs simulated")
    cons_ax.set(xlabel="step", ylabel="consensus distance (RMS to the mean)", yscale="log",
                title="consensus: real (solid) vs simulated")  # fmt: skip
    loss_ax.legend(fontsize=7)
    cons_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
