"""The control channel of ``dpwa bench exchange``: the trainer side's handle on the peer process.

The trainer binds a ZeroMQ PAIR socket on loopback and starts the peer as
``python -m dpwa.tools.bench.exchange peer ENDPOINT PARENT_PID``; the peer connects and sends ``{"ok": true}``.
From then on every message is one JSON object: the trainer sends ``{"op": NAME, **arguments}`` and the peer
answers ``{"ok": true, **results}`` or ``{"ok": false, "error": TEXT}``; ``quit`` gets no answer. The commands
are listed in :mod:`dpwa.tools.bench.exchange.peer`.

:func:`running_peer` stops the peer on the way out whatever happened: ``quit``, then SIGTERM, then SIGKILL,
:data:`STOP_GRACE_S` apart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import zmq

log = logging.getLogger(__name__)

__all__ = [
    "CONTROL_TIMEOUT_S",
    "PEER_IDLE_S",
    "PEER_MODULE",
    "STOP_GRACE_S",
    "PeerProcess",
    "receive_answer",
    "running_peer",
    "send_message",
]

CONTROL_TIMEOUT_S = 120.0
"""Longest wait for the peer's answer to one command (setting up 25M floats takes about a second)."""
PEER_IDLE_S = 600.0
"""The peer exits after this long without a command."""
STOP_GRACE_S = 3.0
"""How long the peer is given after ``quit``, and again after SIGTERM, before the next step of stopping it."""
PEER_MODULE = "dpwa.tools.bench.exchange"
"""The peer's command line is ``python -m PEER_MODULE peer ENDPOINT PARENT_PID``."""


def send_message(sock: zmq.Socket, message: dict[str, Any]) -> None:
    """Send ``message`` as one JSON frame."""
    sock.send(json.dumps(message).encode())


def receive_answer(sock: zmq.Socket, timeout_s: float, what: str) -> dict[str, Any]:
    """The next answer on ``sock``; TimeoutError after ``timeout_s``, RuntimeError when it says the command failed."""
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no answer from the peer within {timeout_s:g} s ({what})")
    answer = json.loads(sock.recv())
    if not answer.get("ok"):
        raise RuntimeError(f"peer failed ({what}): {answer.get('error')}")
    return answer


class PeerProcess:
    """The peer subprocess and its control socket; :meth:`call` sends one command and waits for the answer."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._sock = ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
        argv = [sys.executable, "-m", PEER_MODULE, "peer", f"tcp://127.0.0.1:{port}", str(os.getpid())]
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        log.info("peer started, pid %d", self.proc.pid)
        try:
            receive_answer(self._sock, CONTROL_TIMEOUT_S, "start")
        except BaseException:
            self.stop()
            raise

    def call(self, op: str, timeout_s: float = CONTROL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Send ``op`` and wait for the peer's answer; TimeoutError / RuntimeError if it fails."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the peer exited with status {self.proc.returncode}")
        send_message(self._sock, {"op": op, **args})
        return receive_answer(self._sock, timeout_s, op)

    def send(self, op: str, **args: Any) -> None:
        """Send ``op`` without waiting (read the answer with :meth:`answer`)."""
        send_message(self._sock, {"op": op, **args})

    def answer(self, what: str, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """The answer to the command sent last with :meth:`send`."""
        return receive_answer(self._sock, timeout_s, what)

    def stop(self) -> None:
        """Ask the peer to quit; SIGTERM then SIGKILL if it does not within the grace period. Idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                send_message(self._sock, {"op": "quit"})
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(STOP_GRACE_S)
        self._sock.close(linger=0)


@contextlib.contextmanager
def running_peer(ctx: zmq.Context) -> Iterator[PeerProcess]:
    """The peer process, stopped on the way out whatever happened (SIGTERM too)."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, on_term)
    peer = PeerProcess(ctx)
    try:
        yield peer
    finally:
        peer.stop()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
