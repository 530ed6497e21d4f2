"""The memory rows of ``dpwa bench exchange``: what a node adds beside its model for the exchange, per rule.

For each rule of :data:`RULES` and each ``transport.memory`` mode of :data:`MODES`, two node processes on
loopback (``python -m dpwa.tools.bench.exchange.memory``, default settings otherwise, shared memory on) each
build the benchmark's model (:func:`make_model`), measure their memory, connect, run :data:`STEPS` rounds of
``update_send`` / ``update_wait`` with no training, measure again, and close once both measured (``low`` with a
push or exchange rule: also one inbox slot, :data:`LOW_PUSH_INBOX`); then :data:`EXTRA_ROWS`: a 16-bit
``wire_dtype`` (a pull rule in ``low`` mode keeps its snapshot and its receive buffer in it alone), and AD-PSGD
split into an active and a passive node (``bipartite: true``: each keeps one exchange buffer). A node that finished
its steps keeps mixing what arrives until its peer finished too (a passive node, whose steps cost nothing here,
keeps publishing, so it takes the active one's exchanges). The figure is
the growth of the *proportional* set size (``Pss`` of ``/proc/self/smaps_rollup``: a page shared by k processes
counts 1/k in each, so a peer's segment a node reads is not counted twice), the larger of the two nodes. Less
the node's fixed cost (the same pair with a :data:`FIXED_FLOATS`-float model: about 1 MB), in model sizes, it
is held against the target, at most :data:`TARGET_MODEL_SIZES`. Growth of the resident set (``VmRSS``) is shown
beside it, and the mixes each node made.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dpwa.config import yaml12
from dpwa.rules import RULES as RULES_BY_NAME
from dpwa.rules import Transfer
from dpwa.tools.bench.exchange.pair import make_model
from dpwa.tools.bench.procs import free_ports
from dpwa.tools.bench.report import Column

__all__ = [
    "COLUMNS",
    "EXTRA_ROWS",
    "MODES",
    "RULES",
    "STEPS",
    "TARGET_MODEL_SIZES",
    "measure_memory",
    "memory_row",
]

RULES = ("constant", "pushsum", "adpsgd", "dpsgd")
MODES = ("normal", "low")
"""``transport.memory``: a pool of snapshot buffers, or one rewritten in place."""
EXTRA_ROWS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("constant", "low", "bfloat16", {}),
    ("adpsgd", "low", "float32", {"bipartite": True}),
)
"""(rule, mode, wire dtype, rule settings) rows measured after the plain float32 ones."""
STEPS = 30
TARGET_MODEL_SIZES = 2.0
"""A node's memory beside its model: the published snapshot and one receive buffer."""
START_TIMEOUT_S = 60.0
POLL_S = 0.005
"""How often a node that made its steps mixes what its peer's steps brought, until the peer made them too."""
LOW_PUSH_INBOX = {"inbox_slots": 1, "inbox_per_sender": 1}
"""A push or exchange rule's low-memory setting beside ``transport.memory: low``: one inbox slot (each is a
model)."""
TOLERANCE = 0.01
"""How far over the target a figure may lie and still meet it: pages, alignment and the allocator (2 x 100 MB
buffers measure 2.004 model sizes)."""
FIXED_FLOATS = 1000
"""The model of the pair that measures a node's fixed cost (threads, sockets, queues): what does not grow with
the model, taken off the figure."""

COLUMNS = [
    Column("rule", "rule"),
    Column("memory", "memory"),
    Column("wire", "wire"),
    Column("settings", "settings"),
    Column("floats", "floats", ","),
    Column("model_mb", "model MB", ".1f"),
    Column("pss_added_mb", "added PSS MB", ".1f"),
    Column("fixed_mb", "fixed MB", ".1f"),
    Column("model_sizes", "model sizes", ".3f"),
    Column("ok_memory", "<=2"),
    Column("rss_added_mb", "added RSS MB", ".1f"),
    Column("mixes", "mixes"),
]


