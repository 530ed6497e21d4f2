"""SLURM: the node list of a job step, computed by every task alone from the variables ``srun`` sets.

One node per task, named ``<host>-<SLURM_LOCALID>``, listening on ``base_port + SLURM_LOCALID`` of its
host (``base_port`` from the cluster file, else :func:`derived_base_port`: a block of ports chosen by the job
and step IDs, so two jobs or steps sharing a host rarely meet), in SLURM's block order: the hosts of
``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``) in order, each with its count of ``SLURM_STEP_TASKS_PER_NODE``
(or ``SLURM_TASKS_PER_NODE``) tasks, so that task ``SLURM_PROCID`` is node number ``SLURM_PROCID`` of the list. A
layout that is not block (a cyclic distribution: task ``PROCID`` is not local task ``LOCALID`` of host ``NODEID`` in
block order) or a heterogeneous job is refused with one line naming the variable.

The compressed host list (``gpu[01-04,07],cpu9``) is expanded by ``scontrol show hostnames`` when it is on
PATH, else by :func:`expand_hostlist` (SLURM's syntax: comma-separated names, each with bracketed
ranges whose lower bound's digits set the zero-padding, several bracket groups multiplying out).
"""

from __future__ import annotations

import itertools
import math
import re
import shutil
import subprocess
import zlib
from collections.abc import Mapping

from dpwa.config import ConfigError, NodeSpec
from dpwa.engines.variables import env_int
from dpwa.utils.settings import clipped

__all__ = [
    "DERIVED_PORTS",
    "PORT_BLOCK",
    "derived_base_port",
    "SlurmError",
    "expand_hostlist",
    "expand_tasks_per_node",
    "in_slurm_step",
    "slurm_nodes",
]

DERIVED_PORTS = (10000, 19999)
"""Where :func:`derived_base_port` puts a step's ports: below ``dpwa run -n``'s range (20000-32767, whose ports it
locks; a step's nodes take no lock) and so below Linux's ephemeral range (no outgoing connection is given one)."""
PORT_BLOCK = 64
"""The ports of one step on one host: a derived base port starts a block of this many."""
SCONTROL_TIMEOUT_S = 10.0
MAX_STEP_TASKS = 100_000
"""The most hosts a step's variables may expand to: checked before expanding (``n[0-9999999999]`` would not end)."""
_STEP_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")


