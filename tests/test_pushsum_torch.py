"""Push-sum's local step goes to the numerator in the PyTorch adapter and DpwaOptimizer, float32 and bfloat16.

Whatever the optimizer did between update_send and update_wait is a motion ``delta`` of the de-biased model;
SGP counts it on the numerator, ``z <- z + delta``, so the de-biased model after update_wait is
``x_published + delta / w`` (``w`` the weight the node kept when it pushed), before any message is folded.

To see ``w != 1`` without timing, node w1 of a two-node cluster runs alone: its first push (half its weight)
never gets an answer (nobody listens at w2's port), so it stays in flight, every later push to w2 is skipped
(one unresolved push per receiver), ``w`` stays 0.5, nothing is ever folded, and each step's motion is doubled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import free_ports, write_cluster
from torch import nn

from dpwa.adapters.optimizer import DpwaOptimizer
from dpwa.adapters.pytorch import DpwaPyTorchAdapter

pytestmark = [pytest.mark.integration]

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)]  # the fast subset: float32


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1)).to(dtype)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone().double()


def _cluster(tmp_path: Path) -> Path:
    return write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="pushsum", timeout_ms=100)


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 5, generator=gen)
    param = next(model.parameters())
    return ((model(x.to(param.dtype)).double() - 1.0) ** 2).mean()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_adapter_moves_any_optimizer_step_to_the_numerator(tmp_path: Path, dtype: torch.dtype) -> None:
    """Adam with momentum-like state, two accumulated micro-batches a step: after update_wait the parameters
    are ``x_published + delta / w`` (bfloat16: to its rounding)."""
    model = _model(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    adapter = DpwaPyTorchAdapter(model, "w1", _cluster(tmp_path), seed=0)
    try:
        for step in range(4):
            adapter.update_send(1.0)
            weight = adapter.connection.dpwa_state().extras["weight"]
            published = _flat(model)
            for micro in range(2):
                _loss(model, step * 2 + micro).backward()
            optimizer.step()
            optimizer.zero_grad()
            delta = _flat(model) - published
            assert delta.abs().max() > 0
            adapter.update_wait(1.0)
            assert weight == 0.5, weight
            want = published + delta / weight
            rtol = 0.0 if dtype == torch.float32 else 8e-3  # bfloat16: the result rounded (half an ulp, 2^-9)
            torch.testing.assert_close(_flat(model), want, atol=1e-6, rtol=rtol)
            assert adapter.connection.last_exchange["step_scale"] == 2.0
    finally:
        adapter.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dpwa_optimizer_moves_its_step_to_the_numerator_and_a_skipped_step_moves_nothing(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """DpwaOptimizer around SGD: ``step()`` is the wrapped step, update_wait, update_send, so a step's motion
    ``-lr * g`` ends as ``-lr * g / w``. A step a GradScaler skips (``zero_grad`` without ``step``) still
    exchanges, and moves nothing."""
    model = _model(dtype)
    lr = 0.05
    optimizer = DpwaOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model, "w1", _cluster(tmp_path), seed=0)
    try:
        _loss(model, 99).backward()
        optimizer.step()  # the first step: the wrapped step, then the first update_send (w 1 -> 0.5)
        optimizer.zero_grad()
        for step in range(4):
            weight = optimizer.adapter.connection.dpwa_state().extras["weight"]
            published = _flat(model)
            _loss(model, step).backward()
            if step == 2:  # as a GradScaler does after an overflow: no step, then zero_grad
                optimizer.zero_grad()
                torch.testing.assert_close(_flat(model), published, atol=0.0, rtol=0.0)
                continue
            grads = torch.cat([p.grad.detach().double().ravel() for p in model.parameters()])
            stepped = _flat(model) - lr * grads  # what SGD alone would leave (before bfloat16's rounding)
            optimizer.step()
            optimizer.zero_grad()
            assert weight == 0.5, weight
            want = published + (stepped - published) / weight
            # bfloat16: SGD's result rounded (half an ulp, doubled by 1/w) and the mix's result rounded: 1.5 ulp
            rtol = 0.0 if dtype == torch.float32 else 1.2e-2
            torch.testing.assert_close(_flat(model), want, atol=1e-6, rtol=rtol)
    finally:
        optimizer.close()
