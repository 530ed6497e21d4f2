"""The one loop of every thread that owns a single socket: poll with a timeout until stopped, then close it.

The RX server (:class:`dpwa.node.transport.RxServer`) and the ZAP handler
(:class:`dpwa.security.zap.ZapHandler`) are both a :class:`SocketThread`: ``stop()`` ends
either within :data:`POLL_MS` milliseconds, and a bug that raises ends it with the exception
kept in ``failure`` (the node raises it in the trainer's next call) instead of vanishing.
"""

from __future__ import annotations

import logging
import threading

import zmq

__all__ = ["POLL_MS", "SocketThread"]

log = logging.getLogger(__name__)

POLL_MS = 100
"""Longest a dpwa thread sleeps in poll before it looks at its stop flag."""


class SocketThread(threading.Thread):
    """A thread that owns one bound socket: polls it (``POLL_MS``) until ``stop()``, passes each readable
    moment to :meth:`_handle_one`, and closes the socket on the way out. An exception ends the thread (a
    bug, not a network fault): it is kept in ``failure`` and logged with ``failure_message``."""

    failure_message = "socket thread failed"

    def __init__(self, sock: zmq.Socket, *, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._sock = sock
        self._stop_flag = threading.Event()
        self.failure: BaseException | None = None
        """The exception that ended the thread, if one did."""

    def stop(self) -> None:
        """Ask the thread to end; it does within ``POLL_MS`` (join it to know)."""
        self._stop_flag.set()

    def close_socket(self) -> None:
        """Close the socket of a thread that was never started (its owner gives up before :meth:`start`)."""
        if self.is_alive():
            raise RuntimeError(f"{self.name} is running: stop it, and it closes its socket")
        self._sock.close(linger=0)

    def run(self) -> None:
        sock = self._sock
        try:
            while not self._stop_flag.is_set():
                if sock.poll(self._poll_ms(), zmq.POLLIN):
                    self._handle_one(sock)
                self._tick()
        except Exception as exc:
            self.failure = exc
            log.exception(self.failure_message)
        finally:
            sock.close(linger=0)

    def _handle_one(self, sock: zmq.Socket) -> None:
        raise NotImplementedError

    def _poll_ms(self) -> int:
        """How long the next poll may sleep (at most ``POLL_MS``)."""
        return POLL_MS

    def _tick(self) -> None:
        """Called after every poll, readable or not (timers); default no-op."""
