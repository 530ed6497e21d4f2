"""dpwa: distributed pair-wise averaging — decentralized, asynchronous gossip training over ZeroMQ."""

from dpwa.config import ClusterConfig, ConfigError, load_config
from dpwa.node.connection import DpwaConnection

__all__ = ["ClusterConfig", "ConfigError", "DpwaConnection", "load_config"]
__version__ = "0.1.0"
