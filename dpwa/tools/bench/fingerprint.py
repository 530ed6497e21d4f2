"""Parameter fingerprints over time: a worker appends (time, step, flat parameters) records; the bench reads them.

The file ``<node>.params.bin`` is a plain array of fixed-size records (numpy dtype
:func:`record_dtype`): ``time`` (Unix seconds, float64), ``step`` (int64) and ``params`` (the
node's parameters flattened, float32).  Records are appended whole and flushed, so a reader sees
whole records (:func:`read_records` drops a torn tail).  Meant for small models: one record of the
demo MLP is 28 KB, of the scale bench's 970-parameter MLP 4 KB.  numpy only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["SUFFIX", "ParamRecorder", "mean_state_at", "read_records", "record_dtype", "spread"]

SUFFIX = ".params.bin"


def record_dtype(size: int) -> np.dtype:
    """One record: ``time`` float64, ``step`` int64, ``params`` float32[size]."""
    return np.dtype([("time", "<f8"), ("step", "<i8"), ("params", "<f4", (size,))])


class ParamRecorder:
    """Appends a record to ``path`` on :meth:`record`, or every ``every`` steps on :meth:`maybe_record`."""

    def __init__(self, path: Path, size: int, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.path = path
        self.dtype = record_dtype(size)
        self.every = every
        self._buf = np.zeros(1, dtype=self.dtype)
        self._file = open(path, "wb", buffering=0)  # closed in close()

    def record(self, step: int, params: np.ndarray) -> None:
        """Append (now, ``step``, ``params``) -- ``params`` a flat float array of the recorder's size."""
        self._buf["time"] = time.time()
        self._buf["step"] = step
        self._buf["params"][0] = params
        self._file.write(self._buf.tobytes())

    def maybe_record(self, step: int, params: np.ndarray) -> None:
        if step % self.every == 0:
            self.record(step, params)

    def close(self) -> None:
        if not self._file.closed:
            os.fsync(self._file.fileno())
            self._file.close()


def read_records(path: Path, size: int) -> np.ndarray:
    """Every whole record of ``path`` (a structured array, possibly empty)."""
    dtype = record_dtype(size)
    data = path.read_bytes()
    whole = len(data) // dtype.itemsize
    return np.frombuffer(data[: whole * dtype.itemsize], dtype=dtype)


def mean_state_at(records: Sequence[np.ndarray], t: float) -> tuple[np.ndarray, np.ndarray]:
    """At time ``t``: every node's latest parameters (its first record if none is that old), and their mean.

    ``records``: one structured array per node, in time order.  Returns (stacked [nodes, size], mean).
    """
    latest = []
    for rec in records:
        i = int(np.searchsorted(rec["time"], t, side="right")) - 1
        latest.append(rec["params"][max(0, i)].astype(np.float64))
    stacked = np.stack(latest)
    return stacked, stacked.mean(axis=0)


def spread(stacked: np.ndarray, mean: np.ndarray) -> tuple[float, float]:
    """(max over nodes of ``||x_i - mean||``, the same divided by ``||mean||``)."""
    distance = float(np.max(np.linalg.norm(stacked - mean, axis=1)))
    norm = float(np.linalg.norm(mean))
    return distance, distance / norm if norm > 0 else float("nan")
