"""The launcher's lifeline: a guard process that stops the launcher's children should the launcher die first.

A SIGKILLed launcher cannot stop its nodes. The kernel then sends each node SIGTERM (``PR_SET_PDEATHSIG``), but a
node that ignores SIGTERM, or a process a node started (the signal reaches only the direct child), would live on.
So a :class:`~dpwa.launcher.supervisor.Supervisor` starts one guard process with its first child
(:class:`Lifeline`) and tells it, on a pipe, each process group it starts (``+PGID``), each it found empty
(``-PGID``), and ``done`` once it has stopped them itself. When the pipe ends without ``done`` -- the launcher died
-- the guard stops every group it still knows as the launcher would have: SIGTERM, up to :data:`GRACE_S` seconds,
SIGKILL, up to :data:`KILL_WAIT_S` more; then it exits. It signals only groups the launcher started, and forgets a
group once it has no live member (checked every :data:`CHECK_S` seconds, and told by the supervisor as soon as it
sees one empty): a group id the kernel could hand out again is dropped as the supervisor drops it, the same short
check-then-signal window aside. A process a node moved out of its group (``setsid``) is not the guard's to stop.

The guard runs this file as a script (``python -I -S lifeline.py``), importing nothing but the standard library: it
starts in milliseconds and holds little memory. :func:`groups_with_live_members` is shared with the supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import IO

__all__ = [
    "CHECK_S",
    "CLOSE_WAIT_S",
    "GRACE_S",
    "KILL_WAIT_S",
    "Lifeline",
    "groups_with_live_members",
    "guard",
    "stop_groups",
]

log = logging.getLogger(__name__)

GRACE_S = 3.0
"""How long the groups get to exit after SIGTERM before SIGKILL (the supervisor's STOP_GRACE_S)."""
KILL_WAIT_S = 1.5
"""How long the guard waits for SIGKILLed groups to disappear."""
CHECK_S = 1.0
"""How often the guard forgets groups without a live member, in seconds."""
CLOSE_WAIT_S = 5.0
"""How long :meth:`Lifeline.close` waits for the guard to exit after ``done`` before it kills it."""
_POLL_S = 0.05


def groups_with_live_members(pgids: Iterable[int]) -> set[int]:
    """Those of ``pgids`` with at least one member that is not a zombie (from /proc; else by signal 0). A group
    whose leader still runs is found without reading the rest of /proc."""
    wanted = set(pgids)
    led = {pgid for pgid in wanted if _leads_live_group(pgid)}
    wanted -= led
    if not wanted:
        return led
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - no /proc (macOS): zombies count as members here
        return {pgid for pgid in wanted if _probe_group(pgid)}
    found = set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue  # exited meanwhile
        if len(fields) > 2 and fields[0] not in ("Z", "X") and int(fields[2]) in wanted:
            found.add(int(fields[2]))
    return found | led


def _leads_live_group(pgid: int) -> bool:
    """Whether process ``pgid`` runs (not a zombie) and leads group ``pgid`` (False when unknown: no /proc)."""
    try:
        with open(f"/proc/{pgid}/stat", encoding="utf-8", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return len(fields) > 2 and fields[0] not in ("Z", "X") and fields[2] == str(pgid)


def _probe_group(pgid: int) -> bool:  # pragma: no cover - used without /proc only
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- the guard process


def guard(fd: int, check_s: float = CHECK_S, grace_s: float = GRACE_S, kill_wait_s: float = KILL_WAIT_S) -> int:
    """Read the launcher's messages on ``fd`` until ``done`` (return 0) or the end of the pipe: then stop every
    group still known (:func:`stop_groups`) and return 1 if any was left to stop, else 0."""
    groups: set[int] = set()
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], check_s)
        if ready:
            data = os.read(fd, 4096)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if line == b"done":
                    return 0
                if line[:1] in (b"+", b"-") and line[1:].isdigit() and _may_signal(int(line[1:])):
                    (groups.add if line[:1] == b"+" else groups.discard)(int(line[1:]))
        groups &= groups_with_live_members(groups)
    live = groups_with_live_members(groups)
    if not live:
        return 0
    left = stop_groups(live, grace_s, kill_wait_s)  # first: a log line may block on a stderr nobody reads
    log.warning("dpwa lifeline: the launcher died; stopped the process groups it left: %s", sorted(live))
    if left:  # pragma: no cover - the kernel did not deliver SIGKILL in time
        log.error("dpwa lifeline: process groups %s still alive after SIGKILL", sorted(left))
    return 1


