"""The names of the dtypes a model's arrays may travel in between nodes.

The cluster file's ``wire_dtype`` key allows ``auto`` (every array travels in its own dtype) or one of
:data:`WIRE_DTYPES` (float arrays wider than it travel in it; ``int8``: every float array travels as blockwise
int8 values with one float32 scale per block, :mod:`dpwa.utils.int8`); ``dpwa bench exchange --wire-dtype``
measures each of them. How each travels on the wire (its code in a message) is ``dpwa.node.wire``'s business.
"""

from __future__ import annotations

__all__ = ["WIRE_DTYPES"]

WIRE_DTYPES = ("float16", "bfloat16", "float32", "int8")
"""The wire dtypes by name: the float ones narrowest first, then ``int8`` (quantized, the narrowest of all)."""
