"""Ending one of dpwa's own worker processes the moment its work is saved, without the interpreter's teardown.

A process that imported torch spends about 0.35 s of CPU at exit tearing down its modules; the N nodes of a
``dpwa run`` on one machine pay it N times at the end of every run, on the cores a slower node still trains on.
Only for the ``python -m`` entry points of dpwa's workers (the demo, the bench workers), whose threads are stopped
and whose files are closed when ``main`` returns; never for a user's script.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_now"]

log = logging.getLogger(__name__)


def exit_now(code: int) -> NoReturn:
    """Flush the logging handlers, stdout and stderr, then end the process with ``code`` at once (``os._exit``).

    A thread still running (a non-daemon one would have kept the process alive) is logged by name first."""
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if alive:
        log.warning("exiting with threads still running: %s", ", ".join(alive))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can reach it
            pass
    os._exit(code)
