"""Shared test helpers: free ports, cluster files, and node processes driven over pipes."""

from __future__ import annotations

import contextlib
import gc
import json
import queue
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from parts import pytest_addoption, pytest_collection_modifyitems  # noqa: F401 (hooks: pytest finds them here)

from dpwa.config import yaml12

if TYPE_CHECKING:
    import numpy as np

    from dpwa import DpwaConnection

HERE = Path(__file__).resolve().parent
WORKER = HERE / "node_worker.py"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Take the heap loaded by imports and collection out of the cyclic garbage collector (``gc.freeze``).

    A full collection walks every tracked object, and all threads of the process stand still meanwhile.
    With torch, numpy, hypothesis and ~960 collected tests loaded (about 340 000 objects) a full
    collection took 100-300 ms on a 2-core machine: longer than the 200 ms fetch deadlines of the
    timing tests, so a node's TX thread or a fake peer stalled by it turned a reply sent in time into
    a timeout. These objects live for the whole session anyway; frozen, they are never walked again.
    """
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (a due collection runs after it, at the next allocation).

    For a test that checks what a node does with a reply sent well within a short deadline: a collection
    landing inside the deadline stalls every thread of the process and makes the reply late.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_RESERVED: list[Any] = []  # the port reservations of the running test, given back when it ends


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1, reserved as ``dpwa run -n`` reserves its own: free a moment ago,
    below the kernel's ephemeral range (no outgoing connection takes one as its source port before the test's
    node binds it; one did, with ``bind(0)``'s ports) and locked against the other worker's tests and every dpwa
    launcher until the test ends."""
    from dpwa.engines.local import reserve_ports

    reservation = reserve_ports(n)
    _RESERVED.append(reservation)
    return list(reservation.ports)


@pytest.fixture(autouse=True)
def _release_reserved_ports() -> Iterator[None]:
    """Give back the ports :func:`free_ports` reserved during the test (a port still bound by a module's
    nodes stays theirs: a reservation skips a port it cannot bind)."""
    yield
    while _RESERVED:
        _RESERVED.pop().release()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when host:port can be bound right now, as a server (and ZeroMQ) binds: with SO_REUSEADDR."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def write_cluster(path: Path, ports: list[int], **settings: Any) -> Path:
    """A mapping-format cluster file with nodes w1..wN on 127.0.0.1."""
    doc = {"nodes": [{"name": f"w{i + 1}", "host": "127.0.0.1", "port": p} for i, p in enumerate(ports)]}
    doc.update(settings)
    path.write_text(yaml12.dump(doc, sort_keys=False))
    return path


def wait_until(condition: Callable[[], Any], timeout: float, interval: float = 0.02, message: str = "") -> Any:
    """Poll ``condition`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s: {message or condition}")
        time.sleep(interval)


def in_threads(n: int, body: Callable[[int], None], timeout: float = 120.0) -> None:
    """Run ``body(i)`` for i in 0..n-1, each in its own thread (one trainer per node); fail the test if one
    is still running after ``timeout`` seconds or raised (its exception is shown)."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            body(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a trainer thread hung"
    assert not errors, errors


@contextlib.contextmanager
def publishing_flat_out(conn: Any, size: int) -> Iterator[None]:
    """While the block runs, ``conn`` publishes generation ``g`` as every element = v(g) = ``g % 128 + 1`` at each
    ``update_send``, as fast as it can, in a thread of its own (the writer of the torn-read tests): two
    generations in a row differ even rounded to a 16-bit wire (bfloat16 holds integers to 256 exactly)."""
    import numpy as np

    stop = threading.Event()

    def write() -> None:
        x = np.zeros(size, np.float32)
        g = 0
        while not stop.is_set():
            g += 1
            x.fill(g % 128 + 1)
            conn.update_send([x], 1.0)
            conn.update_wait(1.0)

    writer = threading.Thread(target=write, name="flat-out-writer")
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join(30)
    assert not writer.is_alive(), "the writer hung"


@contextlib.contextmanager
def pool_publishing_flat_out(pool: Any, size: int) -> Iterator[dict[str, int]]:
    """While the block runs, a thread publishes generation ``g`` into ``pool`` as every element = v(g) =
    ``g % 128 + 1`` (two in a row differ in any wire dtype), as fast as it can; yields its counts, ``published``
    and ``skipped`` (publishes that found every buffer busy). The pool is closed after."""
    import numpy as np

    counts = {"published": 0, "skipped": 0}
    stop = threading.Event()

    def write() -> None:
        value = np.zeros(size, np.float32)
        while not stop.is_set():
            counts["published"] += 1
            value.fill(counts["published"] % 128 + 1)
            counts["skipped"] += pool.publish([value], 0.0, 0.0, {}) is None

    writer = threading.Thread(target=write, name="flat-out-pool-writer")
    writer.start()
    try:
        wait_until(lambda: counts["published"] > 2, 10)
        yield counts
    finally:
        stop.set()
        writer.join(10)
        pool.close(release=not writer.is_alive())
    assert not writer.is_alive(), "the writer hung"


