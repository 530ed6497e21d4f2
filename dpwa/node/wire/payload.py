"""Payload conversion: a snapshot's arrays to wire bytes and back, checking every received value.

:class:`PayloadWriter` rounds the sender's arrays (its *local* layout) into the wire buffer
(the *wire* layout, see :meth:`~dpwa.node.wire.layout.Layout.on_wire`) chunk by chunk;
:class:`PayloadReader` takes each received chunk into a receive buffer, widening it back when
the two layouts differ, and reports whether every value is valid: floats finite, indices below
their bound (:mod:`~dpwa.node.wire.checks`; :attr:`PayloadReader.fault` names what failed).
Under ``wire_dtype: int8`` a float array's wire scales and values are written and read by
:mod:`~dpwa.node.wire.quantized`. All of them work in fixed-size blocks with fixed-size scratch:
nothing proportional to the model is allocated per payload, and nothing here touches a socket.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpwa.node.wire.checks import FiniteChecker, PayloadChecker, block_fault
from dpwa.node.wire.constants import PAYLOAD_BLOCK
from dpwa.node.wire.layout import ROLE_PLAIN, ROLE_SCALES, Layout, code_dtype
from dpwa.node.wire.quantized import Int8Reader, Int8Writer
from dpwa.utils.bfloat16 import from_float32

__all__ = ["FiniteChecker", "PayloadReader", "PayloadWriter"]


_F16_TABLE: np.ndarray | None = None


def _f16_table() -> np.ndarray:
    """Every float16 value as float32, indexed by its bits (256 KiB, built once): widening by table look-up
    is about 1.5x faster than numpy's float16 cast and exactly the same."""
    global _F16_TABLE
    if _F16_TABLE is None:
        _F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    return _F16_TABLE


class PayloadReader:
    """Takes a received chunk into a receive buffer: copy (or widen), and check every value.

    ``wire`` is the layout the bytes travel in, ``local`` the receive buffer's
    (:meth:`~dpwa.node.wire.layout.Layout.on_wire` of it: a float32 array may travel as float16 or
    bfloat16, or as int8 scales and values). Without conversion (``direct``) the transport lets
    ZeroMQ copy a chunk straight into place and calls :meth:`check`; otherwise :meth:`read` widens
    each block of :data:`~dpwa.node.wire.constants.PAYLOAD_BLOCK` elements exactly (float16 and
    bfloat16 are subsets of float32), or dequantizes it, from ZeroMQ's buffer and checks it while
    it is in cache: one pass over the received bytes. When the process has already imported torch, float16 and
    bfloat16 are widened by torch's casts (the same values, 1.2-2.7x faster);
    else by a table look-up (float16) or a shift (bfloat16). Scratch is
    fixed-size; nothing proportional to the model is allocated per payload (int8 scales are kept
    per receive buffer, :class:`~dpwa.node.wire.quantized.Int8Reader`). A payload's chunks must
    come in order (the transport takes nothing else).

    Checks: every float finite, every index below its array's bound; when :meth:`check` or
    :meth:`read` returns False, :attr:`fault` says which failed.
    """

    def __init__(self, wire: Layout, local: Layout, block: int = PAYLOAD_BLOCK) -> None:
        self._sources = wire.sources(local)  # ValueError unless wire is local's wire layout
        self.wire = wire
        self.local = local
        self.direct = wire is local or (wire.dtypes == local.dtypes and wire.bounds == local.bounds)
        """No conversion: the bytes may be received straight into the buffer, then :meth:`check`-ed."""
        self.fault: str | None = None
        """Why the latest :meth:`check` or :meth:`read` returned False (a rejection reason), else None."""
        self._checker = PayloadChecker(local, block)
        self._int8 = Int8Reader(local, self._sources, block) if len(wire.dtypes) != len(local.dtypes) else None
        self._block = block
        self._ok = np.empty(block, dtype=bool)
        self._bits = np.empty(block, dtype=np.uint16)
        self._f32 = np.empty(block, dtype=np.float32)
        self._table = None
        if any(wire.dtypes[j] == "<f2" != local.dtypes[i] for j, (i, _) in enumerate(self._sources)):
            self._table = _f16_table()
            self._index = np.empty(block, dtype=np.intp)  # np.take would allocate one per call

    def check(self, views: Sequence[np.ndarray], start: int, end: int) -> bool:
        """After bytes [start, end) were received straight into the buffer (``direct``): all valid?

        ZeroMQ's own copy into the buffer (a large memcpy) plus this check measured a few
        percent faster than :meth:`read`'s block-by-block copy; :meth:`read` is for widening.
        """
        self.fault = self._checker.fault(views, start, end)
        return self.fault is None

    def read(self, src: np.ndarray, start: int, views: Sequence[np.ndarray]) -> bool:
        """Take ``src`` (uint8, the wire bytes from offset ``start``) into ``views`` (arrays of the local layout).

        Returns False at the first block holding a NaN or an infinity, or an index out of range (``views``
        are then partly written: receive buffers are scratch until a reply is accepted); :attr:`fault` says
        which.
        """
        end = start + src.size
        self.fault = None
        for index, lo, hi in self.wire.segments(start, end):
            code = self.wire.dtypes[index]
            dtype = code_dtype(code)
            first = self.wire.offsets[index] + lo * dtype.itemsize - start
            values = src[first : first + (hi - lo) * dtype.itemsize].view(dtype)
            local, role = self._sources[index]
            if role == ROLE_PLAIN:
                out = views[local].reshape(-1)[lo:hi]
                self.fault = self._take(values, out, code, self.local.dtypes[local], self.local.bound(local))
            elif role == ROLE_SCALES:
                assert self._int8 is not None
                self.fault = self._int8.scales(values, views, local, lo)
            else:
                assert self._int8 is not None
                self.fault = self._int8.values(values, views, local, lo)
            if self.fault is not None:
                return False
        return True

    def _take(self, src: np.ndarray, dst: np.ndarray, wire: str, local: str, bound: int) -> str | None:
        """Copy or widen ``src`` (codes ``wire``) into ``dst`` (code ``local``, bound ``bound``) block by block;
        the rejection reason of the first block that fails its check, else None."""
        block = self._block
        torch = _loaded_torch() if local == "<f4" and wire in ("bf16", "<f2") else None  # once per array
        for a in range(0, src.size, block):
            b = min(a + block, src.size)
            s, d, ok = src[a:b], dst[a:b], self._ok[: b - a]
            if wire == local:
                np.copyto(d, s)
            elif wire == "bf16" and torch is not None and s.flags.aligned and s.flags.writeable:
                torch.from_numpy(d).copy_(torch.from_numpy(s.view(np.uint16)).view(torch.bfloat16))
            elif wire == "bf16":
                wide = d if local == "<f4" else self._f32[: b - a]
                bits = wide.view(np.uint32)  # a bfloat16 is the upper half of a float32: zero-extend, shift
                np.copyto(bits, s.view(np.uint16))
                np.left_shift(bits, 16, out=bits)
                if wide is not d:
                    np.copyto(d, wide)
            elif wire == "<f2" and torch is not None and s.flags.aligned and s.flags.writeable:
                # exact, vectorized: ~2.7x the table look-up (torch takes no read-only array: a peer's segment)
                torch.from_numpy(d).copy_(torch.from_numpy(s))
            elif wire == "<f2" and local == "<f4" and self._table is not None:
                index = self._index[: b - a]
                np.copyto(index, s.view(np.uint16))
                np.take(self._table, index, out=d, mode="clip")
            else:
                np.copyto(d, s)  # numpy's exact widening cast
            fault = block_fault(d, local, bound, ok, self._bits)
            if fault is not None:
                return fault
        return None


