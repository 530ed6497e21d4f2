"""scripts/test.sh's two parts (tests/parts.py): every test lands in exactly one, and the serial part holds exactly
the tests marked ``timing`` or ``outcome``, however they are marked (on the function, its class or its module)."""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]

SAMPLE = """
import pytest


def test_plain():
    pass


@pytest.mark.timing
def test_timed():
    pass


@pytest.mark.outcome
@pytest.mark.parametrize("k", [1, 2])
def test_measured(k):
    pass


@pytest.mark.slow
def test_slow_only():
    pass


@pytest.mark.timing
class TestTimedClass:
    def test_in_class(self):
        pass
"""


MODULE_MARKED = """
import pytest

pytestmark = pytest.mark.outcome


def test_in_marked_module():
    pass
"""


def collected(pytester: pytest.Pytester, *args: str) -> set[str]:
    """The test ids a ``--collect-only`` run of the samples selects with ``args`` (tests/parts.py as a plugin)."""
    result = pytester.runpytest("-p", "parts", "--collect-only", "-q", *args)
    return {m.group(0) for line in result.outlines if (m := re.match(r"test_\w+\.py::\S+", line))}


def test_every_test_is_in_exactly_one_part(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_sample=SAMPLE, test_module=MODULE_MARKED)
    pytester.makeini("[pytest]\nmarkers =\n    timing: t\n    outcome: o\n    slow: s\n")
    everything = collected(pytester)
    parallel = collected(pytester, "--part", "parallel")
    serial = collected(pytester, "--part", "serial")
    assert len(everything) == 7
    assert parallel | serial == everything and not parallel & serial
    assert serial == {
        "test_sample.py::test_timed",
        "test_sample.py::test_measured[1]",
        "test_sample.py::test_measured[2]",
        "test_sample.py::TestTimedClass::test_in_class",
        "test_module.py::test_in_marked_module",
    }
    assert collected(pytester, "--part", "serial", "-k", "measured") == {
        "test_sample.py::test_measured[1]",
        "test_sample.py::test_measured[2]",
    }