def mixed_whole(conn: Any, x: Any) -> bool:
    """One step of a reader that zeroes ``x`` first: True when it mixed a peer in, and then every element holds the
    same value (a torn snapshot would leave two)."""
    x.fill(0.0)
    conn.update_send([x], 1.0)
    if conn.update_wait(1.0) == 0:
        return False
    assert x.min() == x.max() > 0, "a torn snapshot was mixed"
    return True


def traced(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn``; return its result and the peak of Python/numpy memory allocated meanwhile (tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def traced_peak(fn: Callable[[], Any]) -> int:
    """The peak memory allocated while ``fn`` runs (see :func:`traced`)."""
    return traced(fn)[1]


def rss_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak) of process ``pid``, in MiB (Linux /proc)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) / 1024
    return out


def exchange_pair(
    a: DpwaConnection, b: DpwaConnection, pa: list[np.ndarray], pb: list[np.ndarray], rounds: int
) -> None:
    """``rounds`` rounds of two connected nodes: b publishes ``pb``, a publishes ``pa`` and must mix b's
    parameters (factor 0.5, asserted), then b waits for its own fetch."""
    for _ in range(rounds):
        b.update_send(pb, 1.0)
        a.update_send(pa, 1.0)
        assert a.update_wait(1.0) == 0.5
        b.update_wait(1.0)


def reap(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """Kill ``proc`` if it still runs, wait for it (``timeout`` s), and close the pipes this side holds to it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=timeout)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


@contextlib.contextmanager
def processes() -> Iterator[dict[str, subprocess.Popen[Any]]]:
    """A dict to put started processes in; every one still running when the block ends is killed, and every
    pipe to them closed."""
    procs: dict[str, subprocess.Popen[Any]] = {}
    try:
        yield procs
    finally:
        for proc in procs.values():
            reap(proc)


def wait_all(procs: dict[str, subprocess.Popen[Any]], logs: Path, timeout: float = 60) -> None:
    """Wait for every process to exit 0; a failure shows the process's log ``logs/<name>.log``."""
    for name, proc in procs.items():
        code = proc.wait(timeout=timeout)
        assert code == 0, f"{name} exited {code}:\n{(logs / f'{name}.log').read_text()}"


class NodeProcess:
    """tests/node_worker.py in a subprocess: send a command line, read one JSON answer with a deadline."""

    def __init__(self, name: str, config: Path, seed: int, size: int = 1000, dtype: str = "float32") -> None:
        argv = [sys.executable, str(WORKER), "--name", name, "--config", str(config), "--seed", str(seed)]
        self._spawn(name, [*argv, "--size", str(size), "--dtype", dtype])

    def _spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Start ``argv`` with line-buffered pipes, pump its output, and wait (60 s) for its ready line."""
        self.name = name
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()
        self.ready = self.read(timeout=60)

    @staticmethod
    def _pump(stream: Any, out: queue.Queue[str | None]) -> None:
        """Queue each line of ``stream``, then None; the stream is closed at its end (the process exited)."""
        with stream:
            for line in stream:
                out.put(line)
        out.put(None)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self._stderr.append(line)

    def _close_stdin(self) -> None:
        """After the process exited: its stdin pipe is ours to close (what was unsent goes nowhere)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"node {self.name} gave no answer within {timeout}s; stderr: {''.join(self._stderr[-20:])}")
        if line is None:
            pytest.fail(f"node {self.name} exited ({self.proc.poll()}); stderr: {''.join(self._stderr[-20:])}")
        return json.loads(line)

    def call(self, command: str, timeout: float = 120) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def send(self, command: str) -> None:
        """Send without waiting for the answer (read it later with ``read``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def quit(self, timeout: float = 10) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout=timeout)
            finally:
                self.proc.wait(timeout=timeout)
        self._close_stdin()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._close_stdin()


@pytest.fixture
def nodes() -> Iterator[Callable[..., NodeProcess]]:
    """Start node processes; every one still alive at teardown is killed."""
    started: list[NodeProcess] = []

    def start(*args: Any, **kwargs: Any) -> NodeProcess:
        node = NodeProcess(*args, **kwargs)
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()
