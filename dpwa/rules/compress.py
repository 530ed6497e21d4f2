"""Compression operators for compressed gossip (CHOCO-SGD): which coordinates, or which precision, travel.

A compressor ``Q`` maps a difference ``d = x - x_hat`` to what a node sends (Koloskova, Stich & Jaggi 2019,
section 3: any ``Q`` with ``E||Q(d) - d||^2 <= (1 - delta) ||d||^2`` works, ``delta`` = the share kept):

* ``topk:F`` -- the ``k = ceil(F * n)`` coordinates of largest ``|d|`` in each parameter array (``delta >= F``);
* ``randk:F`` -- ``k`` coordinates drawn uniformly without replacement, not rescaled (``delta = F``);
* ``int8`` -- every coordinate, rounded to 8 bits with one float32 scale per block (blockwise absmax, as
  hivemind's and bitsandbytes' 8-bit quantization: :mod:`dpwa.utils.int8`).

The cluster file selects one with a single word, ``compressor: topk:0.01``; :func:`parse_compressor` reads
it and :class:`CompressorSpec` lets the settings check it. Pure functions, numpy only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpwa.utils.settings import Spec, show_value

__all__ = ["KINDS", "Compressor", "CompressorSpec", "index_dtype", "parse_compressor", "random_k", "top_k"]

KINDS = ("topk", "randk", "int8")
"""The compressor kinds: ``topk`` and ``randk`` take a fraction (``topk:0.01``), ``int8`` none."""
_FRACTION = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
"""A fraction as written after ``topk:``: a decimal number, no sign, spaces or ``_``."""


@dataclass(frozen=True)
class Compressor:
    """A parsed compressor: its ``kind`` (one of :data:`KINDS`) and the ``fraction`` of coordinates kept
    (1.0 for ``int8``, which keeps every coordinate at lower precision)."""

    kind: str
    fraction: float = 1.0

    @property
    def sparse(self) -> bool:
        """True when it sends indices and values (``topk``, ``randk``)."""
        return self.kind in ("topk", "randk")

    def kept(self, n: int) -> int:
        """How many of ``n`` coordinates a sparse compressor sends: ``min(n, max(1, ceil(fraction * n)))``, in exact
        arithmetic on the fraction as written (``topk:0.07`` of 100 keeps 7; binary floating point would say 8)."""
        return min(n, max(1, math.ceil(Fraction(repr(self.fraction)) * n)))

    def __str__(self) -> str:
        return self.kind if self.kind == "int8" else f"{self.kind}:{self.fraction:g}"


def parse_compressor(text: str) -> Compressor:
    """``"topk:F"`` / ``"randk:F"`` (``0 < F <= 1``) or ``"int8"``; ValueError naming what is allowed."""
    if not isinstance(text, str):
        raise ValueError(f"must be topk:FRACTION, randk:FRACTION or int8, got {show_value(text)}")
    kind, sep, arg = text.partition(":")
    if text == "int8":
        return Compressor("int8")
    if kind in ("topk", "randk") and sep:
        fraction = float(arg) if _FRACTION.fullmatch(arg) else math.nan  # as written: no spaces, no ``_``
        if 0.0 < fraction <= 1.0:
            return Compressor(kind, fraction)
        raise ValueError(f"the fraction of {kind} must be a decimal number in (0, 1], unsigned, got {arg!r}")
    raise ValueError(f"must be topk:FRACTION, randk:FRACTION or int8, got {text!r}")


@dataclass(frozen=True)
class CompressorSpec(Spec):
    """A settings field holding a compressor's word (:func:`parse_compressor` says what is allowed)."""

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        try:
            parse_compressor(value)  # type: ignore[arg-type]
        except ValueError as err:
            yield "", str(err)


def index_dtype(n: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every index of an array of ``n`` elements: uint16 up to 2^16
    elements, else uint32 (the wire checks each received index below ``n`` either way)."""
    return np.dtype(np.uint16 if n <= 1 << 16 else np.uint32)


def top_k(d: np.ndarray, k: int, out: np.ndarray) -> None:
    """The indices of the ``k`` largest ``|d|`` of the flat ``d``, ascending, into ``out`` (``k`` of them, of
    :func:`index_dtype`)."""
    magnitude = np.abs(d)
    if k >= d.size:
        out[...] = np.arange(d.size, dtype=out.dtype)
        return
    chosen = np.argpartition(magnitude, d.size - k)[d.size - k :]
    chosen.sort()
    out[...] = chosen


def random_k(rng: np.random.Generator, n: int, k: int, out: np.ndarray) -> None:
    """``k`` distinct indices of ``range(n)`` drawn uniformly by ``rng``, ascending, into ``out`` (of
    :func:`index_dtype`)."""
    chosen = rng.choice(n, size=k, replace=False, shuffle=False)
    chosen.sort()
    out[...] = chosen
