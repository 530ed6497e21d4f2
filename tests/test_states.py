"""The node's states and what each outcome does (dpwa/node/states.py), the words a record names them by, what a lost
reply tells the rule, and that a transport whose construction fails half-way leaves no bound port behind."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from conftest import free_ports

from dpwa.metrics import fetch_reason
from dpwa.node import wire
from dpwa.node.core import lost_extras
from dpwa.node.states import (
    FETCH_MOVES,
    PUSH_FLOW_EFFECT,
    PUSH_MOVES,
    SLOT_MOVES,
    FetchStatus,
    FlowEffect,
    PushStatus,
    SlotState,
    fetch_effect,
    moves,
)
from dpwa.node.timeouts import Timeouts
from dpwa.node.transport import Transport


def test_every_state_has_its_row_and_final_states_move_nowhere() -> None:
    for table, enum in ((FETCH_MOVES, FetchStatus), (PUSH_MOVES, PushStatus), (SLOT_MOVES, SlotState)):
        assert set(table) == set(enum)
        assert all(set(targets) <= set(enum) for targets in table.values())
    assert all(not FETCH_MOVES[s] for s in FetchStatus if s is not FetchStatus.PENDING)
    assert all(not PUSH_MOVES[s] for s in (PushStatus.DELIVERED, PushStatus.REFUSED, PushStatus.LOST))


def test_the_transitions_the_code_makes_are_allowed_and_others_not() -> None:
    assert moves(FETCH_MOVES, FetchStatus.PENDING, FetchStatus.OK)
    assert not moves(FETCH_MOVES, FetchStatus.TIMEOUT, FetchStatus.OK)  # one verdict per target
    assert moves(PUSH_MOVES, PushStatus.SENDING, PushStatus.UNKNOWN)
    assert moves(PUSH_MOVES, PushStatus.UNKNOWN, PushStatus.DELIVERED)  # a SETTLE query's answer
    assert not moves(PUSH_MOVES, PushStatus.UNKNOWN, PushStatus.SENDING)
    assert not moves(PUSH_MOVES, PushStatus.REFUSED, PushStatus.DELIVERED)  # the mass came back: final
    push = [SlotState.FREE, SlotState.RECEIVING, SlotState.FULL, SlotState.MIXING, SlotState.FREE]
    exchange = [SlotState.FREE, SlotState.RECEIVING, SlotState.HELD, SlotState.SERVED, SlotState.COMMITTED]
    for path in (push, exchange + [SlotState.MIXING, SlotState.FREE]):
        assert all(moves(SLOT_MOVES, a, b) for a, b in zip(path, path[1:]))
    assert not moves(SLOT_MOVES, SlotState.MIXING, SlotState.FULL)
    assert not moves(SLOT_MOVES, SlotState.FREE, SlotState.FULL)


@pytest.mark.parametrize(
    ("status", "code", "effect"),
    [
        (FetchStatus.OK, "", FlowEffect.SUCCESS),
        (FetchStatus.REFUSED, "busy", FlowEffect.NONE),
        (FetchStatus.REFUSED, "not-ready", FlowEffect.NONE),
        (FetchStatus.REFUSED, "left", FlowEffect.NONE),
        (FetchStatus.REFUSED, "not-a-member", FlowEffect.NONE),
        (FetchStatus.REFUSED, "layout-mismatch", FlowEffect.FAILURE),
        (FetchStatus.TIMEOUT, "timeout", FlowEffect.FAILURE),
        (FetchStatus.REJECTED, "nonfinite", FlowEffect.FAILURE),
    ],
)
def test_which_fetch_outcome_penalises_a_peer(status: FetchStatus, code: str, effect: FlowEffect) -> None:
    assert fetch_effect(status, code) is effect
    assert fetch_effect(str(status), code) is effect  # a plain word reads the same  # type: ignore[arg-type]


def test_a_push_answered_either_way_shows_the_peer_is_there() -> None:
    assert PUSH_FLOW_EFFECT[PushStatus.DELIVERED] is PUSH_FLOW_EFFECT[PushStatus.REFUSED] is FlowEffect.SUCCESS
    assert PUSH_FLOW_EFFECT[PushStatus.UNKNOWN] is FlowEffect.FAILURE


def test_records_name_outcomes_by_plain_words() -> None:
    reasons = [fetch_reason(FetchStatus.TIMEOUT, "timeout"), fetch_reason(FetchStatus.REFUSED, "busy")]
    assert reasons == ["timeout", "refused: busy"] and all(type(r) is str for r in reasons)
    assert fetch_reason(FetchStatus.TIMEOUT, "timeout", late=True) == "timeout: late"
    assert fetch_reason(FetchStatus.OK) is None
    assert json.dumps({"status": FetchStatus.OK}) == '{"status": "ok"}'


def test_a_lost_reply_tells_the_rule_what_came() -> None:
    """A STATE's extras; an ERROR that came after the target timed out carries none (it has no extras field); nothing
    at all is None."""
    state = wire.decode_message(
        wire.encode_state(
            "w2", 3, clock=1.0, loss=0.5, extras={"weight": 0.5}, layout=wire.Layout.of([np.zeros(4, np.float32)])
        )
    )
    error = wire.decode_message(wire.encode_error("w2", 3, wire.ErrorCode.BUSY, "in another exchange"))
    assert lost_extras(state) == {"weight": 0.5}
    assert lost_extras(error) == {} and not hasattr(error, "extras")
    assert lost_extras(None) is None


class _NoTx(Transport):
    def make_tx(self, peers: dict[str, str], port: object) -> object:  # type: ignore[override]
        raise RuntimeError("no TX client")


class _Port:
    inbox = None

    def auth_denied(self, address: str) -> None:
        pass

    def expire_loans(self, now: float) -> None:
        pass


def test_a_transport_whose_tx_cannot_be_built_frees_its_bound_port() -> None:
    (port,) = free_ports(1)
    with pytest.raises(RuntimeError, match="no TX client"):
        _NoTx("w1", f"tcp://127.0.0.1:{port}", {}, _Port(), Timeouts(exchange_s=1.0, join_s=1.0))  # type: ignore[arg-type]
    with socket.socket() as probe:  # the RX server's socket is closed and its context ended: the port is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
    # Control: a transport that is built holds the port until it is closed.
    held = Transport("w1", f"tcp://127.0.0.1:{port}", {}, _Port(), Timeouts(exchange_s=1.0, join_s=1.0))  # type: ignore[arg-type]
    held.start()
    try:
        with socket.socket() as probe, pytest.raises(OSError):
            probe.bind(("127.0.0.1", port))
    finally:
        held.stop()
        assert held.close()
