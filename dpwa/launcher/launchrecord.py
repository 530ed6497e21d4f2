"""Which launcher started which node of a run directory: ``launch.json``'s ``started_by``, so that
``dpwa run --resume`` run again in each launcher's place starts that launcher's nodes, and only those.

Several launchers may share one run directory: one per host (each with ``--node``), or one per task of an
``srun`` step (``srun dpwa run ...``, where every task writes ``runs/slurm-<job>``). Each launcher records its
nodes under its own key (:func:`launcher_key`): its SLURM task (``SLURM_PROCID``) inside an srun step, else
its host name. The records are merged under the run directory's lock (:func:`merge_launch`); ``--resume``
picks its own (:func:`nodes_to_resume`). Pure functions: the locking and the file are
:meth:`dpwa.launcher.rundir.RunDir.write_launch`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpwa.engines.slurm import in_slurm_step

__all__ = ["launcher_key", "merge_launch", "nodes_to_resume", "threads_to_resume"]


def launcher_key(env: Mapping[str, str], hostname: str) -> str:
    """This launcher's key: ``slurm task <SLURM_PROCID>`` in a task of an srun step (the same task of a step run
    again gets the same key, on whichever host), else ``host <hostname>``."""
    if in_slurm_step(env):
        return f"slurm task {env['SLURM_PROCID']}"
    return f"host {hostname}"


def _started_by(record: Mapping[str, Any]) -> dict[str, str] | None:
    """``record``'s node -> launcher map; None for a record without one (written before it was recorded);
    ValueError for one that is not a map of names to keys."""
    started = record.get("started_by")
    if started is None:
        return None
    if not isinstance(started, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in started.items()):
        raise ValueError(f"started_by must map node names to launchers, got {started!r}")
    return started


def merge_launch(old: Mapping[str, Any] | None, record: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``record`` (this launcher's: its ``nodes``, command, threads ...) merged into ``old`` (the file's record,
    or None): ``started_by`` maps every node to the launcher that started it -- ``old``'s entries kept, less
    this launcher's earlier ones and any naming one of its nodes now -- and ``nodes`` lists every node there,
    ``old``'s first. The other fields are ``record``'s (every launcher of a run runs one command)."""
    try:
        kept = _started_by(old or {}) or {}
    except ValueError:  # a damaged record: this launcher's entries start it anew
        kept = {}
    ours = list(record["nodes"])
    started = {node: by for node, by in kept.items() if by != key and node not in ours}
    started.update(dict.fromkeys(ours, key))
    threads = old.get("threads_of") if old is not None else None  # each host's share of its cores is its own
    threads_of = {by: n for by, n in (threads if isinstance(threads, dict) else {}).items() if by in started.values()}
    threads_of[key] = record["threads"]
    return {**record, "nodes": list(started), "started_by": started, "threads_of": threads_of}


def threads_to_resume(record: Mapping[str, Any], key: str) -> Any:
    """The threads per node the launcher ``key`` gave its nodes (``threads_of``), else the record's ``threads``
    (one launcher's run, or an older record): the caller checks the value."""
    threads_of = record.get("threads_of")
    if isinstance(threads_of, dict) and key in threads_of:
        return threads_of[key]
    return record["threads"]


def nodes_to_resume(record: Mapping[str, Any], key: str) -> list[str]:
    """The nodes ``--resume`` starts for the launcher ``key``: those it started; all of ``record``'s when one
    launcher started them all (resumed from anywhere) or the record names no launchers (an older one).
    ValueError saying where to resume when several launchers started them and none was ``key``."""
    nodes = [str(node) for node in record["nodes"]]
    started = _started_by(record)
    if started is None:
        return nodes
    mine = [node for node in nodes if started.get(node) == key]
    launchers = sorted(set(started.values()))
    if mine or len(launchers) <= 1:
        return mine or nodes
    where = "; ".join(f"{by}: {', '.join(n for n in nodes if started.get(n) == by)}" for by in launchers)
    raise ValueError(
        f"its nodes were started by {len(launchers)} launchers ({where}), none of them this one ({key}): "
        "run --resume in each launcher's place (the same host, or the same task of an srun step)"
    )
