"""PyTorch state for dpwa checkpoints: a model's and an optimizer's state as numpy arrays plus JSON, and back.

:func:`model_arrays` / :func:`load_model_arrays`: every entry of ``model.state_dict()`` (parameters and
buffers, integer ones included), loaded back in place (``load_state_dict`` copies into the existing
tensors, so their memory -- and the adapter's views of it -- stays the same).

:func:`optimizer_parts` / :func:`load_optimizer_parts`: ``optimizer.state_dict()``: every tensor in its
per-parameter state (SGD momentum buffers, Adam moments and step counts) as an array, every other
value and the ``param_groups`` as JSON.  A value that is neither a tensor nor JSON-safe is a TypeError
at save time.  Nothing is pickled; bfloat16 tensors travel as :data:`dpwa.utils.bfloat16.BFLOAT16` arrays.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dpwa.utils.bfloat16 import BFLOAT16, is_bfloat16

__all__ = [
    "array_of",
    "check_model_arrays",
    "load_model_arrays",
    "load_optimizer_parts",
    "model_arrays",
    "optimizer_parts",
    "tensor_of",
]


def array_of(t: torch.Tensor) -> np.ndarray:
    """A numpy copy of tensor ``t`` (on the CPU; bfloat16 as BFLOAT16 words)."""
    t = t.detach().to("cpu", copy=True).contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def tensor_of(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor holding a copy of ``a`` (a BFLOAT16 array becomes a bfloat16 tensor)."""
    if is_bfloat16(a.dtype):
        return torch.from_numpy(np.array(a.view(np.int16), copy=True)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


def model_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """``model.state_dict()`` as arrays, keyed by state-dict name."""
    return {name: array_of(t) for name, t in model.state_dict().items()}


def check_model_arrays(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """ValueError unless ``arrays`` has exactly ``model``'s state_dict names with their shapes (nothing is loaded:
    a checkpoint is checked whole before any part of it is applied)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing, extra = sorted(expected.keys() - arrays.keys()), sorted(arrays.keys() - expected.keys())
    if missing or extra:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"checkpoint does not fit the model: {name} has shape {arrays[name].shape}, not {shape}")


def load_model_arrays(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """``model.load_state_dict`` (strict: the same names and shapes) from :func:`model_arrays` output, in place."""
    model.load_state_dict({name: tensor_of(a) for name, a in arrays.items()}, strict=True)


def optimizer_parts(optimizer: torch.optim.Optimizer) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays keyed ``"<param index>/<state key>"``, JSON-safe rest) of ``optimizer.state_dict()``."""
    sd = optimizer.state_dict()
    arrays: dict[str, np.ndarray] = {}
    state: dict[str, dict[str, Any]] = {}
    for index, entries in sd["state"].items():
        out: dict[str, Any] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                arrays[f"{index}/{key}"] = array_of(value)
                out[key] = {"tensor": True}
            else:
                out[key] = {"value": _json_safe(value, f"optimizer state {index}.{key}")}
        state[str(index)] = out
    groups = [_json_safe(group, "optimizer param_groups") for group in sd["param_groups"]]
    return arrays, {"kind": type(optimizer).__qualname__, "state": state, "param_groups": groups}


def load_optimizer_parts(
    optimizer: torch.optim.Optimizer, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]
) -> None:
    """``optimizer.load_state_dict`` from :func:`optimizer_parts` output (another class's state loads where torch
    takes it: dpwa's MomentumSGD and torch's SGD share theirs); ValueError if it does not fit, or is malformed, and
    the optimizer is then as it was."""
    try:
        state: dict[int, dict[str, Any]] = {}
        for index, entries in meta["state"].items():
            out: dict[str, Any] = {}
            for key, entry in entries.items():
                out[key] = tensor_of(arrays[f"{index}/{key}"]) if entry.get("tensor") else entry["value"]
            state[int(index)] = out
        groups = [dict(group) for group in meta["param_groups"]]
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"optimizer state in checkpoint is malformed: {err!r}") from err
    before = copy.deepcopy(optimizer.state_dict())
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except Exception as err:  # torch may raise after it took the groups (Adam given SGD's: KeyError 'step')
        optimizer.load_state_dict(before)  # as it was: a checkpoint never half-loads
        kind, mine = meta.get("kind"), type(optimizer).__qualname__
        whose = f" (it holds a {kind}'s state, this optimizer is a {mine})" if kind not in (None, mine) else ""
        raise ValueError(f"optimizer state in checkpoint does not fit this optimizer{whose}: {err!r}") from err


def _json_safe(value: Any, what: str) -> Any:
    """``value`` with tuples as lists, checked to survive JSON unchanged; TypeError otherwise."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"{what}: {value} cannot be checkpointed as JSON")
    if isinstance(value, list):
        return [_json_safe(v, what) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v, f"{what}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{what}: a {type(value).__name__} cannot be checkpointed (numbers, strings, lists only)")
