"""``dpwa run -n N``: a local cluster without a cluster file, on ports no concurrent run takes.

The end-to-end runs start the real launcher (``python -m dpwa.cli run -n ...``) with the gossiping test node
of tests/test_launcher.py; every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from conftest import port_is_free, wait_until
from test_launcher import NODE_SCRIPT, _demo_runnable, alive, finish, launch, log_values

from dpwa.cli import app as cli
from dpwa.cli.run import _names_node_count, _split_at_script
from dpwa.config import parse_config
from dpwa.engines import local
from dpwa.engines.local import LOCK_DIR_ENV, local_nodes, lock_dir, reserve_ports
from dpwa.metrics import read_metrics
from dpwa.utils import lockfile

# --------------------------------------------------------------------------- reserving ports


# The spans and ports of these tests lie below PORT_RANGE (20000-32767), where no dpwa launcher, bench or test
# (conftest.free_ports) reserves: a port the other test worker reserved there would take one of theirs.


def free_span(size: int) -> tuple[int, int]:
    """A span of ``size`` ports of which every one can be reserved now (one taken by anything else on the machine
    -- another test's process, another user's -- would leave a reservation of them all short)."""
    for lo in range(18000, 20000 - size, size):
        try:
            reserve_ports(size, port_range=(lo, lo + size - 1)).release()
        except OSError:
            continue
        return lo, lo + size - 1
    pytest.skip(f"no {size} free ports in 18000-19999")


def test_two_reservations_never_share_a_port_and_a_released_port_is_free_again() -> None:
    rng = random.Random(5)
    span = free_span(100)
    first = reserve_ports(60, port_range=span, rng=rng)
    try:
        second = reserve_ports(40, port_range=span, rng=rng)  # the 40 ports the first one left
        assert not set(first.ports) & set(second.ports) and len(set(first.ports + second.ports)) == 100
        with pytest.raises(OSError, match=f"only 0 of 1 ports free in {span[0]}-{span[1]}"):
            reserve_ports(1, port_range=span)
        second.release()
        third = reserve_ports(40, port_range=span)
        assert set(third.ports) == set(second.ports)
        third.release()
    finally:
        first.release()


def test_a_port_locked_by_another_process_or_in_use_is_skipped() -> None:
    span = (19100, 19103)
    lock_dir().mkdir(exist_ok=True)  # before the holder opens its lock file there
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT);"
         " fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
         str(lock_dir() / "19100.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    listener = socket.socket()
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        listener.bind(("127.0.0.1", 19101))
        listener.listen()
        with reserve_ports(2, port_range=span) as got:
            assert sorted(got.ports) == [19102, 19103]
    finally:
        listener.close()
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()  # type: ignore[union-attr]


@pytest.fixture
def private_lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A lock directory in this test's own temporary directory (``DPWA_LOCK_DIR``): nothing else's lock files."""
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "dpwa-ports"))
    assert lock_dir() == tmp_path / "dpwa-ports"
    return lock_dir()


