"""The stdin command loop shared by the test worker processes (tests/node_worker.py, tests/adapter_worker.py,
tests/fault_worker.py).

A worker runs as a script, so tests/ is sys.path[0] and ``from worker_loop import serve`` works.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

Command = Callable[[list[str]], object]
"""A command's handler: gets the words after the command's name, returns the JSON-able answer."""


def answer(obj: object) -> None:
    """Write ``obj`` as one JSON line on stdout, flushed (the test reads it at once)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(ready: object, commands: dict[str, Command], close: Callable[[], None]) -> int:
    """Answer ``ready``, then every non-blank stdin line with exactly one JSON line, until ``quit`` or end of input.

    The first word names the command in ``commands``; an unknown one is answered ``{"error": ...}``. ``quit``
    calls ``close`` and answers ``{"closed": true}``; at end of input ``close`` is called without an answer.
    Returns the exit code: 0.
    """
    answer(ready)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            close()
            answer({"closed": True})
            return 0
        handler = commands.get(words[0])
        answer(handler(words[1:]) if handler is not None else {"error": f"unknown command {words[0]!r}"})
    close()
    return 0
