"""The package's architecture, read from its imports: four layers, arrows only downward, no circle.

    machine  <  planning  <  server  <  commands

``env_values``, ``strict_json`` and ``version`` sit below every layer and import nothing of
ours; the package root (``sglang_sm120/__init__.py``) is SGLang's entry point and nothing of
ours imports it.
Every import counts, a function's lazy one too: a lazy import still runs, only later.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import sglang_sm120

PACKAGE = "sglang_sm120"
ROOT = Path(sglang_sm120.__file__).parent
LAYERS = ("machine", "planning", "server", "commands")
BASE = ("env_values", "strict_json", "version")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The modules of ours that ``name`` imports anywhere in its body: ``from pkg import sub``
    is the submodule where one of that name exists, the package otherwise."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")} - {name}


GRAPH = {name: imports_of(name) for name in MODULES}


def rank(name: str) -> int:
    """0: the base modules; 1-4: the layers bottom up; 5: the package root (entry point)."""
    if name == PACKAGE:
        return len(LAYERS) + 1
    part = name.split(".")[1]
    if part in BASE:
        return 0
    return LAYERS.index(part) + 1 if part in LAYERS else -1


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_belongs_to_a_layer():
    unplaced = [name for name in MODULES if rank(name) < 0]
    assert not unplaced, f"modules outside {LAYERS} and {BASE}: {unplaced}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_imports_only_its_own_layer_or_lower(name):
    upward = sorted(dep for dep in GRAPH[name] if rank(dep) > rank(name))
    assert not upward, f"{name} (layer {rank(name)}) imports higher layers: {upward}"


def test_the_base_modules_import_nothing_of_ours():
    for name in (f"{PACKAGE}.{base}" for base in BASE):
        assert GRAPH[name] == set(), (name, GRAPH[name])


def test_nothing_imports_the_package_root():
    importers = sorted(name for name, deps in GRAPH.items() if PACKAGE in deps)
    assert not importers, f"import the entry point, not a layer: {importers}"


def test_no_import_circle_inside_the_package():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH) or [])


def test_the_cycle_finder_finds_a_circle():
    """The check above can fail: a circle of three modules is found, a chain is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
