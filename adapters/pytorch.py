"""DpwaPyTorchAdapter: gossip-average a PyTorch model's parameters with its peers, in place.

Around each batch::

    adapter = DpwaPyTorchAdapter(model)        # name/config from DPWA_NODE / DPWA_CONFIG under `dpwa run`
    for x, y in data:
        adapter.update_send(loss)              # publish the current parameters, maybe start a fetch
        loss = train_step(model, optimizer, x, y)
        factor = adapter.update_wait(loss)     # mix: p <- (1-f)*p + f*p_peer, in place

What is exchanged: every floating tensor of ``model.parameters()`` (tied
parameters once) and, with ``buffers=True``, every floating buffer (BatchNorm
``running_mean``/``running_var``); integer buffers (``num_batches_tracked``)
never.  fp16, bf16, fp32 and fp64 all work; a bf16 tensor travels as its raw
16 bits (:data:`dpwa.utils.bfloat16.BFLOAT16`) and is mixed in float32, rounded once.

In place: a CPU tensor is handed to the core as a numpy view of its own memory,
so mixing writes straight into the parameter -- no copy, same ``data_ptr()``,
and the optimizer (which holds the same tensors) keeps stepping them; optimizer
state (momentum, Adam moments) is never touched.  Call ``update_wait`` between
optimizer steps, not inside a forward/backward pass: the mix does not bump
autograd's version counters.

CUDA tensors are staged through pinned host tensors, one per parameter, on the
current CUDA stream: ``update_send`` copies device->host and publishes the host
copy; ``update_wait`` copies device->host (the freshly trained values), mixes on
the host, and copies host->device only when the mix changed them (``params_changed``).  Kernels queued
later on the same stream see the mixed values.

With a run directory (``run_dir=`` or ``DPWA_RUN_DIR``) every ``update_wait``
appends one record to ``<run_dir>/<name>.metrics.jsonl`` (docs/metrics.md) and
:meth:`DpwaPyTorchAdapter.report` appends ``"event": "report"`` lines.

Checkpoints (:mod:`dpwa.checkpoint`, no pickle): with ``checkpoint_every: K`` in the cluster file
and a run directory, every K-th ``update_wait`` writes the model's state, the optimizer's (pass
``optimizer=``) and the node's gossip state atomically to ``<run_dir>/checkpoints/<name>.ckpt.npz``.
:meth:`DpwaPyTorchAdapter.restore`, called once before training, resumes from it when the launcher
asks (``DPWA_RESUME=1``: ``dpwa run --resume``, ``--restart-failed``) and then bootstraps from a
peer when asked (``bootstrap: peer`` or ``DPWA_BOOTSTRAP=peer``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpwa.adapters.rendezvous import RendezvousError, rendezvous
from dpwa.adapters.torch_state import (
    check_model_arrays,
    load_model_arrays,
    load_optimizer_parts,
    model_arrays,
    optimizer_parts,
)
from dpwa.checkpoint import DpwaState, checkpoint_path, load_latest, write_checkpoint
from dpwa.config import ClusterConfig, ConfigError, NodeSpec, resolve_config
from dpwa.engines import EngineError, engine_nodes
from dpwa.engines.join import JOIN_ENV, joining_host, joining_nodes
from dpwa.engines.local import PortReservation, reserve_ports
from dpwa.engines.slurm import in_slurm_step
from dpwa.engines.variables import in_torch_launch
from dpwa.metrics import MetricsWriter
from dpwa.modelfile import model_path, write_model
from dpwa.node.connection import DpwaConnection
from dpwa.utils.bfloat16 import BFLOAT16

__all__ = ["ENV_BOOTSTRAP", "ENV_CONFIG", "ENV_NODE", "ENV_RESUME", "ENV_RUN_DIR", "DpwaPyTorchAdapter", "Restored"]

log = logging.getLogger(__name__)

ENV_NODE = "DPWA_NODE"
ENV_CONFIG = "DPWA_CONFIG"
ENV_RUN_DIR = "DPWA_RUN_DIR"
ENV_RESUME = "DPWA_RESUME"  # "1": restore() loads the node's checkpoint (set by `dpwa run --resume` and restarts)
ENV_BOOTSTRAP = "DPWA_BOOTSTRAP"  # "peer" / "none": overrides the cluster file's `bootstrap` in restore()

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_EXCHANGE_DEFAULTS: dict[str, Any] = {
    "factor": 0.0,
    "peer": None,
    "status": None,
    "bytes": 0,
    "fetch_ms": 0.0,
    "clock_gap": None,
}
_RESERVED = (
    "time",
    "node",
    "step",
    "clock",
    "loss",
    "mixes",
    "failed",
    "bytes_in",
    "bytes_out",
    "bytes_sent",
    "event",
)


def _scalar(value: Any, what: str = "loss") -> float:
    """A float from a Python number, a numpy scalar or a 0-dim tensor/array; ValueError for anything else."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim != 0:
        kind = "tensor" if isinstance(value, torch.Tensor) else "array"
        raise ValueError(f"{what} must be a float or a 0-dim tensor, got a {kind} of shape {tuple(value.shape)}")
    if isinstance(value, torch.Tensor):
        return float(value.item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a float or a 0-dim tensor, got {type(value).__name__}") from None


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of CPU tensor ``t``'s own memory (bf16 as BFLOAT16 raw bits)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


@dataclass
class _Entry:
    """One exchanged tensor: the model's tensor, its host copy (itself on CPU) and the numpy view the core mixes."""

    name: str
    tensor: torch.Tensor
    host: torch.Tensor
    array: np.ndarray
    data_ptr: int
    staged: bool  # True: ``host`` is a separate (pinned) copy the adapter keeps in step with ``tensor``


def _named_tensors(model: torch.nn.Module, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Floating parameters, then (``buffers``) floating buffers; integer ones are left out (counters, indices),
    complex ones refused (ValueError): left out, they would drift apart between the nodes in silence."""
    named = [*model.named_parameters(), *(model.named_buffers() if buffers else ())]
    for name, t in named:
        if t.is_complex():
            raise ValueError(
                f"{name}: complex tensors are not supported (dpwa exchanges real floating tensors); hold it as a real "
                "tensor with a last dimension of 2 (torch.view_as_real) and make it complex in forward"
            )
        if t.is_floating_point():
            yield name, t


def _collect(model: torch.nn.Module, buffers: bool, force_staging: bool) -> list[_Entry]:
    """The entries to exchange, checked: supported dtype, contiguous, no partial memory overlap."""
    entries: list[_Entry] = []
    seen: dict[tuple[Any, ...], str] = {}
    spans: list[tuple[str, int, int, str]] = []
    for name, t in _named_tensors(model, buffers):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported (float16, bfloat16, float32, float64)")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}: tensors on {t.device} are not supported (cpu or cuda)")
        if not t.is_contiguous():
            raise ValueError(f"{name}: tensor must be contiguous (call .contiguous() on it before building the model)")
        key = (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape))
        if key in seen:  # the same memory under two names (tied weights): exchanged once
            log.debug("%s shares its memory with %s; exchanged once", name, seen[key])
            continue
        seen[key] = name
        if t.numel():
            spans.append((str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name))
        staged = force_staging or t.device.type != "cpu"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) if staged else t.detach()
        entries.append(_Entry(name, t, host, _host_array(host), t.data_ptr(), staged))
    spans.sort()
    for (dev_a, _, end_a, name_a), (dev_b, start_b, _, name_b) in zip(spans, spans[1:]):
        if dev_a == dev_b and start_b < end_a:
            raise ValueError(f"{name_a} and {name_b} partly overlap in memory; dpwa would mix the overlap twice")
    if not entries:
        raise ValueError("the model has no floating-point parameters to exchange")
    return entries


@dataclass(frozen=True)
class Restored:
    """What :meth:`DpwaPyTorchAdapter.restore` did: the step training goes on from (the batches the checkpoint's
    model took) and its loss, the checkpoint loaded (None: none), the peer copied (None: none), and the ``meta``
    saved with the checkpoint."""

    step: int
    loss: float | None
    checkpoint: Path | None
    peer: str | None
    meta: Mapping[str, Any] = field(default_factory=dict)


def _joining_node(
    name: str | None, config: ClusterConfig | str | os.PathLike[str] | None, join: str
) -> tuple[str, ClusterConfig, PortReservation | None]:
    """``DPWA_JOIN=[NAME@]HOST:PORT``: this node joins the running cluster of that member (docs/membership.md).

    The settings are ``config``'s (else every default); a config that lists this node keeps its address,
    else the node listens on a reserved port of its advertised address (:mod:`dpwa.engines.join`), named
    ``name`` or ``<host>-<port>``. The reservation is returned: hold it until the node has bound."""
    settings = resolve_config(config) if config is not None else ClusterConfig(source=JOIN_ENV)
    try:
        settings = settings.with_join(join)
    except ConfigError as err:
        raise ValueError(f"{JOIN_ENV}={join!r}: {err.reason}") from None
    address = settings.join_address
    assert address is not None
    if name is not None and any(n.name == name for n in settings.nodes):
        return name, settings, None
    try:
        host = joining_host(address, os.environ)  # the node listens there: its port is reserved there
        reservation = reserve_ports(1, host)
    except (OSError, TypeError, ValueError) as err:  # TypeError, ValueError: a host no resolver takes
        raise ValueError(f"{JOIN_ENV}={join!r}: {err}") from None
    try:
        (node,) = joining_nodes(host, reservation.ports)
        if name is not None:
            node = NodeSpec(name, node.host, node.port)
        return node.name, settings.with_nodes([node]), reservation
    except (OSError, ConfigError) as err:
        reservation.release()
        raise ValueError(f"{JOIN_ENV}={join!r}: {err}") from None


def _engine_node(
    config: ClusterConfig | str | os.PathLike[str] | None,
) -> tuple[str, ClusterConfig, PortReservation | None]:
    """Under torchrun / a PyTorchJob (also inside a SLURM job: ``srun torchrun``) or srun, without a node name:
    node number RANK / SLURM_PROCID of ``config``'s nodes; for a config without nodes (or none: every default),
    the engine's node list -- the rendezvous (:mod:`dpwa.adapters.rendezvous`, whose port reservation is
    returned: hold it until the node has bound) or the SLURM step (:mod:`dpwa.engines.slurm`)."""
    slurm = in_slurm_step(os.environ) and not in_torch_launch(os.environ)  # torchrun is the innermost launcher
    settings = resolve_config(config) if config is not None else ClusterConfig(source="srun" if slurm else "torchrun")
    if settings.nodes:
        variable = "SLURM_PROCID" if slurm else "RANK"
        rank = int(os.environ[variable])
        if not 0 <= rank < len(settings.nodes):
            raise ValueError(f"{variable}={rank} but {settings.source} has {len(settings.nodes)} nodes")
        return settings.nodes[rank].name, settings, None
    try:
        if slurm:
            resolved, mine, _ = engine_nodes(settings, os.environ)
            assert mine is not None
            return mine, resolved, None
        met = rendezvous(settings)
    except (EngineError, RendezvousError) as err:
        raise ValueError(str(err)) from None
    return met.name, met.config, met.reservation


class DpwaPyTorchAdapter:
    """One dpwa node training ``model``: :meth:`update_send` / :meth:`update_wait` around every batch.

    ``name`` and ``config`` (a cluster file path or a :class:`~dpwa.config.ClusterConfig`) default
    to the ``DPWA_NODE`` / ``DPWA_CONFIG`` environment variables that ``dpwa run`` sets.
    ``buffers``: also average floating buffers (BatchNorm statistics).  ``seed``: reproducible
    peer choice.  ``run_dir`` (default ``DPWA_RUN_DIR``): where ``<name>.metrics.jsonl`` goes;
    none, no metrics file.  ``optimizer``: saved in and restored from checkpoints with the model.
    ``wait_for_peers_s`` > 0: before returning, wait at most that long until every peer is up
    (:meth:`wait_for_peers`), so that nodes started together also start training together.
    Build the adapter after the model has reached its device and dtype: it holds views of the
    tensors as they are now.  ``_force_staging`` is a test hook:
    stage CPU tensors through host copies exactly as CUDA tensors are.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        name: str | None = None,
        config: ClusterConfig | str | os.PathLike[str] | None = None,
        *,
        buffers: bool = True,
        seed: int | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        wait_for_peers_s: float = 0.0,
        _force_staging: bool = False,
    ) -> None:
        name = name if name is not None else os.environ.get(ENV_NODE) or None
        config = config if config is not None else os.environ.get(ENV_CONFIG) or None
        reservation = None
        join = os.environ.get(JOIN_ENV)
        if join:  # a node joining a running cluster
            name, config, reservation = _joining_node(name, config, join)
        elif name is None and (in_slurm_step(os.environ) or in_torch_launch(os.environ)):  # srun, torchrun, Job
            name, config, reservation = _engine_node(config)
        given = ((f"name ({ENV_NODE})", name), (f"config ({ENV_CONFIG})", config))
        missing = [what for what, value in given if value is None or value == ""]
        if missing:
            raise ValueError(
                f"DpwaPyTorchAdapter needs a node name and a cluster config; missing: {', '.join(missing)}. "
                f"Pass name=/config=, start the script with `dpwa run`, which sets {ENV_NODE} and {ENV_CONFIG}, "
                "or under srun."
            )
        assert name is not None and config is not None
        try:
            self._entries = _collect(model, buffers, _force_staging)
        except BaseException:
            if reservation is not None:  # the rendezvous' port: nobody binds it now
                reservation.release()
            raise
        self._arrays = [e.array for e in self._entries]
        self._staged = [e for e in self._entries if e.staged]
        self._step = 0
        self._bytes_out = 0  # the node's bytes_out at the previous record: bytes_sent is the difference
        self._closed = False
        try:
            self._conn = DpwaConnection(name, config, seed=seed, params=self._arrays)
        finally:
            if reservation is not None:  # the node has bound its port (or failed): nobody else may take it now
                reservation.release()
        self._metrics: MetricsWriter | None = None
        self._model = model
        self._optimizer = optimizer
        self.steps_ahead = 0
        """Optimizer steps the model holds beyond the ``update_wait`` calls: a loop that waits for a step's
        exchange at the next step (:class:`~dpwa.adapters.stepping.StepExchange`) sets 1 while one is open. A
        checkpoint records the batches its model took (``update_wait`` calls plus these), which a resume's
        :attr:`Restored.step` gives back, so that no batch is taken twice."""
        run_dir = run_dir if run_dir is not None else os.environ.get(ENV_RUN_DIR) or None
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self._checkpoint = checkpoint_path(run_dir, name) if run_dir is not None else None
        self._checkpoint_every = self._conn.config.checkpoint_every if run_dir is not None else 0
        try:
            if self._checkpoint_every and optimizer is not None:
                optimizer_parts(optimizer)  # a setting no checkpoint can hold (a tensor lr) fails now, not at step K
            if run_dir is not None:
                self._metrics = MetricsWriter(Path(run_dir) / f"{name}.metrics.jsonl")
            if wait_for_peers_s > 0:
                self.wait_for_peers(wait_for_peers_s)
        except BaseException:  # a bad run directory, or Ctrl-C while waiting: nothing left running
            if self._metrics is not None:
                self._metrics.close()
            self._conn.close()
            raise
        nbytes = sum(e.tensor.numel() * e.tensor.element_size() for e in self._entries)
        log.info(
            "adapter %s: %d tensors, %.1f MB, %d staged through host buffers, metrics: %s",
            name,
            len(self._entries),
            nbytes / 1e6,
            len(self._staged),
            self._metrics.path if self._metrics else "off",
        )

    # ------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        return self._conn.name

    @property
    def connection(self) -> DpwaConnection:
        """The numpy-level node underneath."""
        return self._conn

    @property
    def step(self) -> int:
        """``update_wait`` calls so far."""
        return self._step

    @property
    def progress(self) -> int:
        """The step index to schedule by: :attr:`step`, or, if a node this one has heard of (directly or through
        its peers) has started a later step, that step (``connection.front - 1``).

        Asynchronous nodes drift apart by a few percent of their steps. Indexed by :attr:`step`, a schedule that
        decays to 0 gives a node that lags steps several times larger than its peers' near the end, and its
        data then dominate the point the nodes agree on (docs/rules.md, "Heterogeneous data"). Indexed by
        ``progress``, every node takes the step size of the furthest one; a node that is still behind when the
        others finish runs its last steps with the schedule's final value."""
        return max(self._step, self._conn.front - 1)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The model's tensors that are exchanged, in wire order."""
        return [e.tensor for e in self._entries]

    @property
    def run_dir(self) -> Path | None:
        """Where the metrics file, checkpoints and saved model go (``run_dir=`` or ``DPWA_RUN_DIR``), or None."""
        return self._run_dir

    @property
    def checkpoint_path(self) -> Path | None:
        """``<run_dir>/checkpoints/<name>.ckpt.npz``, or None without a run directory."""
        return self._checkpoint

    @property
    def metrics_path(self) -> Path | None:
        """``<run_dir>/<name>.metrics.jsonl``, or None without a run directory."""
        return self._metrics.path if self._metrics else None

    def wait_for_peers(self, timeout_s: float) -> dict[str, bool]:
        """Wait at most ``timeout_s`` seconds until every peer's node is up; for each peer, whether it answered.

        Call it once before training (or pass ``wait_for_peers_s=``): in a short run, a node that trains
        while a peer is still importing torch trains alone (see :meth:`DpwaConnection.wait_for_peers`).
        """
        started = time.monotonic()
        answered = self._conn.wait_for_peers(timeout_s)
        missing = sorted(peer for peer, up in answered.items() if not up)
        if missing:
            log.warning("node %s: after %.1fs, no answer from %s; training anyway", self.name, timeout_s, missing)
        else:
            log.info("node %s: all %d peers are up (%.2fs)", self.name, len(answered), time.monotonic() - started)
        return answered

    # ------------------------------------------------------------ the exchange

    def update_send(self, loss: Any) -> None:
        """clock += 1; publish the current parameters (copied, so training may go on); maybe start a fetch.

        ``loss``: a float or a 0-dim tensor (the last known loss; peers may use it to weigh the mix).
        """
        value = _scalar(loss)
        self._check_open()
        self._to_host()
        self._conn.update_send(self._arrays, value)

    def update_wait(self, loss: Any) -> float:
        """Wait for the fetch (at most until its deadline) and mix in place; return the factor (0.0 = no mix).

        ``p <- (1-f)*p + f*p_peer`` for every exchanged tensor, with ``f`` from the cluster's rule.
        """
        value = _scalar(loss)
        self._check_open()
        self._to_host()
        factor = self._conn.update_wait(value)
        if factor != 0.0 or self._conn.params_changed:
            self._to_device()
        self._step += 1
        if self._metrics is not None:
            self._member_events()  # first: they happened before this record's time
            self._metrics.write(self._exchange_record(value))
        if self._checkpoint_every and self._step % self._checkpoint_every == 0:
            self.save_checkpoint()
        return factor

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"adapter {self.name} is closed")
        for e in self._entries:
            if e.tensor.data_ptr() != e.data_ptr:
                raise RuntimeError(
                    f"{e.name} was reallocated after the adapter was built (model.to(), .half(), or a .data "
                    "assignment?); build the adapter once the model has its final device and dtype"
                )

    def _to_host(self) -> None:
        """Staged tensors only: device -> pinned host, then wait for the copies."""
        if not self._staged:
            return
        for e in self._staged:
            e.host.copy_(e.tensor.detach(), non_blocking=e.tensor.is_cuda)
        self._synchronize()

    def _to_device(self) -> None:
        """Staged tensors only: mixed host values -> device, queued on the current stream."""
        with torch.no_grad():
            for e in self._staged:
                e.tensor.copy_(e.host, non_blocking=e.tensor.is_cuda)

    def _synchronize(self) -> None:
        for device in {e.tensor.device for e in self._staged if e.tensor.is_cuda}:
            torch.cuda.current_stream(device).synchronize()

    # ------------------------------------------------------------ metrics

    def _exchange_record(self, loss: float) -> dict[str, Any]:
        """One docs/metrics.md exchange record for the update_wait just done."""
        exchange = dict(self._conn.last_exchange or {})
        stats = self._conn.stats()
        record: dict[str, Any] = {"time": time.time(), "node": self.name, "step": self._step}
        record["clock"] = float(self._conn.clock)
        record["loss"] = loss
        for key, default in _EXCHANGE_DEFAULTS.items():
            record[key] = exchange.get(key, default)
        record["reasons"] = list(exchange.get("reasons") or [])  # one per outcome in status other than ok / pushed
        record["mixes"] = int(stats["mixes"])
        record["failed"] = int(stats["fetches_failed"])  # not the declined refusals (not ready, busy, left)
        record["bytes_in"] = int(stats["bytes_in"])
        record["bytes_out"] = int(stats["bytes_out"])
        record["bytes_sent"] = record["bytes_out"] - self._bytes_out  # since the previous record: bytes per step
        self._bytes_out = record["bytes_out"]
        for key, value in exchange.items():  # the rule's own metrics
            if key not in record and key not in _RESERVED:
                record[key] = float(value) if isinstance(value, (int, float)) else value
        return record

    def report(self, **values: Any) -> None:
        """Append ``{"event": "report", "time", "node", **values}`` to the metrics file (e.g. ``accuracy=0.93``).

        Values: numbers, strings, booleans, None or 0-dim tensors.  Always logged at INFO;
        written only when there is a run directory.
        """
        clean: dict[str, Any] = {}
        for key, value in values.items():
            if key in ("event", "time", "node"):
                raise ValueError(f"report(): {key!r} is set by the adapter")
            if isinstance(value, torch.Tensor):
                value = _scalar(value, f"report(): {key}")
            elif not isinstance(value, (int, float, str, bool, type(None), np.generic)):
                raise TypeError(f"report(): {key}={type(value).__name__} is not a number or a string")
            clean[key] = value
        log.info("node %s report: %s", self.name, ", ".join(f"{k}={v}" for k, v in clean.items()))
        if self._metrics is not None:
            self._metrics.write({"time": time.time(), "node": self.name, "event": "report", **clean})

    # ------------------------------------------------------------ checkpoints and restarts

    def save_checkpoint(
        self, path: str | os.PathLike[str] | None = None, meta: Mapping[str, Any] | None = None
    ) -> Path:
        """Write model, optimizer and gossip state atomically to ``path`` (default :attr:`checkpoint_path`).

        ``meta``: JSON-safe values of the caller's, handed back by :meth:`load_checkpoint` / :meth:`restore`.
        """
        target = Path(path) if path is not None else self._checkpoint
        if target is None:
            raise ValueError("save_checkpoint() needs a path: this adapter has no run directory")
        arrays = {f"model/{k}": a for k, a in model_arrays(self._model).items()}
        document: dict[str, Any] = {"node": self.name, "time": time.time(), "user": dict(meta or {})}
        document["batches"] = self._step + self.steps_ahead  # what the model took: where a resumed loop goes on
        if self._optimizer is not None:
            optim_arrays, document["optimizer"] = optimizer_parts(self._optimizer)
            arrays.update({f"optim/{k}": a for k, a in optim_arrays.items()})
        state = self.gossip_state()  # the adapter counts update_wait calls; the node update_send calls
        document["dpwa"] = state.to_meta()
        arrays.update({f"dpwa/{k}": a for k, a in state.arrays.items()})
        written = write_checkpoint(target, arrays, document)
        log.debug("node %s: checkpoint at step %d in %s", self.name, self._step, written)
        return written

    def save_model(self, path: str | os.PathLike[str] | None = None, meta: Mapping[str, Any] | None = None) -> Path:
        """Write the model's state dict (parameters and buffers, any dtype) to ``path`` (default
        ``<run_dir>/<name>.model.npz``) with this node's push-sum weight (1 under other rules), the step and
        ``meta`` (JSON-safe values of the caller's): the file ``dpwa average RUN_DIR`` averages
        (:mod:`dpwa.modelfile`). Save after :meth:`close`: a push-sum node that handed its mass to a member as it
        left then records weight 0 (its mass is in that member's file), so the average counts every unit once;
        saved before, a later hand-off would count twice. Open or closed, it writes the model as it is."""
        if path is None:
            if self._run_dir is None:
                raise ValueError("save_model() needs a path: this adapter has no run directory")
            path = model_path(self._run_dir, self.name)
        weight = float(self._conn.dpwa_state().extras.get("weight", 1.0))
        written = write_model(
            path, model_arrays(self._model), node=self.name, weight=weight, step=self._step, user=dict(meta or {})
        )
        log.info("node %s: model saved to %s (step %d, weight %g)", self.name, written, self._step, weight)
        return written

    def gossip_state(self) -> DpwaState:
        """The node's gossip state (clock, steps, loss, the rule's extras and arrays; copies), ``step`` being
        this adapter's ``update_wait`` count: what a checkpoint or :class:`~dpwa.adapters.optimizer.DpwaOptimizer`'s
        ``state_dict`` keeps."""
        state = self._conn.dpwa_state()
        state.step = self._step
        return state

    def load_gossip_state(self, state: DpwaState) -> None:
        """Take back a :meth:`gossip_state` (before training goes on): the step count, clock and rule state."""
        self._check_open()
        self._to_host()
        self._conn.restore_state(state, self._arrays)
        self._step = state.step

    def load_checkpoint(self, path: str | os.PathLike[str] | None = None) -> Restored | None:
        """Load the latest complete checkpoint at ``path`` (default :attr:`checkpoint_path`; falls back to the
        previous one if the latest is damaged) into model, optimizer and node; None (nothing changed) if none,
        ``CheckpointError`` if one exists and neither loads.

        Call it before training; a checkpoint that does not fit the model or optimizer raises (ValueError, or
        the RuntimeError of ``load_state_dict``) before anything is loaded: model, optimizer and node are left
        as they were. Values of another dtype are cast, as ``load_state_dict`` casts them.
        """
        target = Path(path) if path is not None else self._checkpoint
        checkpoint = load_latest(target) if target is not None else None
        if checkpoint is None:
            return None
        self._check_open()
        state = DpwaState.from_meta(checkpoint.meta.get("dpwa", {}), checkpoint.section("dpwa"))
        model = checkpoint.section("model")
        check_model_arrays(self._model, model)  # all checked before anything is applied: never half-loaded
        if self._optimizer is not None and "optimizer" in checkpoint.meta:  # torch checks it all before it loads
            load_optimizer_parts(self._optimizer, checkpoint.section("optim"), checkpoint.meta["optimizer"])
        elif self._optimizer is not None:
            log.warning("node %s: %s holds no optimizer state; the optimizer starts afresh", self.name, target)
        load_model_arrays(self._model, model)
        self.load_gossip_state(state)  # load_state_dict copied in place: the exchanged tensors are the same memory
        user = checkpoint.meta.get("user")
        log.info("node %s: resumed from %s at step %d", self.name, checkpoint.path, self._step)
        batches = checkpoint.meta.get("batches")  # absent in a checkpoint of an older dpwa: its step
        at = batches if isinstance(batches, int) and not isinstance(batches, bool) and batches >= 0 else self._step
        return Restored(at, state.loss, checkpoint.path, None, user if isinstance(user, dict) else {})

    def restore(
        self, *, resume: bool | None = None, bootstrap: bool | None = None, timeout_s: float | None = None
    ) -> Restored:
        """Call once before the first step: resume from this node's checkpoint, then bootstrap from a peer.

        ``resume`` (default: ``DPWA_RESUME=1``, set by ``dpwa run --resume`` and ``--restart-failed``): load the
        latest checkpoint, if there is one.  ``bootstrap`` (default: ``DPWA_BOOTSTRAP``, else the cluster file's
        ``bootstrap: peer``): copy the model of a peer whose clock is ahead (:meth:`DpwaConnection.bootstrap`,
        at most ``timeout_s``, default ``bootstrap_timeout_s``).  Both are logged and written to the metrics
        file as ``"event": "resume"`` / ``"event": "bootstrap"`` records.
        """
        if resume is None:
            resume = os.environ.get(ENV_RESUME, "") == "1"
        if bootstrap is None:
            mode = os.environ.get(ENV_BOOTSTRAP) or self._conn.config.bootstrap
            bootstrap = mode == "peer"
        loaded = self.load_checkpoint() if resume else None
        if resume:
            if loaded is None:
                log.info("node %s: no checkpoint to resume from; starting at step 0", self.name)
            self._event("resume", step=self._step, checkpoint=str(loaded.checkpoint) if loaded else None)
        peer = None
        if bootstrap:
            self._check_open()
            self._to_host()
            peer = self._conn.bootstrap(self._arrays, timeout_s)
            if peer is not None:
                self._to_device()
            self._event("bootstrap", step=self._step, peer=peer, clock=float(self._conn.clock))
        return Restored(
            loaded.step if loaded is not None else self._step,
            loaded.loss if loaded is not None else None,
            loaded.checkpoint if loaded is not None else None,
            peer,
            loaded.meta if loaded is not None else {},
        )

    def _member_events(self) -> None:
        """One ``"event": "member"`` record per membership change the node saw (docs/membership.md)."""
        assert self._metrics is not None
        for change in self._conn.member_events():
            self._metrics.write({**change.record(), "node": self.name})

    def _event(self, event: str, **values: Any) -> None:
        if self._metrics is not None:
            self._metrics.write({"time": time.time(), "node": self.name, "event": event, **values})

    # ------------------------------------------------------------ lifetime

    def stats(self) -> dict[str, Any]:
        """The connection's counters (see :meth:`DpwaConnection.stats`) plus ``step`` and ``tensors``."""
        out = self._conn.stats()
        out["step"] = self._step
        out["tensors"] = len(self._entries)
        return out

    def close(self, linger: float = 0.0, idle: float = 1.0, *, final_mix: bool = False) -> None:
        """Stop the node (free its port) and close the metrics file; idempotent.

        ``linger``: keep serving peers that still fetch for up to that many seconds first, until
        nobody fetched for ``idle`` seconds (:meth:`dpwa.DpwaConnection.close`) -- what a node
        that finished before its peers should do.

        The model is left as the last ``update_wait`` left it: under a push rule the node folds the pushes that
        arrived since into the mass it hands to a member as it leaves, and (``final_mix`` False, the default)
        puts the model back as it was, so what a script evaluated before closing is what it saves after.
        ``final_mix=True`` keeps that fold in the model, and under ``adpsgd`` mixes the exchanges peers committed
        after the last ``update_wait`` (:meth:`dpwa.DpwaConnection.close`). Call :meth:`save_model` after closing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._to_host()  # staged: the steps since the last update_wait live on the device only
            self._conn.close(linger=linger, idle=idle, final_mix=final_mix)
            if final_mix and self._staged:
                self._to_device()
        finally:
            if self._metrics is not None:
                self._member_events()  # its own leave
                self._metrics.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> DpwaPyTorchAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DpwaPyTorchAdapter({self.name!r}, tensors={len(self._entries)}, step={self._step})"