class SlurmError(ValueError):
    """The SLURM variables do not describe a step dpwa can lay out; ``str()`` is one line naming the variable."""


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """True in a task of an ``srun`` step: SLURM_STEP_ID, SLURM_PROCID, SLURM_LOCALID and SLURM_NODEID all set.
    A batch script's own shell (``sbatch``) has the last three too (each 0, SLURM_NTASKS with ``-n``), but no
    SLURM_STEP_ID: it is one process, not task 0 of a step."""
    return all(env.get(name) is not None for name in ("SLURM_STEP_ID", *_STEP_VARIABLES))


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmError(f"host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"host list {text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _range_values(text: str, spec: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]`` (the lower bound's width pads the range)."""
    out: list[str] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise SlurmError(f"host list {text!r}: {item!r} is not a number or a range a-b")
        lo, hi = match.group(1), match.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise SlurmError(f"host list {text!r}: range {item!r} runs backwards")
        if int(hi) - int(lo) + len(out) >= MAX_STEP_TASKS:
            raise SlurmError(f"host list {clipped(text)}: more than {MAX_STEP_TASKS} hosts")
        out += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list as names, in order: ``"gpu[01-02,07],cpu9"`` -> gpu01, gpu02, gpu07, cpu9."""
    if not text.strip():
        raise SlurmError("host list is empty")
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        if not part:
            raise SlurmError(f"host list {text!r}: an empty name")
        pieces = re.split(r"\[([^\]]*)\]", part)  # literal, range, literal, range, ..., literal
        choices = [[pieces[i]] if i % 2 == 0 else _range_values(text, pieces[i]) for i in range(len(pieces))]
        if any(not re.fullmatch(r"[A-Za-z0-9._-]*", pieces[i]) for i in range(0, len(pieces), 2)):
            raise SlurmError(f"host list {text!r}: {part!r} has a character a host name cannot have")
        if len(hosts) + math.prod(len(c) for c in choices) > MAX_STEP_TASKS:
            raise SlurmError(f"host list {clipped(text)}: more than {MAX_STEP_TASKS} hosts")
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None or int(match.group(1)) < 1 or (match.group(2) is not None and int(match.group(2)) < 1):
            raise SlurmError(f"tasks per node {text!r}: {item!r} is not N or N(xM) with N, M >= 1")
        if len(counts) + int(match.group(2) or 1) > MAX_STEP_TASKS:
            raise SlurmError(f"tasks per node {clipped(text)}: more than {MAX_STEP_TASKS} hosts")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _hosts(text: str, use_scontrol: bool) -> list[str]:
    scontrol = shutil.which("scontrol") if use_scontrol else None
    if scontrol is not None:
        try:
            done = subprocess.run(
                [scontrol, "show", "hostnames", text], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    return expand_hostlist(text)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str]:
    for name in names:
        if env.get(name):
            return name, env[name]
    raise SlurmError(f"{' / '.join(names)}: not set, so the step's hosts are unknown")


def derived_base_port(env: Mapping[str, str]) -> int:
    """The step's base port when the cluster file gives none: the start of one of the :data:`PORT_BLOCK`-port
    blocks of :data:`DERIVED_PORTS`, picked by a hash of ``SLURM_JOB_ID.SLURM_STEP_ID`` -- the same in every task
    of the step, and for two jobs (or two steps of one job) sharing a host a different block but for 1 chance in
    156. A fixed base port gave every job on a host the same ports, and the second to start could not bind."""
    lo, hi = DERIVED_PORTS
    blocks = (hi - lo + 1) // PORT_BLOCK
    key = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}".encode()
    return lo + (zlib.crc32(key) % blocks) * PORT_BLOCK


def slurm_nodes(
    env: Mapping[str, str], base_port: int | None = None, *, use_scontrol: bool = True
) -> tuple[tuple[NodeSpec, ...], str]:
    """Every node of this job step, in block order, and the name of this task's node (SlurmError if not);
    ``base_port`` None: :func:`derived_base_port`."""
    for name in ("SLURM_HET_SIZE", "SLURM_PACK_SIZE"):
        if env.get(name):
            raise SlurmError(f"{name}={env[name]!r}: a heterogeneous job; list the nodes in the cluster file")
    distribution = env.get("SLURM_DISTRIBUTION", "").split(":")[0].split(",")[0]  # the hosts' level: "block,Pack"
    procid, localid, nodeid = (env_int(env, name, SlurmError) for name in _STEP_VARIABLES)
    list_name, list_text = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    tasks_name, tasks_text = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    hosts = _hosts(list_text, use_scontrol)
    counts = expand_tasks_per_node(tasks_text)
    if len(counts) != len(hosts):
        raise SlurmError(f"{tasks_name}={tasks_text!r} gives {len(counts)} hosts but {list_name} has {len(hosts)}")
    for total_name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if env.get(total_name) and env_int(env, total_name, SlurmError) != sum(counts):
            raise SlurmError(f"{total_name}={env[total_name]!r} but {tasks_name}={tasks_text!r} sums to {sum(counts)}")
    if distribution not in ("", "block", "*") and max(counts) > 1:  # every task refuses, not only those out of place
        raise SlurmError(
            f"SLURM_DISTRIBUTION={env['SLURM_DISTRIBUTION']!r}: only block placement (or one task per host); "
            "srun -m block, or list the nodes"
        )
    if base_port is None:
        if max(counts) > PORT_BLOCK:
            raise SlurmError(
                f"{tasks_name}={tasks_text!r}: more than {PORT_BLOCK} tasks on a host, more than a derived block of "
                "ports holds; set base_port in the cluster file"
            )
        base_port = derived_base_port(env)
    if base_port + max(counts) - 1 > 65535:
        raise SlurmError(f"{tasks_name}={tasks_text!r}: base port {base_port} + {max(counts) - 1} tasks exceeds 65535")
    try:
        nodes = tuple(
            NodeSpec(f"{host}-{local}", host, base_port + local) for host, n in zip(hosts, counts) for local in range(n)
        )
    except ConfigError as err:  # a host no cluster file would take (".n1", a name over 128 characters)
        raise SlurmError(f"{list_name}={clipped(list_text)}: {err.reason}") from None
    if nodeid >= len(hosts) or localid >= counts[nodeid]:
        raise SlurmError(f"SLURM_NODEID={nodeid} / SLURM_LOCALID={localid}: no such task in {list_name}={list_text!r}")
    if sum(counts[:nodeid]) + localid != procid:
        raise SlurmError(
            f"SLURM_PROCID={procid} is not task {localid} of host {nodeid} in block order (a cyclic or arbitrary "
            "distribution); run with srun -m block, or list the nodes in the cluster file"
        )
    return nodes, nodes[procid].name
