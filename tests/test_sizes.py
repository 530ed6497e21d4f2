"""Size as a symptom: no module of dpwa/ above MODULE_LINES lines, no function above FUNCTION_LINES lines (its
docstring not counted), the node's step class (dpwa.node.core.Node) under STEP_CLASS_LINES. A piece that is
better whole is listed in WHOLE with the reason; the list is checked too, so an entry that no longer applies
must go."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dpwa"

MODULE_LINES = 600
FUNCTION_LINES = 60
STEP_CLASS_LINES = 400

WHOLE: dict[str, str] = {
    # "path/to/module.py:qualified.name": "why it reads better as one piece"
}


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """Lines from the ``def``/``class`` line to the last, less the docstring's."""
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        assert first.end_lineno is not None
        lines -= first.end_lineno - first.lineno + 1
    return lines


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def oversized() -> dict[str, int]:
    """Every module and function over its limit, by ``path`` or ``path:qualified.name``, with its size."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT).as_posix()
        if text.count("\n") > MODULE_LINES:
            found[where] = text.count("\n")
        for name, node in functions(ast.parse(text)):
            if body_lines(node) > FUNCTION_LINES:
                found[f"{where}:{name}"] = body_lines(node)
    return found


def test_no_module_or_function_is_oversized() -> None:
    found = {key: size for key, size in oversized().items() if key not in WHOLE}
    assert not found, "over the size limits (split it, or list it in WHOLE with the reason):\n" + "\n".join(
        f"  {key}: {size} lines" for key, size in found.items()
    )


def test_every_whole_entry_still_applies() -> None:
    stale = set(WHOLE) - set(oversized())
    assert not stale, f"listed in WHOLE but within the limits now: {sorted(stale)}"


def test_the_step_class_is_small() -> None:
    tree = ast.parse((PACKAGE / "node" / "core.py").read_text(encoding="utf-8"))
    step = next(n for n in ast.iter_child_nodes(tree) if isinstance(n, ast.ClassDef) and n.name == "Node")
    assert body_lines(step) <= STEP_CLASS_LINES


def test_the_check_sees_a_long_function() -> None:
    """Control: a function of FUNCTION_LINES + 1 lines, docstring aside, is found; one of FUNCTION_LINES is not."""

    def source(lines: int) -> str:
        return "class C:\n    def f(self):\n        '''doc\n        more'''\n" + "        x = 1\n" * (lines - 1)

    assert [(name, body_lines(node)) for name, node in functions(ast.parse(source(FUNCTION_LINES + 1)))] == [
        ("C.f", FUNCTION_LINES + 1)
    ]
    assert body_lines(next(n for _, n in functions(ast.parse(source(FUNCTION_LINES))))) == FUNCTION_LINES
