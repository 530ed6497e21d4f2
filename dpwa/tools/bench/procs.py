"""Worker processes of the train and scale benchmarks: ports, a cluster file, start, watch, stop, memory.

The discipline is ``dpwa run``'s (:mod:`dpwa.launcher.supervisor`): every worker is started by a
:class:`~dpwa.launcher.supervisor.Supervisor` in its own process group, with its output in ``<name>.log``;
:func:`run_workers` polls them with a hard deadline and, whatever happens (a failing worker, the
deadline, Ctrl-C, an exception), stops every one it started before it returns or raises.  Only
those processes are ever signalled.  This module never imports torch.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpwa.config import ClusterConfig, NodeSpec, yaml12
from dpwa.engines.local import PortReservation, reserve_ports
from dpwa.launcher.placement import node_env, threads_per_node
from dpwa.launcher.rundir import tail_lines
from dpwa.launcher.supervisor import POLL_S, SignalTrap, Supervisor, stop_and_close
from dpwa.rules.pairwise import ConstantSettings

log = logging.getLogger(__name__)

__all__ = [
    "BenchInterrupted",
    "WorkerFailed",
    "WorkerRun",
    "count_fds",
    "free_ports",
    "release_ports",
    "node_names",
    "read_rss_kib",
    "run_workers",
    "worker_start",
    "write_cluster",
]

TAIL_LINES = 15


class WorkerFailed(RuntimeError):
    """A worker exited non-zero, or the deadline passed; the message names it and quotes its log."""


class BenchInterrupted(RuntimeError):
    """SIGINT or SIGTERM arrived while workers ran (they have been stopped); ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}: stopped every worker this benchmark started")
        self.signum = signum


def worker_start(bench: str, argv: Sequence[str] | None = None) -> tuple[dict[str, Any], int]:
    """A bench worker's command line ``SPEC RANK`` -> (the JSON spec ``dpwa bench <bench>`` wrote, rank).

    Also sets up logging and torch's thread count as the demo's nodes do (imports torch: workers only).
    """
    from dpwa.tools import demo

    parser = argparse.ArgumentParser(prog=f"python -m dpwa.tools.bench.{bench}worker")
    parser.add_argument("spec", type=Path, help=f"the JSON spec written by dpwa bench {bench}")
    parser.add_argument("rank", type=int)
    args = parser.parse_args(argv)
    demo.configure_logging()
    demo.set_threads()
    return json.loads(args.spec.read_text()), args.rank


_HELD: list[PortReservation] = []
"""The ports this process reserved for its benches' workers, held until it exits (:func:`release_ports`)."""


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports on ``host``, reserved as ``dpwa run -n`` reserves its own (:func:`reserve_ports`):
    free a moment ago, below the kernel's ephemeral range and locked against every other dpwa launcher and bench
    until this process exits.

    A port the kernel handed out as free (``bind(0)``) lies in the ephemeral range: any outgoing connection on
    the machine (a ZeroMQ peer's, another job's) could take it as its source port before the worker binds it;
    one did in a test run. Below that range only an explicit bind can, and dpwa's own binders take the lock.
    """
    reservation = reserve_ports(n, host)
    _HELD.append(reservation)
    return list(reservation.ports)


def release_ports() -> None:
    """Give back every port :func:`free_ports` reserved (at exit; idempotent)."""
    while _HELD:
        _HELD.pop().release()


atexit.register(release_ports)


def node_names(n: int) -> list[str]:
    """``w1 .. wN``, the names the sample cluster files use."""
    return [f"w{i + 1}" for i in range(n)]


def write_cluster(
    path: Path, ports: Sequence[int], *, interpolation: str = "constant", constant: float = 0.5, **settings: object
) -> ClusterConfig:
    """A cluster file of nodes ``w1..wN`` on 127.0.0.1 at ``ports``: rule ``interpolation`` with its default
    settings (``constant``: the value ``constant``).

    ``settings``: other top-level keys (``timeout_ms=...``).  Returns the validated config.
    """
    nodes = tuple(NodeSpec(name, "127.0.0.1", port) for name, port in zip(node_names(len(ports)), ports))
    config = ClusterConfig(
        nodes=nodes,
        interpolation=interpolation,
        rule_settings={"constant": ConstantSettings(value=constant)} if interpolation == "constant" else {},
        **settings,  # type: ignore[arg-type]
    )
    path.write_text(yaml12.dump(config.to_dict(), sort_keys=False))
    return config


def count_fds(pid: int) -> int | None:
    """Open file descriptors of ``pid`` (entries of /proc/<pid>/fd); None once it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def read_rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of /proc/<pid>/status); None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclasses.dataclass
