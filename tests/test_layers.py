"""The package's layers (docs/architecture.md), enforced: every import of every module against the layer
table, no import cycle, no torch where it does not belong, ``__all__`` everywhere, and a wheel that holds
every subpackage.

ruff enforces the rest of the style (tests/test_lint.py): TID251 bans torch and matplotlib outside
adapters/ and dpwa/tools/, TID252 bans relative imports.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYER_OF: dict[str, str] = {
    # module prefix -> layer; the longest prefix wins
    "dpwa": "api",
    "dpwa.utils": "utils",
    "dpwa.rules": "rules",
    "dpwa.security": "security",
    "dpwa.config": "config",
    "dpwa.checkpoint": "formats",
    "dpwa.metrics": "formats",
    "dpwa.modelfile": "formats",
    "dpwa.engines": "engines",
    "dpwa.node": "node",
    "dpwa.launcher": "launcher",
    "dpwa.adapters": "adapters",
    "dpwa.tools": "tools",
    "dpwa.cli": "cli",
}

MAY_IMPORT: dict[str, set[str]] = {
    # layer -> the layers it may import (besides itself)
    "utils": set(),
    "rules": {"utils"},
    "security": {"utils"},
    "formats": {"utils"},
    # the cluster file: its rule keys come from the rules' registry, its security key reads key files
    "config": {"rules", "security", "utils"},
    "engines": {"config", "utils"},
    "node": {"rules", "security", "config", "formats", "utils"},
    "api": {"node", "engines", "config", "formats", "utils"},
    "launcher": {"engines", "config", "formats", "utils"},
    "adapters": {"api", "engines", "node", "rules", "config", "formats", "utils"},
    "tools": {"api", "adapters", "engines", "launcher", "node", "rules", "security", "config", "formats", "utils"},
    "cli": {
        "api",
        "tools",
        "adapters",
        "engines",
        "launcher",
        "node",
        "rules",
        "security",
        "config",
        "formats",
        "utils",
    },
}

NARROW: dict[str, set[str]] = {
    # modules (a package: each module in it) whose arrows into another layer are narrower than the layer table:
    # only these targets
    "dpwa.config": {
        "dpwa.rules",  # RULES: each rule's name, settings class and schedules
        "dpwa.rules.schedules",  # SCHEDULES: the names the ``peers`` key allows
        "dpwa.security.keyfiles",  # the key-file format alone, to check a cluster's public keys
        "dpwa.utils.dtypes",
        "dpwa.utils.settings",
    },
}

NO_TORCH = [
    "dpwa",
    "dpwa.node",
    "dpwa.rules",
    "dpwa.launcher",
    "dpwa.security",
    "dpwa.utils",
    "dpwa.config",
    "dpwa.checkpoint",
    "dpwa.metrics",
    "dpwa.modelfile",
    "dpwa.engines",
    "dpwa.cli",
    "dpwa.cli.run",
    "dpwa.cli.keys",
    "dpwa.cli.plot",
    "dpwa.cli.bench",
    "dpwa.tools.plot",
    "dpwa.tools.simulation",
    "dpwa.tools.tensorboard",
    "dpwa.cli.simulate",
    "dpwa.tools.sim.runner",
]
"""Modules that load neither torch nor matplotlib nor an optional extra (tensorboardX) when imported (`dpwa
validate`, `dpwa run`, `dpwa plot`
never pay for torch; the node and everything under it never may)."""


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def source_modules() -> list[Module]:
    """Every module of the installed package as the source tree lays it out (adapters/ is dpwa.adapters)."""
    out = []
    for top, prefix in ((ROOT / "dpwa", "dpwa"), (ROOT / "adapters", "dpwa.adapters")):
        for path in sorted(top.rglob("*.py")):
            parts = list(path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            out.append(Module(name, path, ast.parse(path.read_text(), str(path))))
    return out


MODULES = source_modules()
NAMES = {m.name for m in MODULES}


def layer(name: str) -> str:
    best = max((p for p in LAYER_OF if name == p or name.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def dpwa_imports(module: Module) -> Iterator[tuple[int, str]]:
    """(line, imported dpwa module) for every import anywhere in ``module`` (functions and TYPE_CHECKING too).

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dpwa":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module.path}:{node.lineno}: a relative import"
            base = node.module or ""
            if base.split(".")[0] != "dpwa":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if sub in NAMES else base


