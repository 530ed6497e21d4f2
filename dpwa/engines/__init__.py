"""Where a cluster's nodes come from when its file does not list them: the *engines* people run.

A cluster file may leave ``nodes`` out (or there may be no file: every setting has a default); then the
engine that started the job knows the nodes:

* ``dpwa run -n N`` -- N nodes on this machine, on ports no other ``dpwa run -n`` holds
  (:mod:`dpwa.engines.local`)::

      reservation = reserve_ports(4)               # held until the job ends
      config = config.with_nodes(local_nodes(reservation.ports))

* SLURM -- under ``srun``, one node per task of the step, computed by every task alone
  (:mod:`dpwa.engines.slurm`)::

      config, mine, source = engine_nodes(config, os.environ)   # mine: this task's node

Everything here reads the environment and the file system only (stdlib, and ``scontrol`` when it is on
PATH); it never imports torch, so the launcher, the CLI and the adapters share it.
"""

from __future__ import annotations

from collections.abc import Mapping

from dpwa.config import ClusterConfig, ConfigError
from dpwa.engines.local import PortReservation, local_nodes, reserve_ports
from dpwa.engines.slurm import SlurmError, in_slurm_step, slurm_nodes

__all__ = ["EngineError", "PortReservation", "engine_nodes", "local_nodes", "reserve_ports"]


class EngineError(ValueError):
    """No engine gives the nodes, or its variables are wrong; ``str()`` is one line."""


def engine_nodes(config: ClusterConfig, env: Mapping[str, str]) -> tuple[ClusterConfig, str | None, str]:
    """``config`` with its nodes, this process's node name when the engine says (else None), and the source.

    The file's ``nodes`` win; else a SLURM step (``srun``); else EngineError naming what to do."""
    if config.nodes:
        return config, None, "the cluster file's nodes"
    if in_slurm_step(env):
        try:
            nodes, mine = slurm_nodes(env, config.base_port)
            resolved = config.with_nodes(nodes)
        except SlurmError as err:
            raise EngineError(f"SLURM: {err}") from None
        except ConfigError as err:  # the step's nodes as a cluster (e.g. more than a member table carries)
            raise EngineError(f"SLURM: the step's {len(nodes)} tasks: {err.reason}") from None
        return resolved, mine, f"the SLURM step ({len(nodes)} tasks)"
    raise EngineError(
        f"no `nodes` in the file and no engine gave any: run `dpwa run -n N --config {config.source}` for local "
        "nodes, start it with srun, or list the nodes"
    )
