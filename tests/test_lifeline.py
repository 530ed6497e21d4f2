"""The launcher's lifeline (dpwa/launcher/lifeline.py): the guard stops the groups it was told of when its pipe ends
without ``done`` -- SIGTERM, then SIGKILL for a process that ignores it -- and nothing when the launcher said
``done`` or the groups are already empty; a supervisor's ``close`` ends the guard. The end-to-end case (a SIGKILLed
``dpwa run``) is in tests/test_launcher.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until

from dpwa.launcher import lifeline
from dpwa.launcher.supervisor import Supervisor

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def stubborn() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a group of its own that ignores SIGTERM (killed at teardown if a test left it)."""
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _run_guard(fd: int, result: list[int]) -> threading.Thread:
    thread = threading.Thread(target=lambda: result.append(lifeline.guard(fd, 0.05, 0.3, 5.0)), daemon=True)
    thread.start()
    return thread


def test_a_pipe_that_ends_without_done_stops_the_groups_even_through_an_ignored_sigterm(
    stubborn: subprocess.Popen[bytes],
) -> None:
    read, write = os.pipe()
    result: list[int] = []
    thread = _run_guard(read, result)
    try:
        os.write(write, f"junk\n+x\n+{stubborn.pid}\n".encode())  # malformed lines are ignored
        time.sleep(0.2)  # seconds: a few of the guard's checks pass with the group alive; it is kept
    finally:
        os.close(write)  # the launcher died
    thread.join(15.0)
    os.close(read)
    assert result == [1]
    assert stubborn.wait(timeout=5) == -signal.SIGKILL  # SIGTERM was ignored; SIGKILL after the grace


def test_done_leaves_the_groups_alone(stubborn: subprocess.Popen[bytes]) -> None:
    read, write = os.pipe()
    result: list[int] = []
    thread = _run_guard(read, result)
    os.write(write, f"+{stubborn.pid}\ndone\n".encode())
    thread.join(15.0)
    os.close(write)
    os.close(read)
    assert result == [0] and stubborn.poll() is None


def test_a_group_of_zombies_only_is_forgotten_and_never_signalled(tmp_path: Path) -> None:
    """The group's leader has exited and is not reaped yet (a zombie holds its id, so no other process can take
    it): the guard counts the group empty and leaves it alone."""
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    os.waitid(os.P_PID, done.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    read, write = os.pipe()
    result: list[int] = []
    thread = _run_guard(read, result)
    os.write(write, f"+{done.pid}\n".encode())
    os.close(write)
    thread.join(15.0)
    os.close(read)
    assert result == [0]  # nothing was left to stop
    assert done.wait(timeout=5) == 0


def test_a_supervisor_starts_its_guard_with_its_first_child_and_close_ends_it(tmp_path: Path) -> None:
    sup = Supervisor()
    child = sup.start("w1", [sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ),
                      log_path=tmp_path / "w1.log")  # fmt: skip
    try:
        assert sup._lifeline is not None
        guard = sup._lifeline.pid
        assert guard is not None and _alive(guard)
        sup.stop(grace_s=2.0)
    finally:
        sup.close()
    assert child.returncode is not None
    wait_until(lambda: not _alive(guard), 5.0, message="the guard exited")
    sup.close()  # idempotent


def test_the_guard_never_takes_group_0_1_or_its_own() -> None:
    assert not any(lifeline._may_signal(pgid) for pgid in (0, 1, os.getpgrp()))
    assert lifeline._may_signal(os.getpgrp() + 1)


def test_a_guard_whose_stderr_nobody_reads_still_stops_the_groups(stubborn: subprocess.Popen[bytes]) -> None:
    """The launcher's stderr is a pipe its parent stopped reading, full: the guard still stops the groups and
    exits (its line is lost), and the pipe's write end, shared with the launcher, stays blocking."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_end, b"x" * 65536)
    os.set_blocking(write_end, True)
    guard = subprocess.Popen(
        [sys.executable, "-I", "-S", lifeline.__file__], stdin=subprocess.PIPE, stderr=write_end, start_new_session=True
    )
    os.close(write_end)
    try:
        assert guard.stdin is not None
        guard.stdin.write(f"+{stubborn.pid}\n".encode())
        guard.stdin.close()  # the launcher died
        assert guard.wait(timeout=lifeline.GRACE_S + lifeline.KILL_WAIT_S + 10) == 1
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.wait(timeout=10)
        os.close(read_end)