class WorkerRun:
    """What :func:`run_workers` observed: per worker its pid, wall seconds, RSS samples (KiB), most open fds."""

    pids: dict[str, int]
    seconds: dict[str, float]
    rss_kib: dict[str, list[int]]
    fds_max: dict[str, int]
    wall_s: float


def run_workers(
    run_dir: Path,
    module: str,
    names: Sequence[str],
    args: Callable[[int, str], Sequence[str]],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    threads: int | None = None,
    config_path: Path | None = None,
    sample_s: float = 0.5,
    on_tick: Callable[[float], None] | None = None,
) -> WorkerRun:
    """Run ``python -m module *args(rank, name)`` once per name, in parallel, until all have exited.

    Each worker gets :func:`dpwa.launcher.placement.node_env` (``DPWA_NODE``, ``DPWA_CONFIG``, ``DPWA_RUN_DIR``
    and ``threads`` threads; default: usable cores // workers, at least 1), its output in
    ``run_dir/<name>.log``.  Every ``sample_s`` the RSS and open fds of each running worker are sampled and
    ``on_tick(elapsed seconds)`` called (e.g. to release a start barrier).

    Raises :class:`WorkerFailed` when a worker exits non-zero or ``timeout_s`` passes, and
    :class:`BenchInterrupted` on SIGINT/SIGTERM; in every case (and on any other exception) every
    worker has been stopped first -- SIGTERM to its process group, SIGKILL after the grace period.
    """
    base = dict(os.environ if env is None else env)
    per = threads if threads is not None else threads_per_node(len(names))
    supervisor = Supervisor()
    rss: dict[str, list[int]] = {name: [] for name in names}
    fds: dict[str, int] = {name: 0 for name in names}
    start = time.monotonic()
    deadline = start + timeout_s
    next_sample = start
    with SignalTrap() as trap:
        try:
            for rank, name in enumerate(names):
                child_env = node_env(
                    base, node=name, config_path=config_path or run_dir / "cluster.yaml", run_dir=run_dir, threads=per
                )
                argv = [sys.executable, "-m", module, *args(rank, name)]
                supervisor.start(name, argv, env=child_env, log_path=run_dir / f"{name}.log")
            while True:
                supervisor.poll()
                now = time.monotonic()
                if now >= next_sample:
                    _sample(supervisor, rss, fds)
                    next_sample = now + sample_s
                    if on_tick is not None:
                        on_tick(now - start)
                if trap.received:
                    raise BenchInterrupted(trap.received[0])
                failed = [c for c in supervisor.children.values() if c.state == "failed"]
                if failed:
                    raise WorkerFailed(_failure(failed[0].name, failed[0].describe_exit(), failed[0].log_path))
                if not supervisor.running():
                    break
                if now >= deadline:
                    late = supervisor.running()[0]
                    raise WorkerFailed(_failure(late.name, f"still running after {timeout_s:g} s", late.log_path))
                time.sleep(POLL_S)
        finally:
            stop_and_close(supervisor, trap)
    children = supervisor.children
    return WorkerRun(
        pids={name: children[name].pid for name in names},
        seconds={name: (children[name].ended or time.monotonic()) - children[name].started for name in names},
        rss_kib=rss,
        fds_max=fds,
        wall_s=time.monotonic() - start,
    )


def _sample(supervisor: Supervisor, rss: dict[str, list[int]], fds: dict[str, int]) -> None:
    """Append each running worker's RSS (KiB) to ``rss[name]``; raise ``fds[name]`` to its open fds if more."""
    for child in supervisor.running():
        value = read_rss_kib(child.pid)
        if value is not None:
            rss[child.name].append(value)
        fds[child.name] = max(fds[child.name], count_fds(child.pid) or 0)


def _failure(name: str, what: str, log_path: Path) -> str:
    lines = "\n".join(f"    {line}" for line in tail_lines(log_path, TAIL_LINES))
    return f"worker {name}: {what}; last lines of {log_path}:\n{lines}"
