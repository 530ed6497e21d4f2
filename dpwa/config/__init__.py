"""Cluster configuration: the dataclasses (:mod:`dpwa.config.cluster`, the `join` address in :mod:`dpwa.config.join`,
YAML 1.2 numbers in :mod:`dpwa.config.yaml12`) and the cluster-file reader
(:mod:`dpwa.config.reading`).

``load_config(path)`` reads and validates a cluster file; every problem is a :class:`ConfigError` naming the file,
line, key and what is allowed. A :class:`ClusterConfig` built in Python is checked the same way on construction.
"""

from __future__ import annotations

from dpwa.config.cluster import (
    BOOTSTRAP_MODES,
    MEMORY,
    MEMORY_MODES,
    PEER_SCHEDULES,
    SHARED_MEMORY_MODES,
    ClusterConfig,
    ConfigError,
    NodeSpec,
    SecurityConfig,
    TransportConfig,
)
from dpwa.config.join import MAX_JOINED, JoinAddress, parse_join
from dpwa.config.reading import load_config, parse_config, resolve_config

__all__ = [
    "BOOTSTRAP_MODES",
    "MAX_JOINED",
    "MEMORY",
    "PEER_SCHEDULES",
    "ClusterConfig",
    "ConfigError",
    "JoinAddress",
    "NodeSpec",
    "SecurityConfig",
    "TransportConfig",
    "SHARED_MEMORY_MODES",
    "MEMORY_MODES",
    "load_config",
    "parse_config",
    "parse_join",
    "resolve_config",
]
