"""The package's layers (issues 18 and 38): every import points down, and no module imports itself back.

Each module belongs to a layer by its folder (or, for a top-level module, by its name).  A module
may import from its own layer and the layers below; an import of a higher layer, or a cycle between
modules (through any chain of imports, top-level or inside functions), fails here.  Imports under
``if TYPE_CHECKING:`` are for annotations only and are not counted.

Above the core (errors .. maintenance) the integration layer has the same kind of rules:
``metadata``/``recording`` (what a store says about itself, and recording episodes into it) sit
below ``shards`` (many stores read as one), which sits below the integrations (sb3, torch, interop,
ray, dask, demo); the integrations are siblings that never import each other; the package root
``trajstore`` sits above them (no integration imports the root), and the CLI is the top: it may
import everything, nothing imports it (only ``python -m trajstore``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _package_ast import import_origin, module_name

PACKAGE = Path(__file__).resolve().parents[1] / "trajstore"

#: The integrations: siblings of one layer, each on the layers below and never on another one.
INTEGRATIONS = ("trajstore.sb3", "trajstore.torch", "trajstore.torchrl", "trajstore.interop", "trajstore.ray",
                "trajstore.dask",
                "trajstore.demo")

#: Bottom to top.  Every module lives in the layer its folder (or its own name) is listed in; the
#: bare ``trajstore`` prefix holds only the package root (a new top-level module must be placed).
LAYERS = [
    ("base", ("trajstore.errors", "trajstore._optional")),
    ("spaces", ("trajstore.spaces",)),
    ("storage", ("trajstore.storage",)),
    ("core", ("trajstore.core",)),
    ("sampling", ("trajstore.sampling",)),
    ("buffers", ("trajstore.buffers",)),
    ("maintenance", ("trajstore.maintenance",)),
    ("records", ("trajstore.metadata", "trajstore.recording", "trajstore.images")),
    ("shards", ("trajstore.shards",)),
    ("integrations", INTEGRATIONS),
    ("public", ("trajstore",)),
    ("cli", ("trajstore.cli", "trajstore.__main__")),
]


def _modules() -> dict[str, Path]:
    return {module_name(path, PACKAGE): path for path in PACKAGE.rglob("*.py")}


def _placed(module: str) -> tuple[int, str]:
    """(layer index, the longest prefix of LAYERS that holds ``module``)."""
    best, rank = "", len(LAYERS) - 1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, rank = p, i
    return rank, best


def _layer(module: str) -> int:
    return _placed(module)[0]


def _integration(module: str) -> str | None:
    """The integration package (one of INTEGRATIONS) ``module`` belongs to, or None."""
    return next((p for p in INTEGRATIONS if module == p or module.startswith(p + ".")), None)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported trajstore module, line) for every runtime import in the module."""
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            target = import_origin(name, is_pkg, node)
            if target.split(".")[0] == "trajstore":
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in mods else target, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "trajstore")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return [(m, line) for m, line in found if m != name]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_every_module_has_a_known_layer_and_every_folder_a_job(graph) -> None:
    for pkg in {m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}:
        doc = ast.get_docstring(ast.parse((PACKAGE.parent / pkg.replace(".", "/") / "__init__.py").read_text()))
        assert doc, f"{pkg}/__init__.py has no docstring stating the package's job"
    unplaced = sorted(m for m in graph if m != "trajstore" and _placed(m)[1] == "trajstore")
    assert not unplaced, f"modules in no layer of LAYERS (add them there and to docs/architecture.md): {unplaced}"


def test_imports_point_down(graph) -> None:
    upward = []
    for module, imports in sorted(graph.items()):
        for target, line in imports:
            if _layer(target) > _layer(module):
                upward.append(f"{module}:{line} imports {target} "
                              f"({LAYERS[_layer(module)][0]} -> {LAYERS[_layer(target)][0]})")
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_integrations_do_not_import_each_other(graph) -> None:
    """sb3, torch, interop, ray, dask and demo each stand on the layers below only: what two of
    them share belongs below them (shards, records or the core)."""
    across = [f"{module}:{line} imports {target}"
              for module, imports in sorted(graph.items()) for target, line in imports
              if _integration(module) and _integration(target) not in (None, _integration(module))]
    assert not across, "imports between integrations:\n" + "\n".join(across)


def test_no_import_cycles(graph) -> None:
    edges = {m: sorted({t for t, _ in imps if t in graph}) for m, imps in graph.items()}
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_upward_and_circular_imports(tmp_path) -> None:
    """The walk itself: lazy imports count, TYPE_CHECKING ones do not."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trajstore.buffers import base\n"
                   "def f():\n    from trajstore.maintenance import verify\n")
    mods = {"trajstore.maintenance.verify": src, "trajstore.buffers.base": src}
    assert _imports("trajstore.storage.x", src, mods) == [("trajstore.maintenance.verify", 5)]
    assert _layer("trajstore.storage.fields.mapped") < _layer("trajstore.core.table") < _layer("trajstore.dask")
    assert (_layer("trajstore.maintenance.verify") < _layer("trajstore.recording") < _layer("trajstore.shards.rows")
            < _layer("trajstore.torch.datasets") < _layer("trajstore") < _layer("trajstore.cli.show"))
    assert _integration("trajstore.sb3.replay") == "trajstore.sb3" and _integration("trajstore.shards") is None
    assert _placed("trajstore.newmodule") == (LAYERS.index(("public", ("trajstore",))), "trajstore")