def _kib(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in {path}")


def _memory_kib() -> dict[str, int]:
    return {"pss": _kib("/proc/self/smaps_rollup", "Pss:"), "rss": _kib("/proc/self/status", "VmRSS:")}


def _stepped(out: str) -> Path:
    """The file a node writes once it made its steps (beside its figures' ``out``)."""
    return Path(out + ".stepped")


def _worker(name: str, config: str, floats: int, steps: int, out: str, peer_out: str) -> None:
    """One node: measure, connect, ``steps`` rounds, then mix (``update_wait``; a node that never fetches: whole
    rounds) until the peer made its steps too, measure; the figures as JSON in ``out``; close once the peer
    measured too (``peer_out`` written): a node that closed early would unmap its segment from under the other's
    count."""
    from dpwa.config import load_config
    from dpwa.node.connection import DpwaConnection
    from dpwa.rules.schedules import make_schedule

    model = make_model(floats, seed=1 if name == "t" else 2)
    cluster = load_config(config)
    before = _memory_kib()
    conn = DpwaConnection(name, cluster, seed=1 if name == "t" else 2)
    try:
        conn.wait_for_peers(START_TIMEOUT_S)
        for _ in range(steps):
            conn.update_send(model, 1.0)
            conn.update_wait(1.0)
        _stepped(out).touch()
        roster = [n.name for n in cluster.nodes]
        # a node that never fetches (a passive AD-PSGD node) starts nothing its peer must answer: it steps on,
        # publishing a snapshot for each exchange; the others only mix what the peer's steps bring
        fetches = make_schedule(cluster.schedule, cluster.settings, roster).fetches(name, roster)
        deadline = time.monotonic() + START_TIMEOUT_S + steps * max(1.0, floats * 4 / 1e8)
        while not _stepped(peer_out).exists() and time.monotonic() < deadline:
            if not fetches:
                conn.update_send(model, 1.0)
            conn.update_wait(1.0)
            time.sleep(POLL_S)
        after = _memory_kib()
        mixes = conn.stats()["mixes"]
        Path(out).write_text(json.dumps({"before": before, "after": after, "mixes": mixes}))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not Path(peer_out).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        conn.close()


def memory_row(
    rule: str,
    mode: str,
    floats: int,
    nodes: Sequence[dict[str, Any]],
    fixed: Sequence[dict[str, Any]],
    wire: str = "float32",
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The row of ``rule`` (with its ``settings``) in ``mode`` with a ``wire`` dtype: the larger growth of the two
    nodes, in MB, and in model sizes (of the float32 model) once the node's fixed cost is taken off (the growth of
    the same pair with a :data:`FIXED_FLOATS`-float model)."""
    model_kib = floats * 4 / 1024
    pss = max(n["after"]["pss"] - n["before"]["pss"] for n in nodes)
    rss = max(n["after"]["rss"] - n["before"]["rss"] for n in nodes)
    fixed_pss = max(n["after"]["pss"] - n["before"]["pss"] for n in fixed)
    sizes = (pss - fixed_pss) / model_kib
    return {
        "rule": rule,
        "memory": mode,
        "wire": wire,
        "settings": ", ".join(f"{k}: {str(v).lower()}" for k, v in (settings or {}).items()) or "-",
        "floats": floats,
        "model_mb": floats * 4 / 1e6,
        "pss_added_mb": pss * 1024 / 1e6,
        "fixed_mb": fixed_pss * 1024 / 1e6,
        "rss_added_mb": rss * 1024 / 1e6,
        "model_sizes": sizes,
        "ok_memory": "✓" if sizes <= TARGET_MODEL_SIZES * (1 + TOLERANCE) else "✗",
        "mixes": [n["mixes"] for n in nodes],
    }


def _run_pair(
    directory: Path, rule: str, mode: str, floats: int, steps: int, wire: str, settings: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Two node processes of ``rule`` (with ``settings``) in ``mode``, ``wire`` dtype, with a ``floats``-float
    model: each one's figures."""
    ports = free_ports(2)
    doc = {
        "nodes": [{"name": name, "host": "127.0.0.1", "port": port} for name, port in zip("tp", ports)],
        "interpolation": rule,
        "timeout_ms": max(5000.0, floats * 4 / 1e6 * 200),
        "transport": {"memory": mode},
        **({"wire_dtype": wire} if wire != "float32" else {}),
        **(LOW_PUSH_INBOX if mode == "low" and RULES_BY_NAME[rule].transfer is not Transfer.PULL else {}),
        **({rule: dict(settings)} if settings else {}),
    }
    label = f"{rule}-{mode}-{wire}{''.join(f'-{k}' for k in settings)}-{floats}"
    config = directory / f"memory-{label}.yaml"
    config.write_text(yaml12.dump(doc, sort_keys=False))
    outs = [directory / f"memory-{label}-{name}.json" for name in "tp"]
    for out in outs:
        out.unlink(missing_ok=True)  # a peer waits for the other's files: never one of an earlier run
        _stepped(str(out)).unlink(missing_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", __name__, name, str(config), str(floats), str(steps), str(out), str(peer)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, out, peer in zip("tp", outs, outs[::-1])
    ]
    deadline = time.monotonic() + 2 * START_TIMEOUT_S + steps * max(1.0, floats * 4 / 1e8)
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"memory worker ({rule}, {mode}) exited {proc.returncode}: {err[-2000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for out in outs:
        _stepped(str(out)).unlink(missing_ok=True)
    return [json.loads(out.read_text()) for out in outs]


def measure_memory(
    directory: Path,
    floats: int,
    rules: Sequence[str] = RULES,
    steps: int = STEPS,
    modes: Sequence[str] = MODES,
    extra: Sequence[tuple[str, str, str, Mapping[str, Any]]] = EXTRA_ROWS,
) -> list[dict]:
    """One row per rule and mode with a float32 wire, then one per ``extra`` (rule, mode, wire dtype, rule
    settings): two pairs of node processes each, one after the other."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    plain: list[tuple[str, str, str, Mapping[str, Any]]] = [(r, m, "float32", {}) for m in modes for r in rules]
    for rule, mode, wire, settings in [*plain, *extra]:
        fixed = _run_pair(directory, rule, mode, FIXED_FLOATS, steps, wire, settings)
        nodes = _run_pair(directory, rule, mode, floats, steps, wire, settings)
        rows.append(memory_row(rule, mode, floats, nodes, fixed, wire, settings))
    return rows


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
