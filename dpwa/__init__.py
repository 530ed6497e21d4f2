"""dpwa: distributed pair-wise averaging — decentralized, asynchronous gossip training over ZeroMQ.

In a training script: ``dpwa.node_name()``, ``dpwa.rank()``, ``dpwa.world_size()`` (from ``dpwa run``, SLURM or
torchrun) and ``dpwa.shard(n_items, partition)`` (this node's part of the data).
"""

from dpwa.config import ClusterConfig, ConfigError, load_config
from dpwa.node.connection import DpwaConnection
from dpwa.shard import shard
from dpwa.world import World, WorldError, node_name, rank, whereami, world_size

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "DpwaConnection",
    "World",
    "WorldError",
    "load_config",
    "node_name",
    "rank",
    "shard",
    "whereami",
    "world_size",
]
__version__ = "0.1.0"
