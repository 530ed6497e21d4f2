"""The demo's data, torch-free: a 10-class Gaussian mixture in 32 features, a pure function of a seed.

Every class owns ``centers_per_class`` random centres; a sample is a centre plus Gaussian noise (features
have unit variance). The demo (:mod:`dpwa.tools.demo`) wraps it in torch tensors; the simulator's training
(:mod:`dpwa.tools.simtrain`) uses the numpy arrays as they are.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["DataSpec", "MixtureData", "gaussian_mixture"]


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The generated classification problem; every field goes into the model files' metadata."""

    features: int = 32
    classes: int = 10
    centers_per_class: int = 4
    noise: float = 0.8  # per-feature noise std; centres have std sqrt(1 - noise**2), so features have unit variance
    n_train: int = 40_000
    n_test: int = 10_000


@dataclasses.dataclass(frozen=True)
class MixtureData:
    """Training and held-out splits: float32 features, int64 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def gaussian_mixture(seed: int, spec: DataSpec = DataSpec()) -> MixtureData:
    """The mixture of ``spec``, a pure function of ``seed`` (numpy's PCG64 stream)."""
    rng = np.random.default_rng([seed, 0xDA7A])
    n_centers = spec.classes * spec.centers_per_class
    centers = rng.normal(scale=math.sqrt(1.0 - spec.noise**2), size=(n_centers, spec.features))
    center_class = np.repeat(np.arange(spec.classes), spec.centers_per_class)
    n = spec.n_train + spec.n_test
    which = rng.integers(0, n_centers, size=n)
    x = (centers[which] + rng.normal(scale=spec.noise, size=(n, spec.features))).astype(np.float32)
    y = center_class[which].astype(np.int64)
    return MixtureData(x[: spec.n_train], y[: spec.n_train], x[spec.n_train :], y[spec.n_train :])
