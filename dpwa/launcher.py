"""Process management for ``dpwa run``: which nodes run here, their environment, start, watch, stop.

Contract:

* :func:`select_nodes` picks the nodes this launcher starts: the ``--node`` names; else, under
  SLURM (``SLURM_PROCID`` and ``SLURM_NTASKS`` set), node number ``SLURM_PROCID`` of the file;
  else every node whose host is this machine (:class:`LocalHosts`). Problems are ConfigErrors.
* :func:`node_env` gives a node ``DPWA_NODE``, ``DPWA_CONFIG``, ``DPWA_RUN_DIR`` and sizes
  ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``DPWA_TORCH_THREADS``
  so the local nodes share the usable cores (:func:`threads_per_node`).
* :class:`Supervisor` starts each child in its own session (process group id == its pid) with
  stdin from /dev/null and stdout+stderr into its log file. :meth:`Supervisor.stop` sends SIGTERM to
  each child's process group, waits up to a grace period, then SIGKILLs what is left, and waits
  again -- every wait has a deadline. It only ever signals the process groups of children it
  started, and only while that group still has members (its id cannot have been reused then).
* On Linux each child also asks for SIGTERM should the launcher die without cleaning up (even by
  SIGKILL): ``prctl(PR_SET_PDEATHSIG)``.
* :class:`SignalTrap` turns SIGINT/SIGTERM into a flag while children run and restores the
  previous handlers on exit.

The ``dpwa run`` command (:func:`run`) and its loop (:func:`run_job`: start, watch with live
progress, stop, evaluate the demo, summarize) are at the bottom. This module never imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as _dt
import errno
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import click

from .cli import EXIT_CONFIG_ERROR as EXIT_USAGE
from .cli import fail
from .config import ClusterConfig, ConfigError, NodeSpec, load_config
from .progress import NodeView, Progress, summary_table
from .rundir import MetricsTail, NodeMetrics, RunDir, default_run_dir, tail_lines

log = logging.getLogger(__name__)

__all__ = [
    "ENV_CONFIG",
    "ENV_NODE",
    "ENV_RUN_DIR",
    "ENV_TORCH_THREADS",
    "Child",
    "LocalHosts",
    "SignalTrap",
    "Supervisor",
    "node_env",
    "select_nodes",
    "threads_per_node",
    "usable_cores",
]

ENV_NODE = "DPWA_NODE"
ENV_CONFIG = "DPWA_CONFIG"
ENV_RUN_DIR = "DPWA_RUN_DIR"
ENV_TORCH_THREADS = "DPWA_TORCH_THREADS"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", ENV_TORCH_THREADS)

STOP_GRACE_S = 3.0
"""How long stopped children get to exit after SIGTERM before SIGKILL."""
KILL_WAIT_S = 1.5
"""How long to wait for SIGKILLed process groups to disappear."""
POLL_S = 0.05

_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


# --------------------------------------------------------------------------- which nodes run here


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` resolves to (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]) for info in infos}


def _can_bind(address: str) -> bool:
    """True when a socket can bind ``address`` (port 0): the address belongs to one of this machine's interfaces."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


