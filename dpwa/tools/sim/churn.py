"""Churn: nodes that crash, restart, join and leave at given simulated times.

``--churn crash:w3@2s,restart:w3@5s,leave:w7@4s,join:w65@3s``. A crash stops a node at once: it answers
nothing, what its inbox held and the verdicts of its pushes in flight are lost with it (the pushes still land), and
its peers find out as on the network (timeouts, then flow control marks it down). A restart brings it back with the
state it had at the crash: a step it was computing is trained again, one whose local update was applied (it waited
for its exchange) counts, its ``update_wait`` cut short with nothing arrived. A leave is clean: the node hands what
its rule holds to a member (push-sum: its whole weight, one last push) and every member forgets it. A join adds a
member that copies a live node's model (a bootstrap) and starts training; every member adds it.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Sequence

from dpwa.tools.sim.units import parse_duration

__all__ = ["ChurnEvent", "ChurnKind", "check_churn", "parse_churn"]


class ChurnKind(enum.StrEnum):
    """What happens to the node."""

    CRASH = "crash"
    RESTART = "restart"
    LEAVE = "leave"
    JOIN = "join"


@dataclasses.dataclass(frozen=True)
class ChurnEvent:
    """``kind`` happens to ``node`` at ``at_s`` simulated seconds."""

    kind: ChurnKind
    node: str
    at_s: float


def parse_churn(text: str) -> list[ChurnEvent]:
    """Comma-separated ``KIND:NODE@TIME`` items, sorted by time; ValueError names the bad item."""
    events = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"([a-z]+):([A-Za-z0-9_.-]+)@(.+)", item)
        if match is None or match.group(1) not in set(ChurnKind):
            raise ValueError(f"churn {item!r}: expected KIND:NODE@TIME with KIND one of {', '.join(ChurnKind)}")
        events.append(ChurnEvent(ChurnKind(match.group(1)), match.group(2), parse_duration(match.group(3))))
    return sorted(events, key=lambda e: e.at_s)


def check_churn(events: Sequence[ChurnEvent], nodes: int) -> None:
    """ValueError naming the first event that cannot happen to the simulation's nodes w1..w``nodes`` and those
    the earlier events joined: a crash, restart or leave of no such node, a join of a name already taken -- said
    before the run, not when its time comes (minutes into a large one)."""
    names = {f"w{i + 1}" for i in range(nodes)}
    for event in events:
        if event.kind is ChurnKind.JOIN:
            if event.node in names:
                raise ValueError(f"churn {event.kind}:{event.node}: {event.node} is a node already")
            names.add(event.node)
        elif event.node not in names:
            raise ValueError(f"churn {event.kind}:{event.node}: no node {event.node} (w1..w{nodes} and the joined)")
