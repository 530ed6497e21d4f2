"""A node's final model as a file, and the average of a run's models: ``<run_dir>/<node>.model.npz``.

The file is a dpwa checkpoint file (:mod:`dpwa.checkpoint`: no pickle, every array's CRC-32 checked, bfloat16
kept as its 16 bits) holding the model's state dict under ``model/<name>`` and the metadata ``{"kind":
"model", "node", "step", "weight", "user": {...}}``. ``weight`` is the node's push-sum weight (1 under every
other rule): push-sum's consensus point is the weighted mean ``sum_i w_i x_i / sum_i w_i``, so that is the
average taken; with equal weights it is the plain mean. A push-sum node saved after it left has weight 0: it
handed its mass (its model included) to a member, whose file holds it -- so every unit of mass counts once.

:func:`average_models` computes it in float64 (float16 / bfloat16 / float32 / float64 arrays, each cast back to
its own dtype, rounded once); integer entries (BatchNorm's ``num_batches_tracked``) come from the first model.
:func:`disagreement` is how far apart the models are: the relative distance to their mean,
``sqrt(sum_i w_i ||x_i - m||^2 / sum_i w_i) / ||m||`` over every floating entry, and each node's own
``||x_i - m|| / ||m||``. Pure numpy: the launcher and the CLI use it without torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpwa.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, is_bfloat16, to_float32

__all__ = [
    "AVERAGED_MODEL",
    "MODEL_SUFFIX",
    "Disagreement",
    "ModelFile",
    "average_models",
    "disagreement",
    "model_path",
    "read_model",
    "run_models",
    "write_model",
]

MODEL_SUFFIX = ".model.npz"
AVERAGED_MODEL = "averaged" + MODEL_SUFFIX
"""The average of a run's models (``dpwa average RUN_DIR``): a model file of node ``averaged``."""
_KIND = "model"


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """One saved model: its node, its state dict as arrays, its push-sum weight, the caller's metadata."""

    node: str
    arrays: Mapping[str, np.ndarray]
    weight: float = 1.0
    step: int = 0
    user: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    path: Path | None = None


def model_path(run_dir: str | os.PathLike[str], node: str) -> Path:
    """``<run_dir>/<node>.model.npz``."""
    return Path(run_dir) / f"{node}{MODEL_SUFFIX}"


def write_model(
    path: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    *,
    node: str,
    weight: float = 1.0,
    step: int = 0,
    user: Mapping[str, Any] | None = None,
) -> Path:
    """Write a model file atomically (the module doc-string); ValueError for a weight that is not finite and >= 0."""
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"a model's weight must be finite and >= 0, got {weight!r}")
    document = {"kind": _KIND, "node": node, "weight": float(weight), "step": int(step), "user": dict(user or {})}
    return write_checkpoint(path, {f"model/{k}": a for k, a in arrays.items()}, document, keep_previous=False)


def read_model(path: str | os.PathLike[str]) -> ModelFile:
    """The model file at ``path``; CheckpointError when it cannot be used or is not a model file."""
    checkpoint = read_checkpoint(path)
    meta = checkpoint.meta
    weight = meta.get("weight")
    if meta.get("kind") != _KIND or not isinstance(meta.get("node"), str):
        raise CheckpointError(f"{path}: a dpwa checkpoint, not a model file")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight >= 0):
        raise CheckpointError(f"{path}: bad weight {weight!r}")
    user = meta.get("user")
    step = meta.get("step")
    return ModelFile(
        meta["node"], checkpoint.section("model"), float(weight), step if isinstance(step, int) else 0,
        user if isinstance(user, dict) else {}, Path(path),
    )  # fmt: skip


def run_models(run_dir: str | os.PathLike[str]) -> list[ModelFile]:
    """Every node's model file in ``run_dir`` (not the average), by node name; CheckpointError for a bad one."""
    paths = sorted(p for p in Path(run_dir).glob(f"*{MODEL_SUFFIX}") if p.name != AVERAGED_MODEL)
    return [read_model(p) for p in paths]


def _is_float(a: np.ndarray) -> bool:
    return is_bfloat16(a.dtype) or np.issubdtype(a.dtype, np.floating)


def _wide(a: np.ndarray) -> np.ndarray:
    """``a`` as float64 (bfloat16 words decoded)."""
    if is_bfloat16(a.dtype):
        return to_float32(a, np.empty(a.shape, np.float32)).astype(np.float64)
    return a.astype(np.float64)


def _narrow(a: np.ndarray, like: np.ndarray) -> np.ndarray:
    """float64 ``a`` in ``like``'s dtype, rounded once (bfloat16 through float32: exact to float32 first)."""
    if is_bfloat16(like.dtype):
        return from_float32(a.astype(np.float32), np.empty(a.shape, np.uint16)).view(BFLOAT16)
    return a.astype(like.dtype)


def _check_same(models: Sequence[ModelFile]) -> None:
    if not models:
        raise ValueError("no models to average")
    first = models[0]
    for model in models[1:]:
        if set(model.arrays) != set(first.arrays):
            extra = sorted(set(model.arrays) ^ set(first.arrays))[:3]
            raise ValueError(f"{model.node} and {first.node} have different entries ({', '.join(extra)} ...)")
        for key, a in model.arrays.items():
            b = first.arrays[key]
            if a.shape != b.shape or a.dtype != b.dtype or is_bfloat16(a.dtype) != is_bfloat16(b.dtype):
                raise ValueError(f"{key}: {model.node} has {a.dtype}{a.shape} but {first.node} has {b.dtype}{b.shape}")


def average_models(models: Sequence[ModelFile]) -> dict[str, np.ndarray]:
    """``sum_i w_i x_i / sum_i w_i`` entry by entry (the module doc-string); ValueError for models that differ or
    whose weights are all 0."""
    _check_same(models)
    total = sum(m.weight for m in models)
    if total <= 0:
        raise ValueError("every model's weight is 0: each handed its mass to a node whose model is not among them")
    if not math.isfinite(total):
        raise ValueError(f"the models' weights sum to {total}: each weight over it would be 0")
    out: dict[str, np.ndarray] = {}
    for key, first in models[0].arrays.items():
        if not _is_float(first):
            out[key] = np.array(first, copy=True)
            continue
        acc = np.zeros(first.shape, np.float64)
        for model in models:
            acc += (model.weight / total) * _wide(model.arrays[key])
        out[key] = _narrow(acc, first)
    return out


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """How far apart the models are: ``overall`` (weighted root mean square of ``||x_i - m||``, over ``||m||``) and
    each node's ``||x_i - m|| / ||m||``."""

    overall: float
    nodes: Mapping[str, float]


def disagreement(models: Sequence[ModelFile], mean: Mapping[str, np.ndarray]) -> Disagreement:
    """The relative distance of ``models`` to ``mean`` (their :func:`average_models`), over floating entries."""
    _check_same(models)
    norm2 = sum(float(np.sum(_wide(a) ** 2)) for a in mean.values() if _is_float(a))
    distances: dict[str, float] = {}
    for model in models:
        d2 = sum(float(np.sum((_wide(a) - _wide(mean[k])) ** 2)) for k, a in model.arrays.items() if _is_float(a))
        distances[model.node] = d2
    total = sum(m.weight for m in models)
    spread = sum(m.weight * distances[m.node] for m in models) / total
    scale = math.sqrt(norm2) if norm2 > 0 else 1.0
    return Disagreement(math.sqrt(spread) / scale, {n: math.sqrt(d) / scale for n, d in distances.items()})
