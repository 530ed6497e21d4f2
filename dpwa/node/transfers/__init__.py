"""How a node's models travel: one small class per transfer pattern, chosen once from the rule.

* :mod:`~dpwa.node.transfers.base` -- :class:`TransferPattern`, the interface the node's step calls (and when),
  and :class:`Arrival`, what one ``update_wait`` found;
* :mod:`~dpwa.node.transfers.host` -- what a pattern needs of its node and of the TX thread (protocols);
* :mod:`~dpwa.node.transfers.fetcher` -- fetch jobs, receive buffers, verdicts: what every pattern uses;
* :mod:`~dpwa.node.transfers.pull` -- :class:`PullTransfer`: fetch the round's peers;
* :mod:`~dpwa.node.transfers.receiving` -- the inbox half of push and exchange;
* :mod:`~dpwa.node.transfers.push` -- :class:`PushTransfer`: push-sum, SGP, OSGP;
* :mod:`~dpwa.node.transfers.exchange` -- :class:`ExchangeTransfer`: AD-PSGD.

:func:`make_transfer` is the one place that looks at which pattern a rule uses.
"""

from __future__ import annotations

from dpwa.node.transfers.base import Arrival, TransferPattern
from dpwa.node.transfers.exchange import ExchangeTransfer
from dpwa.node.transfers.host import Host
from dpwa.node.transfers.pull import PullTransfer
from dpwa.node.transfers.push import PushTransfer
from dpwa.rules import Transfer

__all__ = [
    "PATTERNS",
    "Arrival",
    "ExchangeTransfer",
    "PullTransfer",
    "PushTransfer",
    "TransferPattern",
    "make_transfer",
]

PATTERNS: dict[Transfer, type[TransferPattern]] = {
    pattern.kind: pattern for pattern in (PullTransfer, PushTransfer, ExchangeTransfer)
}
"""The pattern of each kind of :class:`~dpwa.rules.Transfer`."""


def make_transfer(host: Host) -> TransferPattern:
    """The transfer pattern of ``host``'s rule (``host.rule.transfer``), built for ``host``."""
    return PATTERNS[Transfer(host.rule.transfer)](host)