class LocalHosts:
    """Decides whether a node's host is this machine.

    Local are: ``localhost`` (and its usual aliases), any loopback address (127.0.0.0/8, ::1),
    the unspecified address, ``socket.gethostname()`` and ``socket.getfqdn()`` and every address
    they resolve to, and any name or address that resolves to an address a socket here can bind.
    Results are cached per host.
    """

    def __init__(self) -> None:
        hostname, fqdn = socket.gethostname(), socket.getfqdn()
        self.names = {*_LOCAL_NAMES, hostname.lower(), fqdn.lower()}
        self.addresses: set[str] = set()
        for name in (hostname, fqdn):
            self.addresses |= _addresses(name)
        self._cache: dict[str, bool] = {}

    def __call__(self, host: str) -> bool:
        key = host.strip().strip("[]").lower()
        if key not in self._cache:
            self._cache[key] = self._is_local(key)
            log.debug("host %r is %slocal", host, "" if self._cache[key] else "not ")
        return self._cache[key]

    def _is_local(self, host: str) -> bool:
        if host in self.names:
            return True
        return any(self._is_local_address(a) for a in _addresses(host))

    def _is_local_address(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        return ip.is_loopback or ip.is_unspecified or address in self.addresses or _can_bind(address)


def select_nodes(
    config: ClusterConfig,
    names: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    is_local: Callable[[str], bool] | None = None,
) -> tuple[list[NodeSpec], list[str]]:
    """The nodes to start here, and warnings to show the user.

    ``names`` (``--node``, repeatable, duplicates ignored) wins; an unknown name is a ConfigError.
    Else, when ``SLURM_PROCID`` and ``SLURM_NTASKS`` are both set, node number ``SLURM_PROCID``
    (``SLURM_NTASKS`` must equal the number of nodes). Else every node whose host ``is_local``;
    none is a ConfigError naming the hosts of the file. A chosen node whose host does not look
    local is started anyway, with a warning.
    """
    env = os.environ if env is None else env
    local = is_local if is_local is not None else LocalHosts()
    if names:
        chosen = [config.node(name) for name in dict.fromkeys(names)]
    elif env.get("SLURM_PROCID") is not None and env.get("SLURM_NTASKS") is not None:
        chosen = [_slurm_node(config, env["SLURM_PROCID"], env["SLURM_NTASKS"])]
    else:
        chosen = [node for node in config.nodes if local(node.host)]
        if not chosen:
            hosts = ", ".join(dict.fromkeys(node.host for node in config.nodes))
            reason = (
                f"no node runs on this machine ({socket.gethostname()}); hosts in the file: {hosts}; "
                "start nodes explicitly with --node NAME"
            )
            raise config.error("nodes", reason)
        return chosen, []
    warnings = [
        f"node {node.name}'s host {node.host} does not look like this machine; starting it anyway"
        for node in chosen
        if not local(node.host)
    ]
    return chosen, warnings


def _slurm_node(config: ClusterConfig, procid: str, ntasks: str) -> NodeSpec:
    """Node number ``procid`` of the file; the task count must equal the node count."""
    try:
        rank, tasks = int(procid), int(ntasks)
    except ValueError:
        raise config.error("nodes", f"SLURM_PROCID={procid!r} and SLURM_NTASKS={ntasks!r} must be integers") from None
    n = len(config.nodes)
    if tasks != n:
        reason = (
            f"SLURM_NTASKS={tasks} but the file has {n} node{'s' if n != 1 else ''}: run one task per node "
            f"(srun --ntasks={n} ...), or choose nodes with --node NAME"
        )
        raise config.error("nodes", reason)
    if not 0 <= rank < n:
        raise config.error("nodes", f"SLURM_PROCID={rank} is not in [0, {n - 1}]")
    return config.nodes[rank]


# --------------------------------------------------------------------------- environment


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a SLURM allocation), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS
        return max(1, os.cpu_count() or 1)


def threads_per_node(local_nodes: int, cores: int | None = None) -> int:
    """``max(1, cores // local_nodes)``: intra-op threads per node so the nodes share the cores."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, local_nodes))


def node_env(
    base: Mapping[str, str],
    *,
    node: str | None,
    config_path: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    threads: int,
) -> dict[str, str]:
    """``base`` plus the variables a dpwa node process reads (``node`` None: a helper, not a node).

    ``PYTHONUNBUFFERED=1`` so a node's log is written as it goes.
    """
    env = dict(base)
    if node is not None:
        env[ENV_NODE] = node
    else:
        env.pop(ENV_NODE, None)
    env[ENV_CONFIG] = os.fspath(config_path)
    env[ENV_RUN_DIR] = os.fspath(run_dir)
    for name in THREAD_VARIABLES:
        env[name] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --------------------------------------------------------------------------- children


@dataclasses.dataclass
class Child:
    """One process started by a :class:`Supervisor`; ``state`` is running, ok, failed or stopped."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    started: float
    ended: float | None = None
    stopped: bool = False  # the supervisor signalled it

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    @property
    def state(self) -> str:
        if self.returncode is None:
            return "running"
        if self.stopped:
            return "stopped"
        return "ok" if self.returncode == 0 else "failed"

    def describe_exit(self) -> str:
        """E.g. ``exit status 1`` or ``killed by SIGSEGV``."""
        code = self.returncode
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"


