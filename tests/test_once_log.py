"""The node's once-per-key log: it remembers a bounded number of keys, so a flood of new keys costs neither memory
nor a flood of warnings; and a stranger's names are one key (a flood of FETCHes with a wrong layout, each under a new
name, cannot fill it)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from dpwa.config import MAX_JOINED, NodeSpec
from dpwa.node import serving, wire
from dpwa.node.membership import Membership
from dpwa.node.stats import ONCE_LOG_KEYS, NodeStats, OnceLog


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
    assert levels == [logging.WARNING] * 4 + [logging.DEBUG] * 97  # the 4th says the log is full, once
    assert "further ones are logged at DEBUG" in caplog.records[3].getMessage()
    assert len(once._seen) == 3  # the bound itself: what a flood can cost
    assert ONCE_LOG_KEYS >= 8 * MAX_JOINED  # every member of the largest table, each with its few reasons


def test_strangers_fetching_with_a_wrong_layout_are_one_key(caplog: pytest.LogCaptureFixture) -> None:
    """100 FETCHes with a wrong layout, each under a new name no member has (no CURVE: a name is only a word), and
    one from a member: two warnings and two keys, however many names the strangers make up."""
    me = NodeSpec("w1", "127.0.0.1", 4001)
    node = SimpleNamespace(
        name="w1",
        membership=Membership(me, [me, NodeSpec("w2", "127.0.0.1", 4002)], 8, 10.0, lambda: None),
        stats=NodeStats(),
        once=OnceLog(logging.getLogger("dpwa.test.once")),
        wire_layout=wire.Layout.of([np.zeros(4, np.float32)]),
        pool=object(),
    )
    with caplog.at_level(logging.DEBUG, logger="dpwa.test.once"):
        for asker in [f"stranger-{i}" for i in range(100)] + ["w2", "w2"]:
            reply = serving.serve(node, wire.Fetch(node=asker, req=1, fingerprint="not-the-layout"))  # type: ignore[arg-type]
            refusal = wire.decode_message(reply.header)
            assert isinstance(refusal, wire.Error) and refusal.code == wire.ErrorCode.LAYOUT
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "refusing stranger-0" in warnings[0] and "refusing w2" in warnings[1]
    assert len(node.once._seen) == 2
