"""The JSON fields of a header body: the checks every message kind shares, and what they raise.

A decoded header body is an untrusted ``dict``. Each function here reads one field (or one
group of fields) of it, checks its type and range, and returns it, or raises
:class:`WireError` (reason ``header``, or ``non-finite`` for a clock or loss that is no finite
number). The message classes of :mod:`dpwa.node.wire.messages` compose these; none of them
repeats a check. :class:`MemberNews` is the member table news a message may carry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpwa.node.members import Member, from_wire
from dpwa.node.wire.constants import MAX_HOST_ID_CHARS, MAX_NAME_CHARS, MAX_REQ

__all__ = [
    "MemberNews",
    "SharedRef",
    "WireError",
    "envelope",
    "extras_sum",
    "finite_float",
    "finite_clock_loss",
    "host_field",
    "member_news",
    "name_list",
    "optional_count",
    "optional_flag",
    "positive_mass",
    "required",
    "settled_pair",
    "shared_ref",
]


class WireError(Exception):
    """A message that must be dropped; ``reason`` is a short counter name."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MemberNews:
    """What a message says about the sender's member table: its digest, and the whole table when the sender
    believes the receiver's differs (``members`` None: digest only)."""

    digest: str
    members: Sequence[Member] | None = None


@dataclass(frozen=True)
class SharedRef:
    """Where a co-located reader finds a lent snapshot: the server's process id and the descriptor of its memory
    file there, the file's random token, and until when (``time.monotonic`` seconds of the common clock) it is
    lent (dpwa/node/sharedmem.py)."""

    pid: int
    fd: int
    token: str
    until: float

    def to_wire(self) -> dict[str, Any]:
        """The JSON object a STATE or PUSH header carries as ``shm``."""
        return {"pid": self.pid, "fd": self.fd, "token": self.token, "until": self.until}


def shared_ref(value: Any) -> SharedRef | None:
    """A STATE's or PUSH's ``shm`` field (absent: None): positive pid, fd >= 0, a 32-hex-digit token, a finite
    ``until``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise WireError("header", "field 'shm' of the wrong type")
    pid, fd = required(value, "pid", int), required(value, "fd", int)
    token, until = required(value, "token", str), required(value, "until", (int, float))
    if pid <= 0 or not 0 <= fd < 2**31 or pid >= 2**31:
        raise WireError("header", "field 'shm' names no process or descriptor")
    if len(token) != 32 or any(c not in "0123456789abcdef" for c in token):
        raise WireError("header", "field 'shm' has no 32-hex-digit token")
    deadline = finite_float(until)
    if deadline is None:
        raise WireError("non-finite", "field 'shm' has a non-finite deadline")
    return SharedRef(pid=pid, fd=fd, token=token, until=deadline)


def host_field(body: dict[str, Any]) -> str:
    """A header's ``host`` field (absent: ""): a co-location identity of at most :data:`MAX_HOST_ID_CHARS`."""
    host = body.get("host", "")
    if not isinstance(host, str) or len(host) > MAX_HOST_ID_CHARS:
        raise WireError("header", "field 'host' of the wrong type or too long")
    return host


def required(body: dict[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    """``body[key]`` when it is one of ``types`` (a bool is never an int here); else WireError."""
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, types):
        raise WireError("header", f"field {key!r} missing or of the wrong type")
    return value


def optional_count(body: dict[str, Any], key: str, lowest: int) -> int:
    """``body[key]``: an integer in ``[lowest, MAX_REQ]``, or -1 when the field is absent (-1 itself is invalid)."""
    if key not in body:
        return -1
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= MAX_REQ:
        raise WireError("header", f"field {key!r} is not an integer in [{lowest}, 2^64 - 1]")
    return value


def optional_flag(body: dict[str, Any], key: str) -> bool:
    """An optional boolean header field (``stream``, ``hold``, ``bipartite``), False when absent."""
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise WireError("header", f"field {key!r} of the wrong type")
    return value


def finite_float(value: int | float) -> float | None:
    """``float(value)`` when that is finite; None for inf, nan and a JSON integer beyond float range (``10**400``,
    whose ``float`` raises OverflowError): how a number a header carries becomes a float."""
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def finite_clock_loss(body: dict[str, Any]) -> tuple[float, float]:
    """``clock`` and ``loss``: two numbers, both finite (reason ``non-finite`` otherwise)."""
    clock = finite_float(required(body, "clock", (int, float)))
    loss = finite_float(required(body, "loss", (int, float)))
    if clock is None or loss is None:
        raise WireError("non-finite", "clock or loss is not finite")
    return clock, loss


def positive_mass(value: Any) -> float | None:
    """An optional positive finite number (a MEMBERS ``mass``); anything else is as if absent."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    mass = finite_float(value)
    return mass if mass is not None and mass > 0 else None


def member_news(body: dict[str, Any]) -> MemberNews | None:
    """The optional ``md`` (a digest: 16 hex digits) and ``members`` (see :func:`~dpwa.node.members.from_wire`);
    None when the message carries neither."""
    digest = body.get("md", "")
    if not isinstance(digest, str) or len(digest) > 16:
        raise WireError("header", "field 'md' of the wrong type")
    if "members" not in body:
        return MemberNews(digest) if "md" in body else None
    members = from_wire(body["members"])
    if members is None:
        raise WireError("header", "field 'members' malformed")
    return MemberNews(digest, tuple(members))


def envelope(body: dict[str, Any]) -> tuple[str, int, MemberNews | None]:
    """The fields every kind may carry, checked alike for all: the sender's name, the request id and the
    member news (a kind that sends no news still has a malformed one rejected)."""
    node = required(body, "node", str)
    if not 0 < len(node) <= MAX_NAME_CHARS:
        raise WireError("header", "bad node name")
    req = required(body, "req", int)
    return node, req, member_news(body)


def name_list(body: dict[str, Any], key: str) -> tuple[str, ...]:
    """An optional list of strings (``permanent``), () when absent."""
    value = body.get(key, [])
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise WireError("header", f"field {key!r} of the wrong type")
    return tuple(value)


def settled_pair(value: Any) -> tuple[int, bool | None] | None:
    """An optional ``[sequence number, verdict]`` pair (``settled``), the verdict a bool or None."""
    if value is None:
        return None
    if not (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and (value[1] is None or isinstance(value[1], bool))
    ):
        raise WireError("header", "field 'settled' malformed")
    return value[0], value[1]


def extras_sum(extras: Iterable[Mapping[str, Any]], key: str) -> float:
    """The sum of ``e[key]`` over ``extras`` where it is a finite number (an int or float, not a bool); others
    count 0."""
    total = 0.0
    for e in extras:
        value = e.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total += finite_float(value) or 0.0
    return total
