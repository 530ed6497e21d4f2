"""Child processes of ``dpwa run``: start each in its own session, watch, stop them all -- and nothing else.

* :class:`Supervisor` starts each child in its own session (process group id == its pid) with
  stdin from /dev/null and stdout+stderr into its log file. :meth:`Supervisor.stop` sends SIGTERM to
  each child's process group, waits up to a grace period, then SIGKILLs what is left, and waits
  again -- every wait has a deadline. It only ever signals the process groups of children it
  started, and only while that group still has members (its id cannot have been reused then).
* On Linux each child also asks for SIGTERM should the launcher die without cleaning up (even by
  SIGKILL): ``prctl(PR_SET_PDEATHSIG)``. And a guard process (:mod:`~dpwa.launcher.lifeline`, started with the
  first child, ended by :meth:`Supervisor.close`) stops the children's process groups -- SIGTERM, then SIGKILL --
  should the launcher die first: a node that ignores SIGTERM, and what a node started, do not outlive it.
* :class:`SignalTrap` turns SIGINT/SIGTERM into a flag while children run and restores the
  previous handlers on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from dpwa.launcher.lifeline import GRACE_S, KILL_WAIT_S, Lifeline, groups_with_live_members

log = logging.getLogger(__name__)

__all__ = [
    "KILL_WAIT_S",
    "POLL_S",
    "STOP_GRACE_S",
    "Child",
    "SignalTrap",
    "Supervisor",
    "stop_and_close",
    "stop_quietly",
]

STOP_GRACE_S = GRACE_S
"""How long stopped children get to exit after SIGTERM before SIGKILL (the guard's too)."""
POLL_S = 0.05


@dataclasses.dataclass
class Child:
    """One process started by a :class:`Supervisor`; ``state`` is running, ok, failed or stopped."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    started: float
    ended: float | None = None
    stopped: bool = False  # the supervisor signalled it

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    @property
    def state(self) -> str:
        if self.returncode is None:
            return "running"
        if self.stopped:
            return "stopped"
        return "ok" if self.returncode == 0 else "failed"

    def describe_exit(self) -> str:
        """E.g. ``exit status 1`` or ``killed by SIGSEGV``."""
        code = self.returncode
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"


class Supervisor:
    """The processes one launcher started, and the only code that signals them.

    Each child leads its own process group (``start_new_session``); signals go to the group, so a
    node's own helpers (e.g. data-loader workers) are stopped with it. A group is signalled only
    while it still has members, so its id cannot have been handed to an unrelated process.
    """

    def __init__(self) -> None:
        self.children: dict[str, Child] = {}
        self.previous: dict[str, list[Child]] = {}  # earlier processes of a restarted child, oldest first
        self._groups: set[int] = set()  # process groups that may still have members
        self._killed: set[int] = set()  # groups already sent SIGKILL
        self._leftovers: dict[int, float] = {}  # groups an exited child left behind -> when SIGKILL follows SIGTERM
        self._preexec = _die_with_parent()
        self._lifeline: Lifeline | None = None

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        cwd: str | os.PathLike[str] | None = None,
        append: bool = False,
        replace: bool = False,
    ) -> Child:
        """Start ``argv`` as child ``name``, its stdout and stderr going to ``log_path`` (truncated unless
        ``append``). ``replace``: ``name`` may be a child that has exited (a restart; the old one moves to
        ``previous[name]``); a running child's name is always a ValueError."""
        old = self.children.get(name)
        if old is not None and (not replace or old.returncode is None):
            raise ValueError(f"a child named {name!r} was already started")
        if self._lifeline is None:  # before the first child: a launcher killed right after it still has its guard
            self._lifeline = Lifeline()
        with open(log_path, "ab" if append else "wb") as log_file:
            popen = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self._preexec,  # only prctl, getppid and kill run between fork and exec
                close_fds=True,
            )
        child = Child(name, popen, log_path, time.monotonic())
        if old is not None:
            self.previous.setdefault(name, []).append(old)
        self.children[name] = child
        self._groups.add(popen.pid)
        self._lifeline.add(popen.pid)
        log.info("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
        return child

    def running(self) -> list[Child]:
        return [c for c in self.children.values() if c.returncode is None]

    def poll(self) -> list[Child]:
        """Reap children that exited since the last call and return them; terminate what they left behind."""
        exited = []
        for child in self.children.values():
            if child.returncode is None and child.popen.poll() is not None:
                child.ended = time.monotonic()
                exited.append(child)
                log.info("%s (pid %d) ended: %s", child.name, child.pid, child.describe_exit())
                if child.pid in self._live_groups([child.pid]) and not child.stopped:
                    log.warning("%s exited but left processes in its group; terminating them", child.name)
                    self._signal_group(child.pid, signal.SIGTERM)
                    self._leftovers[child.pid] = time.monotonic() + STOP_GRACE_S
        self._end_leftovers()
        return exited

    def _end_leftovers(self) -> None:
        """SIGKILL what exited children left behind and SIGTERM did not end within the grace period."""
        now = time.monotonic()
        for pgid, deadline in list(self._leftovers.items()):
            if pgid not in self._live_groups([pgid]):
                del self._leftovers[pgid]
            elif now >= deadline and pgid not in self._killed:
                self._killed.add(pgid)
                log.warning("process group %d outlived its node by %.0f s after SIGTERM; sending SIGKILL", pgid,
                            STOP_GRACE_S)  # fmt: skip
                self._signal_group(pgid, signal.SIGKILL)

    def left_behind(self, name: str) -> bool:
        """Whether child ``name`` has exited but processes of its group still live (a restart waits for them)."""
        child = self.children.get(name)
        return child is not None and child.returncode is not None and child.pid in self._live_groups([child.pid])

    def stop(
        self,
        grace_s: float = STOP_GRACE_S,
        kill_wait_s: float = KILL_WAIT_S,
        hurry: Callable[[], bool] = lambda: False,
    ) -> None:
        """Stop every child and its process group: SIGTERM, up to ``grace_s`` to exit, SIGKILL, up to
        ``kill_wait_s`` more. ``hurry()`` true (e.g. a second Ctrl-C) cuts the grace period short.
        Returns when every group is gone or the deadlines have passed (then it logs an error).
        """
        self.poll()
        for child in self.running():
            child.stopped = True
        pending = sorted(self._live_groups(self._groups - self._killed))
        if not pending:  # nothing left, or only groups SIGKILL could not end (already waited for)
            return
        for pgid in pending:
            self._signal_group(pgid, signal.SIGTERM)
        self._wait_groups(pending, time.monotonic() + grace_s, hurry)
        left = sorted(self._live_groups(pending))
        for pgid in left:
            self._killed.add(pgid)
            log.warning("process group %d did not stop after SIGTERM; sending SIGKILL", pgid)
            self._signal_group(pgid, signal.SIGKILL)
        if left:
            self._wait_groups(left, time.monotonic() + kill_wait_s, lambda: False)
        still = sorted(self._live_groups(left))
        if still:  # pragma: no cover - the kernel did not deliver SIGKILL in time
            log.error("process groups %s still alive after SIGKILL", still)

    # ------------------------------------------------------------------ internals

    def _wait_groups(self, groups: list[int], deadline: float, hurry: Callable[[], bool]) -> None:
        while True:
            self.poll()
            if not self._live_groups(groups):
                return
            if time.monotonic() >= deadline or hurry():
                return
            time.sleep(POLL_S)

    def _child_of(self, pgid: int) -> Child | None:
        return next((c for c in self.children.values() if c.pid == pgid), None)

    def _leader_running(self, pgid: int) -> bool:
        child = self._child_of(pgid)
        return child is not None and child.returncode is None

    def _live_groups(self, pgids: Iterable[int]) -> set[int]:
        """Those of ``pgids`` (groups this supervisor created) that still have a live member.

        A group whose leader is not reaped is live. Once the leader is reaped, the group id stays
        reserved by the kernel for as long as any member (even a zombie) remains, so looking it up
        cannot find another program's group. Groups found empty -- or holding only zombies, which a
        container's init may never reap -- are forgotten and never signalled again.
        """
        wanted = set(pgids) & self._groups
        live = {pgid for pgid in wanted if self._leader_running(pgid)}
        orphaned = wanted - live
        if orphaned:
            found = groups_with_live_members(orphaned)
            self._forget(orphaned - found)
            live |= found
        return live

    def _forget(self, pgids: Iterable[int]) -> None:
        """Groups found without a live member: never signalled again (by this supervisor, nor by its guard)."""
        for pgid in pgids:
            if pgid in self._groups:
                self._groups.discard(pgid)
                if self._lifeline is not None:
                    self._lifeline.remove(pgid)

    def close(self) -> None:
        """End the guard process (:mod:`~dpwa.launcher.lifeline`): the launcher has stopped its children itself.
        Call it after :meth:`stop`; a supervisor closed while children run leaves them unguarded."""
        if self._lifeline is not None:
            self._lifeline.close()

    def _signal_group(self, pgid: int, sig: signal.Signals) -> None:
        if pgid not in self._groups:
            return
        try:
            os.killpg(pgid, sig)
            log.debug("sent %s to process group %d", sig.name, pgid)
        except ProcessLookupError:
            self._forget([pgid])
        except OSError as err:  # pragma: no cover
            if err.errno != errno.EPERM:
                raise
            log.warning("not allowed to signal process group %d", pgid)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child if the launcher dies (even by SIGKILL).

    Best effort: None where ``prctl`` is not available. Between fork and exec the child runs only ``prctl`` (resolved
    before the fork), ``getppid`` and ``kill``: no lock another thread of the launcher (numpy's BLAS workers) holds.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1
    term = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, term, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), term)

    return preexec


class SignalTrap:
    """While active, SIGINT, SIGTERM and SIGHUP (the terminal or ssh session closed) are recorded in ``received``
    instead of ending the launcher.

    Previous handlers are restored on exit. Outside the main thread (where handlers cannot be set)
    it records nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalTrap:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                log.debug("cannot trap %s outside the main thread", sig.name)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        log.info("received %s", signal.Signals(signum).name)

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None


def stop_quietly(supervisor: Supervisor, trap: SignalTrap | None = None) -> None:
    """:meth:`Supervisor.stop`, hurried by a second signal on ``trap``; never raises OSError."""
    with contextlib.suppress(OSError):
        supervisor.stop(hurry=(lambda: len(trap.received) >= 2) if trap is not None else (lambda: False))


def stop_and_close(supervisor: Supervisor, trap: SignalTrap | None = None) -> None:
    """The end of a run: :func:`stop_quietly`, then :meth:`Supervisor.close` (the guard ends) even if stopping
    raised."""
    try:
        stop_quietly(supervisor, trap)
    finally:
        supervisor.close()


# --------------------------------------------------------------------------- the run
