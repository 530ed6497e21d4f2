"""The one loop of every thread that owns a single socket: poll with a timeout until stopped, then close it.

The RX server (:class:`dpwa.node.transport.RxServer`) and the ZAP handler
(:class:`dpwa.security.zap.ZapHandler`) are both a :class:`SocketThread`: ``stop()`` wakes the thread
at once (an in-process socket it polls beside its own) and it ends; a bug that raises ends it with the
exception kept in ``failure`` (the node raises it in the trainer's next call) instead of vanishing.
"""

from __future__ import annotations

import logging
import threading

import zmq

from dpwa.utils.waker import Waker

__all__ = ["POLL_MS", "SocketThread"]

log = logging.getLogger(__name__)

POLL_MS = 100
"""Longest a dpwa thread sleeps in poll before it runs its timers (:meth:`SocketThread._tick`) again."""


class SocketThread(threading.Thread):
    """A thread that owns one bound socket: polls it (``POLL_MS``) until ``stop()``, passes each readable
    moment to :meth:`_handle_one`, and closes the socket on the way out. An exception ends the thread (a
    bug, not a network fault): it is kept in ``failure`` and logged with ``failure_message``.

    ``stop()`` wakes the poll through a :class:`~dpwa.utils.waker.Waker` that the thread makes when it starts and
    closes when it ends (so its context can be ended once it has been joined; a thread never started has none)."""

    failure_message = "socket thread failed"

    def __init__(self, sock: zmq.Socket, *, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._sock = sock
        self._stop_flag = threading.Event()
        self._waker: Waker | None = None
        """Made and closed by the thread; ``stop()`` wakes it (None before the thread starts)."""
        self.failure: BaseException | None = None
        """The exception that ended the thread, if one did."""

    def stop(self) -> None:
        """Ask the thread to end; it wakes at once and ends after the message it is handling (join it to know)."""
        self._stop_flag.set()
        waker = self._waker  # None: the thread has not made it yet, and will see the flag once it has
        if waker is not None:
            waker.wake()

    def close_socket(self) -> None:
        """Close the socket of a thread that was never started (its owner gives up before :meth:`start`)."""
        if self.is_alive():
            raise RuntimeError(f"{self.name} is running: stop it, and it closes its socket")
        self._sock.close(linger=0)

    def run(self) -> None:
        sock = self._sock
        try:
            self._waker = Waker(sock.context, self.name)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(self._waker.socket, zmq.POLLIN)
            while not self._stop_flag.is_set():
                if dict(poller.poll(self._poll_ms())).get(sock, 0) & zmq.POLLIN:
                    self._handle_one(sock)
                self._tick()
        except Exception as exc:
            self.failure = exc
            log.exception(self.failure_message)
        finally:
            sock.close(linger=0)
            if self._waker is not None:
                self._waker.close()

    def _handle_one(self, sock: zmq.Socket) -> None:
        raise NotImplementedError

    def _poll_ms(self) -> int:
        """How long the next poll may sleep (at most ``POLL_MS``)."""
        return POLL_MS

    def _tick(self) -> None:
        """Called after every poll, readable or not (timers); default no-op."""
