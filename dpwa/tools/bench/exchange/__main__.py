"""``python -m dpwa.tools.bench.exchange peer ENDPOINT PARENT_PID``: the peer process that ``dpwa bench exchange``
starts (:func:`dpwa.tools.bench.exchange.peer.peer_main`); it is not meant to be run by hand."""

import logging
import sys

from dpwa.tools.bench.exchange.peer import peer_main

if len(sys.argv) == 4 and sys.argv[1] == "peer":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s peer %(levelname)s %(name)s: %(message)s")
    peer_main(sys.argv[2], int(sys.argv[3]))
else:
    sys.exit("usage: python -m dpwa.tools.bench.exchange peer ENDPOINT PARENT_PID (started by `dpwa bench exchange`)")
