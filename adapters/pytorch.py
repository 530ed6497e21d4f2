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
16 bits (:data:`dpwa.bfloat16.BFLOAT16`) and is mixed in float32, rounded once.

In place: a CPU tensor is handed to the core as a numpy view of its own memory,
so mixing writes straight into the parameter -- no copy, same ``data_ptr()``,
and the optimizer (which holds the same tensors) keeps stepping them; optimizer
state (momentum, Adam moments) is never touched.  Call ``update_wait`` between
optimizer steps, not inside a forward/backward pass: the mix does not bump
autograd's version counters.

CUDA tensors are staged through pinned host tensors, one per parameter, on the
current CUDA stream: ``update_send`` copies device->host and publishes the host
copy; ``update_wait`` copies device->host (the freshly trained values), mixes on
the host, and copies host->device only when ``factor != 0``.  Kernels queued
later on the same stream see the mixed values.

With a run directory (``run_dir=`` or ``DPWA_RUN_DIR``) every ``update_wait``
appends one record to ``<run_dir>/<name>.metrics.jsonl`` (docs/metrics.md) and
:meth:`DpwaPyTorchAdapter.report` appends ``"event": "report"`` lines.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpwa.bfloat16 import BFLOAT16
from dpwa.config import ClusterConfig
from dpwa.connection import DpwaConnection
from dpwa.metrics import MetricsWriter

__all__ = ["ENV_CONFIG", "ENV_NODE", "ENV_RUN_DIR", "DpwaPyTorchAdapter"]

log = logging.getLogger(__name__)

ENV_NODE = "DPWA_NODE"
ENV_CONFIG = "DPWA_CONFIG"
ENV_RUN_DIR = "DPWA_RUN_DIR"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_EXCHANGE_DEFAULTS: dict[str, Any] = {
    "factor": 0.0,
    "peer": None,
    "status": None,
    "bytes": 0,
    "fetch_ms": 0.0,
    "clock_gap": None,
}
_RESERVED = ("time", "node", "step", "clock", "loss", "mixes", "failed", "bytes_in", "bytes_out", "event")


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
    """Floating parameters, then (``buffers``) floating buffers; integer ones are left out."""
    for name, p in model.named_parameters():
        if p.is_floating_point():
            yield name, p
    if buffers:
        for name, b in model.named_buffers():
            if b.is_floating_point():
                yield name, b


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


class DpwaPyTorchAdapter:
    """One dpwa node training ``model``: :meth:`update_send` / :meth:`update_wait` around every batch.

    ``name`` and ``config`` (a cluster file path or a :class:`~dpwa.config.ClusterConfig`) default
    to the ``DPWA_NODE`` / ``DPWA_CONFIG`` environment variables that ``dpwa run`` sets.
    ``buffers``: also average floating buffers (BatchNorm statistics).  ``seed``: reproducible
    peer choice.  ``run_dir`` (default ``DPWA_RUN_DIR``): where ``<name>.metrics.jsonl`` goes;
    none, no metrics file.  Build the adapter after the model has reached its device and
    dtype: it holds views of the tensors as they are now.  ``_force_staging`` is a test hook:
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
        _force_staging: bool = False,
    ) -> None:
        name = name if name is not None else os.environ.get(ENV_NODE)
        config = config if config is not None else os.environ.get(ENV_CONFIG)
        given = ((f"name ({ENV_NODE})", name), (f"config ({ENV_CONFIG})", config))
        missing = [what for what, value in given if value is None or value == ""]
        if missing:
            raise ValueError(
                f"DpwaPyTorchAdapter needs a node name and a cluster config; missing: {', '.join(missing)}. "
                f"Pass name=/config=, or start the script with `dpwa run`, which sets {ENV_NODE} and {ENV_CONFIG}."
            )
        assert name is not None and config is not None
        self._entries = _collect(model, buffers, _force_staging)
        self._arrays = [e.array for e in self._entries]
        self._staged = [e for e in self._entries if e.staged]
        self._step = 0
        self._closed = False
        self._conn = DpwaConnection(name, config, seed=seed)
        self._metrics: MetricsWriter | None = None
        run_dir = run_dir if run_dir is not None else os.environ.get(ENV_RUN_DIR) or None
        try:
            if run_dir is not None:
                self._metrics = MetricsWriter(Path(run_dir) / f"{name}.metrics.jsonl")
        except BaseException:
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
    def tensors(self) -> list[torch.Tensor]:
        """The model's tensors that are exchanged, in wire order."""
        return [e.tensor for e in self._entries]

    @property
    def metrics_path(self) -> Path | None:
        """``<run_dir>/<name>.metrics.jsonl``, or None without a run directory."""
        return self._metrics.path if self._metrics else None

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
        if factor != 0.0:
            self._to_device()
        self._step += 1
        if self._metrics is not None:
            self._metrics.write(self._exchange_record(value))
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
        record["mixes"] = int(stats["mixes"])
        record["failed"] = int(stats["fetches_timed_out"] + stats["fetches_refused"] + stats["fetches_rejected"])
        record["bytes_in"] = int(stats["bytes_in"])
        record["bytes_out"] = int(stats["bytes_out"])
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

    # ------------------------------------------------------------ lifetime

    def stats(self) -> dict[str, Any]:
        """The connection's counters (see :meth:`DpwaConnection.stats`) plus ``step`` and ``tensors``."""
        out = self._conn.stats()
        out["step"] = self._step
        out["tensors"] = len(self._entries)
        return out

    def close(self, linger: float = 0.0, idle: float = 1.0) -> None:
        """Stop the node (free its port) and close the metrics file; idempotent.

        ``linger``: keep serving peers that still fetch for up to that many seconds first, until
        nobody fetched for ``idle`` seconds (:meth:`dpwa.DpwaConnection.close`) -- what a node
        that finished before its peers should do.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.close(linger=linger, idle=idle)
        finally:
            if self._metrics is not None:
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
