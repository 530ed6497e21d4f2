"""Reading what an engine hands a process: its environment variables, each wrong one a one-line error."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["TORCH_VARIABLES", "env_int", "in_torch_launch"]

TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for every worker, and what a Kubeflow PyTorchJob sets in every pod."""


def in_torch_launch(env: Mapping[str, str]) -> bool:
    """True when RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all set (torchrun, PyTorchJob)."""
    return all(env.get(name) for name in TORCH_VARIABLES)


def env_int(env: Mapping[str, str], name: str, error: type[Exception], lo: int = 0) -> int:
    """``env[name]`` as an integer >= ``lo``; else ``error`` with one line naming the variable and its value."""
    value = env.get(name)
    digits = value.strip() if value is not None else ""
    if not (digits.isascii() and digits.isdigit()) or int(digits) < lo:  # isdigit alone takes "¹", int() does not
        expected = "a non-negative integer" if lo == 0 else f"an integer >= {lo}"
        raise error(f"{name}={value!r}: expected {expected}")
    return int(value)
