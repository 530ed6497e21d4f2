"""The memory rows of ``dpwa bench exchange``: what a node adds beside its model for the exchange, per rule.

For each rule of :data:`RULES`, two node processes on loopback (``python -m dpwa.tools.bench.exchange.memory``,
default settings, shared memory as configured) each build the benchmark's model (:func:`make_model`), measure
their memory, connect, run :data:`STEPS` rounds of ``update_send`` / ``update_wait`` with no training, measure
again and close. The figure is the growth of the *proportional* set size (``Pss`` of ``/proc/self/
smaps_rollup``: a page shared by k processes counts 1/k in each, so a peer's segment a node reads is not
counted twice), in model sizes; the row shows the larger of the two nodes and the target, at most
:data:`TARGET_MODEL_SIZES`. Growth of the resident set (``VmRSS``) is shown beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from dpwa.tools.bench.exchange.pair import make_model
from dpwa.tools.bench.procs import free_ports
from dpwa.tools.bench.report import Column

__all__ = ["COLUMNS", "RULES", "STEPS", "TARGET_MODEL_SIZES", "measure_memory", "memory_row"]

RULES = ("constant", "pushsum", "adpsgd", "dpsgd")
STEPS = 30
TARGET_MODEL_SIZES = 2.0
"""A node's memory beside its model: the published snapshot and one receive buffer."""
START_TIMEOUT_S = 60.0

COLUMNS = [
    Column("rule", "rule"),
    Column("floats", "floats", ","),
    Column("model_mb", "model MB", ".1f"),
    Column("pss_added_mb", "added PSS MB", ".1f"),
    Column("model_sizes", "model sizes", ".2f"),
    Column("ok_memory", "<=2"),
    Column("rss_added_mb", "added RSS MB", ".1f"),
]


def _kib(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in {path}")


def _memory_kib() -> dict[str, int]:
    return {"pss": _kib("/proc/self/smaps_rollup", "Pss:"), "rss": _kib("/proc/self/status", "VmRSS:")}


def _worker(name: str, config: str, floats: int, steps: int, out: str) -> None:
    """One node: measure, connect, ``steps`` rounds, measure, close; the figures as JSON in ``out``."""
    from dpwa.config import load_config
    from dpwa.node.connection import DpwaConnection

    model = make_model(floats, seed=1 if name == "t" else 2)
    cluster = load_config(config)
    before = _memory_kib()
    conn = DpwaConnection(name, cluster, seed=1 if name == "t" else 2)
    try:
        conn.wait_for_peers(START_TIMEOUT_S)
        for _ in range(steps):
            conn.update_send(model, 1.0)
            conn.update_wait(1.0)
        after = _memory_kib()
        mixes = conn.stats()["mixes"]
    finally:
        conn.close()
    Path(out).write_text(json.dumps({"before": before, "after": after, "mixes": mixes}))


def memory_row(rule: str, floats: int, nodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The row of ``rule``: the larger growth of the two nodes, in MB and in model sizes."""
    model_kib = floats * 4 / 1024
    pss = max(n["after"]["pss"] - n["before"]["pss"] for n in nodes)
    rss = max(n["after"]["rss"] - n["before"]["rss"] for n in nodes)
    sizes = pss / model_kib
    return {
        "rule": rule,
        "floats": floats,
        "model_mb": floats * 4 / 1e6,
        "pss_added_mb": pss * 1024 / 1e6,
        "rss_added_mb": rss * 1024 / 1e6,
        "model_sizes": sizes,
        "ok_memory": "✓" if sizes <= TARGET_MODEL_SIZES else "✗",
        "mixes": [n["mixes"] for n in nodes],
    }


def measure_memory(directory: Path, floats: int, rules: Sequence[str] = RULES, steps: int = STEPS) -> list[dict]:
    """One row per rule (two node processes each, one rule after the other)."""
    directory.mkdir(parents=True, exist_ok=True)
    timeout_s = START_TIMEOUT_S + steps * max(1.0, floats * 4 / 1e8)
    rows = []
    for rule in rules:
        ports = free_ports(2)
        doc = {
            "nodes": [{"name": name, "host": "127.0.0.1", "port": port} for name, port in zip("tp", ports)],
            "interpolation": rule,
            "timeout_ms": max(5000.0, floats * 4 / 1e6 * 200),
        }
        config = directory / f"memory-{rule}.yaml"
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
        outs = [directory / f"memory-{rule}-{name}.json" for name in "tp"]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", __name__, name, str(config), str(floats), str(steps), str(out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, out in zip("tp", outs)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if proc.returncode != 0:
                    raise RuntimeError(f"memory worker ({rule}) exited {proc.returncode}: {err[-2000:]}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        rows.append(memory_row(rule, floats, [json.loads(out.read_text()) for out in outs]))
    return rows


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
