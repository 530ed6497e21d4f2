"""Live progress of a ``dpwa run`` and its summary table.

:class:`Progress` is fed snapshots (:class:`NodeView`) as often as the launcher likes and draws
only when due: on a terminal one line per node, redrawn in place about once a second; otherwise
(a pipe, a log file, CI) one compact line every few seconds. It never reads files or processes
itself. :func:`summary_table` formats the end-of-run table.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from dpwa.launcher.rundir import NodeMetrics
from dpwa.utils.partition import describe

__all__ = ["NodeView", "Progress", "summary_table"]

TTY_INTERVAL_S = 1.0
PLAIN_INTERVAL_S = 5.0
_ERASE_LINE = "\x1b[2K"


@dataclasses.dataclass(frozen=True)
class NodeView:
    """What the display knows of one node: its name, state (``running``, ``ok``, ``failed``, ``stopped``)
    and its metrics so far."""

    name: str
    state: str
    metrics: NodeMetrics


class Progress:
    """Draw node progress to ``stream`` when due; :meth:`close` leaves the cursor on a fresh line.

    ``interactive`` defaults to ``stream.isatty()``; ``interval`` to 1 s on a terminal, 5 s otherwise.
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        interactive: bool | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.interactive = _isatty(stream) if interactive is None else interactive
        self.interval = interval if interval is not None else TTY_INTERVAL_S if self.interactive else PLAIN_INTERVAL_S
        self._clock = clock
        self._start = clock()
        self._next = self._start + (0.0 if self.interactive else self.interval)
        self._drawn = 0  # lines currently on screen (interactive mode)
        self._rates: dict[str, tuple[float, int, float]] = {}  # name -> (time, bytes_in, MB/s)

    def update(self, views: Sequence[NodeView], *, force: bool = False) -> bool:
        """Draw ``views`` if a redraw is due (or ``force``); return whether it drew."""
        now = self._clock()
        if not force and now < self._next:
            return False
        self._next = now + self.interval
        rates = {v.name: self._rate(v, now) for v in views}
        elapsed = now - self._start
        if self.interactive:
            self._redraw([_line(v, rates[v.name]) for v in views])
        else:
            self._write(f"[{elapsed:5.0f}s] " + " | ".join(_compact(v, rates[v.name]) for v in views) + "\n")
        return True

    def message(self, text: str) -> None:
        """Print ``text`` on its own line, above the live lines (which are redrawn at the next update)."""
        self._clear()
        self._write(text.rstrip("\n") + "\n")

    def close(self) -> None:
        """Stop drawing: the live lines stay on screen and later output starts below them."""
        self._drawn = 0
        self._flush()

    def _rate(self, view: NodeView, now: float) -> float:
        """MB/s received by the node since the previous draw."""
        before = self._rates.get(view.name)
        received = view.metrics.bytes_in
        rate = 0.0
        if before is not None:
            then, old, old_rate = before
            rate = (received - old) / 1e6 / (now - then) if now > then else old_rate
        self._rates[view.name] = (now, received, rate)
        return max(rate, 0.0)

    def _redraw(self, lines: list[str]) -> None:
        self._clear()
        self._write("".join(f"{line}\n" for line in lines))
        self._drawn = len(lines)

    def _clear(self) -> None:
        if self.interactive and self._drawn:
            self._write(f"\x1b[{self._drawn}F" + f"{_ERASE_LINE}\n" * self._drawn + f"\x1b[{self._drawn}F")
            self._drawn = 0

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self._flush()

    def _flush(self) -> None:
        flush = getattr(self.stream, "flush", None)
        if flush is not None:
            flush()


