"""The two parts scripts/test.sh runs the suite in (``--part``), as pytest hooks that conftest.py imports.

``--part parallel``: the tests that may share the machine with others (two pytest-xdist workers run them at once);
``--part serial``: those marked ``timing`` (deadlines, hand-offs and start-ups that assume nothing else runs) or
``outcome`` (bounds measured over runs with nothing else running), run after, one at a time; ``--part all`` (the
default): every selected test. Every test is in exactly one of the two parts.
"""

from __future__ import annotations

import pytest

__all__ = ["PARTS", "SERIAL_MARKERS", "pytest_addoption", "pytest_collection_modifyitems", "runs_alone"]

PARTS = ("all", "parallel", "serial")
SERIAL_MARKERS = ("timing", "outcome")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part",
        choices=PARTS,
        default="all",
        help="run all selected tests; only those that may run beside others (parallel); or only those marked "
        "timing or outcome (serial)",
    )


def runs_alone(item: pytest.Item) -> bool:
    """True for a test that must run with nothing else beside it: one marked ``timing`` or ``outcome``."""
    return any(item.get_closest_marker(name) is not None for name in SERIAL_MARKERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the part of the selection that ``--part`` names; the rest is deselected (and reported so)."""
    part = config.getoption("part")
    if part == "all":
        return
    serial = part == "serial"
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (kept if runs_alone(item) == serial else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
