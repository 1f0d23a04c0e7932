"""Every public callable of the package has a docstring (issue 18).

Walks every module under ``trajstore/`` with :mod:`ast` (nothing of the package is imported) and
lists, as ``path:line name``, each public callable without one: module-level functions and
classes whose name does not start with ``_``, and the methods and properties of those classes
whose name does not start with ``_`` (dunders included in "private").  Private modules
(``_optional.py``, ``sb3/_base.py``...) are walked too: their public names are imported by the
public ones.

Allowed without a docstring, each decided in :func:`_why_allowed` below:

* property setters and deleters: the getter carries the property's docstring;
* ``@overload`` stubs: the implementation carries it;
* a method of a class that implements a base class or protocol, when the base documents the
  same name: a base class or protocol of the package (its own method docstring, or its
  ``Attributes`` section for properties), a protocol implemented without subclassing it (listed
  in :data:`IMPLEMENTS`), or a third-party base class that defines the name (looked up with
  :mod:`inspect` on the imported class; only the bases listed in :data:`THIRD_PARTY_BASES`).

A property named in its own class's numpydoc ``Attributes`` section counts as documented (the
protocols declare their properties that way).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _package_ast import import_origin, module_name

PACKAGE = Path(__file__).resolve().parents[1] / "trajstore"

#: Classes that implement a protocol of the package structurally (without subclassing it), and
#: the protocol they implement: their methods take that protocol's docstrings.  Checked: both
#: must exist (a renamed class fails here instead of silently losing the exception).
IMPLEMENTS = {
    "trajstore.buffers.rows.BufferRows": "trajstore.sampling.source.RowSource",
    "trajstore.buffers.rows.TrajectoryRows": "trajstore.sampling.source.EpisodeSource",
    "trajstore.storage.fields.mapped.MappedField": "trajstore.storage.fields.base.Field",
    "trajstore.storage.fields.chunked.ChunkedField": "trajstore.storage.fields.base.Field",
    "trajstore.storage.locks.FlockBackend": "trajstore.storage.locks.LockBackend",
    "trajstore.storage.locks.FilelockBackend": "trajstore.storage.locks.LockBackend",
    "trajstore.core.commit.StoreCommits": "trajstore.core.table.TableOwner",
}

#: Third-party base classes whose methods a subclass of the package may override undocumented:
#: the base documents them (zarr's store API, gymnasium's ``reset``/``step``).  Imported only
#: when a method needs it.  SB3's buffers are left out on purpose: importing them imports torch
#: (seconds), so overrides of theirs in public classes carry their own docstrings.
THIRD_PARTY_BASES = {
    "zarr.storage.LocalStore",
    "zarr.storage.ZipStore",
    "gymnasium.Wrapper",
    "gymnasium.vector.VectorWrapper",
}


@dataclass
class _Module:
    name: str
    path: Path
    tree: ast.Module
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted origin


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements at module level, through ``if``/``try`` blocks (conditional definitions)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse) + _top_level(node.finalbody)
            for handler in node.handlers:
                out += _top_level(handler.body)
        else:
            out.append(node)
    return out


def _parse(name: str, path: Path, source: str) -> _Module:
    mod = _Module(name, path, ast.parse(source))
    is_pkg = path.name == "__init__.py"
    for node in _top_level(mod.tree.body):
        if isinstance(node, ast.ClassDef):
            mod.classes[node.name] = node
        elif isinstance(node, ast.ImportFrom):
            origin = import_origin(name, is_pkg, node)
            for alias in node.names:
                mod.imports[alias.asname or alias.name] = f"{origin}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    mod.imports[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    mod.imports[root] = root
    return mod


def _modules(root: Path = PACKAGE) -> dict[str, _Module]:
    return {(n := module_name(p, root)): _parse(n, p, p.read_text()) for p in sorted(root.rglob("*.py"))}


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Subscript):  # Sampler[list[int]]
        return _dotted(expr.value)
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return f"{head}.{expr.attr}" if head else None
    return None


def _qualify(mod: _Module, expr: ast.expr) -> str | None:
    """The dotted origin of a base-class expression, as the module's imports name it."""
    dotted = _dotted(expr)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    if head in mod.classes and not rest:
        return f"{mod.name}.{head}"
    origin = mod.imports.get(head)
    if origin is None:
        return dotted
    return f"{origin}.{rest}" if rest else origin


