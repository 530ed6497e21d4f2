"""The run directory of ``dpwa run``: its layout, the files the launcher writes, and reading metrics back.

The layout is a contract with the adapter (docs/metrics.md)::

    <run_dir>/cluster.yaml            resolved cluster config           (launcher)
    <run_dir>/<node>.log              the node's stdout and stderr       (launcher)
    <run_dir>/<node>.metrics.jsonl    one JSON object per line           (adapter)
    <run_dir>/summary.json            per-node summary, run outcome      (launcher)
    <run_dir>/<node>.model.npz        final model (dpwa/modelfile.py)    (adapter.save_model, built-in demo)
    <run_dir>/<node>.data.json        the node's data: partition, class histogram (built-in demo, benchmarks)
    <run_dir>/demo.json               averaged-model and baseline accuracy (built-in demo)
    <run_dir>/averaged.model.npz      the average of the nodes' models     (dpwa average)
    <run_dir>/average.json            its disagreement and evaluation      (dpwa average)
    <run_dir>/launch.json             nodes, command, threads: what `dpwa run --resume` restarts (launchers)
    <run_dir>/checkpoints/<node>.ckpt.npz[.prev]  latest (and previous) checkpoint (adapter, dpwa/checkpoint.py)

Metrics files are read tolerantly: a line that is not a JSON object (typically a torn last
line of a node that is still writing, or was killed mid-write) is skipped, never an error.
:class:`NodeMetrics` folds records into the numbers the progress display and summary show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dpwa.checkpoint import checkpoint_path, remove_checkpoints
from dpwa.config import ClusterConfig, yaml12
from dpwa.launcher.launchrecord import merge_launch
from dpwa.metrics import is_failure, read_metrics
from dpwa.modelfile import AVERAGED_MODEL
from dpwa.utils.atomic import write_atomically
from dpwa.utils.lockfile import HeldLocks, lock_file

log = logging.getLogger(__name__)

__all__ = [
    "NodeMetrics",
    "RunDir",
    "default_run_dir",
    "finite_number",
    "tail_lines",
]

CONFIG = "cluster.yaml"
SUMMARY_LOCK_S = 30.0
"""The longest ``write_summary`` (``write_launch``) waits for another launcher sharing the run directory to finish
writing its own."""
SUMMARY = "summary.json"
DEMO = "demo.json"
AVERAGE = "average.json"
EVALUATE_LOG = "evaluate.log"
LAUNCH = "launch.json"
LOG_SUFFIX = ".log"
METRICS_SUFFIX = ".metrics.jsonl"
MODEL_SUFFIX = ".model.npz"
DATA_SUFFIX = ".data.json"


def default_run_dir(
    base: str | os.PathLike[str] = "runs",
    env: Mapping[str, str] | None = None,
    prefix: str = "",
    *,
    step_shared: bool = False,
) -> Path:
    """``base/<prefix><YYYYmmdd-HHMMSS>``, created here and new: a taken timestamp gets ``-2``, ``-3``..., and the
    directory is made with an exclusive ``mkdir``, so two launches in the same second never share one.
    ``step_shared`` (the launchers of one cluster file, one per task) in an ``srun`` step:
    ``base/<prefix>slurm-<job>.<step>`` (not created), which every task of the step shares (on a shared file
    system). A batch script's own shell is no step (no SLURM_STEP_ID): each run there gets a new directory, as
    outside SLURM, and so does a run whose nodes are its own alone (``dpwa run -n``, a simulation)."""
    env = os.environ if env is None else env
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    if step_shared and job and step:
        return Path(base) / f"{prefix}slurm-{job}.{step}"
    stamp = prefix + _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    Path(base).mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = Path(base) / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{base}: {stamp} and its next 9,998 suffixes are all taken")


class RunDir:
    """One run directory: the paths of its files and the launcher's writes to it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------------ paths

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY

    @property
    def demo_path(self) -> Path:
        return self.path / DEMO

    @property
    def evaluate_log(self) -> Path:
        return self.path / EVALUATE_LOG

    def log_path(self, node: str) -> Path:
        return self.path / f"{node}{LOG_SUFFIX}"

    def metrics_path(self, node: str) -> Path:
        return self.path / f"{node}{METRICS_SUFFIX}"

    def data_path(self, node: str) -> Path:
        return self.path / f"{node}{DATA_SUFFIX}"

    def model_path(self, node: str) -> Path:
        return self.path / f"{node}{MODEL_SUFFIX}"

    @property
    def launch_path(self) -> Path:
        return self.path / LAUNCH

    def checkpoint_path(self, node: str) -> Path:
        return checkpoint_path(self.path, node)

    def metrics_nodes(self) -> list[str]:
        """Names of the nodes that have a metrics file, sorted."""
        return sorted(p.name[: -len(METRICS_SUFFIX)] for p in self.path.glob(f"*{METRICS_SUFFIX}"))

    # ------------------------------------------------------------------ writes

    def prepare(self, nodes: Iterable[str], *, evaluate: bool = False, resume: bool = False) -> None:
        """Create the directory; remove the files a previous run left for ``nodes`` (only theirs).

        A metrics file is appended to by the adapter, so a stale one would mix two runs; a stale
        checkpoint would be resumed from by a restarted node.  ``evaluate`` also removes a stale
        ``demo.json`` and ``evaluate.log``.  ``resume`` (``dpwa run --resume``): logs, metrics and
        checkpoints are kept -- the run goes on -- and only final models (and the demo's results) go.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        nodes = list(nodes)
        kinds = (self.model_path,) if resume else (self.log_path, self.metrics_path, self.model_path)
        stale = [kind(n) for n in nodes for kind in kinds]
        if evaluate:
            stale += [self.demo_path, self.evaluate_log]
        stale += [self.path / AVERAGE, self.path / AVERAGED_MODEL]  # of the models about to be replaced
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                log.info("removed stale %s", path)
        for node in nodes if not resume else ():
            for path in remove_checkpoints(self.checkpoint_path(node)):
                log.info("removed stale %s", path)

    def claim(self, nodes: Iterable[str]) -> HeldLocks:
        """Lock each of ``nodes`` in this directory (``.<node>.lock``, :func:`dpwa.utils.lockfile.lock_file`) until
        the locks are released; OSError naming the first node another launcher holds: two launchers sharing a run
        directory must not run (and clear the files of) one node. Nothing is held when it raises."""
        self.path.mkdir(parents=True, exist_ok=True)
        handles: list[tuple[int, Path]] = []
        for node in nodes:
            path = self.path / f".{node}.lock"
            fd = lock_file(path)
            if fd is None:
                HeldLocks(handles).release()
                raise OSError(f"{self.path}: node {node} is run by another launcher in this run directory")
            handles.append((fd, path))
        return HeldLocks(handles)

    def write_launch(self, record: Mapping[str, Any], launcher: str) -> dict[str, Any]:
        """Write ``launch.json``: what ``dpwa run --resume`` needs to start the same nodes the same way. ``record``
        is the launcher ``launcher``'s (:func:`~dpwa.launcher.launchrecord.launcher_key`); it is merged, under an
        exclusive lock, with the other launchers' sharing the directory (:func:`merge_launch`). What was written."""
        with self._locked():
            merged = merge_launch(self.read_launch(), record, launcher)
            write_atomically(self.launch_path, json.dumps(merged, indent=2) + "\n")
        return merged

    def read_launch(self) -> dict[str, Any] | None:
        """``launch.json`` as a dict, or None when missing or unreadable."""
        return _read_json(self.launch_path)

    def write_config(self, config: ClusterConfig) -> Path:
        """Write the resolved config (``config.to_dict()``) as ``cluster.yaml``; return its path."""
        text = f"# resolved from {config.source}\n" + yaml12.dump(config.to_dict(), sort_keys=False)
        write_atomically(self.config_path, text)
        return self.config_path

    def write_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write ``summary.json``, merging node entries with one already there; return what was written.

        Several launchers (one per host, e.g. under SLURM) may share a run directory: each one's
        ``nodes`` entries replace only the same names, under an exclusive lock; ``ok`` is recomputed
        over all nodes.
        """
        with self._locked():
            old = self.read_summary() or {}
            nodes = dict(old["nodes"]) if isinstance(old.get("nodes"), dict) else {}
            nodes.update(summary.get("nodes", {}))
            merged = {**summary, "nodes": nodes}
            merged["ok"] = bool(summary.get("ok", True)) and all(
                isinstance(n, dict) and n.get("status") == "ok" for n in nodes.values()
            )
            write_atomically(self.summary_path, json.dumps(merged, indent=2) + "\n")
        return merged

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold an exclusive flock on the directory itself (no lock file left behind), taken within
        ``SUMMARY_LOCK_S`` seconds: launchers sharing the directory merge their records one at a time."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = os.open(self.path, os.O_RDONLY)
        try:
            _lock_within(lock, SUMMARY_LOCK_S, self.path)
            yield
        finally:
            os.close(lock)  # releases the lock

    # ------------------------------------------------------------------ reads

    def read_summary(self) -> dict[str, Any] | None:
        """``summary.json`` as a dict, or None when missing or unreadable."""
        return _read_json(self.summary_path)

    def read_average(self) -> dict[str, Any] | None:
        """``average.json`` (``dpwa average RUN_DIR``) as a dict, or None when missing or unreadable."""
        return _read_json(self.path / AVERAGE)

    def read_demo(self) -> dict[str, Any] | None:
        """``demo.json`` as a dict, or None when missing or unreadable."""
        return _read_json(self.demo_path)

    def read_data(self, node: str) -> dict[str, Any] | None:
        """``<node>.data.json`` (partition and class histogram) as a dict, or None when missing or unreadable."""
        return _read_json(self.data_path(node))

    def read_metrics(self, node: str) -> list[dict[str, Any]]:
        """Every record of ``<node>.metrics.jsonl`` (``[]`` if there is none)."""
        return read_metrics(self.metrics_path(node), missing_ok=True)


@dataclasses.dataclass
class NodeMetrics:
    """Running totals of one node's metrics records (exchange lines and ``"event": "report"`` lines).

    Cumulative counters (``mixes``, ``bytes_in``) come from the records when present, else they are
    counted here. Every outcome of a record's ``reasons`` (docs/metrics.md) is counted under its reason,
    in ``failed_by_reason`` if it is a failure (:func:`dpwa.metrics.is_failure`), else in
    ``declined_by_reason`` (not ready, busy, left); ``failed`` is the sum of the failures, so the two
    agree (a record without ``reasons``, from an older dpwa, brings its cumulative ``failed`` and its
    statuses as reasons). ``timeouts`` counts ``timeout`` outcomes in ``status``; the mean fetch time is
    over exchanges with at least one ``ok`` outcome, the mean push time (push rules: send to ACK) over
    exchanges that found a push delivered (``delivered``).
    """

    steps: int = 0
    loss: float | None = None
    mixes: int = 0
    failed: int = 0
    timeouts: int = 0
    bytes_in: int = 0
    fetch_ms_total: float = 0.0
    fetches_ok: int = 0
    push_ms_total: float = 0.0
    pushes_timed: int = 0
    """Exchange records whose ``push_ms`` is a delivered push's (``delivered`` > 0)."""
    failed_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    declined_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    first_time: float | None = None
    last_time: float | None = None
    report: dict[str, Any] = dataclasses.field(default_factory=dict)
    members: int | None = None
    """Members the node sees (from its latest ``"event": "member"`` record); None before any change."""

    @classmethod
    def of(cls, records: Iterable[Mapping[str, Any]]) -> NodeMetrics:
        out = cls()
        out.add_all(records)
        return out

    def add_all(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.add(record)

    def add(self, record: Mapping[str, Any]) -> None:
        """Fold one record in."""
        t = finite_number(record.get("time"))
        if t is not None:
            self.first_time = t if self.first_time is None else min(self.first_time, t)
            self.last_time = t if self.last_time is None else max(self.last_time, t)
        if record.get("event") == "report":
            self.report.update({k: v for k, v in record.items() if k not in ("event", "time", "node")})
            return
        if record.get("event") == "member":
            count = record.get("members")
            if isinstance(count, int) and not isinstance(count, bool):
                self.members = count
            return
        if record.get("event") is not None:
            return
        step = finite_number(record.get("step"))
        self.steps = max(self.steps, int(step)) if step is not None else self.steps + 1
        loss = finite_number(record.get("loss"))
        if loss is not None:
            self.loss = loss
        statuses = [s for s in str(record.get("status") or "").split(",") if s]
        reasons = record.get("reasons")
        given = isinstance(reasons, list)
        if not given:  # an older record: the statuses are the reasons
            reasons = [s for s in statuses if s not in ("ok", "pushed")]
        failures = 0
        for reason in (str(r) for r in reasons):
            failure = is_failure(reason)
            failures += failure
            tally = self.failed_by_reason if failure else self.declined_by_reason
            tally[reason] = tally.get(reason, 0) + 1
        self.timeouts += statuses.count("timeout")
        factor = finite_number(record.get("factor")) or 0.0
        self.mixes = _counter(record, "mixes", self.mixes + (factor > 0))
        self.failed = self.failed + failures if given else _counter(record, "failed", self.failed + failures)
        self.bytes_in = _counter(record, "bytes_in", self.bytes_in + int(finite_number(record.get("bytes")) or 0))
        fetch_ms = finite_number(record.get("fetch_ms"))
        if "ok" in statuses and fetch_ms is not None:
            self.fetch_ms_total += fetch_ms
            self.fetches_ok += 1
        push_ms = finite_number(record.get("push_ms"))
        delivered = finite_number(record.get("delivered"))
        if push_ms is not None and (delivered > 0 if delivered is not None else push_ms > 0):
            self.push_ms_total += push_ms
            self.pushes_timed += 1

    @property
    def mean_fetch_ms(self) -> float | None:
        return self.fetch_ms_total / self.fetches_ok if self.fetches_ok else None

    @property
    def mean_push_ms(self) -> float | None:
        """Mean of the exchanges' ``push_ms`` (the slowest push delivered since the previous exchange)."""
        return self.push_ms_total / self.pushes_timed if self.pushes_timed else None

    @property
    def declined(self) -> int:
        """Fetches declined (not ready, busy, left): not failures."""
        return sum(self.declined_by_reason.values())

    @property
    def accuracy(self) -> float | None:
        return finite_number(self.report.get("accuracy"))

    @property
    def final_loss(self) -> float | None:
        reported = finite_number(self.report.get("final_loss"))
        return reported if reported is not None else self.loss

    def summary(self) -> dict[str, Any]:
        """The numbers ``summary.json`` keeps per node."""
        return {
            "steps": self.steps,
            "final_loss": self.final_loss,
            "accuracy": self.accuracy,
            "mixes": self.mixes,
            "failed_fetches": self.failed,
            "failed_by_reason": dict(sorted(self.failed_by_reason.items(), key=_by_count)),
            "declined_fetches": self.declined,
            "declined_by_reason": dict(sorted(self.declined_by_reason.items(), key=_by_count)),
            "timeouts": self.timeouts,
            "mean_fetch_ms": self.mean_fetch_ms,
            "mean_push_ms": self.mean_push_ms,
            "bytes_in": self.bytes_in,
            "report": self.report,
        }


def tail_lines(path: str | os.PathLike[str], n: int = 20, max_bytes: int = 64 * 1024) -> list[str]:
    """The last ``n`` lines of a text file (``[]`` if it is missing), decoded leniently."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except FileNotFoundError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


# --------------------------------------------------------------------------- helpers


def finite_number(value: object) -> float | None:
    """``value`` as a finite float, or None (bools, strings, NaN and missing values are None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits: no float holds it
        return None
    return number if math.isfinite(number) else None


def _by_count(item: tuple[str, int]) -> tuple[int, str]:
    """Sort key of a ``(reason, count)``: the most frequent first, then by name."""
    return -item[1], item[0]


def _counter(record: Mapping[str, Any], key: str, fallback: int) -> int:
    value = finite_number(record.get(key))
    return int(value) if value is not None else int(fallback)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _lock_within(fd: int, timeout_s: float, path: Path, poll_s: float = 0.05) -> None:
    """Take an exclusive flock on ``fd`` within ``timeout_s`` seconds; OSError naming ``path`` past that (a launcher
    that holds it that long is stuck, or the file system's locks are)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(f"{path}: another launcher held its lock for over {timeout_s:g} s") from None
            time.sleep(poll_s)
