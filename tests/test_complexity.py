"""No function of the package is too branchy to hold in one's head (issue 38 section 4): the
cyclomatic complexity of every function and method under trajstore/ is at most 25.

Counted on the AST (no extra dependency), as radon counts: 1, plus 1 per ``if``, conditional
expression, ``assert``, ``match`` case and loop (and its ``else``), per ``except`` (and a
``try``'s ``else``), per operand of ``and``/``or`` beyond the first, and per comprehension ``for``
and its ``if`` clauses.  A nested function or class is counted on its own.  A function above the
limit is split into named steps (a table of checks, one function each), as
``maintenance/repair.py`` and ``storage/array_meta.py`` are.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trajstore"
MAX_COMPLEXITY = 25

_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def complexity(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Cyclomatic complexity of ``fn``'s own body (nested functions and classes excluded)."""
    n = 1
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, _NESTED):
            continue
        if isinstance(node, (ast.If, ast.IfExp, ast.Assert, ast.match_case)):
            n += 1
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            n += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            n += len(node.handlers) + bool(node.orelse)  # type: ignore[attr-defined]
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
        stack.extend(ast.iter_child_nodes(node))
    return n


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_counter_counts_each_kind_of_branch() -> None:
    src = ("def f(x, ys):\n"
           "    if x and ys or not x:\n"          # if 1, and/or 2
           "        return [y for y in ys if y]\n"  # comprehension 1, its if 1
           "    for y in ys:\n"                     # loop 1
           "        assert y\n"                     # assert 1
           "    else:\n"                            # loop else 1
           "        pass\n"
           "    try:\n"
           "        x = 1 if x else 2\n"            # conditional 1
           "    except ValueError:\n"               # handler 1
           "        pass\n"
           "    def g():\n"                         # nested: not counted here
           "        if x: pass\n"
           "    while x:\n"                         # loop 1
           "        break\n")
    # 1 + if 1 + and/or 2 + comprehension 2 + loop and its else 2 + assert 1 + conditional 1 + handler 1 + while 1
    f = _functions(ast.parse(src))[0]
    assert f.name == "f" and complexity(f) == 12
    g = _functions(ast.parse(src))[1]
    assert g.name == "g" and complexity(g) == 2


def test_no_function_is_above_the_limit() -> None:
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for fn in _functions(ast.parse(path.read_text(), str(path))):
            c = complexity(fn)
            if c > MAX_COMPLEXITY:
                over.append(f"{path.relative_to(PACKAGE.parent)}:{fn.lineno} {fn.name}: {c}")
    assert not over, (f"functions above cyclomatic complexity {MAX_COMPLEXITY} (split them into named steps):\n"
                      + "\n".join(over))