def _find_class(mods: dict[str, _Module], qualname: str, depth: int = 0) -> tuple[_Module, ast.ClassDef] | None:
    """The package's class ``qualname`` names, following re-exports (``from .x import C``)."""
    module, _, cls = qualname.rpartition(".")
    mod = mods.get(module)
    if mod is None or depth > 10:
        return None
    if cls in mod.classes:
        return mod, mod.classes[cls]
    if cls in mod.imports:
        return _find_class(mods, mod.imports[cls], depth + 1)
    return None


def _members(cls: ast.ClassDef) -> dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
    out: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, []).append(node)
    return out


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [d for d in (_dotted(x.func if isinstance(x, ast.Call) else x) for x in node.decorator_list) if d]


def _is_property(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(d.split(".")[-1] in ("property", "cached_property") for d in _decorators(node))


def _attributes_section(cls: ast.ClassDef) -> set[str]:
    """Names the class docstring's numpydoc ``Attributes`` section describes."""
    doc = ast.get_docstring(cls) or ""
    match = re.search(r"^Attributes\n-+\n(.*?)(?=^\S[^\n]*\n-+\n|\Z)", doc, re.M | re.S)
    if not match:
        return set()
    names: set[str] = set()
    for line in match.group(1).splitlines():
        if line and not line[0].isspace():
            names.update(n.strip() for n in line.split(":")[0].split(","))
    return names


def _documented_in(mods: dict[str, _Module], qualname: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether class ``qualname`` (of the package, or a listed third-party base) documents ``name``:
    a docstring of its own, its ``Attributes`` section, or (recursively) one of its bases."""
    if qualname in seen:
        return False
    found = _find_class(mods, qualname)
    if found is None:
        if qualname not in THIRD_PARTY_BASES:
            return False
        module, _, cls_name = qualname.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except ImportError:  # an optional dependency missing: the method must document itself
            return False
        return any(name in vars(c) for c in inspect.getmro(cls) if c is not object)
    mod, cls_node = found
    defs = _members(cls_node).get(name, [])
    if any(ast.get_docstring(d) for d in defs):
        return True
    if name in _attributes_section(cls_node) and (not defs or all(_is_property(d) for d in defs)):
        return True
    return any(_documented_in(mods, base, name, seen | {qualname}) for base in _bases(mods, mod, cls_node))


def _bases(mods: dict[str, _Module], mod: _Module, cls: ast.ClassDef) -> list[str]:
    bases = [q for q in (_qualify(mod, b) for b in cls.bases) if q]
    implemented = IMPLEMENTS.get(f"{mod.name}.{cls.name}")
    return bases + ([implemented] if implemented else [])


def _why_allowed(mods: dict[str, _Module], mod: _Module, cls: ast.ClassDef,
                 node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    decorators = _decorators(node)
    # (a) A property's setter or deleter: the getter's docstring describes the property.
    if any(d.endswith((".setter", ".deleter")) for d in decorators):
        return "setter"
    # (c) An @overload stub: the implementation that follows carries the docstring.
    if any(d.split(".")[-1] == "overload" for d in decorators):
        return "overload"
    # (b) The class implements a base class or protocol that documents the same name.
    if any(_documented_in(mods, base, node.name, frozenset({f"{mod.name}.{cls.name}"}))
           for base in _bases(mods, mod, cls)):
        return "documented on a base"
    # A property described in its own class's Attributes section (numpydoc's place for them).
    if _is_property(node) and node.name in _attributes_section(cls):
        return "Attributes section"
    return None


def _missing(mods: dict[str, _Module], root: Path = PACKAGE) -> list[str]:
    """``path:line name`` for every public callable without a docstring."""
    out: list[str] = []

    def where(mod: _Module, node: ast.stmt, name: str) -> str:
        return f"{mod.path.relative_to(root.parent)}:{node.lineno} {name}"

    def visit_class(mod: _Module, cls: ast.ClassDef, prefix: str) -> None:
        qual = f"{prefix}{cls.name}"
        if not ast.get_docstring(cls):
            out.append(where(mod, cls, qual))
        for node in cls.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit_class(mod, node, qual + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                if not ast.get_docstring(node) and _why_allowed(mods, mod, cls, node) is None:
                    out.append(where(mod, node, f"{qual}.{node.name}"))

    for mod in mods.values():
        for node in _top_level(mod.tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                # (c) as for methods: an @overload stub is documented by the implementation after it.
                if not ast.get_docstring(node) and "overload" not in [d.split(".")[-1] for d in _decorators(node)]:
                    out.append(where(mod, node, node.name))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit_class(mod, node, "")
    return out


@pytest.fixture(scope="module")
def package() -> dict[str, _Module]:
    return _modules()


def test_every_public_callable_has_a_docstring(package) -> None:
    missing = _missing(package)
    assert not missing, f"{len(missing)} public callables without a docstring:\n" + "\n".join(missing)


def test_the_protocol_implementations_named_exist(package) -> None:
    mods = package
    stale = [f"{c} -> {p}" for c, p in IMPLEMENTS.items() if _find_class(mods, c) is None or _find_class(mods, p) is None]
    assert not stale, "IMPLEMENTS names classes that do not exist (renamed or moved?):\n" + "\n".join(stale)


def test_the_checker_sees_missing_docstrings_and_allows_only_the_exceptions(tmp_path, monkeypatch) -> None:
    """The walk itself, on a synthetic package: what is listed and what is allowed."""
    root = tmp_path / "trajstore"
    root.mkdir()
    (root / "base.py").write_text('''
from typing import Protocol

class Proto(Protocol):
    """A protocol.

    Attributes
    ----------
    size, width : int
        Declared here, not on the stubs.
    """

    @property
    def size(self) -> int: ...

    def read(self) -> int:
        """Documented once, here."""

class Base:
    """A base class with an undocumented method."""
    def undocumented(self): pass
''')
    (root / "impl.py").write_text('''
from typing import overload
from zarr.storage import LocalStore
from trajstore.base import Base, Proto

def public(): pass
def _private(): pass
@overload
def stub(x: int) -> int: ...
def stub(x):
    """The implementation."""

class Impl(Proto):
    """Subclasses the protocol."""
    @property
    def size(self): return 1
    @size.setter
    def size(self, v): pass
    def read(self): return 1
    def write(self): pass
    def _helper(self): pass
    def __len__(self): return 0
    @overload
    def get(self, i: int) -> int: ...
    def get(self, i):
        """The implementation."""

class Structural:
    """Implements Proto without subclassing it (listed in IMPLEMENTS)."""
    def read(self): return 1
    def other(self): pass

class Child(Base):
    """Inherits an undocumented method: no exception."""
    def undocumented(self): pass

class Store(LocalStore):
    """Subclasses a third-party base."""
    def get(self): pass
    def extra(self): pass

class Undocumented:
    pass
''')
    monkeypatch.setitem(IMPLEMENTS, "trajstore.impl.Structural", "trajstore.base.Proto")
    listed = {entry.split(" ")[1] for entry in _missing(_modules(root), root)}
    assert listed == {"public", "Impl.write", "Structural.other", "Base.undocumented", "Child.undocumented",
                      "Store.extra", "Undocumented"}, listed
