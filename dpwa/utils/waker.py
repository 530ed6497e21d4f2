"""Waking a thread out of ``zmq.Poller.poll``: a pair of in-process sockets, one polled by the thread, one any
thread sends an empty message on. The TX thread and every :class:`~dpwa.utils.socket_thread.SocketThread` (the RX
server, the ZAP handler) poll one, so ``stop()`` and new work reach them at once instead of after their poll's
timeout."""

from __future__ import annotations

import itertools
import threading

import zmq

__all__ = ["Waker"]

_IDS = itertools.count()


class Waker:
    """The thread polls :attr:`socket`; :meth:`wake` (any thread) makes it readable, :meth:`drain` (the thread)
    empties it. :meth:`close` closes both ends (idempotent; a later :meth:`wake` does nothing), so that the context
    can end. The lock serializes the sending end's use from several threads (ZeroMQ sockets are not thread-safe;
    a lock is the full memory barrier that lets one move between threads)."""

    def __init__(self, ctx: zmq.Context, name: str) -> None:
        address = f"inproc://dpwa-wake-{name}-{next(_IDS)}"
        self._lock = threading.Lock()
        with self._lock:
            self.socket = ctx.socket(zmq.PAIR)
            """The end the woken thread polls (and only it uses)."""
            try:
                self.socket.bind(address)
                self._sender = ctx.socket(zmq.PAIR)
                self._sender.connect(address)
            except BaseException:
                self.socket.close(linger=0)
                raise

    def wake(self) -> None:
        """Make :attr:`socket` readable (one message at most waits: a second wake adds nothing)."""
        with self._lock:
            if not self._sender.closed:
                try:
                    self._sender.send(b"", zmq.NOBLOCK)
                except zmq.Again:  # woken already
                    pass

    def drain(self) -> None:
        """Take every wake-up message waiting (the woken thread, before it looks at its work)."""
        while self.socket.poll(0):
            self.socket.recv()

    def close(self) -> None:
        """Close both ends (once the woken thread no longer polls)."""
        with self._lock:
            self._sender.close(linger=0)
            self.socket.close(linger=0)
