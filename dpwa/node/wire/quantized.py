"""``wire_dtype: int8``: a float array's two wire arrays, written from it and read back into it.

Under ``int8`` each float array of ``n`` elements travels as its float32 block scales
(:func:`~dpwa.utils.int8.int8_scales` of them), then its ``n`` int8 values (:mod:`dpwa.utils.int8`:
``scale = max |x|`` per block of :data:`~dpwa.utils.int8.INT8_BLOCK`, ``q = rint(x / scale * 127)``).
A payload is converted chunk by chunk, and a chunk boundary may fall anywhere, also inside a block:

* :class:`Int8Writer` fills any range of either wire array from the local array alone (a range of
  values recomputes the scales of its blocks: the same bits as the scales array holds), so chunks
  may be written in any order, by any thread that holds one writer;
* :class:`Int8Reader` keeps the scales as they arrive (checked finite) and dequantizes the values
  with them into the local array, checking every result finite (a float16 array may overflow).
  Chunks arrive in order, so an array's scales are in before the first of its values. The scales
  belong to the receive buffer (several replies are received at once, one buffer each): the
  reader keeps them per buffer, allocated at the first payload a buffer receives (at most
  :data:`MAX_BUFFERS`, a few per node), never per message.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from dpwa.node.wire.checks import NON_FINITE, block_fault
from dpwa.node.wire.constants import PAYLOAD_BLOCK
from dpwa.node.wire.layout import ROLE_SCALES, Layout
from dpwa.utils.int8 import (
    INT8_BLOCK,
    INT8_PIECE,
    Int8Scratch,
    absmax_scales_,
    dequantize_int8_,
    int8_scales,
    quantize_int8_,
)

__all__ = ["MAX_BUFFERS", "Int8Reader", "Int8Writer"]

MAX_BUFFERS = 64
"""The most receive buffers an :class:`Int8Reader` keeps scales for; beyond, the longest unused are dropped."""


class Int8Writer:
    """Quantizes ranges of local float arrays into their wire scales and values (fixed-size scratch)."""

    def __init__(self) -> None:
        self._scratch = Int8Scratch(INT8_PIECE)
        self._values = np.empty(INT8_PIECE, np.int8)
        self._scales = np.empty(INT8_PIECE // INT8_BLOCK, np.float32)

    def scales(self, src: np.ndarray, dst: np.ndarray, lo: int, hi: int) -> None:
        """``dst[lo:hi]`` <- the scales of blocks [lo, hi) of ``src`` (the local array, flat)."""
        step = INT8_PIECE // INT8_BLOCK
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            absmax_scales_(src[a * INT8_BLOCK : min(b * INT8_BLOCK, src.size)], dst[a:b], scratch=self._scratch)

    def values(self, src: np.ndarray, dst: np.ndarray, lo: int, hi: int) -> None:
        """``dst[lo:hi]`` <- the int8 values of elements [lo, hi) of ``src`` (flat), whole blocks quantized."""
        first, last = lo // INT8_BLOCK * INT8_BLOCK, min(-(-hi // INT8_BLOCK) * INT8_BLOCK, src.size)
        for a in range(first, last, INT8_PIECE):
            b = min(a + INT8_PIECE, last)
            scales = self._scales[: int8_scales(b - a)]
            if lo <= a and b <= hi:  # the piece lies inside the range: straight into place
                quantize_int8_(src[a:b], dst[a:b], scales, scratch=self._scratch)
                continue
            quantize_int8_(src[a:b], self._values[: b - a], scales, scratch=self._scratch)
            x0, x1 = max(a, lo), min(b, hi)
            dst[x0:x1] = self._values[x0 - a : x1 - a]


class Int8Reader:
    """Takes wire scales and values into receive buffers of the ``local`` layout; see the module doc-string.

    ``sources``: :meth:`~dpwa.node.wire.layout.Layout.sources` of the wire layout.
    """

    def __init__(self, local: Layout, sources: Sequence[tuple[int, str]], block: int = PAYLOAD_BLOCK) -> None:
        self._offsets: dict[int, int] = {}
        size = 0
        for index, role in sources:
            if role == ROLE_SCALES:
                self._offsets[index] = size
                size += int8_scales(local.sizes[index])
        self._size = size
        self._codes = local.dtypes
        self._block = block
        self._stores: OrderedDict[int, np.ndarray] = OrderedDict()
        self._ok = np.empty(max(block, 1), dtype=bool)
        self._bits = np.empty(max(block, 1), dtype=np.uint16)
        self._scratch = Int8Scratch(INT8_PIECE)

    def _store(self, views: Sequence[np.ndarray], index: int) -> np.ndarray:
        """The scales of local array ``index`` kept for the receive buffer ``views`` belong to."""
        key = int(views[0].__array_interface__["data"][0])
        store = self._stores.get(key)
        if store is None:
            store = self._stores[key] = np.empty(self._size, np.float32)
            while len(self._stores) > MAX_BUFFERS:
                self._stores.popitem(last=False)
        else:
            self._stores.move_to_end(key)
        start = self._offsets[index]
        return store[start : start + int8_scales(views[index].size)]

    def scales(self, src: np.ndarray, views: Sequence[np.ndarray], index: int, lo: int) -> str | None:
        """Keep ``src`` (float32: the scales of blocks ``lo`` on of local array ``index``) for ``views``'s buffer;
        :data:`~dpwa.node.wire.checks.NON_FINITE` when one is not finite, else None."""
        kept = self._store(views, index)[lo : lo + src.size]
        np.copyto(kept, src)
        for a in range(0, kept.size, self._block):
            if block_fault(kept[a : a + self._block], "<f4", 0, self._ok, self._bits) is not None:
                return NON_FINITE
        return None

    def values(self, src: np.ndarray, views: Sequence[np.ndarray], index: int, lo: int) -> str | None:
        """Dequantize ``src`` (int8: elements ``lo`` on of local array ``index``) into ``views[index]`` with the
        scales kept for that buffer; :data:`~dpwa.node.wire.checks.NON_FINITE` at a result that is not finite."""
        scales = self._store(views, index)
        out = views[index].reshape(-1)
        code = self._codes[index]
        for a in range(0, src.size, self._block):
            b = min(a + self._block, src.size)
            dst = out[lo + a : lo + b]
            dequantize_int8_(src[a:b], scales, dst, first=lo + a, scratch=self._scratch)
            if block_fault(dst, code, 0, self._ok, self._bits) is not None:
                return NON_FINITE
        return None
