"""Node checkpoints: named numpy arrays plus JSON metadata in one ``.npz`` file, written atomically.

The format (no pickle anywhere; loaded with ``np.load(allow_pickle=False)``)::

    <key>       one array per key ("model/0.weight", "optim/3/momentum_buffer", "dpwa/gem_m/0", ...)
    __meta__    uint8 array: UTF-8 JSON {"format": "dpwa-checkpoint", "version": 1,
                "arrays": {key: {"crc32": int, "dtype": "float32" | "bfloat16" | ...}}, ...caller's keys}

Every array's CRC-32 is in the metadata and checked on load, so a file with a damaged member
is refused, not half-loaded.  bfloat16 arrays (:data:`dpwa.utils.bfloat16.BFLOAT16`) are stored as
their raw ``uint16`` words and come back tagged as bfloat16.

Atomicity (:func:`write_checkpoint`): the file is written to a temporary file in the same
directory, flushed and fsync'ed, the current checkpoint is hard-linked to ``<path>.prev``
(the previous one, kept as a fallback), the temporary file is renamed onto ``path``
(``os.replace``) and the directory is fsync'ed.  At every instant ``path`` is either the old
complete file or the new complete one, so a crash (even SIGKILL or power loss after the
fsyncs) never leaves a checkpoint that fails to load.  :func:`load_latest` reads ``path`` and
falls back to ``<path>.prev`` if ``path`` is missing or damaged; a damaged ``path`` is then moved aside to
``<path>.damaged``, so that the next write does not keep it as ``.prev`` in the good one's place.

:class:`DpwaState` is the node's own gossip state (clock, step, loss, the rule's scalar extras
and arrays) as stored in a checkpoint.  This module never imports torch; the PyTorch glue
(model and optimizer state) is in :mod:`dpwa.adapters.pytorch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dpwa.utils.atomic import TEMP_SUFFIX, temp_path, write_atomically
from dpwa.utils.bfloat16 import BFLOAT16, is_bfloat16

__all__ = [
    "CHECKPOINT_DIR",
    "CHECKPOINT_SUFFIX",
    "Checkpoint",
    "CheckpointError",
    "DpwaState",
    "checkpoint_path",
    "load_latest",
    "previous_path",
    "read_checkpoint",
    "remove_checkpoints",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = "dpwa-checkpoint"
VERSION = 1
META_KEY = "__meta__"
CHECKPOINT_DIR = "checkpoints"
"""Checkpoints of ``dpwa run`` go to ``<run_dir>/checkpoints/<node>.ckpt.npz``."""
CHECKPOINT_SUFFIX = ".ckpt.npz"
PREV_SUFFIX = ".prev"
DAMAGED_SUFFIX = ".damaged"
"""A latest checkpoint that failed to load while its previous one loaded is kept as ``<path>.damaged``."""
_BFLOAT16_NAME = "bfloat16"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: unreadable, torn, damaged, or not a dpwa checkpoint."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its arrays by key, its metadata (the caller's keys plus ``format``,
    ``version`` and ``arrays``) and the file it came from."""

    arrays: Mapping[str, np.ndarray]
    meta: Mapping[str, Any]
    path: Path

    def section(self, prefix: str) -> dict[str, np.ndarray]:
        """The arrays whose key starts with ``prefix + "/"``, keyed by the rest of their key."""
        head = prefix + "/"
        return {key[len(head) :]: a for key, a in self.arrays.items() if key.startswith(head)}


def checkpoint_path(run_dir: str | os.PathLike[str], node: str) -> Path:
    """``<run_dir>/checkpoints/<node>.ckpt.npz``."""
    return Path(run_dir) / CHECKPOINT_DIR / f"{node}{CHECKPOINT_SUFFIX}"


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where the checkpoint before ``path``'s current one is kept: ``<path>.prev``."""
    path = Path(path)
    return path.with_name(path.name + PREV_SUFFIX)


def remove_checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """Delete the checkpoint at ``path``, its previous one, one moved aside as damaged and leftover temporary files;
    return what was removed."""
    path = Path(path)
    removed = []
    for candidate in (path, previous_path(path), path.with_name(path.name + DAMAGED_SUFFIX), *_temp_files(path)):
        with contextlib.suppress(FileNotFoundError):
            candidate.unlink()
            removed.append(candidate)
    return removed


# --------------------------------------------------------------------------- writing


