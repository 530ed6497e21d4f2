"""CurveZMQ for dpwa nodes: who may talk to a node, and encryption of everything they say.

With ``security: {curve: true, keys: DIR}`` in the cluster file every node's server is a CURVE
server that admits exactly the public keys of the cluster's nodes, and every fetch is a CURVE
client that knows its peer's public key. By role, as in pyzmq's ``zmq.auth``:

* :mod:`~dpwa.security.keyfiles` -- the key files (``NAME.key``, ``NAME.key_secret``): format,
  reading, writing (the cluster file's loader reads them to validate the ``security`` section);
* :mod:`~dpwa.security.keys` -- generating key pairs (``dpwa keys generate``);
* :mod:`~dpwa.security.zap` -- the ZAP handler thread that admits or refuses each connection;
* :mod:`~dpwa.security.curve` -- one node's keys, its ZAP handler and the socket options
  (:class:`~dpwa.security.curve.NodeSecurity`), and the warning for a node exposed without CURVE.
"""

from dpwa.security.curve import NodeSecurity, warn_if_exposed
from dpwa.security.keyfiles import KeyFileError, read_key_file
from dpwa.security.keys import generate_keys
from dpwa.security.zap import ZapHandler

__all__ = ["KeyFileError", "NodeSecurity", "ZapHandler", "generate_keys", "read_key_file", "warn_if_exposed"]
