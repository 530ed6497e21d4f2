"""The docs site builds strictly (a broken link, a missing page or a page outside the nav fails), and the
README's links point at files that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {
        p.parent.name if p.parent != tmp_path / "site" else "index" for p in (tmp_path / "site").rglob("index.html")
    }
    assert pages <= built | {"index"}, f"pages not built: {sorted(pages - built)}"


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links to its docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: reference belongs in docs/"
    commands = [line for line in lines[:12] if line.startswith("scripts/")]
    assert [c.split()[0] for c in commands] == ["scripts/demo.sh", "scripts/test.sh"]
