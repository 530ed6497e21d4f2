"""What a ZeroMQ TCP endpoint names: pure, no sockets."""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(endpoint: str) -> bool:
    """True when ``tcp://ADDRESS:PORT`` binds a loopback address (127.0.0.0/8, ::1 or localhost)."""
    host = endpoint.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
