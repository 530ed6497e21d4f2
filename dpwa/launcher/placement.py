"""Where nodes run: which nodes of a cluster file this launcher starts, and each node's environment.

* :func:`select_nodes` picks the nodes this launcher starts: the ``--node`` names; else, in a task of
  an ``srun`` step, node number ``SLURM_PROCID`` of the file; else (a batch script's own shell too)
  every node whose host is this machine (:class:`LocalHosts`). Problems are ConfigErrors.
* :func:`node_env` gives a node ``DPWA_NODE``, ``DPWA_CONFIG``, ``DPWA_RUN_DIR`` and sizes
  ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``DPWA_TORCH_THREADS``
  so the local nodes share the usable cores (:func:`threads_per_node`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from dpwa.config import ClusterConfig, NodeSpec
from dpwa.engines.slurm import in_slurm_step
from dpwa.utils.cores import ENV_TORCH_THREADS, usable_cores

log = logging.getLogger(__name__)

__all__ = [
    "ENV_CONFIG",
    "ENV_NODE",
    "ENV_RUN_DIR",
    "ENV_TORCH_THREADS",
    "LOOKUP_WORKERS",
    "THREAD_VARIABLES",
    "LocalHosts",
    "node_env",
    "select_nodes",
    "threads_per_node",
    "usable_cores",
]

ENV_NODE = "DPWA_NODE"
ENV_CONFIG = "DPWA_CONFIG"
ENV_RUN_DIR = "DPWA_RUN_DIR"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", ENV_TORCH_THREADS)

_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


# --------------------------------------------------------------------------- which nodes run here

LOOKUP_WORKERS = 16
"""The most host-name lookups :meth:`LocalHosts.learn` runs at once."""


def _key(host: str) -> str:
    """How a host is looked up and cached: ``[::1]`` and `` Example.COM `` as ``::1`` and ``example.com``."""
    return host.strip().strip("[]").lower()


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
        key = _key(host)
        if key not in self._cache:
            self._cache[key] = self._is_local(key)
            log.debug("host %r is %slocal", host, "" if self._cache[key] else "not ")
        return self._cache[key]

    def learn(self, hosts: Iterable[str], workers: int = LOOKUP_WORKERS) -> None:
        """Decide every host of ``hosts`` not decided yet, up to ``workers`` name lookups at once: a file of
        many hosts that do not resolve waits for the slowest lookup, not for their sum (each lookup keeps the
        resolver's own timeout)."""
        keys = [key for key in dict.fromkeys(_key(h) for h in hosts) if key not in self._cache]
        if len(keys) < 2:
            return
        with ThreadPoolExecutor(max_workers=min(workers, len(keys)), thread_name_prefix="dpwa-lookup") as pool:
            for key, local in zip(keys, pool.map(self._is_local, keys)):
                self._cache[key] = local

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
    Else, in a task of an ``srun`` step (:func:`~dpwa.engines.slurm.in_slurm_step`; not a batch script's own
    shell) with ``SLURM_NTASKS`` set, node number ``SLURM_PROCID`` (``SLURM_NTASKS`` must equal the number of
    nodes). Else every node whose host ``is_local``;
    none is a ConfigError naming the hosts of the file. A chosen node whose host does not look
    local is started anyway, with a warning.
    """
    env = os.environ if env is None else env
    local = is_local if is_local is not None else LocalHosts()
    if names:
        chosen = [config.node(name) for name in dict.fromkeys(names)]
    elif in_slurm_step(env) and env.get("SLURM_NTASKS") is not None:
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
