#!/usr/bin/env python3
"""How a short gossip run ends: the built-in demo on two local nodes, repeated, and the spread of its results.

    python scripts/short_runs.py [--runs 30] [--steps 150] [--batch-size 16] [--lr 0.1] [--momentum 0.9]
                                 [--config SETTINGS.yaml] [--out FILE.json]

Each run starts two demo nodes (``python -m dpwa.tools.demo``, one process each, a fresh pair of free
ports on 127.0.0.1, the cluster settings of ``--config`` if given), waits for both, then evaluates the
run (``--evaluate``: the averaged model and the one-process baseline on the same samples). It prints
one line per run and, at the end, the distribution of the averaged model's held-out accuracy (mean,
standard deviation, min, 5th percentile, median, max) and of the two nodes' disagreement, and writes
every run's figures to ``--out`` (JSON). The docs' "Short runs" table was made with it (Mixing rules page).

The runs are timing-dependent by nature (two processes on shared cores): the point is the distribution.
Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dpwa.config import yaml12

ROOT = Path(__file__).resolve().parents[1]
NODES = ("w1", "w2")
RUN_TIMEOUT_S = 300.0


def free_ports(n: int) -> list[int]:
    """n TCP ports of 127.0.0.1 that were free a moment ago."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def one_run(work: Path, settings: dict[str, Any], demo_args: list[str]) -> dict[str, Any]:
    """Both nodes, then the evaluation; the run's figures (its directory is ``work``)."""
    nodes = [{"name": n, "host": "127.0.0.1", "port": p} for n, p in zip(NODES, free_ports(len(NODES)))]
    cluster = work / "cluster.yaml"
    cluster.write_text(yaml12.dump({**settings, "nodes": nodes}, sort_keys=False))
    procs = []
    started = time.monotonic()
    for name in NODES:
        env = {**os.environ, "DPWA_NODE": name, "DPWA_CONFIG": str(cluster), "DPWA_RUN_DIR": str(work)}
        env.update({"DPWA_TORCH_THREADS": "1", "DPWA_LOG_LEVEL": "WARNING"})
        with open(work / f"{name}.log", "wb") as log:
            argv = [sys.executable, "-m", "dpwa.tools.demo", *demo_args]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    seconds = time.monotonic() - started
    if any(codes):
        return {"ok": False, "codes": codes, "dir": str(work)}
    evaluate = [sys.executable, "-m", "dpwa.tools.demo", "--evaluate", str(work)]
    env = {**os.environ, "DPWA_LOG_LEVEL": "WARNING"}
    subprocess.run(evaluate, env=env, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    summary = json.loads((work / "demo.json").read_text())
    nodes_acc = summary["node_accuracy"]
    return {
        "ok": True,
        "averaged": summary["averaged_accuracy"],
        "baseline": summary["baseline_accuracy"],
        "nodes": nodes_acc,
        "disagreement": max(nodes_acc.values()) - min(nodes_acc.values()),
        "seconds": seconds,
        "dir": str(work),
    }


def describe(values: list[float]) -> dict[str, float]:
    """mean, sd (population), min, p5, median, max of ``values``."""
    ordered = sorted(values)
    p5 = ordered[max(0, round(0.05 * (len(ordered) - 1)))]
    return {
        "mean": statistics.fmean(ordered),
        "sd": statistics.pstdev(ordered),
        "min": ordered[0],
        "p5": p5,
        "median": statistics.median(ordered),
        "max": ordered[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--config", type=Path, help="cluster settings (no nodes), e.g. a rule and its settings")
    parser.add_argument("--out", type=Path, help="write every run's figures here (JSON)")
    args = parser.parse_args(argv)
    settings = yaml12.load(args.config.read_text()) if args.config else {}
    settings = {k: v for k, v in (settings or {}).items() if k != "nodes"}
    demo_args = ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr)]
    demo_args += ["--momentum", str(args.momentum)]
    results = []
    with tempfile.TemporaryDirectory(prefix="dpwa-short-runs-") as tmp:
        for k in range(args.runs):
            work = Path(tmp) / f"run{k:03d}"
            work.mkdir()
            result = one_run(work, settings, demo_args)
            results.append(result)
            if result["ok"]:
                print(
                    f"run {k + 1}/{args.runs}: averaged {result['averaged']:.4f}  nodes "
                    + " ".join(f"{v:.4f}" for v in result["nodes"].values())
                    + f"  baseline {result['baseline']:.4f}  {result['seconds']:.1f}s",
                    flush=True,
                )
            else:
                print(f"run {k + 1}/{args.runs}: FAILED (exit codes {result['codes']})", flush=True)
    good = [r for r in results if r["ok"]]
    if not good:
        return 1
    averaged, disagreement = describe([r["averaged"] for r in good]), describe([r["disagreement"] for r in good])
    print(f"{len(good)} of {len(results)} runs; demo {' '.join(demo_args)}; settings {settings or 'defaults'}")
    print("averaged model accuracy: " + "  ".join(f"{k} {v:.3f}" for k, v in averaged.items()))
    print("node disagreement:       " + "  ".join(f"{k} {v:.3f}" for k, v in disagreement.items()))
    print(f"one-process baseline:    {good[0]['baseline']:.3f}")
    if args.out is not None:
        document = {"demo_args": demo_args, "settings": settings, "runs": results}
        document.update({"averaged": averaged, "disagreement": disagreement})
        args.out.write_text(json.dumps(document, indent=2) + "\n")
    return 0 if len(good) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