def is_within(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or inside the package ``prefix``."""
    return name == prefix or name.startswith(prefix + ".")


def test_the_layer_table_covers_every_module() -> None:
    assert {layer(m.name) for m in MODULES} <= set(MAY_IMPORT)
    assert len(MODULES) > 60 and {"dpwa.node.core", "dpwa.cli.app", "dpwa.adapters.pytorch"} <= NAMES


def test_every_import_follows_the_layers() -> None:
    wrong = []
    for module in MODULES:
        own = layer(module.name)
        for line, target in dpwa_imports(module):
            assert target in NAMES, f"{module.path}:{line}: imports {target}, which does not exist"
            other = layer(target)
            allowed = other == own or other in MAY_IMPORT[own]
            narrow = next((t for prefix, t in NARROW.items() if is_within(module.name, prefix)), None)
            if narrow is not None and other != own:
                allowed = target in narrow
            if not allowed:
                wrong.append(f"{module.path.relative_to(ROOT)}:{line}: {own} -> {other} ({target})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_arrow() -> None:
    """Control: an import against the table is found (the rule can fail)."""
    tree = ast.parse("from dpwa.launcher.job import Job\nimport dpwa.cli.app\n")
    probe = Module("dpwa.node.probe", ROOT / "dpwa" / "node" / "probe.py", tree)
    targets = [layer(t) for _, t in dpwa_imports(probe)]
    assert targets == ["launcher", "cli"] and not set(targets) & MAY_IMPORT["node"]


def import_graph() -> dict[str, set[str]]:
    return {m.name: {t for _, t in dpwa_imports(m) if t != m.name} for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # control


def test_no_layer_cycle() -> None:
    """The layer table itself is a DAG (so the module check above cannot hide a cycle between layers)."""
    assert cycles(MAY_IMPORT) == []


def test_the_node_and_the_commands_load_no_torch_in_a_fresh_interpreter() -> None:
    code = (
        f"import importlib, sys\nfor name in {NO_TORCH!r}:\n    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib', 'tensorboardX'))\n"
        "assert not bad, bad[:5]\nprint(len(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    control = "import sys, dpwa.tools.demo; assert 'torch' in sys.modules"  # the check can see torch
    subprocess.run([sys.executable, "-c", control], check=True, timeout=120, cwd=ROOT)


def defined_names(tree: ast.Module) -> set[str]:
    """Names bound at a module's top level (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def declared_all(tree: ast.Module) -> list[str] | None:
    """The literal ``__all__`` of a module's top level, or None when it has none."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(value))
    return None


@pytest.mark.parametrize(
    "module", [m for m in MODULES if not m.path.name.startswith("_") or m.is_package], ids=lambda m: m.name
)
def test_every_public_module_declares_all(module: Module) -> None:
    names = declared_all(module.tree)
    assert names is not None, f"{module.path.relative_to(ROOT)} has no __all__"
    missing = sorted(set(names) - defined_names(module.tree))
    assert not missing, f"{module.path.relative_to(ROOT)}: __all__ names undefined {missing}"
    assert len(names) == len(set(names)), f"{module.path.relative_to(ROOT)}: __all__ repeats a name"


def test_no_reference_to_notes_outside_the_repository() -> None:
    """The code and docs explain themselves: no pointer to design notes a reader of this repository cannot open."""
    found = []
    for path in [*ROOT.glob("dpwa/**/*.py"), *ROOT.glob("adapters/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]:
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {w}" for w in ("ALGORITHMS", "DESIGN.md", "§") if w in text]
    assert not found, found


# --------------------------------------------------------------------------- the wheel

IGNORED = shutil.ignore_patterns(".venv", ".git", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*cache")


@pytest.mark.slow
def test_a_built_wheel_installs_and_imports_every_subpackage(tmp_path: Path) -> None:
    """Build a wheel from a copy of the tree, install it alone into a folder, and import every package of the
    source tree from there (not from the editable install), the adapters as dpwa.adapters."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."]
    subprocess.run(build, check=True, cwd=src, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("dpwa-*.whl")
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    in_tree = {str(m.path.relative_to(ROOT)).replace("adapters/", "dpwa/adapters/", 1) for m in MODULES}
    assert in_tree <= in_wheel, f"missing from the wheel: {sorted(in_tree - in_wheel)}"
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target)]
    subprocess.run([*install, str(wheel)], check=True, timeout=300, capture_output=True)
    packages = sorted(m.name for m in MODULES if m.is_package)
    code = (
        f"import importlib, dpwa\nassert dpwa.__file__.startswith({str(target)!r}), dpwa.__file__\n"
        f"for name in {packages!r}:\n    importlib.import_module(name)\nprint('imported', len({packages!r}))\n"
    )
    # -S: no site-packages processing, so the editable install's path hook is not there; the dependencies
    # (numpy, zmq, yaml, click, torch) come from this interpreter's site-packages, after the wheel's folder.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])}
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"imported {len(packages)}"
    assert "dpwa.adapters" in packages and "dpwa.node" in packages