def test_every_launcher_shares_one_lock_directory_whatever_its_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two launchers with different TMPDIRs (a batch system's per-job one) must see each other's port locks:
    the directory is /tmp/dpwa-ports, not <TMPDIR>/dpwa-ports (before, each TMPDIR had its own)."""
    monkeypatch.delenv(LOCK_DIR_ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    assert tempfile.gettempdir() == str(tmp_path)
    assert lock_dir() == Path("/tmp/dpwa-ports")


def test_released_ports_leave_no_lock_file(private_lock_dir: Path) -> None:
    span = (19200, 19219)
    with reserve_ports(3, port_range=span) as held:
        assert sorted(p.name for p in private_lock_dir.iterdir()) == sorted(f"{p}.lock" for p in held.ports)
        other = reserve_ports(2, port_range=span)
        assert not set(other.ports) & set(held.ports)
        other.release()
        other.release()  # idempotent
        assert sorted(p.name for p in private_lock_dir.iterdir()) == sorted(f"{p}.lock" for p in held.ports)
    assert list(private_lock_dir.iterdir()) == []
    with pytest.raises(OSError, match="only 0 of 1 ports free"):  # a failed reservation leaves none either
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 19220))
            busy.listen()
            reserve_ports(1, port_range=(19220, 19220))
    assert list(private_lock_dir.iterdir()) == []


def test_a_stale_lock_file_of_a_killed_launcher_is_taken_and_removed(private_lock_dir: Path) -> None:
    private_lock_dir.mkdir()
    (private_lock_dir / "19230.lock").touch()  # nobody holds it: its launcher was killed
    with reserve_ports(1, port_range=(19230, 19230)) as held:
        assert held.ports == (19230,)
    assert list(private_lock_dir.iterdir()) == []


def _holds(port: int, directory: Path) -> bool:
    """Whether some open file description holds ``port``'s lock now (another open of the file cannot lock it)."""
    handle = local._lock(port, directory)
    if handle is None:
        return True
    lockfile.unlock_file(*handle)
    return False


@pytest.mark.parametrize("replaced", [False, True], ids=["removed", "removed-and-recreated"])
def test_a_lock_file_removed_while_being_locked_is_opened_again_and_one_process_holds_the_port(
    private_lock_dir: Path, monkeypatch: pytest.MonkeyPatch, replaced: bool
) -> None:
    """The flock-and-unlink race: B opens the lock file, A (the holder) releases -- unlinks it and closes -- and
    only then B locks the descriptor it opened: an unlinked inode. B must notice and open the path again;
    else a third launcher C could create and lock a new file for the same port, and both would hold it.

    ``replaced``: C has already created and locked the new file when B notices; B must then not hold the port."""
    port = 19240
    private_lock_dir.mkdir()
    holder = local._lock(port, private_lock_dir)  # A
    assert holder is not None
    path = private_lock_dir / f"{port}.lock"
    opened: list[int] = []
    third: list[tuple[int, Path] | None] = []
    real_open = lockfile._open_lock_file

    def open_then_race(target: Path) -> int:
        fd = real_open(target)
        opened.append(os.fstat(fd).st_ino)
        if len(opened) == 1:  # B has its descriptor, not yet its lock: A releases the port now
            local.PortReservation([port], [holder]).release()
            assert not path.exists()
            if replaced:
                monkeypatch.setattr(lockfile, "_open_lock_file", real_open)
                third.append(local._lock(port, private_lock_dir))  # C: a new file, locked
                monkeypatch.setattr(lockfile, "_open_lock_file", open_then_race)
        return fd

    monkeypatch.setattr(lockfile, "_open_lock_file", open_then_race)
    got = local._lock(port, private_lock_dir)  # B
    monkeypatch.setattr(lockfile, "_open_lock_file", real_open)
    assert len(opened) == 2, "B locked the removed file and did not open the path again"
    if replaced:
        assert got is None  # C holds the port: B saw the new file locked
        assert third[0] is not None and os.fstat(third[0][0]).st_ino == os.stat(path).st_ino
        lockfile.unlock_file(*third[0])
    else:
        assert got is not None
        assert os.fstat(got[0]).st_ino == os.stat(path).st_ino  # (the number may be the freed one's again)
        assert _holds(port, private_lock_dir)  # nobody else can lock the file now at the path
        lockfile.unlock_file(*got)
    assert not path.exists() and not _holds(port, private_lock_dir)


def test_a_lock_file_that_keeps_being_removed_is_given_up_after_a_bounded_number_of_tries(
    private_lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private_lock_dir.mkdir()
    path = private_lock_dir / "19250.lock"
    tries: list[int] = []
    real_open = lockfile._open_lock_file

    def open_then_remove(target: Path) -> int:
        fd = real_open(target)
        tries.append(fd)
        os.unlink(target)  # some holder's release, every time
        return fd

    monkeypatch.setattr(lockfile, "_open_lock_file", open_then_remove)
    assert local._lock(19250, private_lock_dir) is None
    assert len(tries) == lockfile.LOCK_ATTEMPTS and not path.exists()


def test_local_nodes_are_w1_to_wn_on_loopback() -> None:
    nodes = local_nodes([40001, 40002])
    assert [(n.name, n.host, n.port) for n in nodes] == [("w1", "127.0.0.1", 40001), ("w2", "127.0.0.1", 40002)]


# --------------------------------------------------------------------------- the command line


def test_with_n_the_first_positional_is_the_script() -> None:
    valued = {"--node", "--steps", "-n", "--nodes", "--config"}
    args = ["-n", "3", "--config", "s.yaml", "t.py", "--lr", "0.1", "-n", "9"]
    assert _names_node_count(args, valued) and _names_node_count(["-n4", "t.py"], valued)
    assert _names_node_count(["--nodes=2"], valued) and _names_node_count(["--steps", "5", "-n", "2"], valued)
    assert not _names_node_count(["c.yaml", "--", "t.py", "-n", "3"], valued)
    # the script's own -n after CLUSTER.yaml (a launcher flag between them): not the launcher's. Before, it
    # switched the parse to -n mode and --quiet was taken for the SCRIPT ("--quiet: no such file")
    assert not _names_node_count(["c.yaml", "--quiet", "t.py", "-n", "4"], valued)
    assert not _names_node_count(["--steps", "-n", "c.yaml"], valued)  # -n is --steps' value here
    split = ["-n", "3", "--config", "s.yaml", "--", "t.py", "--lr", "0.1", "-n", "9"]
    assert _split_at_script(args, valued, 1) == split


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-n", "2", "--partition", "classes:0"], "classes:K needs an integer K >= 1"),
        (["-n", "2", "--partition", "shards"], "expected iid, dirichlet:ALPHA or classes:K"),
        (["-n", "2", "--partition", "iid", "t.py"], "--partition is for the built-in demo"),
        (["--resume", ".", "--partition", "iid"], "keeps the run's data split"),
        (["-n", "2", "--node", "w1"], "-n N starts every node here"),
        (["--config", "x.yaml", "c.yaml"], "--config goes with -n N"),
        (["-n", "0"], "0 is not in the range x>=1"),
        (["-n", "2", "--timeout-s", "nan"], "nan is not a finite number of seconds"),  # it turned the timeout off
    ],
)
def test_usage_errors_of_n(argv: list[str], says: str) -> None:
    result = CliRunner().invoke(cli.main, ["run", *argv])
    assert result.exit_code == 2 and says in result.stderr


