"""torchrun, TorchElastic restarts and the environment of a Kubernetes PyTorchJob, run for real on this machine.

A worker built with ``DpwaPyTorchAdapter(model)`` (no name, no file) meets the others in torch's TCPStore at
MASTER_ADDR:MASTER_PORT (adapters/rendezvous.py). torchrun is part of torch; a PyTorchJob pod gets only
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, which is what the plain processes below get.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_ports

pytest.importorskip("torch")

from dpwa.adapters.rendezvous import RendezvousError, rendezvous  # noqa: E402
from dpwa.config import ClusterConfig  # noqa: E402
from dpwa.engines.variables import in_torch_launch  # noqa: E402

pytestmark = [pytest.mark.integration]

ENGINE_WORKER = Path(__file__).resolve().parent / "engine_worker.py"


def results(text: str) -> list[dict]:
    return sorted(
        (json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), key=lambda r: r["rank"]
    )


def clean_env(tmp: Path | None = None) -> dict[str, str]:
    """This process's environment without engine variables; ``tmp``: TMPDIR for torchrun, whose agent leaves a
    ``torchelastic_*`` directory in the temp directory (in the test's own, not in /tmp)."""
    skip = ("SLURM_", "DPWA_", "TORCHELASTIC_")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(skip) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return env


@pytest.mark.slow  # 7-11 s here: torchrun and three workers
@pytest.mark.parametrize("restarts", [0, 1])
def test_torchrun_standalone_workers_meet_and_mix(tmp_path: Path, restarts: int) -> None:
    """`torchrun --standalone --nproc-per-node 3 train.py`: three workers, one node list, all mix; with a worker
    failing in the first attempt, TorchElastic restarts them all and they meet again under a new prefix."""
    script = ENGINE_WORKER
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    argv += ["--max-restarts", str(restarts), "--monitor-interval", "0.1", str(script), str(restarts)]
    done = subprocess.run(argv, env=clean_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    # A failed attempt's other workers may finish before TorchElastic stops them (the failed worker left
    # cleanly, so they lose no time on it): the last attempt's results are the ones to check.
    got = [r for r in results(done.stdout) if r["restart"] == restarts]
    names = ["127.0.0.1-0", "127.0.0.1-1", "127.0.0.1-2"]
    assert [r["name"] for r in got] == names and all(r["nodes"] == names for r in got)
    assert all(r["mixed"] > 0 for r in got), got  # how many: the CPU share's


@pytest.mark.slow
def test_pytorchjob_pods_get_only_master_addr_port_rank_world_size(tmp_path: Path) -> None:
    """Three plain processes with only the four variables a PyTorchJob sets; rank 0 hosts the store."""
    script = ENGINE_WORKER
    (port,) = free_ports(1)
    procs = []
    for rank in range(3):
        env = clean_env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3")
        procs.append(subprocess.Popen([sys.executable, str(script), "0"], env=env, stdout=subprocess.PIPE, text=True))
    out = ""
    for proc in procs:
        text, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        out += text
    got = results(out)
    assert [r["rank"] for r in got] == [0, 1, 2] and len({tuple(r["nodes"]) for r in got}) == 1
    assert all(r["mixed"] > 0 for r in got), got  # how many: the CPU share's


def test_a_rank_that_never_comes_is_named_after_the_timeout() -> None:
    (port,) = free_ports(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "3"}
    assert in_torch_launch(env) and not in_torch_launch({**env, "RANK": ""})
    with pytest.raises(RendezvousError) as info:
        rendezvous(ClusterConfig(), env, timeout_s=1.0)
    assert "ranks [1, 2] of 3 never published their address" in str(info.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"RANK": "3"}, "RANK=3 is not below WORLD_SIZE=3"),
        ({"WORLD_SIZE": "x"}, "WORLD_SIZE='x': expected an integer >= 1"),
        ({"MASTER_PORT": ""}, "MASTER_PORT: not set"),
    ],
)
def test_bad_launch_variables_are_one_line(change: dict[str, str], says: str) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "RANK": "0", "WORLD_SIZE": "3", **change}
    with pytest.raises(RendezvousError) as info:
        rendezvous(ClusterConfig(), env, timeout_s=1.0)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_multi_host_torchrun_across_three_network_namespaces(tmp_path: Path) -> None:
    """Three "hosts" (namespaces a - b - c, b routing), one torchrun agent each with the c10d rendezvous on a:
    every worker advertises its namespace's address (the one it reaches MASTER_ADDR from) and mixes with the
    workers of the other two."""
    import netns
    from test_netns import build_chain

    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    script = ENGINE_WORKER
    netns.remove_orphans()
    lab = netns.Lab()
    procs: list[subprocess.Popen[str]] = []
    try:
        spaces = build_chain(lab)  # a - b - c, b routing (the partition test's network)
        a, b, c = spaces["a"], spaces["b"], spaces["c"]
        n = lab.subnet
        address = {a: f"{n}.1", b: f"{n}.2", c: f"{n}.6"}
        for ns in (a, b, c):
            argv = [*lab.exec_prefix(ns), sys.executable, "-m", "torch.distributed.run", "--nnodes", "3"]
            argv += ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{n}.1:29400"]
            argv += ["--rdzv-id", "dpwa-multi-host", "--rdzv-conf", f"is_host={int(ns == a)}", "--local-addr"]
            argv += [address[ns], "--monitor-interval", "0.1", str(script), "0"]
            procs.append(
                subprocess.Popen(
                    argv,
                    env=clean_env(tmp_path),
                    cwd=tmp_path,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        out = ""
        for proc in procs:
            text, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            out += text
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        lab.close()
    assert lab.leftovers() == []
    got = results(out)
    names = [f"{address[ns]}-0" for ns in (a, b, c)]
    assert sorted(r["name"] for r in got) == sorted(names) and all(sorted(r["nodes"]) == sorted(names) for r in got)
    assert all(r["mixed"] > 0 for r in got), got  # each peer in another namespace


def test_the_advertised_address_is_the_route_to_master_addr_unless_given() -> None:
    from dpwa.adapters.rendezvous import ADVERTISE_ENV, advertised_address

    assert advertised_address({}, "127.0.0.1", 29500) == "127.0.0.1"  # the local address that reaches it
    assert advertised_address({}, "127.0.0.9", 29500) == "127.0.0.1"
    assert advertised_address({ADVERTISE_ENV: "10.1.2.3"}, "127.0.0.1", 29500) == "10.1.2.3"
    with pytest.raises(RendezvousError, match="MASTER_ADDR='no.such.host.invalid': no route"):
        advertised_address({}, "no.such.host.invalid", 29500)


def test_torchrun_inside_a_slurm_step_picks_the_cluster_files_node_by_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker of ``srun torchrun`` carries SLURM_PROCID (its srun task's, 0 on every worker of the first host)
    and RANK: the adapter's node is number RANK. Before, it was number SLURM_PROCID: every worker one node."""
    from dpwa.adapters.pytorch import _engine_node

    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n" + "".join(f"  - {{name: n{i}, host: 127.0.0.1, port: {47100 + i}}}\n" for i in range(4)))
    slurm = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    for rank in ("1", "3"):
        env = {**slurm, "RANK": rank, "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        name, config, reservation = _engine_node(str(path))
        assert (name, reservation) == (f"n{rank}", None)


def test_a_worker_behind_its_loopback_beside_others_is_refused_with_the_variable_that_fixes_it() -> None:
    """A PyTorchJob's master pod gets MASTER_ADDR=localhost: it advertises 127.0.0.1, which the other pods
    cannot reach (before, they timed out on it in silence). All on loopback (torchrun --standalone) or none:
    fine."""
    from dpwa.adapters.rendezvous import unreachable_workers
    from dpwa.config import NodeSpec

    def nodes(*hosts: str) -> list[NodeSpec]:
        return [NodeSpec(f"{h}-0", h, 40000 + i) for i, h in enumerate(hosts)]

    said = unreachable_workers(nodes("127.0.0.1", "10.0.0.5", "10.0.0.6"))
    assert said is not None and "ranks [0] of 3" in said and "DPWA_ADVERTISE_ADDR" in said and "status.podIP" in said
    assert unreachable_workers(nodes("127.0.0.1", "127.0.0.1", "127.0.0.1")) is None
    assert unreachable_workers(nodes("10.0.0.4", "10.0.0.5")) is None


def test_the_kubernetes_example_gives_every_pod_its_ip_to_advertise() -> None:
    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples/kubernetes/pytorchjob.yaml").read_text())
    for replica in doc["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["DPWA_ADVERTISE_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
