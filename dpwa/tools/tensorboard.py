"""A run directory's metrics as TensorBoard scalars, one TensorBoard run per node (``dpwa plot --tensorboard``).

Every exchange record of ``<node>.metrics.jsonl`` (docs/metrics.md) becomes, at its ``step`` and wall
``time``, the scalars ``loss``, ``factor``, ``fetch_ms``, ``wait_ms``, ``mix_ms``, ``clock``, ``mb_per_s``
(``bytes`` / ``fetch_ms``: the fetch's own rate), ``fetch_ms/<peer>`` (per peer, for an exchange with one
peer that answered) and every other number in it (a rule's metrics: push-sum's ``weight``, the leader rule's
``leader_*``; ``distance``, the models' disagreement, ...), under the node's directory ``<out>/<node>/``;
membership records add ``members``, and the numbers a script reported (``adapter.report(accuracy=...)``)
become ``report/<key>`` at the step the node had reached. ``tensorboard --logdir <out>`` then shows the
cluster side by side, a colour per node.

The writer is tensorboardX's (MIT; the ``dpwa[tensorboard]`` extra): a small pure-Python writer of the event
file format, where ``torch.utils.tensorboard`` needs the whole ``tensorboard`` package. Imported only here,
only when called.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dpwa.launcher.rundir import RunDir

__all__ = ["DEFAULT_DIR", "MISSING_TENSORBOARDX", "scalars", "write_tensorboard"]

log = logging.getLogger(__name__)

DEFAULT_DIR = "tensorboard"
MISSING_TENSORBOARDX = "TensorBoard files need tensorboardX: pip install 'dpwa[tensorboard]'"
SKIPPED = frozenset({"time", "node", "step", "event", "peer", "status", "bytes"})
"""Record keys that are not scalars to plot (the step and time are the axes; ``bytes`` goes into MB/s)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one metrics record (pure): its finite numbers but the axes, plus ``mb_per_s`` for an
    exchange that fetched bytes, ``members`` for a membership record, ``report/<key>`` for a report's numbers;
    ``{}`` for other events."""
    event = record.get("event")
    if event == "member":
        count = _number(record.get("members"))
        return {"members": count} if count is not None else {}
    if event == "report":  # adapter.report(accuracy=...): every number, under report/
        numbers = {key: _number(value) for key, value in record.items() if key not in SKIPPED}
        return {f"report/{key}": v for key, v in numbers.items() if v is not None}
    if event is not None:
        return {}
    out = {key: v for key, value in record.items() if key not in SKIPPED and (v := _number(value)) is not None}
    nbytes, ms = _number(record.get("bytes")), _number(record.get("fetch_ms"))
    if nbytes and ms:
        out["mb_per_s"] = nbytes / ms / 1000.0
    peer = record.get("peer")
    if ms is not None and isinstance(peer, str) and "," not in peer and record.get("status") == "ok":
        out[f"fetch_ms/{peer}"] = ms  # per peer: which peer is slow
    return out


def write_tensorboard(run_dir: RunDir, out: Path | None = None, nodes: Iterable[str] | None = None) -> list[Path]:
    """Write every node's metrics (or ``nodes``') as TensorBoard event files under ``out`` (default
    ``RUN_DIR/tensorboard``), one directory per node, replacing what an earlier call wrote; returns the node
    directories. ValueError without metrics files; ImportError without tensorboardX."""
    from tensorboardX import SummaryWriter  # the optional extra

    names = list(nodes) if nodes is not None else run_dir.metrics_nodes()
    if not names:
        raise ValueError(f"{run_dir.path}: no *.metrics.jsonl files (is it a dpwa run directory?)")
    target = out if out is not None else run_dir.path / DEFAULT_DIR
    written = []
    for name in names:
        directory = target / name
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("events.out.tfevents.*"):  # one file per node: a re-run replaces it
            old.unlink()
        writer = SummaryWriter(logdir=str(directory), flush_secs=3600)
        try:
            last_step = 0
            for record in run_dir.read_metrics(name):
                step = record.get("step")
                if isinstance(step, int) and not isinstance(step, bool):
                    last_step = step
                when = _number(record.get("time"))
                for key, value in scalars(record).items():
                    writer.add_scalar(f"dpwa/{key}", value, global_step=last_step, walltime=when)
        finally:
            writer.close()
        written.append(directory)
        log.info("node %s: TensorBoard scalars in %s", name, directory)
    return written
