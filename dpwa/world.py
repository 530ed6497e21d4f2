"""Who this process is in the cluster: its node name, its rank and the world size, from whatever started it.

Looked up in this order (the same order the PyTorch adapter resolves its node in):

1. ``name=`` / ``config=`` given to the call (a cluster file path or a ClusterConfig, and a node of it);
2. ``DPWA_NODE`` + ``DPWA_CONFIG``, set by ``dpwa run`` for every node it starts;
3. torchrun or a Kubeflow PyTorchJob: rank ``RANK`` of ``WORLD_SIZE``, named ``<address>-<LOCAL_RANK>`` as the
   adapter's rendezvous names it (or the cluster file's node number ``RANK``) -- also inside a SLURM job or step
   (``srun torchrun ...``): torchrun is the innermost launcher, its variables are this process's;
4. a task of a SLURM step (``srun``; not a batch script's own shell): rank ``SLURM_PROCID`` of ``SLURM_NTASKS``,
   named ``<host>-<SLURM_LOCALID>`` as :mod:`dpwa.engines.slurm` names the step's nodes (or the cluster file's
   node number ``SLURM_PROCID``).

The rank of a node is its index in the cluster's node list, which is also the index the built-in demo and the
benchmarks split the data by (:func:`dpwa.shard`). A node joining a running cluster (``DPWA_JOIN``) has a name
but no rank: the membership changes under it. Outside all of these, :class:`WorldError` says what to do.

Example::

    import dpwa
    print(dpwa.node_name(), dpwa.rank(), dpwa.world_size())   # under `dpwa run -n 4`: w1 0 4
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from dpwa.config import ClusterConfig, ConfigError, resolve_config
from dpwa.engines import EngineError, engine_nodes
from dpwa.engines.join import JOIN_ENV, advertised_address
from dpwa.engines.slurm import in_slurm_step
from dpwa.engines.variables import env_int, in_torch_launch

__all__ = ["ENV_CONFIG", "ENV_NODE", "World", "WorldError", "node_name", "rank", "whereami", "world_size"]

ENV_NODE = "DPWA_NODE"
ENV_CONFIG = "DPWA_CONFIG"

_OUTSIDE = (
    "this process was not started by `dpwa run`, srun or torchrun (no DPWA_NODE/DPWA_CONFIG, SLURM_STEP_ID or "
    "RANK/WORLD_SIZE; a batch script's own shell is no srun step), and no name= and config= were given"
)


class WorldError(RuntimeError):
    """This process's place in the cluster cannot be known; ``str()`` is one line saying why and what to do."""


@dataclasses.dataclass(frozen=True)
class World:
    """This process's node: ``name``, ``rank`` (index in the node list, ``0 <= rank < size``), ``size`` (number of
    nodes) and ``source`` (what said so, for messages)."""

    name: str
    rank: int
    size: int
    source: str


def _from_config(name: str, config: ClusterConfig | str | os.PathLike[str], source: str) -> World:
    try:
        settings = resolve_config(config)
        names = [node.name for node in settings.nodes]
        settings.node(name)  # a ConfigError naming the file, the line and the names when it is not there
    except ConfigError as err:
        raise WorldError(str(err)) from None
    return World(name, names.index(name), len(names), source)


def _from_slurm(env: Mapping[str, str], config: ClusterConfig | str | os.PathLike[str] | None) -> World:
    settings = resolve_config(config) if config is not None else ClusterConfig(source="srun")
    procid = env_int(env, "SLURM_PROCID", WorldError)
    if settings.nodes:
        tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
        if tasks and tasks.strip().isascii() and tasks.strip().isdigit() and int(tasks) != len(settings.nodes):
            raise WorldError(f"the SLURM step has {tasks} tasks but {settings.source} has {len(settings.nodes)} nodes")
        if procid >= len(settings.nodes):
            raise WorldError(f"SLURM_PROCID={procid} but {settings.source} has {len(settings.nodes)} nodes")
        return World(settings.nodes[procid].name, procid, len(settings.nodes), f"srun and {settings.source}")
    try:
        resolved, mine, _ = engine_nodes(settings, env)
    except EngineError as err:
        raise WorldError(str(err)) from None
    assert mine is not None
    return World(mine, procid, len(resolved.nodes), "the SLURM step")


