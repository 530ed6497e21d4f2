"""wire_dtype: 16-bit parameters on the wire, mixed in the parameters' own precision.

Unit tests of the wire layout, the rounding (PayloadWriter, numpy and torch backends) and
the widening receive path (PayloadReader); then nodes on 127.0.0.1 exchanging a float32
model in float16 and bfloat16, with every rule.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import exchange_pair, free_ports, port_is_free, traced_peak, write_cluster

from dpwa import ConfigError, DpwaConnection
from dpwa.config import parse_config
from dpwa.node.wire import Layout, PayloadReader, PayloadWriter, payload
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32

SIXTEEN = ["float16", "bfloat16"]


def round16(x: np.ndarray, wire_dtype: str) -> np.ndarray:
    """``x`` (float32) rounded to the wire dtype and widened back: what the receiver must mix in."""
    if wire_dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    bits = np.empty(x.shape, BFLOAT16)
    from_float32(x, bits)
    return to_float32(bits, np.empty(x.shape, np.float32))


@pytest.fixture(params=["numpy", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with numpy's casts, then with torch's (when torch is installed)."""
    if request.param == "torch":
        torch = pytest.importorskip("torch")
        monkeypatch.setattr(payload, "_loaded_torch", lambda: torch)
    else:
        monkeypatch.setattr(payload, "_loaded_torch", lambda: None)
    return str(request.param)


# --------------------------------------------------------------------------- layout


def test_each_array_travels_narrower_or_as_itself():
    arrays = [np.zeros(3, np.float32), np.zeros(2, np.float64), np.zeros(4, np.float16), np.zeros(5, BFLOAT16)]
    local = Layout.of(arrays)
    assert local.on_wire(None) is local and local.on_wire("auto") is local
    assert local.on_wire("float16").dtypes == ("<f2", "<f2", "<f2", "bf16")
    assert local.on_wire("bfloat16").dtypes == ("bf16", "bf16", "<f2", "bf16")  # 16-bit arrays keep their format
    assert local.on_wire("float32").dtypes == ("<f4", "<f4", "<f2", "bf16")
    assert local.on_wire("float16").shapes == local.shapes
    with pytest.raises(ValueError, match="wire dtype"):
        local.on_wire("int4")


def test_fingerprint_includes_the_wire_dtype():
    local = Layout.of([np.zeros((30, 50), np.float32)])
    prints = {local.fingerprint, local.on_wire("float16").fingerprint, local.on_wire("bfloat16").fingerprint}
    assert len(prints) == 3
    assert local.on_wire("float32") is local  # float32 params under float32: nothing changes
    assert local.on_wire("float16").total_bytes < local.total_bytes


def test_config_key_is_validated_with_a_clear_error():
    base = "nodes: [{name: w1, host: localhost, port: 45000}]\n"
    assert parse_config(base).wire_dtype == "auto"
    assert "wire_dtype" not in parse_config(base).to_dict()  # the default is left out of the written file
    config = parse_config(base + "wire_dtype: bfloat16\n")
    assert config.wire_dtype == "bfloat16" and parse_config(base + "wire_dtype: bfloat16\n").to_dict()["wire_dtype"]
    with pytest.raises(ConfigError, match="wire_dtype: unknown value 'half'.*allowed: auto, float16, bfloat16"):
        parse_config(base + "wire_dtype: half\n")
    with pytest.raises(ConfigError, match="wire_dtype: must be one of"):
        parse_config(base + "wire_dtype: 16\n")


# --------------------------------------------------------------------------- rounding and widening


