"""Lint as part of the suite: ruff's rules (ruff.toml) -- among them the banned torch/matplotlib imports
outside adapters/ and dpwa/tools/ (TID251) and the one absolute import style (TID252) -- and its format."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_ruff_check_passes() -> None:
    proc = ruff("check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_clean() -> None:
    proc = ruff("format", "--check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_banned_imports_are_caught(tmp_path: Path) -> None:
    """Control: the project's ruff.toml flags torch in the node and a relative import."""
    (tmp_path / "ruff.toml").write_text((ROOT / "ruff.toml").read_text())
    node = tmp_path / "dpwa" / "node"
    node.mkdir(parents=True)
    (node / "probe.py").write_text("import torch\n\nfrom . import wire\n\n__all__ = [torch, wire]\n")
    proc = ruff("check", "--no-cache", "--output-format", "concise", ".", cwd=tmp_path)
    assert proc.returncode == 1 and "TID251" in proc.stdout and "TID252" in proc.stdout, proc.stdout
