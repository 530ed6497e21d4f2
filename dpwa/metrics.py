"""The per-node metrics file: one JSON object per line (docs/metrics.md).

:class:`MetricsWriter` appends records and flushes every line, so a launcher
tailing ``<run_dir>/<node>.metrics.jsonl`` sees progress live;
:func:`read_metrics` reads such a file back while it is still being written
(an incomplete last line is skipped, not an error).  Pure stdlib.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DECLINED_CODES",
    "MetricsTail",
    "MetricsWriter",
    "fetch_reason",
    "is_failure",
    "json_safe",
    "parse_metrics_line",
    "read_metrics",
]

log = logging.getLogger(__name__)

DECLINED_CODES = frozenset({"not-ready", "busy", "left", "not-a-member"})
"""Codes of the refusals that are not failures (docs/metrics.md): the peer is there and answered, but did not
take part this time -- it has published nothing yet (``not-ready``: starting), it is in other exchanges
(``busy``: AD-PSGD's contention, a full inbox), or it has left the cluster (``left``, ``not-a-member``). Flow
control does not penalise them either. Every other non-ok outcome is a failure."""


def fetch_reason(status: str, code: str = "", late: bool = False) -> str | None:
    """The reason of one fetch outcome as the metrics record and the summary name it; None for ``ok``.

    ``timeout`` (no reply before the deadline), ``timeout: late`` (the TX thread gave no verdict in time:
    ``late``), ``timeout: <code>`` (e.g. ``send-queue-full``), ``refused: <code>`` (the peer's ERROR code, e.g.
    ``busy``, ``not-ready``, ``layout-mismatch``), ``rejected: <reason>`` (the validation reason); a status with
    no code is the reason itself."""
    if status == "ok":
        return None
    if status == "timeout" and late:
        return "timeout: late"
    if not code or (status == "timeout" and code == "timeout"):
        return str(status)  # the word itself, also for a status Enum
    return f"{status}: {code}"


def is_failure(reason: str) -> bool:
    """Whether an outcome of reason ``reason`` (:func:`fetch_reason`; a bare status of an older record too) is a
    failure: every one but ``pushed`` and the refusals of :data:`DECLINED_CODES`."""
    status, _, code = reason.partition(": ")
    if status == "refused":
        return code not in DECLINED_CODES
    return status not in ("ok", "pushed")


def json_safe(value: Any) -> Any:
    """A JSON-safe copy: non-finite floats become null, scalars with ``.item()`` (numpy) their Python value."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        return json_safe(item())
    raise TypeError(f"cannot write a {type(value).__name__} to the metrics file")


class MetricsWriter:
    """Appends one JSON object per :meth:`write` to ``path`` (created with its directory if missing).

    Every line is flushed as it is written (line-buffered), so readers see whole
    lines as soon as they exist.  Non-finite floats are written as ``null`` so any
    JSON parser reads the file.  Thread-safe; :meth:`close` is idempotent and
    writes after it raise ValueError.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # closed in close()
        self._lock = threading.Lock()
        if _ends_torn(self.path):  # a writer killed mid-line (a restarted node appends): end that line first
            self._file.write("\n")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line; TypeError (nothing written) for a value JSON cannot hold."""
        line = json.dumps(json_safe(dict(record)), separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"metrics file {self.path} is closed")
            self._file.write(line)
            self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        """Flush and close the file; idempotent."""
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_torn(path: Path) -> bool:
    """True when ``path`` is non-empty and does not end with a newline."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() == 0:
                return False
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) != b"\n"
    except OSError:
        return False


def read_metrics(path: str | os.PathLike[str], *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """Every JSON-object line of a metrics file, in order; FileNotFoundError if there is none (``[]`` with
    ``missing_ok``).

    Safe on a file still being written: a torn last line (a writer caught
    mid-line) is skipped silently.  Any other line that is not a JSON object is
    skipped with a warning naming ``file:line`` -- a reader never fails a run
    summary over one bad line.  A complete last object is kept even before its
    newline (a JSON object is never the prefix of a longer one).
    """
    path = Path(path)
    if missing_ok and not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested deeper than the parser goes
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number < len(lines):  # the last piece has no newline yet: torn, not corrupt
            log.warning("%s:%d: skipping a line that is not a JSON object", path, number)
    return records


def parse_metrics_line(line: bytes | str) -> dict[str, Any] | None:
    """One metrics line as a dict, or None when it is blank, torn or not a JSON object."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class MetricsTail:
    """Incremental reader of a growing metrics file: each :meth:`read_new` returns the complete new lines."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_new(self, *, final: bool = False) -> list[dict[str, Any]]:
        """Records appended since the last call. A line without its newline is kept for the next call,
        unless ``final`` (the writer has exited): then it is parsed if it is whole JSON, else dropped.
        """
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = b"" if final else lines.pop()
        records = (parse_metrics_line(line) for line in lines if line.strip())
        return [r for r in records if r is not None]
