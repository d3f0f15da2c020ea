"""No class over 25 methods and no function over 60 lines in swarm/ and peers/ without a sentence in the code saying
why it must be so (issue 58, item 7): a class that does several jobs is split into collaborators, a long function
into named steps. The sentence starts with ``size:``, in the docstring or in a comment line right above the ``def`` or
``class`` (or its decorators)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_METHODS = 25
MAX_LINES = 60
MARKER = "size:"


def _methods(node: ast.ClassDef) -> int:
    return sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)


def _says_why(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    """The marker in the node's docstring, or in the comment lines right above it (and its decorators)."""
    if MARKER in (ast.get_docstring(node) or ""):
        return True
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1  # 0-based index of the first line
    above = first - 1
    while above >= 0 and lines[above].strip().startswith("#"):
        if MARKER in lines[above]:
            return True
        above -= 1
    return False


def oversized(path: Path, source: str) -> list[str]:
    """``path:qualified.name`` of each class over MAX_METHODS methods and each function over MAX_LINES lines that
    does not say why, with its figure."""
    lines = source.splitlines()
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                if _methods(child) > MAX_METHODS and not _says_why(child, lines):
                    found.append(f"{path}:{name} ({_methods(child)} methods)")
                visit(child, f"{name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                length = child.end_lineno - child.lineno + 1
                if length > MAX_LINES and not _says_why(child, lines):
                    found.append(f"{path}:{name} ({length} lines)")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_class_or_function_too_large_without_saying_why():
    found = []
    for package in ("swarm", "peers"):
        for file in sorted((ROOT / package).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            found += oversized(path, file.read_text())
    assert found == [], "split these into collaborators or named steps, or say why with 'size:' (issue 58, item 7)"


def test_the_marker_is_read_from_a_docstring_or_the_comment_above():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    source = (
        f"def long():\n{body}\n\n"
        f'def said():\n    """size: one table, kept whole."""\n{body}\n\n'
        f"# size: one table, kept whole.\n@staticmethod\ndef commented():\n{body}\n\n"
        "class Many:\n" + "".join(f"    def m{i}(self): ...\n" for i in range(MAX_METHODS + 1))
    )
    assert oversized("m.py", source) == [f"m.py:long ({MAX_LINES + 1} lines)", f"m.py:Many ({MAX_METHODS + 1} methods)"]