def test_bad_settings_for_n_exit_2_with_one_line(tmp_path: Path) -> None:
    with_nodes = tmp_path / "with_nodes.yaml"
    with_nodes.write_text("nodes:\n  - {name: a, host: 127.0.0.1, port: 4000}\n")
    result = CliRunner().invoke(cli.main, ["run", "-n", "2", "--config", str(with_nodes)])
    assert result.exit_code == 2
    reason = "with -n N the nodes are chosen here: leave `nodes` out of the file, or drop -n"
    assert result.stderr == f"error: {with_nodes}:1: nodes: {reason}\n"
    settings = tmp_path / "settings.yaml"
    settings.write_text("timeout_ms: 500\n")
    result = CliRunner().invoke(cli.main, ["run", str(settings)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "no `nodes` in the file and no engine gave any: run `dpwa run -n N --config" in result.stderr


# --------------------------------------------------------------------------- runs


@pytest.fixture
def node_script(tmp_path: Path) -> Path:
    path = tmp_path / "gossip_node.py"
    path.write_text(NODE_SCRIPT)
    return path


def test_n_runs_a_script_with_the_files_settings_and_writes_the_resolved_cluster(
    tmp_path: Path, node_script: Path
) -> None:
    settings = tmp_path / "rules.yaml"
    settings.write_text("timeout_ms: 700\ninterpolation: constant\nconstant: {value: 0.25}\n")
    run_dir = tmp_path / "run"
    argv = ["--steps", "12", "--barrier", "--sleep", "0.01", "--node", "x"]
    proc = launch(tmp_path, "-n", "3", "--config", str(settings), "--run-dir", str(run_dir), str(node_script), *argv)
    code, out, err = finish(proc, tmp_path, 60)
    assert code == 0, err
    resolved = parse_config((run_dir / "cluster.yaml").read_text())
    assert [n.name for n in resolved.nodes] == ["w1", "w2", "w3"] and {n.host for n in resolved.nodes} == {"127.0.0.1"}
    assert resolved.timeout_ms == 700 and resolved.settings.value == 0.25  # type: ignore[attr-defined]
    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ("w1", "w2", "w3"):
        assert summary["nodes"][name]["status"] == "ok" and summary["nodes"][name]["mixes"] > 0
        assert json.loads(log_values(run_dir / f"{name}.log", "ARGV")[0]) == argv  # the script's own -n-free args
    assert all(port_is_free(n.port) for n in resolved.nodes)


def test_two_concurrent_runs_get_ports_of_their_own(tmp_path: Path, node_script: Path) -> None:
    runs = []
    for label in ("a", "b"):
        here = tmp_path / label
        here.mkdir()
        argv = ["-n", "2", "--run-dir", str(here / "run"), str(node_script), "--steps", "20", "--barrier"]
        runs.append((here, launch(here, *argv, "--sleep", "0.02")))
    for here, proc in runs:
        code, _, err = finish(proc, here, 60)
        assert code == 0, err
    ports = [{n.port for n in parse_config((here / "run" / "cluster.yaml").read_text()).nodes} for here, _ in runs]
    assert len(ports[0]) == len(ports[1]) == 2 and not ports[0] & ports[1]
    for here, _ in runs:
        summary = json.loads((here / "run" / "summary.json").read_text())
        assert all(n["status"] == "ok" and n["mixes"] > 0 for n in summary["nodes"].values())


def test_ctrl_c_stops_an_n_run_and_frees_its_ports(tmp_path: Path, node_script: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(tmp_path, "-n", "2", "--run-dir", str(run_dir), str(node_script), "--steps", "0", "--sleep", "0.02")
    pids: list[int] = []
    try:
        metrics = [run_dir / f"w{i}.metrics.jsonl" for i in (1, 2)]
        wait_until(lambda: all(len(read_metrics(m, missing_ok=True)) >= 3 for m in metrics), 60, 0.05, "training")
        pids = [int(v) for i in (1, 2) for v in log_values(run_dir / f"w{i}.log", "PID")]
        ports = [n.port for n in parse_config((run_dir / "cluster.yaml").read_text()).nodes]
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert code == 128 + signal.SIGINT
    assert not [pid for pid in pids if alive(pid)]
    wait_until(lambda: all(port_is_free(p) for p in ports), 5, message="ports freed")
    for port in ports:  # the launcher's locks went with it: each port can be reserved again
        reserve_ports(1, port_range=(port, port)).release()


@pytest.mark.slow
@pytest.mark.skipif(not _demo_runnable(), reason="the built-in demo needs dpwa.tools.demo and torch")
def test_n_runs_the_built_in_demo(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started = time.monotonic()
    argv = ["-n", "2", "--steps", "30", "--partition", "classes:3", "--run-dir", str(run_dir), "--no-baseline"]
    code, out, err = finish(launch(tmp_path, *argv), tmp_path, 180)
    assert code == 0, err
    assert time.monotonic() - started < 180
    # --no-baseline: no evaluation process (tests/test_launcher.py's sample run has one)
    assert "(averaged-model evaluation skipped: --no-baseline)" in out and "averaged model accuracy" not in out
    assert not (run_dir / "demo.json").exists() and "demo" not in json.loads((run_dir / "summary.json").read_text())
    doc = yaml.safe_load((run_dir / "cluster.yaml").read_text())
    assert [n["name"] for n in doc["nodes"]] == ["w1", "w2"]
    # --partition reached the demo: each node's data file holds its three classes, the summary shows them
    summary = json.loads((run_dir / "summary.json").read_text())
    held = []
    for name in ("w1", "w2"):
        data = json.loads((run_dir / f"{name}.data.json").read_text())
        assert summary["nodes"][name]["data"] == data
        assert data["partition"] == "classes:3" and sum(data["classes"]) == data["samples"]
        classes = [c for c, n in enumerate(data["classes"]) if n > 0]
        assert len(classes) == 3
        held.append(classes)
        assert f"classes:3: {','.join(map(str, classes))}" in out
    assert not set(held[0]) & set(held[1]), "two nodes, three classes each, ten classes: no class shared"


@pytest.mark.parametrize(
    "argv",
    [["-n", "2", "/nonexistent/train.py"], ["-n", "1", "--join", "a\x00b:99", "t.py"]],
    ids=["missing-script", "bad-join-host"],
)
def test_a_run_that_fails_before_it_starts_leaves_no_lock_file(private_lock_dir: Path, argv: list[str]) -> None:
    """``dpwa run -n N`` reserves N ports (a lock file each) before it checks the script and the rest: a run that
    stops there (exit 2, one line) releases them (before, the files stayed until a later run drew those ports)."""
    result = CliRunner().invoke(cli.main, ["run", *argv])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert not private_lock_dir.exists() or list(private_lock_dir.iterdir()) == []


def test_a_joiner_reserves_its_ports_on_the_address_it_will_listen_on(
    private_lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dpwa run -n 1 --join`` listens on its advertised address, so it checks its ports there: an advertised
    address that is not this machine's stops the run at once (exit 2, one line naming it, no lock file left).
    Before, the ports were checked on 127.0.0.1, the reservation passed, and the node then failed to bind."""
    monkeypatch.setenv("DPWA_ADVERTISE_ADDR", "192.0.2.1")  # TEST-NET-1: never an address of this machine
    result = CliRunner().invoke(cli.main, ["run", "-n", "1", "--join", "127.0.0.1:20001", "t.py"])
    assert result.exit_code == 2, result.output
    assert "192.0.2.1 is not an address of this machine" in result.output and "Traceback" not in result.output
    assert not private_lock_dir.exists() or list(private_lock_dir.iterdir()) == []


def test_a_port_taken_on_the_given_address_alone_is_not_reserved_there(private_lock_dir: Path) -> None:
    """A port bound on 127.0.0.2 only: free on 127.0.0.1, not on 127.0.0.2 -- the reservation asks the address."""
    from dpwa.engines.local import reserve_ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="only 0 of 1"):
            reserve_ports(1, "127.0.0.2", port_range=(port, port))
        reserve_ports(1, "127.0.0.1", port_range=(port, port)).release()


def test_an_unresolvable_host_stops_the_reservation_at_once(private_lock_dir: Path) -> None:
    """Not 12,768 lock files and name lookups, one per candidate port, ending in "only 0 of 1 ports free"."""
    with pytest.raises(OSError, match="cannot bind no.such.host.invalid"):
        reserve_ports(1, "no.such.host.invalid")
    assert list(private_lock_dir.iterdir()) == []


def test_a_lock_directory_of_the_users_own_is_left_as_it_was(private_lock_dir: Path) -> None:
    """DPWA_LOCK_DIR names a directory of the user's: it is not made world-writable as the shared default is."""
    private_lock_dir.mkdir(mode=0o700)
    reserve_ports(1).release()
    assert private_lock_dir.stat().st_mode & 0o777 == 0o700
