"""The ``join`` setting: ``[NAME@]HOST:PORT`` of a member of a running cluster, parsed and checked (pure)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from dpwa.utils.settings import Spec, clipped, show_value

__all__ = ["MAX_JOINED", "JoinAddress", "JoinSpec", "parse_join"]

MAX_JOINED = 1024
"""The largest ``max_members``: the whole table must fit a message header (64 KiB)."""


@dataclasses.dataclass(frozen=True)
class JoinAddress:
    """A ``join`` setting parsed: the member to ask (``name`` given only where CURVE needs its key)."""

    host: str
    port: int
    name: str = ""

    def __str__(self) -> str:
        return f"{self.name + '@' if self.name else ''}{self.host}:{self.port}"


def parse_join(value: str) -> JoinAddress:
    """``[NAME@]HOST:PORT`` -> :class:`JoinAddress`; ValueError saying what is wrong."""
    name, _, address = value.rpartition("@") if "@" in value else ("", "", value)
    host, sep, port = address.rpartition(":")
    well_formed = bool(sep and host) and host.isascii() and host.isprintable() and port.isascii() and port.isdigit()
    if not well_formed or any(c.isspace() for c in value) or len(port) > 5 or not 1 <= int(port) <= 65535:
        raise ValueError(f"must be [NAME@]HOST:PORT (ASCII) with a port in [1, 65535], got {clipped(value)}")
    if "@" in value and not name:
        raise ValueError(f"an empty NAME before '@' in {clipped(value)}")
    return JoinAddress(host, int(port), name)


@dataclasses.dataclass(frozen=True)
class JoinSpec(Spec):
    """ "" (no join) or ``[NAME@]HOST:PORT``."""

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if not isinstance(value, str):
            yield "", f"must be [NAME@]HOST:PORT, got {show_value(value)}"
        elif value:
            try:
                parse_join(value)
            except ValueError as err:
                yield "", str(err)