def _from_torch(env: Mapping[str, str], config: ClusterConfig | str | os.PathLike[str] | None) -> World:
    rank_, size = env_int(env, "RANK", WorldError), env_int(env, "WORLD_SIZE", WorldError)
    if rank_ >= size:
        raise WorldError(f"RANK={rank_} is not below WORLD_SIZE={size}")
    settings = resolve_config(config) if config is not None else None
    if settings is not None and settings.nodes:
        if len(settings.nodes) != size:
            raise WorldError(f"WORLD_SIZE={size} but {settings.source} has {len(settings.nodes)} nodes")
        return World(settings.nodes[rank_].name, rank_, size, f"torchrun and {settings.source}")
    local = env_int(env, "LOCAL_RANK", WorldError) if env.get("LOCAL_RANK") else rank_
    master, port = env["MASTER_ADDR"], env_int(env, "MASTER_PORT", WorldError)
    try:
        address = advertised_address(env, master, port)
    except (OSError, TypeError, ValueError) as err:  # TypeError, ValueError: a host no resolver takes (non-ASCII)
        raise WorldError(f"MASTER_ADDR={master!r}: {err}") from None
    return World(f"{address}-{local}", rank_, size, "torchrun")


def whereami(
    name: str | None = None,
    config: ClusterConfig | str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> World:
    """This process's :class:`World` (the module doc-string says from what); WorldError when nothing says."""
    env = os.environ if env is None else env
    name = name if name is not None else env.get(ENV_NODE) or None
    config = config if config is not None else env.get(ENV_CONFIG) or None
    if env.get(JOIN_ENV) or _joins(config):
        raise WorldError(
            f"this node joins a running cluster ({JOIN_ENV}, or `join:` in its cluster file), so it has no fixed rank "
            "or world size (the membership changes); split the data by something else, e.g. its name"
        )
    try:
        if name is not None and config is not None:
            return _from_config(name, config, f"{ENV_NODE}/{ENV_CONFIG}" if env.get(ENV_NODE) == name else "config")
        if in_torch_launch(env):  # before SLURM: `srun torchrun` workers carry both, torchrun's are theirs
            return _from_torch(env, config)
        if in_slurm_step(env):
            return _from_slurm(env, config)
    except ConfigError as err:
        raise WorldError(str(err)) from None
    if name is None and config is None:
        raise WorldError(_OUTSIDE)
    given, missing = ("name", "config= (or DPWA_CONFIG)") if name is not None else ("config", "name= (or DPWA_NODE)")
    raise WorldError(f"a {given} alone does not say which node this is outside srun and torchrun: {missing} is missing")


def _joins(config: ClusterConfig | str | os.PathLike[str] | None) -> bool:
    """True when ``config`` says its nodes join a running cluster (``join:``, as `dpwa run -n N --join` writes)."""
    try:
        return config is not None and bool(resolve_config(config).join)
    except ConfigError:
        return False


def node_name(name: str | None = None, config: ClusterConfig | str | os.PathLike[str] | None = None) -> str:
    """This process's node name (see :func:`whereami`)."""
    return whereami(name, config).name


def rank(name: str | None = None, config: ClusterConfig | str | os.PathLike[str] | None = None) -> int:
    """This node's index in the cluster's node list, ``0 <= rank < world_size()`` (see :func:`whereami`)."""
    return whereami(name, config).rank


def world_size(name: str | None = None, config: ClusterConfig | str | os.PathLike[str] | None = None) -> int:
    """The number of nodes in the cluster (see :func:`whereami`)."""
    return whereami(name, config).size
