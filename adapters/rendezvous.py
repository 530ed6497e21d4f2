"""torchrun / TorchElastic / Kubernetes PyTorchJob: the node list from a rendezvous in torch's TCPStore.

When RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set (torchrun sets them; so does a Kubeflow
PyTorchJob in every pod) and the cluster config has no ``nodes``, every worker:

1. takes the store at MASTER_ADDR:MASTER_PORT -- the one torchrun's agent already hosts when
   ``TORCHELASTIC_USE_AGENT_STORE`` is ``"True"``, else the one rank 0 hosts;
2. reserves a free port on its *advertised address* (``DPWA_ADVERTISE_ADDR``, else the address it
   reaches MASTER_ADDR from) and publishes ``name host port`` under
   ``dpwa/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/<rank>``; the name is
   ``<address>-<LOCAL_RANK>``, the same after a restart of the run;
3. waits, at most ``timeout_s``, for all WORLD_SIZE entries (the error names the missing ranks) and
   builds the cluster in memory -- unless some workers advertised a loopback address and others did not
   (:func:`unreachable_workers`): the training operator sets ``MASTER_ADDR=localhost`` in a PyTorchJob's
   master pod, whose address is then 127.0.0.1, which no other pod can reach. Every worker raises the same
   one-line error, naming ``DPWA_ADVERTISE_ADDR`` (the pod's IP, from the downward API).

A restart by TorchElastic (every worker restarted, RESTART_COUNT + 1) meets under a new prefix. The
core never sees torch: it gets a resolved :class:`~dpwa.config.ClusterConfig`.

Example::

    conn = DpwaPyTorchAdapter(model)     # under torchrun: no name, no file
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dpwa.config import ClusterConfig, NodeSpec
from dpwa.engines.join import ADVERTISE_ENV
from dpwa.engines.join import advertised_address as engine_address
from dpwa.engines.local import PortReservation, reserve_ports
from dpwa.engines.variables import TORCH_VARIABLES, env_int
from dpwa.utils.endpoints import is_loopback

__all__ = [
    "ADVERTISE_ENV",
    "RENDEZVOUS_TIMEOUT_S",
    "Rendezvous",
    "RendezvousError",
    "advertised_address",
    "rendezvous",
    "unreachable_workers",
]

RENDEZVOUS_TIMEOUT_S = 300.0
"""How long a worker waits for every rank to publish its address."""
POLL_S = 0.05
"""How often the missing ranks are looked up while waiting (each look is one store round trip)."""


class RendezvousError(RuntimeError):
    """The rendezvous could not complete; ``str()`` is one line (the variable, or the missing ranks)."""


@dataclass
class Rendezvous:
    """The outcome: the config with every worker's node, this worker's name, and its reserved port."""

    config: ClusterConfig
    name: str
    reservation: PortReservation


def advertised_address(env: Mapping[str, str], master: str, port: int) -> str:
    """``DPWA_ADVERTISE_ADDR``, else the local address this host reaches ``master:port`` from."""
    try:
        return engine_address(env, master, port)
    except OSError as err:
        raise RendezvousError(f"MASTER_ADDR={master!r}: {err}") from None


def unreachable_workers(nodes: Sequence[NodeSpec]) -> str | None:
    """Why some workers cannot be reached (None: all can): the ranks that advertised a loopback address while
    others advertised another -- one machine's loopback, behind which the others cannot fetch."""
    loopback = [rank for rank, node in enumerate(nodes) if is_loopback(node.endpoint)]
    if not loopback or len(loopback) == len(nodes):
        return None
    hosts = ", ".join(sorted({nodes[r].host for r in loopback}))
    return (
        f"ranks {loopback} of {len(nodes)} advertised a loopback address ({hosts}: MASTER_ADDR is local to them, as "
        "the training operator sets it in a PyTorchJob's master pod) and the others did not: no other host can "
        f"reach them; set {ADVERTISE_ENV} to each worker's own address (in Kubernetes: the pod's IP, "
        "valueFrom.fieldRef.fieldPath: status.podIP)"
    )


def rendezvous(
    settings: ClusterConfig, env: Mapping[str, str] | None = None, timeout_s: float = RENDEZVOUS_TIMEOUT_S
) -> Rendezvous:
    """Meet every worker of this launch in the TCPStore and return the cluster (see the module doc-string)."""
    from torch.distributed import TCPStore  # the adapter's layer: torch is allowed here

    env = os.environ if env is None else env
    missing = [name for name in TORCH_VARIABLES if not env.get(name)]
    if missing:
        raise RendezvousError(f"{', '.join(missing)}: not set; torchrun and PyTorchJob set all of {TORCH_VARIABLES}")
    rank, world = env_int(env, "RANK", RendezvousError), env_int(env, "WORLD_SIZE", RendezvousError, 1)
    master, master_port = env["MASTER_ADDR"], env_int(env, "MASTER_PORT", RendezvousError, 1)
    if rank >= world:
        raise RendezvousError(f"RANK={rank} is not below WORLD_SIZE={world}")
    local_rank = env_int(env, "LOCAL_RANK", RendezvousError) if env.get("LOCAL_RANK") else rank
    prefix = f"dpwa/{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    address = advertised_address(env, master, master_port)
    reservation = reserve_ports(1, address)
    try:
        try:
            store = TCPStore(
                master, master_port, is_master=rank == 0 and not agent_store,
                timeout=_dt.timedelta(seconds=timeout_s), wait_for_workers=False,
            )  # fmt: skip
        except (RuntimeError, OSError) as err:
            raise RendezvousError(f"MASTER_ADDR:MASTER_PORT={master}:{master_port}: no store ({err})") from None
        name = f"{address}-{local_rank}"
        store.set(f"{prefix}/{rank}", f"{name} {address} {reservation.ports[0]}")
        deadline = time.monotonic() + timeout_s
        keys = [f"{prefix}/{r}" for r in range(world)]
        while True:
            absent = [r for r, key in enumerate(keys) if not store.check([key])]
            if not absent:
                break
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rendezvous at {master}:{master_port}: after {timeout_s:g} s ranks {absent} of {world} "
                    "never published their address"
                )
            time.sleep(POLL_S)
        nodes = []
        for key in keys:
            entry_name, host, port = store.get(key).decode().split()
            nodes.append(NodeSpec(entry_name, host, int(port)))
        # rank 0 hosts the store: it stays until every worker has read it
        store.add(f"{prefix}/read", 1)
        if rank == 0 and not agent_store:
            while store.add(f"{prefix}/read", 0) < world and time.monotonic() < deadline:
                time.sleep(POLL_S)
        unreachable = unreachable_workers(nodes)
        if unreachable is not None:  # every worker read the same entries: each raises the same error
            raise RendezvousError(unreachable)
        return Rendezvous(settings.with_nodes(nodes), name, reservation)
    except BaseException:
        reservation.release()
        raise
