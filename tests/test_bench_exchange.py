"""`dpwa bench exchange` at a tiny size: the output's shape and finite numbers (never their values).

The figures themselves are the benchmark's business (docs/performance.md); a test only
checks that every measurement was taken and written, and that the benchmark cleans up
after itself, Ctrl-C included.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dpwa.tools.bench.exchange import STOP_GRACE_S, WIRE_DTYPES, parse_count

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="(c) needs torch.distributed"),
]

NUMBERS = [
    "model_mb", "wire_mb", "memcpy_ms", "a_ms", "a_mbs", "a2_ms", "a3_ms", "send_ms", "ready_ms", "fetch_ms",
    "fetch_mbs", "mix_ms", "c_ms", "c_mbs", "step_ms", "wait_ms", "fetch_a", "fetch_a2", "fm_c", "send_memcpy",
    "mix_memcpy", "block", "fm_memcpy",
]  # fmt: skip
CHECKS = [
    "ok_fetch_a", "ok_fetch_a2", "ok_fm_c", "ok_socket", "ok_send", "ok_mix", "ok_block", "ok_push", "ok_fm_memcpy",
    "ok_pf_memcpy",
]  # fmt: skip
PUSH = ["push_ms", "fold_ms", "push_fetch"]  # (d), in the float32 and float32+shm rows only


def wait_for_line(stream: Any, prefix: str, deadline: float) -> None:
    """Read ``stream`` line by line until one starts with ``prefix``; fail at ``deadline`` (time.monotonic)."""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=0.1):
                line = stream.readline()
                if not line:
                    pytest.fail(f"the benchmark closed its output before a line starting with {prefix!r}")
                if line.startswith(prefix):
                    return
    pytest.fail(f"no line starting with {prefix!r} before the deadline")


def bench(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "dpwa.cli", "bench", "exchange", *args]
    # A background job of a non-interactive shell (as CI may run us) inherits SIGINT ignored, and Python then never
    # raises KeyboardInterrupt: give the benchmark the default disposition, as a terminal would.
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kwargs,
    )  # type: ignore[call-overload]


@pytest.mark.slow  # two processes, gloo, every wire dtype and shared memory, then 10 x 2 memory processes: ~35 s
def test_tiny_run_writes_every_figure(tmp_path: Path) -> None:
    plot = importlib.util.find_spec("matplotlib") is not None
    proc = bench("--floats", "10000,2k", "--repeat", "2", "--run-dir", str(tmp_path), *(["--plot"] if plot else []))
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    doc = json.loads((tmp_path / "exchange.json").read_text())
    assert doc["benchmark"] == "exchange"
    assert doc["settings"]["floats"] == [10000, 2000] and doc["settings"]["repeat"] == 2
    assert {"cores", "numpy", "zmq"} <= set(doc["machine"])
    rows = doc["rows"]
    variants = (*WIRE_DTYPES, "float32+shm")  # the last: the float32 exchange through shared memory
    assert [(r["floats"], r["wire"]) for r in rows] == [(n, w) for n in (10000, 2000) for w in variants]
    for row in rows:
        for key in NUMBERS:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] >= 0, (key, row)
        for key in CHECKS:
            assert row[key] in ("✓", "✗", "-"), (key, row[key])
        for key, values in row["samples"].items():
            assert len(values) == 2 and all(math.isfinite(v) for v in values), key
        assert row["fetch_ms"] > 0 and row["a_ms"] > 0 and row["a3_ms"] > 0 and row["c_ms"] > 0
        # the floor of a socket fetch (a3) plus this row's mix, against gloo: the float32 socket row only
        assert (row["floor_c"] > 0) if row["wire"] == "float32" else row["floor_c"] is None, row
        for key in PUSH:
            value = row[key]
            pushed = row["wire"] in ("float32", "float32+shm")  # over the socket, and co-located
            assert (value > 0 and math.isfinite(value)) if pushed else value is None, (key, row)
    assert rows[1]["wire_mb"] < rows[0]["wire_mb"]  # float16 sends fewer bytes than float32
    shared = rows[len(variants) - 1]
    assert shared["wire_mb"] < rows[0]["wire_mb"] / 10  # through shared memory only the header travels
    assert math.isfinite(shared["fm_memcpy"]) and shared["ok_fm_memcpy"] in ("✓", "✗")
    assert math.isfinite(shared["pf_memcpy"]) and shared["ok_pf_memcpy"] in ("✓", "✗")  # a co-located push + fold
    assert rows[0]["pf_memcpy"] is None
    memory = json.loads((tmp_path / "memory.json").read_text())
    rules = ["constant", "pushsum", "adpsgd", "dpsgd"]
    rows_wanted = [(r, m, "float32", "-") for m in ("normal", "low") for r in rules]
    rows_wanted += [("constant", "low", "bfloat16", "-"), ("adpsgd", "low", "float32", "bipartite: true")]
    assert [(r["rule"], r["memory"], r["wire"], r["settings"]) for r in memory["rows"]] == rows_wanted
    for row in memory["rows"]:
        assert row["floats"] == 10000 and math.isfinite(row["model_sizes"]) and len(row["mixes"]) == 2, row
        # a low-memory node declines the fetches that come while it rewrites its snapshot: no count is promised.
        # Else the node behind mixes (a peer ahead is never stale); the node ahead may mix nothing: D-PSGD leaves
        # out a peer more than max_staleness (10) steps behind, and a fast run's two nodes (30 quick steps each,
        # beside another test's processes) drift that far apart (a fresh-clone run of the suite read 0 for one).
        assert max(row["mixes"]) > 0 or row["memory"] == "low", row
    headers = ("(a) raw ms", "(a3) tcp ms", "(a3+mix)/c", "(b) fetch ms", "(c) gloo ms", "(d) push ms", "fetch/a")
    headers += ("(fetch+mix)/c", "mix/memcpy")
    headers += ("(fetch+mix)/memcpy", "(push+fold)/memcpy", "model sizes")
    for header in headers + ("(push+fold)/(fetch+mix)",):
        assert header in out
    if plot:
        assert (tmp_path / "exchange.png").stat().st_size > 0


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_stops_its_peer(tmp_path: Path, signum: int) -> None:
    proc = bench("--floats", "1M", "--repeat", "1000", "--no-gloo", "--run-dir", str(tmp_path), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        peers: list[int] = []
        while not peers and time.monotonic() < deadline:
            peers = children_of(proc.pid)
            time.sleep(0.1)
        assert peers, "the peer process never started"
        assert proc.stdout is not None
        wait_for_line(proc.stdout, "measuring", deadline)  # the measurements are under way
        os.kill(proc.pid, signum)
        # the peer gets "quit", then SIGTERM, then SIGKILL, STOP_GRACE_S apart: bounded, but slow on a loaded machine
        _, err = proc.communicate(timeout=4 * STOP_GRACE_S + 15)
        assert proc.returncode != 0
        assert "Traceback" not in err, err[-3000:]
        assert not any(alive(p) for p in peers), "the peer outlived the benchmark"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_counts_take_suffixes() -> None:
    assert parse_count("25M") == 25_000_000 and parse_count("1.5k") == 1500 and parse_count(" 10000 ") == 10000
    for bad in ("", "M", "-1", "0", "1.5", "3x"):
        with pytest.raises(ValueError):
            parse_count(bad)
