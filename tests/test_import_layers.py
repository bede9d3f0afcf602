"""The code's layers, read from the imports of src/ (module-level and function-local alike): data flows
config -> (data | models) -> train -> use, nothing imports against that flow, and no modules import each other in a
cycle (a cycle that only works because one import sits inside a function still fails here)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "hellbender"
# Modules every layer may use: they import nothing of hellbender's beyond each other.
FOUNDATION = {"errors", "chat_templates", "storage", "metrics"}
# Each layer and the layers it may import (the foundation always).
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "data": {"config"},
    "models": {"config"},
    # The memory planner: the model's structure on the meta device, from the config.
    "plan": {"config", "models"},
    "train": {"config", "data", "models", "plan"},
    "use": {"config", "data", "models", "train"},  # e.g. evaluating pairs with the trainer that scored them
    # The command line and the launcher sit on top of everything.
    "cli": {"config", "data", "models", "plan", "train", "use", "launch"},
    "__main__": {"cli"},
    "launch": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Bundled example files (e.g. a reward-function file a config names) are users' code the package copies, never imports.
EXAMPLES = PACKAGE / "examples"


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if EXAMPLES not in p.parents}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every hellbender module `name` imports, anywhere in its file. `from pkg import sub` imports `pkg` and, when
    `sub` is a module, `sub` as well; a relative import is resolved against the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hellbender"


def test_the_layers_cover_every_module():
    layers = {layer(m) for m in all_modules()} - {"hellbender"}
    assert layers <= set(ALLOWED) | FOUNDATION, f"modules outside any known layer: {layers - set(ALLOWED) - FOUNDATION}"


def test_no_module_imports_against_the_flow():
    wrong = []
    for module, targets in import_graph().items():
        source = layer(module)
        for target in targets:
            to = layer(target)
            if to == source or to in FOUNDATION or to == "hellbender":
                continue
            if source in FOUNDATION or to not in ALLOWED.get(source, set()):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as the list of its modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": set(), "c": {"a"}}, None),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_import_reader_sees_function_local_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from hellbender.train.run import train\n")
    modules = {"hellbender.train.run": Path(), "hellbender.config.m": module}
    assert imported_modules("hellbender.config.m", module, modules) == {"hellbender.train.run"}
