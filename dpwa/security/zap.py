"""The ZAP handler (ZeroMQ Authentication Protocol, RFC 27) of one node's context.

libzmq asks the handler bound at ``inproc://zeromq.zap.01`` in a socket's own context whether
to admit each connection to a CURVE server. :class:`ZapHandler` admits exactly the public keys
it was given and refuses everything else (any other key, or no CURVE at all). Given ``reload``,
it asks that function for the allowed keys again when an unknown key knocks (at most every
``RELOAD_EVERY_S``): so keys added to a key directory are admitted without a restart. It knows
nothing of cluster files or key files: :class:`dpwa.security.curve.NodeSecurity` starts it with
the cluster's keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import zmq

from dpwa.utils.socket_thread import SocketThread

__all__ = ["ZAP_DOMAIN", "ZAP_ENDPOINT", "ZapHandler"]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"dpwa"
ZAP_VERSION = b"1.0"
RELOAD_EVERY_S = 1.0
"""The shortest interval between two reloads of the allowed keys (a flood of unknown keys costs no more)."""


class ZapHandler(SocketThread):
    """Answers libzmq's ZAP requests (RFC 27) for one context: CURVE clients whose public key is in
    ``allowed`` (32-byte binary key -> node name) get 200 with the node name as user id; everything
    else gets 400. Every denial calls ``on_denied(address)``.

    The socket is bound in the constructor (a second handler on one context fails there, loudly);
    ``stop()`` wakes the thread at once; ``join()`` then waits for it to end, its socket closed.
    """

    failure_message = "ZAP handler failed"

    def __init__(
        self,
        ctx: zmq.Context,
        allowed: Mapping[bytes, str],
        on_denied: Callable[[str], None],
        *,
        name: str = "dpwa-zap",
        reload: Callable[[], Mapping[bytes, str]] | None = None,
    ) -> None:
        super().__init__(ctx.socket(zmq.REP), name=name)
        self._allowed = dict(allowed)
        self._reload = reload
        self._reloaded = time.monotonic()
        self._on_denied = on_denied
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            self._sock.close(linger=0)
            raise

    def _handle_one(self, sock: zmq.Socket) -> None:
        request = sock.recv_multipart(zmq.NOBLOCK)
        sock.send_multipart(self._answer(request), zmq.NOBLOCK)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The reply frames for one request: [version, request id, status code, status text, user id, metadata]."""
        if len(request) < 6 or request[0] != ZAP_VERSION:
            request_id = request[1] if len(request) > 1 else b""
            return [ZAP_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""]
        _, request_id, _domain, address, _identity, mechanism, *credentials = request
        if mechanism == b"CURVE" and len(credentials) == 1:
            node = self._allowed.get(credentials[0])
            if node is None and self._reload is not None and time.monotonic() - self._reloaded >= RELOAD_EVERY_S:
                self._reloaded = time.monotonic()
                try:
                    self._allowed = dict(self._reload())
                except Exception:  # an unreadable directory: keep the keys known so far
                    log.exception("reloading the allowed keys failed")
                node = self._allowed.get(credentials[0])
            if node is not None:
                return [ZAP_VERSION, request_id, b"200", b"OK", node.encode(), b""]
        self._on_denied(address.decode("utf-8", "replace"))
        return [ZAP_VERSION, request_id, b"400", b"not a node of this cluster", b"", b""]
