"""The checks every received payload value passes, and the reasons a payload fails them.

Float arrays must hold only finite numbers (:data:`NON_FINITE` otherwise); every element of an
index array (a ``<u2`` or ``<u4`` array with a bound, see :class:`~dpwa.node.wire.layout.Layout`) must lie
below its bound (:data:`INDEX_RANGE`); int8 arrays and unbounded integer arrays are taken as they
come. :class:`FiniteChecker` and :class:`IndexChecker` check arrays already in a receive buffer
(bytes received straight into place), :class:`PayloadChecker` runs both; :func:`block_fault`
checks one block a reader has just converted. Fixed-size scratch only: nothing proportional to
the model is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpwa.node.wire.constants import FINITE_CHECK_BLOCK
from dpwa.node.wire.layout import FLOAT_CODES, MAX_BOUND, Layout
from dpwa.utils.bfloat16 import isfinite as bf16_isfinite

__all__ = [
    "DOT_CHECKED",
    "INDEX_RANGE",
    "NON_FINITE",
    "FiniteChecker",
    "IndexChecker",
    "PayloadChecker",
    "all_finite_by_dot",
    "block_fault",
]

DOT_CHECKED = ("<f4", "<f8")
"""The layout codes :class:`FiniteChecker` checks with one dot product per block (:func:`all_finite_by_dot`)."""
_F16_EXPONENT = np.uint16(0x7C00)
"""float16's exponent bits: all ones is an infinity or a NaN."""
NON_FINITE = "non-finite"
"""The rejection reason of a payload holding a NaN or an infinity (a value, or an int8 array's scale)."""
INDEX_RANGE = "index-range"
"""The rejection reason of a payload holding an index at or above its array's bound."""


class FiniteChecker:
    """Checks that received array bytes hold only finite numbers, with fixed-size scratch buffers.

    Only the float arrays of ``layout`` are looked at (integer arrays cannot be non-finite).
    """

    def __init__(self, layout: Layout, block: int = FINITE_CHECK_BLOCK) -> None:
        self._layout = layout
        self._block = block
        self._scratch = np.empty(block, dtype=bool)
        self._bits = np.empty(block, dtype=np.uint16) if {"bf16", "<f2"} & set(layout.dtypes) else None
        self._zeros = {code: np.zeros(block, code) for code in DOT_CHECKED if code in layout.dtypes}

    def all_finite(self, views: Sequence[np.ndarray], start: int, end: int) -> bool:
        """True when every element of the float arrays lying in bytes [start, end) is finite."""
        with np.errstate(invalid="ignore"):  # the dot of a non-finite block is NaN: the answer, not a problem
            return self._all_finite(views, start, end)

    def _all_finite(self, views: Sequence[np.ndarray], start: int, end: int) -> bool:
        for index, lo, hi in self._layout.segments(start, end):
            code = self._layout.dtypes[index]
            if code not in FLOAT_CODES:
                continue
            flat = views[index].reshape(-1)
            for s in range(lo, hi, self._block):
                if not self._block_finite(code, flat[s : min(s + self._block, hi)]):
                    return False
        return True

    def _block_finite(self, code: str, values: np.ndarray) -> bool:
        """Every element of ``values`` (at most one block, layout code ``code``) is finite."""
        if code in self._zeros:
            return all_finite_by_dot(values, self._zeros[code])
        return _finite(values, code, self._scratch, self._bits)


def all_finite_by_dot(values: np.ndarray, zeros: np.ndarray) -> bool:
    """True when every element of the float32/float64 block ``values`` is finite: ``values . 0 == 0`` exactly then,
    and NaN when one is NaN or infinite (``0 * inf`` is NaN). One read of the block through BLAS (``zeros``: at
    least ``values.size`` zeros of its dtype, cache-resident), ~1.4x faster than ``np.isfinite`` with its output."""
    return bool(np.dot(values, zeros[: values.size]) == 0)


class IndexChecker:
    """Checks that every element of an index array lying in the received bytes is below the array's bound."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self.active = any(0 < b < MAX_BOUND for b in layout.bounds)
        """Whether ``layout`` has an index array whose bound can be exceeded at all."""

    def in_range(self, views: Sequence[np.ndarray], start: int, end: int) -> bool:
        """True when every index of the arrays lying in bytes [start, end) is below its bound."""
        if not self.active:
            return True
        for index, lo, hi in self._layout.segments(start, end):
            bound = self._layout.bound(index)
            if 0 < bound < MAX_BOUND and hi > lo and int(views[index].reshape(-1)[lo:hi].max()) >= bound:
                return False
        return True


class PayloadChecker:
    """Both checks on arrays received straight into place: :meth:`fault` names the first one that fails."""

    def __init__(self, layout: Layout, block: int = FINITE_CHECK_BLOCK) -> None:
        self._finite = FiniteChecker(layout, block)
        self._index = IndexChecker(layout)

    def fault(self, views: Sequence[np.ndarray], start: int, end: int) -> str | None:
        """None when every value of the arrays lying in bytes [start, end) is valid, else the reason it is not
        (:data:`NON_FINITE`, :data:`INDEX_RANGE`)."""
        if not self._finite.all_finite(views, start, end):
            return NON_FINITE
        if not self._index.in_range(views, start, end):
            return INDEX_RANGE
        return None


def _finite(values: np.ndarray, code: str, ok: np.ndarray, bits: np.ndarray | None) -> bool:
    """Every element of the float block ``values`` (layout code ``code``) is finite; ``ok`` (bool) and, for a 16-bit
    code, ``bits`` (uint16) are scratch of at least ``values.size`` elements. 16-bit floats are judged by their
    exponent bits (numpy's float16 ``isfinite`` is emulated, about 4x slower)."""
    out = ok[: values.size]
    if code == "bf16":
        assert bits is not None
        bf16_isfinite(values, out, scratch=bits)
    elif code == "<f2":
        assert bits is not None
        exponent = bits[: values.size]
        np.bitwise_and(values.view(np.uint16), _F16_EXPONENT, out=exponent)
        np.not_equal(exponent, _F16_EXPONENT, out=out)
    else:
        np.isfinite(values, out=out)
    return bool(out.all())


def block_fault(values: np.ndarray, code: str, bound: int, ok: np.ndarray, bits: np.ndarray) -> str | None:
    """The reason block ``values`` (layout code ``code``, bound ``bound``) fails its check, or None.

    ``ok`` (bool) and ``bits`` (uint16) are scratch of at least ``values.size`` elements."""
    if code in FLOAT_CODES:
        return None if _finite(values, code, ok, bits) else NON_FINITE
    if 0 < bound < MAX_BOUND and values.size and int(values.max()) >= bound:
        return INDEX_RANGE
    return None
