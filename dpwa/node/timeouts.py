"""Every time limit a node works with, in seconds, computed once from the cluster config.

A node's waits are all bounded; this object is where each bound is written down, with what it bounds. The node,
its transfers and its transport take it as an argument instead of recomputing ``timeout_ms / 1000`` or keeping
their own constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpwa.config import ClusterConfig

__all__ = ["Timeouts"]


@dataclass(frozen=True)
class Timeouts:
    """The node's time limits, in seconds (``control_reconnect_ms`` in milliseconds, as ZeroMQ takes it)."""

    exchange_s: float
    """``timeout_ms``: one fetch or push, from its start to its verdict; a push arriving in an inbox; SGP's wait for
    its in-neighbours' pushes; one JOIN attempt before it is repeated."""
    join_s: float
    """``join_timeout_s``: a joining node's whole wait for a member to admit it."""
    verdict_slack_s: float = 0.05
    """How long a waiter (update_wait, bootstrap) waits past a deadline for the TX thread's verdict."""
    announce_s: float = 0.5
    """How long a leaving node waits for its members' answers to its leave announcement (live ones answer at once)."""
    thread_join_s: float = 1.0
    """How long :meth:`close` waits for each dpwa thread to end, and the trainer for a dead one to close."""
    control_reconnect_ms: int = 10
    """How often a control socket (JOIN, MEMBERS) retries connecting to a member that is not listening yet (ZeroMQ's
    default, 100 ms, would start nodes that wait for each other that far apart)."""

    @property
    def lend_s(self) -> float:
        """How long a snapshot lent through shared memory stays lent without a RELEASE: four exchanges, at least
        10 s (the requester mixes it at its ``update_wait``, a training step after the fetch)."""
        return max(10.0, 4 * self.exchange_s)

    @property
    def leave_s(self) -> float:
        """A clean close's whole leave (hand-off, settle, announce): two exchanges."""
        return 2 * self.exchange_s

    @classmethod
    def of(cls, config: ClusterConfig) -> Timeouts:
        """The limits ``config`` sets (``timeout_ms``, ``join_timeout_s``); the rest at their defaults."""
        return cls(exchange_s=config.timeout_ms / 1000.0, join_s=config.join_timeout_s)
