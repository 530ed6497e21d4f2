"""The node's once-per-key log: it remembers a bounded number of keys, so a flood of new names (a stranger's
FETCHes, each with a wrong layout and a new name) costs neither memory nor a flood of warnings."""

from __future__ import annotations

import logging

import pytest

from dpwa.node.stats import ONCE_LOG_KEYS, OnceLog


def test_a_key_warns_once_then_logs_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    once = OnceLog(logging.getLogger("dpwa.test.once"))
    with caplog.at_level(logging.DEBUG, logger="dpwa.test.once"):
        for _ in range(3):
            once.warning(("w2", "layout"), "refusing %s", "w2")
        once.forget("w2")
        once.warning(("w2", "layout"), "refusing %s", "w2")
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING]


def test_past_its_limit_a_new_key_is_neither_kept_nor_warned(caplog: pytest.LogCaptureFixture) -> None:
    once = OnceLog(logging.getLogger("dpwa.test.once"), limit=3)
    with caplog.at_level(logging.DEBUG, logger="dpwa.test.once"):
        for i in range(100):
            once.warning((f"stranger-{i}", "layout"), "refusing stranger %d", i)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING] * 3 + [logging.DEBUG] * 97
    assert len(once._seen) == 3  # the bound itself: what a flood can cost
    assert ONCE_LOG_KEYS >= 1024  # enough for every member of the largest table and its reasons
