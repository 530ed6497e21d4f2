"""The demo's optimizer: SGD with momentum, the same arithmetic as ``torch.optim.SGD`` bit for bit, without its start.

Per parameter ``p`` with gradient ``g``: ``b <- g`` at the first step (a copy), ``b <- momentum * b + g`` after it,
then ``p <- p - lr * b`` (``momentum = 0``: ``p <- p - lr * g``): torch's single-tensor path (dampening 0, no weight
decay, not Nesterov), the one it takes on CPU. Its ``state_dict`` has torch's layout (``{"state": {index:
{"momentum_buffer": tensor}}, "param_groups": [...]}``), so a checkpoint written with one loads into the other.

Why not torch's class: the first ``torch.optim.Optimizer`` a process builds imports ``torch._dynamo`` (its
``add_param_group`` and ``step`` are wrapped for the compiler), about 2 s of CPU on a 2-core machine: as much
again as importing torch, paid by every node of every ``dpwa run`` at its start, on the cores its peers start on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["MomentumSGD", "OptimizerLike"]

_GROUP_DEFAULTS: dict[str, Any] = {
    "dampening": 0,
    "weight_decay": 0,
    "nesterov": False,
    "maximize": False,
    "foreach": None,
    "differentiable": False,
    "fused": None,
}
"""The settings torch's SGD records in a parameter group beside ``lr`` and ``momentum``; these are the only ones
:class:`MomentumSGD` steps with (another value in a loaded state is refused)."""


_SAME_AS_DEFAULT = {"foreach": (None, False), "fused": (None, False)}
"""Settings for which torch's SGD on CPU does the same arithmetic whichever of these values a state records."""


def _setting_fits(key: str, value: Any) -> bool:
    """``value`` of the saved setting ``key`` steps as :class:`MomentumSGD` does."""
    return value in _SAME_AS_DEFAULT.get(key, (_GROUP_DEFAULTS[key],))


def _checked_rates(saved: Mapping[str, Any]) -> tuple[float, float]:
    """(lr, momentum) of a saved parameter group that :class:`MomentumSGD` steps exactly; ValueError otherwise."""
    unknown = sorted(set(saved) - {"params", "lr", "momentum", *_GROUP_DEFAULTS})
    if unknown:
        raise ValueError(f"optimizer state has settings MomentumSGD does not step with: {unknown}")
    other = {k: saved[k] for k in _GROUP_DEFAULTS if k in saved and not _setting_fits(k, saved[k])}
    if other:
        raise ValueError(f"optimizer state has settings MomentumSGD does not step with: {other}")
    try:
        lr, momentum = float(saved["lr"]), float(saved["momentum"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"optimizer state has no usable lr and momentum: {err!r}") from err
    if not (math.isfinite(lr) and lr >= 0 and 0 <= momentum < 1):
        raise ValueError(f"optimizer state has lr {lr} and momentum {momentum}: need lr >= 0 and 0 <= momentum < 1")
    return lr, momentum


class MomentumSGD:
    """SGD with momentum over one parameter group; ``param_groups[0]["lr"]`` may be changed between steps."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0) -> None:
        params = list(params)
        if not params:
            raise ValueError("MomentumSGD got an empty parameter list")
        if not lr >= 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr >= 0 and 0 <= momentum < 1; got lr {lr}, momentum {momentum}")
        self.param_groups: list[dict[str, Any]] = [
            {"params": params, "lr": float(lr), "momentum": float(momentum), **_GROUP_DEFAULTS}
        ]
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    @property
    def _params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (``set_to_none=False``: zero it in place, detached from any graph, as torch does)."""
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter that has a gradient (see the module doc-string for the formula)."""
        group = self.param_groups[0]
        lr, momentum = group["lr"], group["momentum"]
        for p in self._params:
            if p.grad is None:
                continue
            direction = p.grad
            if momentum != 0:
                entry = self.state.setdefault(p, {})
                buffer = entry.get("momentum_buffer")
                if buffer is None:
                    buffer = torch.clone(direction).detach()
                    entry["momentum_buffer"] = buffer
                else:
                    buffer.mul_(momentum).add_(direction, alpha=1)
                direction = buffer
            p.add_(direction, alpha=-lr)

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {param index: {"momentum_buffer": tensor}}, "param_groups": [settings, "params": indices]}``
        (the buffers themselves, not copies, as torch gives them)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        state = {index[id(p)]: dict(entry) for p, entry in self.state.items()}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self._params)))}]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The state :meth:`state_dict` (or ``torch.optim.SGD.state_dict``) gave, copied into this optimizer's
        parameters (cast to their dtype and device); ValueError, with nothing changed, if it does not fit: another
        parameter count or shape, a setting or a state entry another optimizer would step with."""
        groups = state_dict["param_groups"]
        params = self._params
        if len(groups) != 1 or len(groups[0]["params"]) != len(params):
            counts = [len(g["params"]) for g in groups]
            raise ValueError(f"optimizer state has groups of {counts} parameters, this optimizer 1 of {len(params)}")
        lr, momentum = _checked_rates(groups[0])
        positions = {int(index): i for i, index in enumerate(groups[0]["params"])}
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            if int(key) not in positions:
                raise ValueError(f"optimizer state for parameter {key}, which no parameter group lists")
            if set(entry) - {"momentum_buffer"}:
                raise ValueError(f"optimizer state {key} holds {sorted(entry)}: not SGD's momentum buffer")
            param = params[positions[int(key)]]
            buffer = entry.get("momentum_buffer")
            if buffer is not None and tuple(buffer.shape) != tuple(param.shape):
                raise ValueError(
                    f"momentum buffer {key} has shape {tuple(buffer.shape)}, its parameter {tuple(param.shape)}"
                )
            copied = None if buffer is None else buffer.detach().to(device=param.device, dtype=param.dtype).clone()
            state[param] = {"momentum_buffer": copied}
        self.param_groups[0]["lr"], self.param_groups[0]["momentum"] = lr, momentum
        self.state = state


OptimizerLike = torch.optim.Optimizer | MomentumSGD
"""What the demo's training loop steps: torch's optimizers or :class:`MomentumSGD` (``param_groups``, ``zero_grad``,
``step``)."""
