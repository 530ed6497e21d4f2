"""What a cluster's member table takes on the wire: bounded, so that the whole table always fits a message header
(64 KiB). The cluster file's nodes are checked against the budget when it is read; joined members beyond it are
refused by the table (:mod:`dpwa.node.members`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["TABLE_BUDGET_BYTES", "entry_bytes", "table_bytes"]

TABLE_BUDGET_BYTES = 48 * 1024
"""The most a member table may take on the wire (JSON), leaving the rest of a 64 KiB header to the message."""


class Named(Protocol):
    name: str
    host: str


def entry_bytes(name: str, host: str) -> int:
    """About what a member of ``name`` at ``host`` takes in a table on the wire (its JSON list, room for numbers)."""
    return len(name) + len(host) + 48


def table_bytes(nodes: Iterable[Named]) -> int:
    """What ``nodes`` take together in a table on the wire."""
    return sum(entry_bytes(node.name, node.host) for node in nodes)
