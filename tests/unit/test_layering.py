"""The package's layers: no import cycle between modules, and no import from a higher layer.

The layers, lowest first (a module may import its own package and any lower layer; the table is
the architecture of docs/ARCHITECTURE.md, so a new edge that breaks it is a design change to
make there first):

    0  passes                           graph passes
    1  sampling, model, trees           logits processing and acceptance; one model's forward;
                                        token trees and tree drafting
    2  request, drafters, config        generate() inputs; whatever proposes tokens; SpecConfig
    3  engine                           planning, the compiled rounds, graphs, the host loop's helpers
    4  api, specfx (package)            speculate() and the generator
    5  demo, train, bench, testing, cli tools beside the library

Imports inside functions count as much as top-level ones (a lazy import hides an edge, it does
not remove it); ``if TYPE_CHECKING:`` imports do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import specfx

PACKAGE = Path(specfx.__file__).parent

LAYERS = {
    "passes": 0,
    "trees": 1,
    "sampling": 1,
    "model": 1,
    "request": 2,
    "drafters": 2,
    "config": 2,
    "engine": 3,
    "api": 4,
    "": 4,  # specfx/__init__.py
    "demo": 5,
    "train": 5,
    "bench": 5,
    "testing": 5,
    "cli": 5,
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / Path(*module.split(".")) / "__init__.py").exists()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """Every specfx module and the specfx modules it imports (a package import names its
    ``__init__``; ``from pkg import module`` names the module)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        edges = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names if _is_package(target)]
                names = [n for n in names if n == target or (PACKAGE.parent / Path(*n.split("."))).with_suffix(".py").exists()
                         or _is_package(n)]
            else:
                continue
            edges.update(n for n in names if n == "specfx" or n.startswith("specfx."))
        edges.discard(module)
        graph[module] = edges
    return graph


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else ""
    return top, LAYERS[top]


def test_every_top_level_name_has_a_layer():
    tops = {_layer_name for m in import_graph() for _layer_name in [m.split(".")[1] if "." in m else ""]}
    assert tops <= set(LAYERS), f"modules outside the layer table: {sorted(tops - set(LAYERS))}"


def test_no_upward_imports():
    upward = []
    for module, edges in import_graph().items():
        top, layer = _layer(module)
        for target in edges:
            ttop, tlayer = _layer(target)
            if ttop != top and tlayer > layer:
                upward.append(f"{module} (layer {layer}) imports {target} (layer {tlayer})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = import_graph()
    # Tarjan's strongly connected components; a component of two or more modules is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_files_stay_small():
    big = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 450}
    assert not big, f"modules over 450 lines (split them by concern): {big}"
