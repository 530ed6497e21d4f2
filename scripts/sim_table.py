"""Every rule under ``dpwa simulate`` at several cluster sizes, with and without stragglers, on iid and
Dirichlet data: the table of docs/simulation.md.

    python scripts/sim_table.py [--nodes 16,256,1024] [--steps 100] [--out runs/sim-table]

Each cell is one run (seed 0; the simulator is deterministic, so the table is exact for it): logistic regression
on the shipped digits, 50 ms steps, 1 Gbit/s links of 1 ms, ``timeout_ms: 100``; stragglers: 10 % of the nodes
4x slower. Writes ``table.json`` (every figure) and ``table.md`` (the docs table) under ``--out``, one line of
progress per run on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dpwa.config import ClusterConfig
from dpwa.rules import RULES
from dpwa.tools.sim.runner import SimOptions, simulate
from dpwa.tools.sim.timing import StepTimes

CONDITIONS = [("iid", 0.0), ("iid", 0.1), ("dirichlet:0.1", 0.0), ("dirichlet:0.1", 0.1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="16,256,1024")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--partitions", default="iid,dirichlet:0.1", help="run only these (a split of the work)")
    parser.add_argument("--out", type=Path, default=Path("runs/sim-table"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "table.json"
    cells = json.loads(path.read_text()) if path.exists() else {}
    for n in [int(v) for v in args.nodes.split(",")]:
        for rule in args.rules.split(","):
            for partition, share in CONDITIONS:
                key = f"{rule}|{n}|{partition}|{share}"
                if key in cells or partition not in args.partitions.split(","):
                    continue
                started = time.time()
                options = SimOptions(
                    ClusterConfig(interpolation=rule, timeout_ms=100.0), nodes=n, steps=args.steps,
                    model="logistic", partition=partition, step_times=StepTimes(0.05, 0.0, share, 4.0),
                )  # fmt: skip
                cells[key] = simulate(options).summary()
                path.write_text(json.dumps(cells, indent=1))
                print(f"{key}: {time.time() - started:.1f} s", file=sys.stderr, flush=True)
    (args.out / "table.md").write_text(markdown(cells, args.steps) + "\n")
    return 0


def markdown(cells: dict[str, dict[str, float]], steps: int) -> str:
    """One row per rule and size: accuracy / consensus distance in each condition, and the simulated time."""
    head = "| rule | nodes | iid | iid, 10 % stragglers | dirichlet:0.1 | dirichlet:0.1, 10 % stragglers |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    keys = sorted({tuple(k.split("|")[:2]) for k in cells}, key=lambda k: (list(RULES).index(k[0]), int(k[1])))
    for rule, n in keys:
        row = []
        for partition, share in CONDITIONS:
            c = cells.get(f"{rule}|{n}|{partition}|{share}")
            cell = "" if c is None else f"{c['accuracy']:.3f} / {c['consensus_distance']:.2g} / {c['sim_time_s']:.1f} s"
            row.append(cell)
        lines.append(f"| `{rule}` | {n} | " + " | ".join(row) + " |")
    note = f"Each cell: accuracy of the mean model (held out) / consensus distance / simulated time, {steps} steps."
    return "\n".join(lines) + "\n\n" + note


if __name__ == "__main__":
    sys.exit(main())
