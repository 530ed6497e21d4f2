"""dpwa.metrics: JSON lines written live and read back while a writer is mid-line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dpwa.metrics import MetricsWriter, read_metrics


def test_lines_are_visible_before_close(tmp_path: Path):
    path = tmp_path / "sub" / "w1.metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1, "loss": 0.5})
    writer.write({"step": 2, "loss": 0.25, "peer": None})
    assert path.read_text().count("\n") == 2  # flushed per line, the file still open
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25, "peer": None}]
    writer.close()
    writer.close()
    assert writer.closed
    with pytest.raises(ValueError, match="closed"):
        writer.write({"step": 3})


def test_appends_and_writes_plain_json(tmp_path: Path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        w.write({"a": np.float32(1.5), "b": np.int64(3), "nan": math.nan, "inf": -math.inf, "nested": {"x": [1, 2]}})
    with MetricsWriter(path) as w:
        w.write({"c": True})
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"a": 1.5, "b": 3, "nan": None, "inf": None, "nested": {"x": [1, 2]}},
        {"c": True},
    ]
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_unserializable_value_writes_nothing(tmp_path: Path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        with pytest.raises(TypeError, match="object"):
            w.write({"bad": object()})
    assert path.read_text() == ""


def test_read_skips_a_torn_last_line(tmp_path: Path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    with caplog.at_level("WARNING", logger="dpwa"):
        assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    assert not caplog.records  # a torn last line is normal while the writer runs
    path.write_text('{"step": 1}\n{"step": 2}')  # complete object, newline not yet written
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


def test_read_skips_bad_lines_in_the_middle_with_a_warning(tmp_path: Path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n[1, 2]\n\n{"step": 2}\n')
    with caplog.at_level("WARNING", logger="dpwa"):
        assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == [f"{path}:2", f"{path}:3"]


def test_a_line_nested_too_deep_or_holding_a_huge_integer_is_skipped_not_raised(tmp_path: Path) -> None:
    """``[[[[...`` deeper than the parser recurses raised RecursionError (a traceback in `dpwa plot`, and in the
    launcher's progress mid-run); an integer of 401 digits parses, and no float holds it (OverflowError)."""
    from dpwa.launcher.rundir import finite_number
    from dpwa.metrics import parse_metrics_line

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n' + "[" * 200_000 + '\n{"step": 2}\n')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    assert parse_metrics_line("[" * 200_000) is None
    assert finite_number(10**400) is None and finite_number(3) == 3.0


def test_read_missing_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "none.jsonl")