def write_checkpoint(
    path: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    *,
    keep_previous: bool = True,
) -> Path:
    """Write ``arrays`` and the JSON-safe ``meta`` to ``path`` atomically (see the module doc-string); return ``path``.

    Keys are non-empty strings without NUL; ``meta`` must not use ``format``, ``version`` or ``arrays``.
    Arrays of Python objects are refused (ValueError), as is metadata JSON cannot hold (TypeError /
    ValueError for NaN or infinity).  ``keep_previous``: keep the replaced checkpoint as ``<path>.prev``.
    The directory is created if needed.
    """
    path = Path(path)
    reserved = {"format", "version", "arrays"} & set(meta)
    if reserved:
        raise ValueError(f"checkpoint metadata may not set {sorted(reserved)}")
    stored: dict[str, np.ndarray] = {}
    info: dict[str, dict[str, Any]] = {}
    for key, array in arrays.items():
        if not isinstance(key, str) or not key or "\0" in key or key == META_KEY:
            raise ValueError(f"bad checkpoint array key {key!r}")
        a = np.asarray(array)
        if a.dtype.hasobject:
            raise ValueError(f"{key}: arrays of Python objects cannot be checkpointed")
        dtype_name = _BFLOAT16_NAME if is_bfloat16(a.dtype) else a.dtype.str
        a = _contiguous(a.view(np.uint16) if dtype_name == _BFLOAT16_NAME else a)
        stored[key] = a
        info[key] = {"crc32": _crc32(a), "dtype": dtype_name}
    document = {**meta, "format": FORMAT, "version": VERSION, "arrays": info}
    text = json.dumps(document, allow_nan=False, separators=(",", ":"), sort_keys=True)
    stored[META_KEY] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in _temp_files(path):  # left behind by a writer that was killed mid-write
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    write_atomically(
        path,
        lambda handle: np.savez(handle, **stored),
        durable=True,
        before_rename=(lambda: _keep_previous(path)) if keep_previous and path.exists() else None,
    )
    log.debug("wrote checkpoint %s (%d arrays, %d bytes)", path, len(arrays), path.stat().st_size)
    return path


def _keep_previous(path: Path) -> None:
    """Hard-link the current checkpoint to ``<path>.prev`` (through a temporary name, then a rename)."""
    prev = previous_path(path)
    link = temp_path(prev)
    try:
        os.link(path, link)
        os.replace(link, prev)
    except OSError as err:  # a file system without hard links: keep only the latest
        log.debug("cannot keep %s as %s: %s", path, prev, err)
    finally:
        with contextlib.suppress(FileNotFoundError):
            link.unlink()


def _temp_files(path: Path) -> list[Path]:
    if not path.parent.is_dir():
        return []
    names = (f".{path.name}.", f".{previous_path(path).name}.")
    return [p for p in path.parent.iterdir() if p.name.startswith(names) and p.name.endswith(TEMP_SUFFIX)]


