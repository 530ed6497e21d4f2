"""Every Python snippet of the README, the docs' index, the getting-started page and the own-script page runs as
written: each in its own globals, in one fresh interpreter, in a directory holding the `cluster.yaml` it names
(one node, w1, on a free port), with DPWA_NODE / DPWA_CONFIG set as `dpwa run` sets them. A block right after the line
``<!-- snippet: fragment -->`` is a piece of a longer script and is not run (the first three pages have none)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_ports

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/index.md", "docs/getting-started.md", "docs/own-script.md"]
WHOLE = PAGES[:3]
FRAGMENT = "<!-- snippet: fragment -->"
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.S)


def snippets(page: str) -> list[tuple[int, str, bool]]:
    """(line, code, is a fragment) of every ```python block of ``page``."""
    text = (ROOT / page).read_text()
    return [
        (text[: m.start("code")].count("\n") + 1, m.group("code"), m.group("before").strip() == FRAGMENT)
        for m in BLOCK.finditer(text)
    ]


CASES = [(page, line, code) for page in PAGES for line, code, fragment in snippets(page) if not fragment]


def test_the_pages_that_must_run_whole_have_snippets_and_no_fragments() -> None:
    for page in WHOLE:
        assert all(not fragment for _, _, fragment in snippets(page)), page
    assert {page for page, _, _ in CASES} >= set(WHOLE)


RUNNER = """
import json, sys, traceback
failed = []
for label, code in json.load(sys.stdin):
    try:
        exec(compile(code, label, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(label + "\\n" + traceback.format_exc())
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_snippet_runs_as_written(tmp_path: Path) -> None:
    """One fresh interpreter runs every snippet, each in its own globals (importing torch once, not per snippet:
    seconds each); every snippet that opens a node closes it, so the next one binds the same port."""
    (port,) = free_ports(1)
    (tmp_path / "cluster.yaml").write_text(f"nodes:\n  - {{name: w1, host: 127.0.0.1, port: {port}}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPWA_", "SLURM_"))}
    env.update(DPWA_NODE="w1", DPWA_CONFIG="cluster.yaml")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    labelled = [(f"{page}:{line}", code) for page, line, code in CASES]
    done = subprocess.run(
        [sys.executable, "-c", RUNNER], input=json.dumps(labelled), cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(failed)[-6000:]