def _loaded_torch() -> Any | None:
    """torch if this process has already imported it (the PyTorch adapter always has), else None.

    The core never imports torch itself: without it every conversion runs in numpy.
    """
    return sys.modules.get("torch")


class PayloadWriter:
    """Rounds a snapshot's values (``local`` layout) into its wire buffer (``wire`` layout), chunk by chunk.

    Integer arrays are copied as they are; ``int8``: blockwise quantization
    (:class:`~dpwa.node.wire.quantized.Int8Writer`, pure numpy, deterministic).
    float32/float64 -> float16 and float64 -> float32 round to nearest even
    (beyond float16's range a value becomes an infinity, which the receiver
    rejects as non-finite); -> bfloat16 rounds to nearest even like torch
    (:func:`dpwa.utils.bfloat16.from_float32`; float64 goes through float32). Finite
    values come out bit for bit the same whichever way they are computed: when the
    process has already imported torch, float32 sources are cast by torch's
    vectorized ``copy_`` (about a memcpy; numpy's casts cost 3x (bfloat16) to 7x
    (float16) that), else by numpy in cache-sized blocks. Fixed-size scratch.
    """

    def __init__(self, local: Layout, wire: Layout, block: int = PAYLOAD_BLOCK) -> None:
        self._sources = wire.sources(local)  # ValueError unless wire is local's wire layout
        self.wire = wire
        self.local = local
        self._block = block
        self._u32 = np.empty(block, dtype=np.uint32)
        self._f32 = np.empty(block, dtype=np.float32)
        self._int8 = Int8Writer() if len(wire.dtypes) != len(local.dtypes) else None

    def write(self, views: Sequence[np.ndarray], wire_views: Sequence[np.ndarray], start: int, end: int) -> None:
        """Fill the elements of ``wire_views`` lying in wire bytes [start, end) from ``views`` (writable arrays).

        Any range, in any order: int8 values recompute the scales of their blocks (the same bits)."""
        torch = _loaded_torch()
        for index, lo, hi in self.wire.segments(start, end):
            local, role = self._sources[index]
            if role != ROLE_PLAIN:
                assert self._int8 is not None
                quantize = self._int8.scales if role == ROLE_SCALES else self._int8.values
                quantize(views[local].reshape(-1), wire_views[index].reshape(-1), lo, hi)
                continue
            src = views[local].reshape(-1)[lo:hi]
            dst = wire_views[index].reshape(-1)[lo:hi]
            code, own = self.wire.dtypes[index], self.local.dtypes[local]
            if code == own:
                np.copyto(dst, src)
            elif torch is not None and own == "<f4":
                out = torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16) if code == "bf16" else None
                (torch.from_numpy(dst) if out is None else out).copy_(torch.from_numpy(src))
            else:
                self._numpy(src, dst, code, own)

    def _numpy(self, src: np.ndarray, dst: np.ndarray, code: str, own: str) -> None:
        """Round ``src`` (code ``own``) into ``dst`` (code ``code``) with numpy, block by block."""
        block = self._block
        with np.errstate(over="ignore", invalid="ignore"):
            for a in range(0, src.size, block):
                b = min(a + block, src.size)
                s, d = src[a:b], dst[a:b]
                if code == "bf16":
                    if own != "<f4":
                        s = self._f32[: b - a]
                        np.copyto(s, src[a:b], casting="same_kind")
                    from_float32(s, d, scratch=self._u32)
                else:
                    np.copyto(d, s, casting="same_kind")
