"""Private means private (issue 38 section 4): a module does not import another module's
underscore names, nor reach into another module's private attributes.  Counted on the AST.

- Imports: ``from trajstore.x import _name`` is refused unless ``_name`` is a package-private
  module imported inside its own package (``storage/fields/mapped.py`` importing
  ``storage.fields._syscalls``).
- Attribute reaches: ``obj._name`` where ``obj`` is not ``self``/``cls``/``super()`` and the
  module does not define ``_name`` itself (as a function, class, variable or ``self._name``
  attribute), while some module of the package does: another module's private.  namedtuple's
  API (``_replace``, ``_asdict``, ...) and third-party privates are not counted.

What remains is listed below, file by file, with its count; a count may only go down (lower it
here when a change removes reaches, so none come back).  Give the piece a public name instead of
adding to a list.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from _package_ast import import_origin, module_name

PACKAGE = Path(__file__).resolve().parents[1] / "trajstore"

#: Imports of another module's underscore names that remain (none: keep it so).
IMPORTS_LEFT: dict[str, int] = {}

#: Attribute reaches into another module's private names that remain.  Only ever lower these.
REACHES_LEFT = {
    # BufferRows' read of a ReplayBuffer's rows without synchronizing (StoredBuffer._read_rows).
    "trajstore/buffers/rows.py": 1,
    # The SB3 rollout buffer's observation gathering read by the vectorized wrapper.
    "trajstore/sb3/dummy_vec.py": 2,
    # zarr's LocalStore._open (no public way to open a store object in place).
    "trajstore/storage/location.py": 1,
}

_NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _is_module(dotted: str) -> bool:
    base = PACKAGE.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def private_imports() -> Counter[str]:
    """``{file: count}`` of imports of another module's underscore names."""
    found: Counter[str] = Counter()
    for path, tree in _sources().items():
        mod = module_name(path, PACKAGE)
        own_package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            origin = import_origin(mod, path.name == "__init__.py", node)
            if not (origin == "trajstore" or origin.startswith("trajstore.")):
                continue
            for alias in node.names:
                if not _private(alias.name):
                    continue
                if origin == own_package and _is_module(f"{origin}.{alias.name}"):
                    continue  # a package-private module, inside its package
                found[_rel(path)] += 1
    return found


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    return names


def private_reaches() -> Counter[str]:
    """``{file: count}`` of reaches into another module's private attributes."""
    sources = _sources()
    defined = {p: _defined(t) for p, t in sources.items()}
    package_privates = {n for names in defined.values() for n in names if _private(n)}
    found: Counter[str] = Counter()
    for path, tree in sources.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in _NAMEDTUPLE_API:
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue  # its own class's (or a base class's) attribute
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if node.attr in defined[path] or node.attr not in package_privates:
                continue
            found[_rel(path)] += 1
    return found


def _check(found: Counter[str], left: dict[str, int], what: str) -> None:
    more = {f: n for f, n in found.items() if n > left.get(f, 0)}
    assert not more, (f"new {what} (give the piece a public name instead): "
                      + ", ".join(f"{f}: {n} (allowed {left.get(f, 0)})" for f, n in sorted(more.items())))
    fewer = {f: n for f, n in left.items() if found.get(f, 0) < n}
    assert not fewer, (f"fewer {what} than listed: lower the counts in tests/test_private_names.py so they "
                       "cannot come back: " + ", ".join(f"{f}: {found.get(f, 0)}" for f in sorted(fewer)))


def test_no_new_import_of_another_modules_underscore_names() -> None:
    _check(private_imports(), IMPORTS_LEFT, "imports of another module's underscore names")


def test_no_new_reach_into_another_modules_private_attributes() -> None:
    _check(private_reaches(), REACHES_LEFT, "reaches into another module's private attributes")


def test_the_counters_see_what_they_count(tmp_path) -> None:
    tree = ast.parse("from trajstore.core.store import _hidden\nx = obj._hidden_attr\n")
    imports = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names if _private(a.name)]
    reaches = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _private(n.attr)]
    assert imports == ["_hidden"] and reaches == ["_hidden_attr"]
    assert "_hidden_attr" not in _defined(tree) and "x" in _defined(tree)