class Supervisor:
    """The processes one launcher started, and the only code that signals them.

    Each child leads its own process group (``start_new_session``); signals go to the group, so a
    node's own helpers (e.g. data-loader workers) are stopped with it. A group is signalled only
    while it still has members, so its id cannot have been handed to an unrelated process.
    """

    def __init__(self) -> None:
        self.children: dict[str, Child] = {}
        self._groups: set[int] = set()  # process groups that may still have members
        self._killed: set[int] = set()  # groups already sent SIGKILL
        self._preexec = _die_with_parent()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        cwd: str | os.PathLike[str] | None = None,
    ) -> Child:
        """Start ``argv`` as child ``name``, its stdout and stderr going to ``log_path`` (truncated)."""
        if name in self.children:
            raise ValueError(f"a child named {name!r} was already started")
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._preexec,  # safe: the launcher forks from its only thread
                close_fds=True,
            )
        child = Child(name, popen, log_path, time.monotonic())
        self.children[name] = child
        self._groups.add(popen.pid)
        log.info("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
        return child

    def running(self) -> list[Child]:
        return [c for c in self.children.values() if c.returncode is None]

    def poll(self) -> list[Child]:
        """Reap children that exited since the last call and return them; terminate what they left behind."""
        exited = []
        for child in self.children.values():
            if child.returncode is None and child.popen.poll() is not None:
                child.ended = time.monotonic()
                exited.append(child)
                log.info("%s (pid %d) ended: %s", child.name, child.pid, child.describe_exit())
                if child.pid in self._live_groups([child.pid]) and not child.stopped:
                    log.warning("%s exited but left processes in its group; terminating them", child.name)
                    self._signal_group(child.pid, signal.SIGTERM)
        return exited

    def stop(
        self,
        grace_s: float = STOP_GRACE_S,
        kill_wait_s: float = KILL_WAIT_S,
        hurry: Callable[[], bool] = lambda: False,
    ) -> None:
        """Stop every child and its process group: SIGTERM, up to ``grace_s`` to exit, SIGKILL, up to
        ``kill_wait_s`` more. ``hurry()`` true (e.g. a second Ctrl-C) cuts the grace period short.
        Returns when every group is gone or the deadlines have passed (then it logs an error).
        """
        self.poll()
        for child in self.running():
            child.stopped = True
        pending = sorted(self._live_groups(self._groups - self._killed))
        if not pending:  # nothing left, or only groups SIGKILL could not end (already waited for)
            return
        for pgid in pending:
            self._signal_group(pgid, signal.SIGTERM)
        self._wait_groups(pending, time.monotonic() + grace_s, hurry)
        left = sorted(self._live_groups(pending))
        for pgid in left:
            self._killed.add(pgid)
            log.warning("process group %d did not stop after SIGTERM; sending SIGKILL", pgid)
            self._signal_group(pgid, signal.SIGKILL)
        if left:
            self._wait_groups(left, time.monotonic() + kill_wait_s, lambda: False)
        still = sorted(self._live_groups(left))
        if still:  # pragma: no cover - the kernel did not deliver SIGKILL in time
            log.error("process groups %s still alive after SIGKILL", still)

    # ------------------------------------------------------------------ internals

    def _wait_groups(self, groups: list[int], deadline: float, hurry: Callable[[], bool]) -> None:
        while True:
            self.poll()
            if not self._live_groups(groups):
                return
            if time.monotonic() >= deadline or hurry():
                return
            time.sleep(POLL_S)

    def _child_of(self, pgid: int) -> Child | None:
        return next((c for c in self.children.values() if c.pid == pgid), None)

    def _leader_running(self, pgid: int) -> bool:
        child = self._child_of(pgid)
        return child is not None and child.returncode is None

    def _live_groups(self, pgids: Iterable[int]) -> set[int]:
        """Those of ``pgids`` (groups this supervisor created) that still have a live member.

        A group whose leader is not reaped is live. Once the leader is reaped, the group id stays
        reserved by the kernel for as long as any member (even a zombie) remains, so looking it up
        cannot find another program's group. Groups found empty -- or holding only zombies, which a
        container's init may never reap -- are forgotten and never signalled again.
        """
        wanted = set(pgids) & self._groups
        live = {pgid for pgid in wanted if self._leader_running(pgid)}
        orphaned = wanted - live
        if orphaned:
            found = _groups_with_live_members(orphaned)
            self._groups -= orphaned - found
            live |= found
        return live

    def _signal_group(self, pgid: int, sig: signal.Signals) -> None:
        if pgid not in self._groups:
            return
        try:
            os.killpg(pgid, sig)
            log.debug("sent %s to process group %d", sig.name, pgid)
        except ProcessLookupError:
            self._groups.discard(pgid)
        except OSError as err:  # pragma: no cover
            if err.errno != errno.EPERM:
                raise
            log.warning("not allowed to signal process group %d", pgid)


def _groups_with_live_members(pgids: set[int]) -> set[int]:
    """Those of ``pgids`` with at least one member that is not a zombie (from /proc; else by signal 0)."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - no /proc (macOS): zombies count as members here
        return {pgid for pgid in pgids if _probe_group(pgid)}
    found = set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue  # exited meanwhile
        if len(fields) > 2 and fields[0] not in ("Z", "X") and int(fields[2]) in pgids:
            found.add(int(fields[2]))
    return found


def _probe_group(pgid: int) -> bool:  # pragma: no cover - used without /proc only
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child if the launcher dies (even by SIGKILL).

    Best effort: None where ``prctl`` is not available. The launcher starts children from its only
    thread, so running Python between fork and exec is safe here.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1
    term = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, term, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), term)

    return preexec


class SignalTrap:
    """While active, SIGINT and SIGTERM are recorded in ``received`` instead of ending the launcher.

    Previous handlers are restored on exit. Outside the main thread (where handlers cannot be set)
    it records nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalTrap:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                log.debug("cannot trap %s outside the main thread", sig.name)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        log.info("received %s", signal.Signals(signum).name)

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None


def stop_quietly(supervisor: Supervisor, trap: SignalTrap | None = None) -> None:
    """:meth:`Supervisor.stop`, hurried by a second signal on ``trap``; never raises OSError."""
    with contextlib.suppress(OSError):
        supervisor.stop(hurry=(lambda: len(trap.received) >= 2) if trap is not None else (lambda: False))


# --------------------------------------------------------------------------- the run

DEMO_MODULE = "dpwa.demo"
TAIL_LINES = 20


@dataclasses.dataclass
class Job:
    """One ``dpwa run`` on this machine: which nodes, the command each runs, and where they write."""

    config: ClusterConfig
    nodes: list[NodeSpec]
    command: list[str]
    run_dir: RunDir
    threads: int
    evaluate: bool = False  # built-in demo with every node here: run `dpwa.demo --evaluate RUN_DIR` after
    timeout_s: float | None = None
    keep_going: bool = False


def run_job(job: Job, *, progress: Progress | None, env: Mapping[str, str] | None = None) -> int:
    """Start ``job``'s nodes, watch them, stop them, write ``summary.json``, print the summary; return the
    exit code: 0 when every node (and the demo's evaluation) succeeded, 1 when one failed or the run timed
    out, 128 + signal number when SIGINT or SIGTERM stopped it.

    Whatever happens -- a signal, a failing node, an exception in the launcher -- every child has been
    stopped (:meth:`Supervisor.stop`) before this returns or raises.
    """
    base = os.environ if env is None else env
    supervisor = Supervisor()
    live = {node.name: NodeMetrics() for node in job.nodes}
    tails = {node.name: MetricsTail(job.run_dir.metrics_path(node.name)) for node in job.nodes}
    started = time.time()
    deadline = None if job.timeout_s is None else time.monotonic() + job.timeout_s

    def tick(force: bool = False) -> None:
        for name, tail in tails.items():
            child = supervisor.children.get(name)
            live[name].add_all(tail.read_new(final=child is not None and child.returncode is not None))
        if progress is not None:
            views = [NodeView(n, supervisor.children[n].state, live[n]) for n in live if n in supervisor.children]
            progress.update(views, force=force)

    status = "failed"
    with SignalTrap() as trap:
        try:
            for node in job.nodes:
                node_vars = node_env(
                    base, node=node.name, config_path=job.run_dir.config_path, run_dir=job.run_dir.path,
                    threads=job.threads,
                )  # fmt: skip
                supervisor.start(node.name, job.command, env=node_vars, log_path=job.run_dir.log_path(node.name))
            status = _watch(supervisor, trap, deadline, not job.keep_going, tick)
            stop_quietly(supervisor, trap)
            tick(force=True)
            if status == "ok" and job.evaluate:
                status = _evaluate(job, supervisor, trap, deadline, base, progress)
        except OSError as err:
            click.echo(f"error: cannot start a node process: {err}", err=True)
            status = "failed"
        finally:
            stop_quietly(supervisor, trap)
            if progress is not None:
                progress.close()
        signum = trap.first
    if signum is not None:
        status = "interrupted"
    code = 0 if status == "ok" else 128 + signum if signum is not None else 1
    _finish(job, supervisor, status, code, signum, started)
    return code


def _watch(
    supervisor: Supervisor,
    trap: SignalTrap,
    deadline: float | None,
    fail_fast: bool,
    tick: Callable[[], None],
) -> str:
    """Poll until every child has exited (``ok`` or ``failed``), one failed (``failed``, if ``fail_fast``),
    a signal arrived (``interrupted``) or the deadline passed (``timeout``). Does not stop anything."""
    while True:
        exited = supervisor.poll()
        tick()
        if trap.received:
            return "interrupted"
        if fail_fast and any(child.state == "failed" for child in exited):
            return "failed"
        if not supervisor.running():
            return "failed" if any(c.state == "failed" for c in supervisor.children.values()) else "ok"
        if deadline is not None and time.monotonic() >= deadline:
            return "timeout"
        time.sleep(POLL_S * 2)


def _evaluate(
    job: Job,
    supervisor: Supervisor,
    trap: SignalTrap,
    deadline: float | None,
    base: Mapping[str, str],
    progress: Progress | None,
) -> str:
    """Run ``python -m dpwa.demo --evaluate RUN_DIR`` (averaged model vs single-process baseline) with every core."""
    if progress is not None:
        progress.message("evaluating the averaged model and a single-process baseline ...")
    helper_env = node_env(
        base, node=None, config_path=job.run_dir.config_path, run_dir=job.run_dir.path, threads=usable_cores()
    )
    argv = [sys.executable, "-m", DEMO_MODULE, "--evaluate", str(job.run_dir.path)]
    supervisor.start("evaluate", argv, env=helper_env, log_path=job.run_dir.evaluate_log)
    return _watch(supervisor, trap, deadline, True, lambda: None)


def _finish(job: Job, supervisor: Supervisor, status: str, code: int, signum: int | None, started: float) -> None:
    """Write ``summary.json`` and print the table, the demo's numbers, failing logs and the run directory."""
    nodes: dict[str, dict[str, Any]] = {}
    for node in job.nodes:
        child = supervisor.children.get(node.name)
        metrics = NodeMetrics.of(job.run_dir.read_metrics(node.name))
        nodes[node.name] = {
            "host": node.host,
            "port": node.port,
            "status": child.state if child is not None else "not started",
            "returncode": None if child is None else child.returncode,
            "exit": None if child is None else child.describe_exit(),
            "pid": None if child is None else child.pid,
            "log": job.run_dir.log_path(node.name).name,
            "metrics": job.run_dir.metrics_path(node.name).name,
            **metrics.summary(),
        }
    summary: dict[str, Any] = {
        "version": 1,
        "run_dir": str(job.run_dir.path),
        "config": job.config.source,
        "command": job.command,
        "host": socket.gethostname(),
        "threads_per_node": job.threads,
        "started": _iso(started),
        "ended": _iso(time.time()),
        "duration_s": round(time.time() - started, 3),
        "outcome": status,
        "exit_code": code,
        "ok": status == "ok",
        "nodes": nodes,
    }
    evaluation = supervisor.children.get("evaluate")
    demo = job.run_dir.read_demo() if evaluation is not None and evaluation.state == "ok" else None
    if job.evaluate:
        summary["demo"] = demo
    try:
        job.run_dir.write_summary(summary)
    except OSError as err:
        click.echo(f"error: cannot write {job.run_dir.summary_path}: {err}", err=True)

    click.echo(summary_table(nodes))
    if demo is not None:
        click.echo(
            f"averaged model accuracy {_num(demo.get('averaged_accuracy'))}, "
            f"single-process baseline {_num(demo.get('baseline_accuracy'))}"
        )
    elif not job.evaluate and job.command[1:3] == ["-m", DEMO_MODULE] and status == "ok":
        click.echo("(averaged-model evaluation skipped: it needs every node of the file in one run directory)")
    for child in supervisor.children.values():
        if child.state == "failed":
            click.echo(f"{child.name} failed ({child.describe_exit()}); last lines of {child.log_path}:", err=True)
            for line in tail_lines(child.log_path, TAIL_LINES):
                click.echo(f"    {line}", err=True)
    if status == "interrupted" and signum is not None:
        click.echo(f"interrupted by {signal.Signals(signum).name}: stopped every process this run started", err=True)
    elif status == "timeout":
        click.echo(f"timed out after {job.timeout_s:g} s: stopped the processes still running", err=True)
    click.echo(f"run dir: {job.run_dir.path}")


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def _num(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


# --------------------------------------------------------------------------- the command


class _RunCommand(click.Command):
    """Launcher options may stand anywhere before SCRIPT; SCRIPT and everything after it go to the script.

    ``dpwa run cluster.yaml --steps 50`` and ``dpwa run --node w1 cluster.yaml train.py --lr 0.1 --node x``
    both parse as meant: a ``--`` is inserted before the second positional argument.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        valued = {o for p in self.params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
        return super().parse_args(ctx, _split_at_script(args, valued))

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return ["[OPTIONS]", "CLUSTER.yaml", "[SCRIPT [ARGS]...]"]


def _split_at_script(args: Sequence[str], valued: set[str]) -> list[str]:
    """``args`` with ``--`` before the second positional argument (SCRIPT), unless a ``--`` comes first."""
    positional = 0
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == "--":
            break
        if arg.startswith("-") and arg != "-":
            skip = arg in valued
            continue
        positional += 1
        if positional == 2:
            return [*args[:i], "--", *args[i:]]
    return list(args)


def _die(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


@click.command("run", cls=_RunCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("cluster", metavar="CLUSTER.yaml")
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--steps", type=click.IntRange(min=1), help="Batches per node of the built-in demo (not with SCRIPT).")
@click.option(
    "--node",
    "node_names",
    multiple=True,
    metavar="NAME",
    help="Start only this node; repeatable. One `dpwa run` per host for a multi-machine cluster.",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Run directory  [default: runs/<YYYYmmdd-HHMMSS>, under SLURM runs/slurm-<job>.<step>]",
)
@click.option(
    "--timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    help="Stop everything after this many seconds and exit 1.",
)
@click.option("--threads", type=click.IntRange(min=1), help="Threads per node  [default: usable cores // local nodes]")
@click.option("--keep-going", is_flag=True, help="Keep the other nodes running when one fails.")
@click.option("--quiet", "-q", is_flag=True, help="No live progress (the summary is still printed).")
def run(
    cluster: str,
    script: str | None,
    script_args: tuple[str, ...],
    steps: int | None,
    node_names: tuple[str, ...],
    run_dir: Path | None,
    timeout_s: float | None,
    threads: int | None,
    keep_going: bool,
    quiet: bool,
) -> None:
    """Start this machine's nodes of CLUSTER.yaml, each running SCRIPT with ARGS (default: the built-in demo).

    A node runs here when its host is this machine (localhost, 127.x, this host's names and addresses),
    or when named with --node. Under SLURM (SLURM_PROCID and SLURM_NTASKS set, no --node) each task
    starts node number SLURM_PROCID, so `srun dpwa run cluster.yaml train.py` starts one node per task.

    Every node process gets DPWA_NODE, DPWA_CONFIG (the resolved copy in the run directory),
    DPWA_RUN_DIR, and OMP/MKL/OPENBLAS_NUM_THREADS and DPWA_TORCH_THREADS so the nodes share the cores.
    Its output goes to RUN_DIR/<node>.log. Without SCRIPT each node runs `python -m dpwa.demo`, and once
    all succeeded the averaged model is compared with a single-process baseline.

    Ctrl-C or SIGTERM stops every process the run started (SIGTERM, then SIGKILL after 3 s).
    Exit status: 0 all nodes succeeded; 1 a node failed or --timeout-s passed; 2 a bad cluster file
    or usage; 130/143 interrupted.
    """
    try:
        config = load_config(cluster)
    except ConfigError as err:
        fail(err)
    if script is None:
        if importlib.util.find_spec(DEMO_MODULE) is None:
            _die(f"the built-in demo ({DEMO_MODULE}) is not installed; give a SCRIPT to run")
        command = [sys.executable, "-m", DEMO_MODULE, *(["--steps", str(steps)] if steps is not None else [])]
    else:
        if steps is not None:
            raise click.UsageError("--steps is for the built-in demo; pass SCRIPT its own options after its name")
        if not os.path.isfile(script):
            _die(f"{script}: no such file")
        command = [sys.executable, os.path.abspath(script), *script_args]
    try:
        nodes, warnings = select_nodes(config, node_names)
    except ConfigError as err:
        fail(err)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)

    directory = RunDir(run_dir if run_dir is not None else default_run_dir())
    evaluate = script is None and len(nodes) == len(config.nodes)
    try:
        directory.prepare([node.name for node in nodes], evaluate=evaluate)
        directory.write_config(config)
    except OSError as err:
        _die(f"{directory.path}: cannot write the run directory: {err.strerror or err}")
    per_node = threads if threads is not None else threads_per_node(len(nodes))
    if not quiet:
        names = ", ".join(node.name for node in nodes)
        plural = "s" if per_node != 1 else ""
        click.echo(f"dpwa run: {names} ({per_node} thread{plural} each); run dir {directory.path}", err=True)
    job = Job(config, nodes, command, directory, per_node, evaluate, timeout_s, keep_going)
    progress = None if quiet else Progress(sys.stderr)
    sys.exit(run_job(job, progress=progress))
