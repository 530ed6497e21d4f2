"""dpwa.utils.socket_thread: ``stop()`` wakes the thread at once (it does not sleep out its poll), and a thread
that ended, or never started, leaves no socket behind in its context (``term()`` returns)."""

from __future__ import annotations

import threading

import zmq

from dpwa.utils.socket_thread import SocketThread

LONG_POLL_MS = 600_000
"""A poll the thread would sleep through for 10 minutes, were it not woken."""
JOIN_S = 10.0
"""How long the test waits for the thread, or for ``term()`` (both take milliseconds)."""


class Echo(SocketThread):
    """Answers every request with its own bytes; polls for LONG_POLL_MS at a time."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        sock = ctx.socket(zmq.REP)
        sock.bind(address)
        super().__init__(sock, name="test-echo")

    def _handle_one(self, sock: zmq.Socket) -> None:
        sock.send(sock.recv(zmq.NOBLOCK))

    def _poll_ms(self) -> int:
        return LONG_POLL_MS


def term_ends(ctx: zmq.Context) -> bool:
    """Whether ``ctx.term()`` returns within JOIN_S (it blocks while any socket of the context is open)."""
    ender = threading.Thread(target=ctx.term, daemon=True)
    ender.start()
    ender.join(JOIN_S)
    return not ender.is_alive()


def test_stop_wakes_the_thread_out_of_its_poll_and_it_leaves_no_socket_open() -> None:
    ctx = zmq.Context()
    thread = Echo(ctx, "inproc://echo")
    thread.start()
    client = ctx.socket(zmq.REQ)
    client.connect("inproc://echo")
    client.send(b"ping")
    assert client.poll(int(JOIN_S * 1000)) and client.recv() == b"ping"  # it serves
    client.close(linger=0)
    thread.stop()
    thread.join(JOIN_S)
    assert not thread.is_alive() and thread.failure is None
    assert term_ends(ctx)


def test_a_thread_stopped_before_it_runs_ends_and_one_never_started_closes_its_socket() -> None:
    ctx = zmq.Context()
    early = Echo(ctx, "inproc://early")
    early.stop()
    early.start()
    early.join(JOIN_S)
    assert not early.is_alive()
    never = Echo(ctx, "inproc://never")
    never.close_socket()
    assert term_ends(ctx)
