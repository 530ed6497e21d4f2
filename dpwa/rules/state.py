"""Model-sized rule state in checkpoints: one array per parameter array, saved and taken back by a name prefix.

A rule that keeps arrays shaped like the parameters (a tracker, public copies, momentum) names them
``<prefix>/<i>`` in :meth:`~dpwa.rules.base.Rule.state_arrays`; :func:`load_model_arrays` takes them back
only when there is one per parameter array, of its shape and of the dtype the rule keeps for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from dpwa.rules.mixing import is_half, narrow, widen

__all__ = ["load_model_arrays", "save_model_arrays", "store_", "whole_number", "widened"]


def save_model_arrays(prefix: str, arrays: Sequence[np.ndarray] | None) -> dict[str, np.ndarray]:
    """``{"<prefix>/<i>": copy of arrays[i]}``; ``{}`` for None (not allocated yet)."""
    if arrays is None:
        return {}
    return {f"{prefix}/{i}": np.array(a, copy=True) for i, a in enumerate(arrays)}


def load_model_arrays(
    prefix: str,
    saved: Mapping[str, np.ndarray],
    params: Sequence[np.ndarray],
    dtype_of: Callable[[np.dtype], np.dtype],
) -> list[np.ndarray] | None | bool:
    """The arrays ``<prefix>/<i>`` of ``saved`` as copies, one per parameter array, when each has its
    parameter's shape and the dtype ``dtype_of(param.dtype)``; None when ``saved`` holds none of them;
    False when they do not fit ``params``."""
    stored = [key for key in saved if key.startswith(prefix + "/")]
    if not stored:
        return None
    found = [saved.get(f"{prefix}/{i}") for i in range(len(params))]
    if len(stored) != len(params) or any(
        a is None or a.shape != p.shape or a.dtype != dtype_of(p.dtype) for a, p in zip(found, params)
    ):
        return False
    return [np.array(a, copy=True) for a in found if a is not None]


def widened(a: np.ndarray) -> np.ndarray:
    """``a`` in its compute dtype (:func:`~dpwa.rules.mixing.compute_dtype`), exactly: a float32 copy of a float16
    or bfloat16 array (bfloat16 arrays are uint16 bits underneath, never computed with directly), ``a`` itself
    otherwise."""
    if not is_half(a.dtype):
        return a
    return widen(a, np.empty(a.shape, np.float32))


def store_(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst <- src`` (compute dtype), rounded once to nearest even into a float16 or bfloat16 ``dst``."""
    if is_half(dst.dtype):
        narrow(np.ascontiguousarray(src, dtype=np.float32), dst, np.empty(dst.shape, np.float32))
    else:
        np.copyto(dst, src, casting="same_kind")


def whole_number(value: object) -> int | None:
    """An int from an int, a whole finite float (extras a checkpoint gave back as floats) or a 0-d array of one;
    None for anything else (bools included): how rules read the counters and epochs peers send."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None
