"""The package's import graph: no cycles (lazy imports inside functions included), and data flows one way
through the folders (docs/DESIGN.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "glmkit"

# Each folder may import only the folders to its left in this order (and itself); the top-level modules
# (errors, units) sit below everything.
LAYERS = ("format", "convert", "model", "backends", "generate", "cache", "eval", "serve", "cli")
# Lower folders a folder may not import although they come earlier in LAYERS (the converter never runs the model).
FORBIDDEN = {"convert": {"model", "backends"}}
NEVER_IMPORTED = ("torch", "transformers")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, wherever in the file the import statement sits."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def package_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(package_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_folders_import_only_lower_layers() -> None:
    wrong = []
    for module, targets in package_graph().items():
        here = folder(module)
        for target in targets:
            there = folder(target)
            if not there or there == here:
                continue
            if not here or LAYERS.index(there) > LAYERS.index(here) or there in FORBIDDEN.get(here, ()):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_torch_in_the_package() -> None:
    users = [name for name, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
             if any(m.split(".")[0] in NEVER_IMPORTED for m in imports_of(path))]
    assert not users, users