def _may_signal(pgid: int) -> bool:
    """A group id the guard may take: never 0 or 1 (kernel threads, init), nor its own group."""
    return pgid > 1 and pgid != os.getpgrp()


def stop_groups(groups: set[int], grace_s: float, kill_wait_s: float) -> set[int]:
    """SIGTERM each group, wait up to ``grace_s`` for them to empty, SIGKILL the rest, wait up to ``kill_wait_s``;
    the groups still alive after that (none, unless the kernel did not deliver SIGKILL in time)."""
    live = set(groups)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        for pgid in sorted(live):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while live and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            live = groups_with_live_members(live)
        if not live:
            break
    return live


# --------------------------------------------------------------------------- the launcher's side


class Lifeline:
    """The launcher's end of the pipe to its guard process (started here, in a session of its own so that a
    terminal's Ctrl-C reaches the launcher, not the guard). Nothing raises: a guard that cannot start or died is
    logged once and the launcher carries on without it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipe: IO[bytes] | None = None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
            self._pipe = self._proc.stdin
        except (OSError, TypeError, ValueError) as err:  # TypeError: no sys.executable (an embedded interpreter)
            log.warning(
                "cannot start the launcher's lifeline (%s): a SIGKILLed launcher leaves its nodes to SIGTERM", err
            )

    @property
    def pid(self) -> int | None:
        """The guard's pid (None when it could not start)."""
        return None if self._proc is None else self._proc.pid

    def add(self, pgid: int) -> None:
        """The launcher started process group ``pgid``."""
        self._send(f"+{pgid}")

    def remove(self, pgid: int) -> None:
        """Process group ``pgid`` has no member left."""
        self._send(f"-{pgid}")

    def _send(self, line: str) -> None:
        if self._pipe is None:
            return
        try:
            self._pipe.write(line.encode() + b"\n")
            self._pipe.flush()
        except OSError as err:  # the guard died: killed, or signalled with the launcher's whole cgroup
            level = logging.DEBUG if line == "done" else logging.WARNING
            log.log(
                level, "the launcher's lifeline is gone (%s): a SIGKILLed launcher leaves its nodes to SIGTERM", err
            )
            self._pipe = None

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Tell the guard the launcher stopped its children itself, and wait (up to ``wait_s``) for it to exit;
        kill it past that. Idempotent."""
        self._send("done")
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                self._pipe.close()
            self._pipe = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()  # our own child, by pid
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=wait_s)
            self._proc = None


def _main() -> int:
    """The guard process: no signal of the launcher's terminal or session reaches it (its own session); a SIGTERM
    sent to it ends it at once, leaving the groups alone."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=_stderr_without_blocking())
    logging.raiseExceptions = False  # a launcher's stderr gone with it: the groups are still stopped
    return guard(sys.stdin.fileno())


def _stderr_without_blocking() -> IO[str]:
    """The launcher's stderr opened anew, non-blocking: a full pipe nobody reads loses the guard's line rather than
    hang it, and the launcher's own descriptor stays as it was (O_NONBLOCK is a property of an open file, which a
    new open does not share); plain stderr where it cannot be reopened (a socket)."""
    try:
        fd = os.open("/proc/self/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return sys.stderr
    return os.fdopen(fd, "w", buffering=1)


if __name__ == "__main__":
    sys.exit(_main())
