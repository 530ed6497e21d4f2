"""exit_now: a worker process ends with its code at once, its logs and output flushed, a live thread named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import logging, sys, threading
    from dpwa.utils.exiting import exit_now
    logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
    logging.getLogger("worker").info("saved the model")
    sys.stdout.write("no newline yet")  # buffered: only a flush gets it out
    sys.stderr.write("and on stderr")
    stop = threading.Event()
    if sys.argv[2] == "thread":
        threading.Thread(target=stop.wait, name="forgotten-thread").start()  # would keep a plain exit waiting
    exit_now(int(sys.argv[3]))
    """
)


def run(tmp_path: Path, thread: bool, code: int) -> tuple[subprocess.CompletedProcess[str], str]:
    log = tmp_path / "worker.log"
    argv = [sys.executable, "-c", SCRIPT, str(log), "thread" if thread else "-", str(code)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as in a pipe
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20, env=env)
    return done, log.read_text()


def test_the_code_the_logs_and_the_output_all_come_out(tmp_path: Path) -> None:
    done, log = run(tmp_path, thread=False, code=3)
    assert done.returncode == 3
    assert done.stdout == "no newline yet" and done.stderr.endswith("and on stderr")  # after any warnings
    assert "saved the model" in log and "WARNING" not in log


def test_a_live_thread_is_named_and_does_not_hold_the_exit(tmp_path: Path) -> None:
    done, log = run(tmp_path, thread=True, code=0)  # a plain sys.exit would wait on the thread: the timeout fails
    assert done.returncode == 0
    assert "exiting with threads still running: forgotten-thread" in log