def special_float32(n: int, seed: int = 0) -> np.ndarray:
    """Values over float32's whole range, signed zeros, float16 subnormals and ties of both 16-bit formats."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 9, n))).astype(np.float32)  # |x| < 65504
    ties = [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 2**-24, 3 * 2**-25, 65504.0, 65519.0]
    x[: len(ties) + 2] = [0.0, -0.0, *ties]
    return x


@pytest.mark.parametrize("wire_dtype", SIXTEEN)
def test_writer_rounds_to_nearest_even_and_reader_widens_exactly(wire_dtype: str, backend: str):
    x = special_float32(300_001)
    local = Layout.of([x, x[:77].copy()])
    wire_layout = local.on_wire(wire_dtype)
    buf = wire_layout.allocate()
    writer = PayloadWriter(local, wire_layout, block=4096)
    bounds = wire_layout.frame_bounds(64 * 1024)
    for start, end in bounds:  # chunk by chunk, as the RX thread does
        writer.write([x, x[:77].copy()], wire_layout.views(buf), start, end)
    reader = PayloadReader(wire_layout, local, block=5000)
    out = [np.full_like(x, np.nan), np.full(77, np.nan, np.float32)]
    for start, end in bounds:
        assert reader.read(buf[start:end], start, out)
    np.testing.assert_array_equal(out[0], round16(x, wire_dtype))
    np.testing.assert_array_equal(out[1], round16(x[:77], wire_dtype))
    assert np.signbit(out[0][1])  # -0.0 stays negative


@pytest.mark.parametrize("wire_dtype", [*SIXTEEN, "float32"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_reader_finds_every_non_finite_value(wire_dtype: str, bad: float, backend: str):
    x = np.ones(10_000, np.float32)
    local = Layout.of([x])
    wire_layout = local.on_wire(wire_dtype)
    reader = PayloadReader(wire_layout, local, block=512)
    for index in (0, 511, 512, 9_999):
        y = x.copy()
        y[index] = bad
        buf = wire_layout.allocate()
        PayloadWriter(local, wire_layout).write([y], wire_layout.views(buf), 0, wire_layout.total_bytes)
        assert not reader.read(buf, 0, [np.empty_like(x)]), (wire_dtype, index)


def test_float16_overflow_becomes_infinite_and_is_refused_by_the_reader(backend: str):
    x = np.array([1.0, 70_000.0, -1e30], np.float32)  # beyond float16's 65504
    local = Layout.of([x])
    wire_layout = local.on_wire("float16")
    buf = wire_layout.allocate()
    PayloadWriter(local, wire_layout).write([x], wire_layout.views(buf), 0, wire_layout.total_bytes)
    assert np.isinf(wire_layout.views(buf)[0][1:]).all()
    assert not PayloadReader(wire_layout, local).read(buf, 0, [np.empty_like(x)])


def test_float64_params_travel_as_float32_and_widen_exactly():
    x = np.random.default_rng(1).standard_normal(1000) * 1e10
    local = Layout.of([x])
    wire_layout = local.on_wire("float32")
    assert wire_layout.dtypes == ("<f4",)
    buf = wire_layout.allocate()
    PayloadWriter(local, wire_layout).write([x], wire_layout.views(buf), 0, wire_layout.total_bytes)
    out = np.empty_like(x)
    assert PayloadReader(wire_layout, local).read(buf, 0, [out])
    np.testing.assert_array_equal(out, x.astype(np.float32).astype(np.float64))


# --------------------------------------------------------------------------- nodes


def cluster(tmp_path: Path, wire_dtype: str, **settings: object) -> Path:
    return write_cluster(tmp_path / "c.yaml", free_ports(2), timeout_ms=3000, wire_dtype=wire_dtype, **settings)


@pytest.mark.parametrize("wire_dtype", ["auto", "bfloat16"])
@pytest.mark.timing
def test_wait_published_says_when_the_snapshot_is_whole_on_the_wire(tmp_path: Path, wire_dtype: str):
    cfg = cluster(tmp_path, wire_dtype, fetch_probability=0.0)
    with DpwaConnection("w1", cfg, seed=1) as node:
        assert node.wait_published(0.01) is False  # nothing published yet
        params = [np.linspace(-3, 3, 3_000_000, dtype=np.float32)]  # 12 MB: rounding takes a while
        node.update_send(params, 1.0)
        assert node.wait_published(10.0) is True
        assert node.stats()["snapshots_skipped"] == 0


@pytest.mark.integration
@pytest.mark.parametrize("wire_dtype", SIXTEEN)
def test_float32_model_mixes_within_16_bit_rounding_of_the_exact_average(tmp_path: Path, wire_dtype: str):
    cfg = cluster(tmp_path, wire_dtype)
    rng = np.random.default_rng(7)
    mine = [rng.standard_normal(1_500_000, dtype=np.float32), rng.standard_normal((30, 7), dtype=np.float32)]
    theirs = [rng.standard_normal(a.shape, dtype=np.float32) for a in mine]  # 6 MB: two chunks on the wire
    before = [a.copy() for a in mine]
    with DpwaConnection("w1", cfg, seed=1) as a, DpwaConnection("w2", cfg, seed=2) as b:
        b.update_send(theirs, 1.0)
        a.update_send(mine, 1.0)
        assert a.update_wait(1.0) == 0.5
        record = a.last_exchange
        assert record["status"] == "ok"
        assert record["bytes"] < sum(x.nbytes for x in mine) * 0.51  # half the bytes travelled
    for got, x, p in zip(mine, before, theirs):
        # exactly the float32 mix of x and the peer rounded once to the wire dtype ...
        expect = np.float32(0.5) * x + np.float32(0.5) * round16(p, wire_dtype)
        np.testing.assert_array_equal(got, expect)
        # ... so within half the 16-bit rounding of the exact average (plus float32's own rounding)
        exact = (x.astype(np.float64) + p.astype(np.float64)) / 2
        ulp16 = np.abs(p).astype(np.float64) * (2.0**-11 if wire_dtype == "float16" else 2.0**-8)
        assert (np.abs(got - exact) <= ulp16 / 2 + np.abs(exact) * 2.0**-23 + 1e-30).all()


@pytest.mark.integration
def test_nodes_with_different_wire_dtypes_refuse_each_other(tmp_path: Path):
    ports = free_ports(2)
    cfg16 = write_cluster(tmp_path / "a.yaml", ports, timeout_ms=1000, wire_dtype="bfloat16")
    cfg32 = write_cluster(tmp_path / "b.yaml", ports, timeout_ms=1000)
    p = [np.zeros(100, np.float32)]
    with DpwaConnection("w1", cfg16) as a, DpwaConnection("w2", cfg32) as b:
        b.update_send([np.ones(100, np.float32)], 1.0)
        a.update_send(p, 1.0)
        assert a.update_wait(1.0) == 0.0
        assert a.stats()["fetches_refused"] == 1 and (p[0] == 0).all()


@pytest.mark.integration
def test_float16_wire_overflow_is_rejected_and_counted(tmp_path: Path):
    cfg = cluster(tmp_path, "float16")
    p = [np.zeros(1000, np.float32)]
    with DpwaConnection("w1", cfg) as a, DpwaConnection("w2", cfg) as b:
        b.update_send([np.full(1000, 1e6, np.float32)], 1.0)
        a.update_send(p, 1.0)
        assert a.update_wait(1.0) == 0.0
        assert a.stats()["rejected_by_reason"] == {"non-finite": 1} and (p[0] == 0).all()


@pytest.mark.integration
@pytest.mark.outcome
@pytest.mark.parametrize(
    ("rule", "settings"),
    [
        ("gem", {"gem": {"reference": "sent"}}),
        ("pushsum", {}),
        ("leader", {}),
        ("group", {"group": {"group_size": 2, "sync_every": 3}}),
    ],
)
def test_every_rule_works_with_a_16_bit_wire(
    tmp_path: Path, rule: str, settings: dict, record_property: Callable[[str, object], None]
):
    """The rules see arrays of the parameters' dtype (widened on receipt): nothing changes for them."""
    cfg = cluster(tmp_path, "bfloat16", interpolation=rule, **settings)
    rng = np.random.default_rng(3)
    params = {n: [rng.standard_normal(5000, dtype=np.float32) + i] for i, n in enumerate(("w1", "w2"))}
    spread0 = float(np.abs(params["w1"][0] - params["w2"][0]).mean())
    nodes = {n: DpwaConnection(n, cfg, seed=i) for i, n in enumerate(("w1", "w2"))}
    errors: list[BaseException] = []

    def train(name: str) -> None:
        local = np.random.default_rng(len(name) + ord(name[-1]))
        try:
            for _ in range(12):
                nodes[name].update_send(params[name], 1.0)
                params[name][0] += local.standard_normal(5000, dtype=np.float32) * np.float32(0.01)  # a step
                time.sleep(0.005)
                nodes[name].update_wait(1.0)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(n,)) for n in nodes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for conn in nodes.values():
            conn.close()
    assert not errors, errors
    mixes = sum(c.stats()["mixes"] for c in nodes.values())
    assert mixes > 0 and all(np.isfinite(p[0]).all() for p in params.values())
    assert all(c.stats()["fetches_rejected"] == 0 for c in nodes.values())
    record_property("spread_ratio", float(np.abs(params["w1"][0] - params["w2"][0]).mean()) / spread0)
    if rule != "gem":  # GEM mixes only as much as a node moved on its own: too little here to show
        assert float(np.abs(params["w1"][0] - params["w2"][0]).mean()) < spread0 * 0.9