def _contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` in C order, keeping its shape (``np.ascontiguousarray`` turns 0-d arrays into 1-d ones)."""
    return a if a.flags.c_contiguous else np.array(a, order="C")


def _crc32(a: np.ndarray) -> int:
    return zlib.crc32(memoryview(a).cast("B")) if a.size else 0


# --------------------------------------------------------------------------- reading


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at ``path``; :class:`CheckpointError` (never another exception) if it cannot be used.

    Checks: a readable zip of ``.npz`` members (no pickle), a ``__meta__`` JSON object of this format and
    version, exactly the arrays it lists, each with its CRC-32.  FileNotFoundError is a CheckpointError too.
    """
    path = Path(path)
    try:  # the file opened here, closed here: np.load leaves its own open when the zip is torn
        with open(path, "rb") as handle, np.load(handle, allow_pickle=False) as npz:
            loaded = {name: npz[name] for name in npz.files}
    except FileNotFoundError as err:
        raise CheckpointError(f"{path}: no such checkpoint") from err
    except Exception as err:  # BadZipFile, ValueError (a pickled member), EOFError, OSError, zlib.error ...
        raise CheckpointError(f"{path}: not a readable checkpoint: {type(err).__name__}: {err}") from err
    raw = loaded.pop(META_KEY, None)
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise CheckpointError(f"{path}: no {META_KEY} member")
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: {META_KEY} is not JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: not a {FORMAT} version {VERSION} file")
    info = meta.get("arrays")
    if not isinstance(info, dict) or set(info) != set(loaded):
        raise CheckpointError(f"{path}: the arrays do not match the metadata's list")
    arrays: dict[str, np.ndarray] = {}
    for key, a in loaded.items():
        entry = info[key]
        if not isinstance(entry, dict) or entry.get("crc32") != _crc32(_contiguous(a)):
            raise CheckpointError(f"{path}: array {key!r} is damaged (CRC-32 mismatch)")
        if entry.get("dtype") == _BFLOAT16_NAME:
            if a.dtype != np.uint16:
                raise CheckpointError(f"{path}: array {key!r} should hold bfloat16 words, has {a.dtype}")
            a = a.view(BFLOAT16)
        elif entry.get("dtype") != a.dtype.str:
            raise CheckpointError(f"{path}: array {key!r} has dtype {a.dtype.str}, metadata says {entry.get('dtype')}")
        arrays[key] = a
    return Checkpoint(arrays, meta, path)


def load_latest(path: str | os.PathLike[str]) -> Checkpoint | None:
    """The checkpoint at ``path``, else (missing or damaged, with a warning) the previous one; None when neither
    exists. A damaged ``path`` whose previous one loads is moved aside to ``<path>.damaged`` (the next write would
    keep it as ``.prev``, over the one that loads). CheckpointError when one exists and neither loads: a node
    asked to resume must not start over from step 0 and write its new checkpoints over the damaged ones (they are
    left for a person to look at)."""
    path = Path(path)
    damaged = []
    for candidate in (path, previous_path(path)):
        if not candidate.exists():
            continue
        try:
            checkpoint = read_checkpoint(candidate)
        except CheckpointError as err:
            log.warning("ignoring checkpoint %s", err)
            damaged.append(str(err))
            continue
        if damaged:
            _move_aside(path)
        return checkpoint
    if damaged:
        raise CheckpointError(
            f"no checkpoint of {path} loads ({'; '.join(damaged)}); move the damaged files aside to start afresh"
        )
    return None


def _move_aside(path: Path) -> None:
    """Rename the damaged checkpoint ``path`` to ``<path>.damaged`` (replacing an older one); a failure is logged."""
    aside = path.with_name(path.name + DAMAGED_SUFFIX)
    try:
        os.replace(path, aside)
    except OSError as err:
        log.warning("cannot move the damaged checkpoint %s aside: %s", path, err)
        return
    log.warning("moved the damaged checkpoint %s aside to %s", path, aside)


# --------------------------------------------------------------------------- the node's own state


@dataclasses.dataclass
class DpwaState:
    """A node's gossip state in a checkpoint.

    ``clock`` (batches trained, fractional after clock mixing), ``step`` (update_send calls: the schedules'
    round), ``loss`` (the last loss reported), ``extras``: the rule's extras whose values are plain finite
    numbers (push-sum's ``weight``); ``arrays``: the rule's arrays (GEM's momentum proxy ``gem_m/<i>``).
    Rule tables that peers gossip anyway (leader table) are not kept: they are relearned from the peers.
    """

    clock: float = 0.0
    step: int = 0
    loss: float = 0.0
    rule: str = ""
    extras: dict[str, float] = dataclasses.field(default_factory=dict)
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        """The JSON part (the arrays go into the checkpoint under ``dpwa/<key>``)."""
        return {
            "clock": float(self.clock),
            "step": int(self.step),
            "loss": float(self.loss),
            "rule": self.rule,
            "extras": dict(scalar_extras(self.extras)),
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> DpwaState:
        """Rebuild from :meth:`to_meta` output and the ``dpwa/`` arrays; CheckpointError for bad values."""
        try:
            clock, step, loss = float(meta["clock"]), meta["step"], float(meta["loss"])
            rule, extras = meta.get("rule", ""), meta.get("extras", {})
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"bad dpwa state in checkpoint: {err!r}") from err
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"bad dpwa state in checkpoint: step {step!r}")
        if not (math.isfinite(clock) and math.isfinite(loss)) or not isinstance(rule, str):
            raise CheckpointError("bad dpwa state in checkpoint: clock, loss or rule")
        if not isinstance(extras, dict):
            raise CheckpointError("bad dpwa state in checkpoint: extras is not a mapping")
        return cls(clock, step, loss, rule, dict(scalar_extras(extras)), dict(arrays))


def scalar_extras(extras: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``extras`` that are finite real numbers (not booleans), as floats."""
    out = {}
    for key, value in extras.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                continue
            if math.isfinite(number):
                out[str(key)] = number
    return out
