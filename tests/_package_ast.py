"""What tests that read the package's source with :mod:`ast` share (test_layers, test_docstrings):
a module's dotted name from its path, and the module an ``import from`` statement names."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """Dotted name of the module at ``path`` in the package folder ``root`` (``pkg/__init__.py`` -> ``pkg``)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_origin(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The dotted module ``from <...> import`` names in ``module`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))
