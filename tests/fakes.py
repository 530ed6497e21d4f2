"""Fake peers for the TX-side tests: a ROUTER bound where a node expects a peer, answering its FETCH requests.

Imported like conftest (``from fakes import FakePeer``): tests/ is on sys.path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from dpwa.node import wire

Messages = list[list[bytes]]
"""The messages a peer sends back for one request, in order; each is a list of frames."""


class FakePeer:
    """A ROUTER bound on 127.0.0.1:``port``; a thread answers each FETCH with the messages ``respond`` builds.

    ``respond(header)`` gets the decoded FETCH header and returns the reply messages (none: no answer); it may be
    replaced at any time. Every request header is kept in ``requests``, in arrival order. ``close`` stops the thread,
    closes the socket without lingering and ends the context: no thread or bound port is left.
    """

    def __init__(
        self,
        port: int,
        respond: Callable[[wire.Message], Messages] = lambda header: [],
        *,
        thread_name: str | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.respond = respond
        self.requests: list[wire.Message] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=thread_name)
        self._thread.start()

    def replies(self, header: wire.Message) -> Messages:
        """The messages that answer ``header``: what ``respond`` builds (a subclass may adapt it)."""
        return self.respond(header)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                identity, frame = self.sock.recv_multipart()
                header = wire.decode_message(frame)
                self.requests.append(header)
                for message in self.replies(header):
                    self.sock.send_multipart([identity, *message])

    def close(self) -> None:
        """Stop answering and release the port."""
        self._stop.set()
        self._thread.join(2)
        self.sock.close(linger=0)
        self.ctx.term()
