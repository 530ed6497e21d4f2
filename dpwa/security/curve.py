"""CurveZMQ for one node: its keys, a ZAP handler admitting exactly the cluster's nodes, socket set-up.

With ``security: {curve: true, keys: DIR}`` a node's RX ROUTER is a CURVE server (the node's
own secret key) and each TX DEALER a CURVE client (the node's key pair plus the peer's public
key). Every connection to the ROUTER goes through the ZAP handler here, which admits a client
only if its public key is one of the cluster's nodes': any other client's connection is closed
at the end of the CURVE handshake, before libzmq reads a single message from it. All traffic is
encrypted and authenticated.

The ZAP handler binds ``inproc://zeromq.zap.01`` in the node's own ``zmq.Context`` (ZAP is per
context; every node has its own, so nodes in one process never share a handler). It must be bound
before the ROUTER and kept until the ROUTER is closed: a CURVE server without a ZAP handler
admits any client that knows its public key. :class:`NodeSecurity` does both in that order.

The key directory is the membership list: besides the cluster file's nodes, the handler admits
any key ``NAME.key`` in the directory, re-reading it when an unknown key knocks (at most once a
second), so a node joining a running cluster (docs/membership.md) needs only its public key
placed in the directory every member reads. A joined member's public key is read from the same
directory when a node first connects to it.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

import zmq
from zmq.utils import z85

from dpwa.security.keyfiles import PUBLIC_SUFFIX, KeyFileError, public_path, read_key_file
from dpwa.security.zap import ZAP_DOMAIN, ZapHandler
from dpwa.utils.endpoints import is_loopback

log = logging.getLogger(__name__)

__all__ = ["STOP_TIMEOUT_S", "NodeSecurity", "warn_if_exposed"]

STOP_TIMEOUT_S = 1.0
"""How long :meth:`NodeSecurity.stop` waits for the ZAP thread to end."""


class NodeSecurity:
    """CURVE keys of one node and its running ZAP handler; ``server``/``client`` set sockets up.

    ``NodeSecurity(name, secret_file, public_files, ctx, on_denied)`` reads the node's key pair and
    every node's public key (``public_files``: node name -> ``NAME.key``; KeyFileError when one is
    missing or invalid -- the cluster file's loader has checked them already) and starts the ZAP
    handler admitting exactly those keys; ``stop()`` stops it (call it after the ROUTER is closed,
    before ``ctx.term()``).
    """

    def __init__(
        self,
        name: str,
        secret_file: str | os.PathLike[str],
        public_files: Mapping[str, str | os.PathLike[str]],
        ctx: zmq.Context,
        on_denied: Callable[[str], None],
        keys_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.public, secret = read_key_file(secret_file, secret=True)
        assert secret is not None
        self._secret = secret
        self.peers = {peer: read_key_file(path)[0] for peer, path in public_files.items()}
        self._file_peers = frozenset(self.peers)
        _warn_if_readable(secret_file)
        self.name = name
        self._keys_dir = keys_dir
        self.zap = ZapHandler(
            ctx,
            {z85.decode(key): peer for peer, key in self.peers.items()},
            on_denied,
            name=f"dpwa-zap-{name}",
            reload=self.allowed_keys if keys_dir is not None else None,
        )
        self.zap.start()

    def allowed_keys(self) -> dict[bytes, str]:
        """Every public key the node admits: the cluster file's, and every ``NAME.key`` in the key directory."""
        allowed = {z85.decode(key): peer for peer, key in self.peers.items()}
        if self._keys_dir is not None:
            for path in sorted(Path(self._keys_dir).glob(f"*{PUBLIC_SUFFIX}")):
                member = path.name[: -len(PUBLIC_SUFFIX)]
                try:
                    allowed.setdefault(z85.decode(read_key_file(path)[0]), member)
                except (KeyFileError, ValueError):
                    continue  # not a key file: not a member
        return allowed

    def peer_key(self, peer: str) -> bytes:
        """``peer``'s public key: the file's, else ``NAME.key`` from the key directory (KeyFileError if none)."""
        key = self.peers.get(peer)
        if key is None:
            if self._keys_dir is None:
                raise KeyFileError(f"no public key for {peer!r}")
            key = self.peers[peer] = read_key_file(public_path(self._keys_dir, peer))[0]
        return key

    def forget(self, peer: str) -> None:
        """Drop a joined member's cached public key (it was forgotten); the file's nodes' keys stay."""
        if peer not in self._file_peers:
            self.peers.pop(peer, None)

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet bound) a CURVE server with this node's secret key, authenticated by ZAP."""
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)

    def client(self, sock: zmq.Socket, peer: str) -> None:
        """Make ``sock`` (not yet connected) a CURVE client of ``peer`` with this node's key pair."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.peer_key(peer))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)

    def stop(self) -> bool:
        """Stop the ZAP handler; True once its thread has ended (within STOP_TIMEOUT_S)."""
        self.zap.stop()
        self.zap.join(timeout=STOP_TIMEOUT_S)
        return not self.zap.is_alive()


def _warn_if_readable(path: str | os.PathLike[str]) -> None:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret key %s is readable by other users (mode %o); chmod 600 it", path, stat.S_IMODE(mode))


def warn_if_exposed(name: str, endpoint: str, curve: bool) -> bool:
    """Log one warning when node ``name`` binds a non-loopback ``endpoint`` without CURVE; True if it did."""
    if curve or is_loopback(endpoint):
        return False
    log.warning(
        "node %s listens on %s without CURVE: anyone who can reach this port can read the model and feed it "
        "parameters; set `security: {curve: true, keys: DIR}` (keys from `dpwa keys generate`)",
        name,
        endpoint,
    )
    return True
