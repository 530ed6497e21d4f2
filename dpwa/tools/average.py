"""``dpwa average RUN_DIR``: average the models a run's nodes saved, say how far apart they were, evaluate them.

1. Reads every ``<node>.model.npz`` of ``RUN_DIR`` (:meth:`DpwaPyTorchAdapter.save_model`, ``DpwaOptimizer.save_model``,
   the Lightning and Hugging Face callbacks at the end of training, the built-in demo) and writes their average,
   push-sum weights honoured, to ``RUN_DIR/averaged.model.npz`` (:mod:`dpwa.modelfile`).
2. The models' disagreement: their relative distance to that mean (overall and per node).
3. With ``--evaluate MODULE:FUNCTION`` (``MODULE`` importable from the current directory, or a ``path/to/file.py``)
   it calls ``FUNCTION(state_dict)`` -- a dict of CPU tensors, what ``model.load_state_dict`` takes -- on the
   averaged model and on every node's; ``FUNCTION`` returns a number or a dict of numbers (the first is the
   headline figure). With ``--baseline OTHER_RUN_DIR`` (e.g. the same script under ``dpwa run -n 1``: one
   process on all the data) that run's averaged model is evaluated too and the difference printed.

Everything goes to ``RUN_DIR/average.json`` and stdout. Only ``--evaluate`` imports torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpwa.checkpoint import CheckpointError
from dpwa.modelfile import AVERAGED_MODEL, ModelFile, average_models, disagreement, run_models, write_model
from dpwa.utils.atomic import write_atomically

__all__ = ["AVERAGE_JSON", "AverageError", "average_run", "check_spec", "headline", "load_function"]

log = logging.getLogger(__name__)

AVERAGE_JSON = "average.json"


class AverageError(ValueError):
    """The run cannot be averaged or evaluated as asked; ``str()`` is one line."""


def check_spec(spec: str) -> tuple[str, str]:
    """(module or file, function) of ``MODULE:FUNCTION`` / ``path/to/file.py:FUNCTION``, checked without importing
    anything (what ``dpwa run --evaluate`` does before it starts the nodes); AverageError if malformed, or naming a
    file that does not exist."""
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name.isidentifier():
        raise AverageError(f"--evaluate {spec!r}: expected MODULE:FUNCTION or path/to/file.py:FUNCTION")
    if module_name.endswith(".py") and not Path(module_name).is_file():
        raise AverageError(f"--evaluate {spec!r}: no file {module_name}")
    return module_name, function_name


def load_function(spec: str) -> Callable[..., Any]:
    """``MODULE:FUNCTION`` (importable from the current directory) or ``path/to/file.py:FUNCTION`` (its directory
    on the import path, so it may import its siblings) as the callable it names; AverageError, one line, for
    anything that goes wrong importing it."""
    module_name, function_name = check_spec(spec)
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or loader_spec.loader is None:
                raise AverageError(f"--evaluate {spec!r}: cannot load {path}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules.setdefault(path.stem, module)
            loader_spec.loader.exec_module(module)
        else:
            if str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except AverageError:
        raise
    except Exception as err:  # ImportError, SyntaxError, whatever its module code raises
        raise AverageError(f"--evaluate {spec!r}: cannot import {module_name}: {type(err).__name__}: {err}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise AverageError(f"--evaluate {spec!r}: {module_name} has no function {function_name}")
    return function


def _figures(value: Any, spec: str) -> dict[str, float]:
    """What an evaluation returned, as named finite-or-not floats (a number is ``score``)."""
    if isinstance(value, Mapping):
        items = list(value.items())
    else:
        items = [("score", value)]
    out = {}
    for key, number in items:
        try:
            out[str(key)] = float(number)
        except (TypeError, ValueError):
            raise AverageError(f"--evaluate {spec}: returned {key}={number!r}, not a number") from None
    if not out:
        raise AverageError(f"--evaluate {spec}: returned no figures")
    return out


def _evaluate(function: Callable[..., Any], spec: str, arrays: Mapping[str, Any]) -> dict[str, float]:
    from dpwa.adapters.torch_state import tensor_of  # torch: only to evaluate

    return _figures(function({k: tensor_of(a) for k, a in arrays.items()}), spec)


def _load(run_dir: Path, nodes: Sequence[str] = ()) -> list[ModelFile]:
    """The run's model files (``nodes``' only, when given: each must be there)."""
    try:
        models = run_models(run_dir)
    except CheckpointError as err:
        raise AverageError(str(err)) from None
    seen: dict[str, str] = {}
    for model in models:  # a copied or renamed file: one node's model counted twice, its figures merged
        name = model.path.name if model.path is not None else model.node
        if model.node in seen:
            raise AverageError(f"{run_dir}: {seen[model.node]} and {name} are both node {model.node}'s model")
        seen[model.node] = name
    if nodes:
        missing = sorted(set(nodes) - {m.node for m in models})
        if missing:
            raise AverageError(f"{run_dir}: no model file of {', '.join(missing)}")
        models = [m for m in models if m.node in set(nodes)]
    if not models:
        raise AverageError(
            f"{run_dir}: no <node>.model.npz files; have each node call adapter.save_model() (or "
            "optimizer.save_model()) "
            "at the end of training"
        )
    return models


def average_run(
    run_dir: str | Path,
    *,
    evaluate: str | None = None,
    baseline: str | Path | None = None,
    nodes: Sequence[str] = (),
) -> dict[str, Any]:
    """Average ``run_dir``'s models (``nodes``' only, when given), measure their disagreement, evaluate when asked
    (see the module doc-string); write and return ``average.json``'s content. AverageError (one line) for what
    cannot be done."""
    run_dir = Path(run_dir)
    models = _load(run_dir, nodes)
    try:
        mean = average_models(models)
    except ValueError as err:
        raise AverageError(f"{run_dir}: cannot average the models: {err}") from None
    total = sum(m.weight for m in models)
    try:
        averaged_path = write_model(run_dir / AVERAGED_MODEL, mean, node="averaged", weight=total)
    except (OSError, ValueError) as err:  # a read-only run directory; ValueError: weights that sum to infinity
        raise AverageError(f"{run_dir}: cannot write {AVERAGED_MODEL}: {err}") from None
    spread = disagreement(models, mean)
    result: dict[str, Any] = {
        "nodes": [m.node for m in models],
        "weights": {m.node: m.weight for m in models},
        "steps": {m.node: m.step for m in models},
        "disagreement": spread.overall,
        "node_distance": dict(spread.nodes),
        "averaged_model": str(averaged_path),
    }
    log.info("%d models averaged into %s; disagreement %.4g", len(models), averaged_path, spread.overall)
    if evaluate is not None:
        function = load_function(evaluate)
        result["evaluate"] = evaluate
        result["averaged"] = _evaluate(function, evaluate, mean)
        result["node_figures"] = {m.node: _evaluate(function, evaluate, m.arrays) for m in models}
        if baseline is not None:
            others = _load(Path(baseline))
            try:
                other_mean = average_models(others)
            except ValueError as err:
                raise AverageError(f"{baseline}: cannot average the models: {err}") from None
            result["baseline_run"] = str(baseline)
            result["baseline_nodes"] = len(others)
            result["baseline"] = _evaluate(function, evaluate, other_mean)
    elif baseline is not None:
        raise AverageError("--baseline needs --evaluate (the figure to compare)")
    try:
        write_atomically(run_dir / AVERAGE_JSON, json.dumps(result, indent=2, allow_nan=True) + "\n")
    except OSError as err:
        raise AverageError(f"{run_dir}: cannot write {AVERAGE_JSON}: {err.strerror or err}") from None
    return result


def _fmt(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def headline(result: Mapping[str, Any]) -> str:
    """The result in a few lines: the averaged model's figure beside the nodes' (and the baseline's), the spread."""
    lines = [
        f"averaged model of {len(result['nodes'])} nodes: {result['averaged_model']}",
        f"disagreement: {100 * result['disagreement']:.3g} % (relative distance of the models to their mean; "
        + ", ".join(f"{n} {100 * d:.3g} %" for n, d in result["node_distance"].items())
        + ")",
    ]
    if "averaged" in result:
        key = next(iter(result["averaged"]))
        nodes = ", ".join(f"{n} {_fmt(f[key])}" for n, f in result["node_figures"].items())
        lines.append(f"{key}: averaged model {_fmt(result['averaged'][key])} (nodes: {nodes})")
        if "baseline" in result:
            base = result["baseline"][key]
            lines.append(
                f"{key}: baseline ({result['baseline_nodes']} node(s), {result['baseline_run']}) {_fmt(base)}; "
                f"difference {_fmt(base - result['averaged'][key])} (baseline - averaged)"
            )
    return "\n".join(lines)