@pytest.mark.integration
@pytest.mark.parametrize("wire_dtype", SIXTEEN)
def test_no_model_sized_allocation_after_warm_up(tmp_path: Path, wire_dtype: str, backend: str):
    cfg = cluster(tmp_path, wire_dtype)
    n = 6_000_000
    p1, p2 = [np.zeros(n, np.float32)], [np.ones(n, np.float32)]
    with DpwaConnection("w1", cfg, seed=1) as a, DpwaConnection("w2", cfg, seed=2) as b:
        exchange_pair(a, b, p1, p2, rounds=4)  # warm-up: layouts, pools, wire buffers, receive buffers
        peak = traced_peak(lambda: exchange_pair(a, b, p1, p2, rounds=4))
    assert peak < 2**21 < p1[0].nbytes / 4, peak


@pytest.mark.integration
@pytest.mark.timing
def test_close_stops_the_converter_thread_too(tmp_path: Path):
    ports = free_ports(2)
    # timeout_ms 300: update_wait waits that long for w2, which never comes; nothing asserted depends on it
    cfg = write_cluster(tmp_path / "c.yaml", ports, wire_dtype="bfloat16", timeout_ms=300)
    conn = DpwaConnection("w1", cfg)
    conn.update_send([np.ones(3_000_000, np.float32)], 1.0)  # the converter starts on it
    assert any(t.name == "dpwa-wire-w1" for t in threading.enumerate())
    conn.update_wait(1.0)
    t0 = time.monotonic()
    conn.close()
    assert time.monotonic() - t0 < 1.0
    assert not [t for t in threading.enumerate() if t.name.startswith("dpwa-") and "w1" in t.name]
    assert port_is_free(ports[0])
