"""offload/planning's modules import each other one way, at module level (offload/planning/__init__.py).

Read from the sources with ast (nothing imported): every `offload.planning.X` import inside a function
of the package fails the first test, and a loop in the module-level import graph fails the second,
naming the loop. The package's __init__ hands names on lazily and is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "offload" / "planning"


def _planning_imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(planning module name, node) of every `offload.planning.X` import in `tree`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("offload.planning."):
            out.append((node.module.split(".")[2], node))
        elif isinstance(node, ast.Import):
            out += [(a.name.split(".")[2], node) for a in node.names if a.name.startswith("offload.planning.")]
    return out


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(PKG.glob("*.py")) if p.stem != "__init__"}


def test_planning_imports_are_module_level():
    late = []
    for name, tree in _modules().items():
        top = {id(n) for n in tree.body}
        late += [
            f"{name}.py:{node.lineno} imports {dep}" for dep, node in _planning_imports(tree) if id(node) not in top
        ]
    assert not late, late


def test_planning_import_graph_has_no_loop():
    graph = {name: {dep for dep, _ in _planning_imports(tree)} for name, tree in _modules().items()}
    assert graph["memplan"] >= {"experts", "selfplan", "draftcost"}  # the graph is really read
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            assert state.get(dep) != 1, "import loop: " + " -> ".join([*path, node, dep])
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
