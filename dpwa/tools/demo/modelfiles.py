"""The demo's model files: ``<run_dir>/<node>.model.npz``, each node's final parameters.

A model file (:mod:`dpwa.modelfile`) holds the parameters and buffers of ``model.state_dict()``, the node's
push-sum weight and a ``__meta__`` JSON string (node name, shard, samples trained on, the
:class:`~dpwa.tools.demo.config.TrainConfig`); it is never unpickled.  A node writes its file through its
adapter; these helpers write, read and average them from torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpwa.adapters.torch_state import model_arrays
from dpwa.modelfile import ModelFile, average_models, read_model, write_model

__all__ = ["META_KEY", "MODEL_SUFFIX", "average_states", "load_model_file", "save_model"]

MODEL_SUFFIX = ".model.npz"
META_KEY = "__meta__"


def save_model(path: Path, model: nn.Module, meta: dict[str, Any], weight: float = 1.0) -> None:
    """``model.state_dict()`` (parameters and buffers) as a model file (:mod:`dpwa.modelfile`, no pickle), with
    ``meta`` (``node`` names it) and the node's push-sum ``weight``."""
    write_model(path, model_arrays(model), node=str(meta.get("node", path.name)), weight=weight, user=meta)


def load_model_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state arrays, meta) from a model file (:func:`save_model`, the adapter's ``save_model``); never unpickles."""
    model = read_model(path)
    return dict(model.arrays), dict(model.user)


def average_states(states: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating arrays (:func:`dpwa.modelfile.average_models`, equal weights: in float64, cast
    back); other arrays from the first state."""
    mean = average_models([ModelFile(str(i), state) for i, state in enumerate(states)])
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in mean.items()}
