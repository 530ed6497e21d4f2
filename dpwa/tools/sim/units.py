"""Quantities on the command line: durations (``50ms``, ``1.5s``, ``200us``) and rates (``1gbit``, ``100mbit``,
``10GB/s``), each parsed to SI units (seconds, bytes per second); ValueError names what was wrong."""

from __future__ import annotations

import math
import re

__all__ = ["parse_duration", "parse_rate"]

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_DURATION = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "min": 60.0}
_RATE = {  # bytes per second per unit
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
}  # fmt: skip


def _split(text: str, units: dict[str, float], what: str) -> float:
    match = re.fullmatch(_NUMBER + r"\s*([a-zA-Z/]*)", text.strip())
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in units:
        raise ValueError(f"{what} {text!r}: expected a number and one of the units {', '.join(u for u in units if u)}")
    value = float(match.group(1)) * units[unit]
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is not finite")
    return value


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with ``s``, ``ms``, ``us``, ``ns`` or ``min`` (a bare number is seconds)."""
    return _split(text, _DURATION, "duration")


def parse_rate(text: str) -> float:
    """Bytes per second in ``text``: bits (``1gbit``, ``100mbit``) or bytes (``10GB/s``) per second; > 0."""
    value = _split(text, _RATE, "rate")
    if value <= 0:
        raise ValueError(f"rate {text!r} must be above 0")
    return value
