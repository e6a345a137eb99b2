"""The house rules, checked over every module of pdserve/ from its source (AST, no imports):

- no module over 400 lines;
- no class whose `__init__` assigns more than 15 distinct `self.` attributes;
- an import inside a function or method has a comment on its line saying why it is lazy.

Each failure names `file:line` and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pdserve"
MAX_LINES = 400
MAX_INIT_ATTRIBUTES = 15


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def where(path: Path, line: int) -> str:
    """`pdserve/x/y.py:line` for a module of the package (a path elsewhere, as given)."""
    return f"{path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path}:{line}"


def long_module(path: Path, lines: list[str]) -> Iterator[str]:
    if len(lines) > MAX_LINES:
        yield f"{where(path, MAX_LINES + 1)}: module has {len(lines)} lines (at most {MAX_LINES})"


def crowded_inits(path: Path, tree: ast.Module) -> Iterator[str]:
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for init in cls.body:
            if isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)) and init.name == "__init__":
                names = self_attributes(init)
                if len(names) > MAX_INIT_ATTRIBUTES:
                    yield (f"{where(path, init.lineno)}: {cls.name}.__init__ assigns {len(names)} self attributes "
                           f"(at most {MAX_INIT_ATTRIBUTES})")


def self_attributes(init: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names of `self.X` assigned anywhere in `init` (plain, annotated, augmented or unpacked)."""
    names = set()
    for node in ast.walk(init):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self"
                        and isinstance(leaf.ctx, ast.Store)):
                    names.add(leaf.attr)
    return names


def uncommented_lazy_imports(path: Path, tree: ast.Module, lines: list[str]) -> Iterator[str]:
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not has_comment(lines, node):
                yield f"{where(path, node.lineno)}: import inside a function without a comment saying why it is lazy"


def has_comment(lines: list[str], node: ast.stmt) -> bool:
    """A `#` comment on any line of the import statement (after the code)."""
    for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
        tokens = lines[number - 1].split("#", 1)
        if len(tokens) == 2 and tokens[1].strip():
            return True
    return False


def violations(path: Path) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, filename=str(path))
    found = [*long_module(path, lines), *crowded_inits(path, tree), *uncommented_lazy_imports(path, tree, lines)]
    return sorted(set(found))  # a nested function's import is seen from each enclosing function


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_module_keeps_the_house_rules(path):
    found = violations(path)
    assert not found, "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
    inside = tmp_path / "pdserve"
    inside.mkdir()
    module = inside / "sample.py"
    attributes = "\n".join(f"        self.a{i} = {i}" for i in range(16))
    module.write_text("class Wide:\n    def __init__(self):\n" + attributes + "\n\n\n"
                      "def f():\n    import json\n    import os  # lazy: a reason\n    return json, os\n"
                      + "\n" * 400)
    found = violations(module)
    assert any("sample.py:401: module has" in v for v in found)
    assert any("sample.py:2: Wide.__init__ assigns 16 self attributes" in v for v in found)
    assert any("sample.py:22: import inside a function" in v for v in found)
    assert not any(":23:" in v for v in found)