def summary_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """The end-of-run table: one row per node (name -> summary.json node entry), no trailing newline.

    The latency column is ``fetch ms`` (``mean_fetch_ms``) or, for push rules, ``push ms`` (``mean_push_ms``:
    send to ACK); ``fetch/push ms`` when nodes differ, a push latency then marked ``(push)``. When some node
    had a fetch declined (not ready, busy, left: not failures) a ``declined`` column is added, and when some
    fetch did not end ok a ``reasons`` column: each reason and its count, the most frequent first, failures
    before declined ones (``refused:`` left out: ``busy 34, timeout 2``). A ``data`` column (the classes holding
    at least 5% of the node's samples, from ``<node>.data.json``) is added when some node wrote its data file."""
    kinds = {_latency(row)[0] for row in rows.values()} - {None}
    latency = {"push"} == kinds
    header: tuple[str, ...] = ("node", "status", "steps", "final loss", "accuracy", "mixes", "failed", "timeouts")
    header += ("push ms" if latency else "fetch/push ms" if len(kinds) > 1 else "fetch ms",)
    with_declined = any(_number(row.get("declined_fetches")) for row in rows.values())
    with_reasons = any(_reasons(row) != "-" for row in rows.values())
    with_data = any(isinstance(row.get("data"), Mapping) for row in rows.values())
    body = [
        (
            name,
            _status(row),
            _fmt(row.get("steps"), "d"),
            _fmt(row.get("final_loss"), ".4f"),
            _fmt(row.get("accuracy"), ".4f"),
            _fmt(row.get("mixes"), "d"),
            _fmt(row.get("failed_fetches"), "d"),
            _fmt(row.get("timeouts"), "d"),
            _latency_cell(row, mixed=len(kinds) > 1),
            *((_fmt(row.get("declined_fetches"), "d"),) if with_declined else ()),
            *((_reasons(row),) if with_reasons else ()),
            *((_data(row.get("data")),) if with_data else ()),
        )
        for name, row in rows.items()
    ]
    header += ("declined",) if with_declined else ()
    header += ("reasons",) if with_reasons else ()
    header += ("data (classes >= 5%)",) if with_data else ()
    text_columns = int(with_reasons) + int(with_data)  # the last ones, left-aligned as the first two
    left = {0, 1} | set(range(len(header) - text_columns, len(header)))
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), *(line(r).rstrip() for r in body)])


def _latency(row: Mapping[str, Any]) -> tuple[str | None, float | None]:
    """A node's latency: ``("fetch", mean_fetch_ms)``, else ``("push", mean_push_ms)``, else ``(None, None)``."""
    for kind in ("fetch", "push"):
        value = _number(row.get(f"mean_{kind}_ms"))
        if value is not None:
            return kind, value
    return None, None


def _latency_cell(row: Mapping[str, Any], *, mixed: bool) -> str:
    kind, value = _latency(row)
    if value is None:
        return "-"
    return f"{value:.1f} (push)" if mixed and kind == "push" else f"{value:.1f}"


def _reasons(row: Mapping[str, Any]) -> str:
    """``failed_by_reason`` then ``declined_by_reason``, compactly: ``busy 34, timeout 2`` (``-``: none)."""
    parts = []
    for key in ("failed_by_reason", "declined_by_reason"):
        counts = row.get(key)
        if not isinstance(counts, Mapping):
            continue
        ranked = sorted(((str(r), n) for r, n in counts.items() if _number(n)), key=lambda rn: (-rn[1], rn[0]))
        parts += [f"{reason.removeprefix('refused: ')} {int(n)}" for reason, n in ranked]
    return ", ".join(parts) or "-"


def _number(value: object) -> float | None:
    """``value`` as a float when it is a number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _data(data: object) -> str:
    """A node's data file as ``PARTITION: CLASSES`` (``-`` when it wrote none or it is malformed)."""
    if not isinstance(data, Mapping):
        return "-"
    hist = data.get("classes")
    if not isinstance(hist, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in hist):
        return "-"
    return f"{data.get('partition', '?')}: {describe(hist)}"


# --------------------------------------------------------------------------- formatting


def _line(view: NodeView, rate: float) -> str:
    m = view.metrics
    loss = "-" if m.loss is None else f"{m.loss:.4f}"
    members = "" if m.members is None or view.state != "running" else f"  members {m.members:>3}"
    return (
        f"{view.name:<10} {view.state:<8} step {m.steps:>7}  loss {loss:>8}  mixes {m.mixes:>6}  "
        f"failed {m.failed:>4}  {rate:7.2f} MB/s{members}"
    )


def _compact(view: NodeView, rate: float) -> str:
    m = view.metrics
    loss = "-" if m.loss is None else f"{m.loss:.3g}"
    state = "" if view.state == "running" else f" {view.state}"
    members = "" if m.members is None or view.state != "running" else f" members {m.members}"
    return f"{view.name}{state} step {m.steps} loss {loss} mix {m.mixes} fail {m.failed} {rate:.2f}MB/s{members}"


def _status(row: Mapping[str, Any]) -> str:
    status = str(row.get("status", "?"))
    code = row.get("returncode")
    return f"{status} ({code})" if status == "failed" and code is not None else status


def _fmt(value: object, spec: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return format(int(value) if spec == "d" else value, spec)


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
