"""What a receiver remembers of each sender's pushes: the latest sequence number it saw and the verdict on it.

Per sender, sequence numbers only grow and a verdict, once given, never changes: a push or SETTLE naming a
number at or below the latest is answered with the verdict of record. The records of senders that are no members
any more are *retired*, not dropped (the latest :data:`RETIRED_VERDICTS` of them): a SETTLE query that comes
after a partition long enough to forget its sender still gets the verdict given (a push taken whose ACK was lost
is still ACKed, so its sender does not take back the mass the receiver already has), and a sender that comes
back finds its record again. The names of the latest :data:`RETIRED_VERDICTS` members that went are kept too
(:meth:`Verdicts.went`), whether they pushed or not: a push that crossed its sender's leave is a departure, not a
stranger's message.
"""

from __future__ import annotations

import collections
from collections.abc import Collection

__all__ = ["NO_VERDICT", "RETIRED_VERDICTS", "Verdict", "Verdicts"]

RETIRED_VERDICTS = 1024
"""The most senders no longer members whose latest verdict is kept."""

Verdict = tuple[int, bool | None]
"""(the latest sequence number seen, True taken / False refused / None pending)."""
NO_VERDICT: Verdict = (-1, None)
"""The record of a sender never seen."""


class Verdicts:
    """The members' records and the retired ones; not thread-safe (the inbox holds its lock around every call)."""

    def __init__(self, keep_retired: int = RETIRED_VERDICTS) -> None:
        self._current: dict[str, Verdict] = {}
        self._retired: collections.OrderedDict[str, Verdict] = collections.OrderedDict()
        self._keep = keep_retired
        self._went: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Members that went and have not come back, the latest ``keep_retired`` of them."""

    def get(self, sender: str) -> Verdict:
        """``sender``'s record (:data:`NO_VERDICT` for one never seen, or retired)."""
        return self._current.get(sender, NO_VERDICT)

    def set(self, sender: str, seq: int, verdict: bool | None) -> None:
        """Record ``verdict`` on ``sender``'s push ``seq``."""
        self._current[sender] = (seq, verdict)

    def retired(self, sender: str) -> Verdict | None:
        """The retired record of ``sender`` (None: none kept)."""
        return self._retired.get(sender)

    def went(self, sender: str) -> bool:
        """Whether ``sender`` was a member and went (one of the latest ``keep_retired``), and is not back."""
        return sender in self._went

    def follow(self, members: Collection[str], held: Collection[str], went: Collection[str] = ()) -> list[str]:
        """The members are ``members``, and ``went`` the former members not among them any more: retire the records
        of every other sender with nothing ``held`` in the inbox (keeping the latest :data:`RETIRED_VERDICTS`),
        restore those of members that came back; remember which members went. Returns the senders retired."""
        for name in sorted(went):  # in name order: which are kept never depends on a hash
            self._went[name] = None
            self._went.move_to_end(name)
        for name in [n for n in self._went if n in members]:
            del self._went[name]
        while len(self._went) > self._keep:
            self._went.popitem(last=False)
        gone = [n for n in self._current if n not in members and n not in held]
        for sender in gone:
            self._retired[sender] = self._current.pop(sender)
            self._retired.move_to_end(sender)
        while len(self._retired) > self._keep:
            self._retired.popitem(last=False)
        for sender in [n for n in self._retired if n in members]:
            self._current.setdefault(sender, self._retired.pop(sender))
        return gone
