"""A small, safe expression language over episode fields: ``trajstore filter --where``.

``return > 100 and not (length < 10 or info.success == 0)``

Grammar (parsed with :mod:`ast`, then checked node by node; nothing is ever evaluated as Python):

- numbers (``3``, ``-2.5``, ``1e3``) and ``True`` / ``False``; quoted strings (``'pick cube'``), which
  compare with text columns (``task``, docs/robot.md);
- field names: an episode column of :func:`~trajstore.buffers.episode_edit.episode_columns`
  (``episode_id``, ``start``, ``length``, ``live``, ``has_data``, and every scalar episode-data
  field); a field below a Dict key is written with dots (``info.success`` is ``info/success``);
- comparisons ``== != < <= > >=``, chained as in Python (``0 < return <= 10``);
- ``and``, ``or``, ``not`` over comparisons (or bool fields), and parentheses.

Anything else (calls, attribute access on values, subscripts, arithmetic, lambdas) is
refused with :class:`~trajstore.errors.BadOptionError` naming the construct and its column.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from trajstore.errors import BadOptionError, UnknownFieldError

__all__ = ["compile_where", "where_fields", "where_strings", "MAX_WHERE_CHARS", "TEXT_FIELDS"]

#: Fields holding text, the only ones quoted strings compare with.
TEXT_FIELDS = ("task",)

#: Longest expression accepted (the parser's recursion stays shallow).
MAX_WHERE_CHARS = 2000

_CMP: dict[type, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    ast.Eq: np.equal, ast.NotEq: np.not_equal, ast.Lt: np.less, ast.LtE: np.less_equal,
    ast.Gt: np.greater, ast.GtE: np.greater_equal,
}
_SYMBOL = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}

Evaluator = Callable[[Mapping[str, np.ndarray]], np.ndarray]


def _refuse(expr: str, node: ast.AST, what: str) -> BadOptionError:
    col = getattr(node, "col_offset", None)
    at = f" at column {col + 1}" if col is not None else ""
    return BadOptionError(f"--where {expr!r}: {what}{at}; allowed: numbers, field names, comparisons "
                          "(== != < <= > >=), and/or/not, parentheses, quoted strings" + _operator_hint(expr))


def _field_name(node: ast.AST) -> str | None:
    """``a.b.c`` (Names and Attributes only) as ``"a/b/c"``; None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return "/".join([node.id] + parts[::-1])
    return None


def _parse(expr: str) -> ast.Expression:
    if not isinstance(expr, str):
        raise BadOptionError(f"--where must be a string; got {type(expr).__name__}")
    if not expr.strip():
        raise BadOptionError("--where is empty; expected an expression such as 'return > 100'")
    if len(expr) > MAX_WHERE_CHARS:
        raise BadOptionError(f"--where is {len(expr)} characters long; at most {MAX_WHERE_CHARS} are accepted")
    # Python's keywords that are natural field names ("return", "from", ...) parse as names when
    # quoted with a trailing marker: rewrite them before parsing.
    try:
        return ast.parse(_escape_keywords(expr), mode="eval")
    except (SyntaxError, RecursionError, ValueError) as e:
        col = getattr(e, "offset", None)
        raise BadOptionError(f"--where {expr!r}: not an expression" + (f" (column {col})" if col else "") +
                             f": {getattr(e, 'msg', e)}" + _operator_hint(expr)) from None


#: Operators of other languages users type, and this language's word for them.
_OTHER_OPERATORS = (("&&", "and"), ("||", "or"), ("!=", None), ("!", "not"), ("&", "and"), ("|", "or"))


def _operator_hint(expr: str) -> str:
    """``"; use 'and' instead of '&&'"`` for the first C/shell-style operator in ``expr`` ("" if none)."""
    for op, word in _OTHER_OPERATORS:
        if op in expr:
            if word is None:  # "!=" is ours: take it out before looking for "!"
                expr = expr.replace(op, " ")
                continue
            return f"; use {word!r} instead of {op!r} (this language writes and, or, not)"
    return ""


_KEYWORD_MARK = "__kw_"


def _escape_keywords(expr: str) -> str:
    """Python keywords used as field names (``return``, ``class``...) become ``__kw_return``;
    the operators ``and``/``or``/``not`` and ``True``/``False`` stay keywords."""
    import io
    import keyword
    import tokenize

    keep = {"and", "or", "not", "True", "False"}
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(expr).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return expr  # ast.parse reports the problem
    out = []
    for tok in toks:
        if tok.type == tokenize.NAME and keyword.iskeyword(tok.string) and tok.string not in keep:
            out.append(tok._replace(string=_KEYWORD_MARK + tok.string))
        else:
            out.append(tok)
    return tokenize.untokenize(out) if any(t.string.startswith(_KEYWORD_MARK) for t in out) else expr


def _unescape(name: str) -> str:
    return "/".join(p[len(_KEYWORD_MARK):] if p.startswith(_KEYWORD_MARK) else p for p in name.split("/"))


def where_fields(expr: str) -> list[str]:
    """The field names ``expr`` uses (``info.success`` as ``"info/success"``), in order of first use.

    Raises
    ------
    BadOptionError
        ``expr`` is not an expression of the language (the message names the construct).
    """
    names: list[str] = []
    _build(expr, _parse(expr).body, names)
    return names


def where_strings(expr: str) -> list[str]:
    """The quoted strings ``expr`` compares with (``"task == 'pick cube'"`` gives ``["pick cube"]``).

    Raises
    ------
    BadOptionError
        ``expr`` is not an expression of the language.
    """
    _build(expr, tree := _parse(expr).body, [])
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def compile_where(expr: str, fields: Mapping[str, np.ndarray] | Iterable[str]) -> Evaluator:
    """Check ``expr`` against the available ``fields`` and return its evaluator.

    Parameters
    ----------
    expr : str
        The expression (see the module docstring).
    fields : mapping of str to (E, ...) arrays, or an iterable of names
        The columns available (``episode_columns`` of a store); with arrays, fields must be
        scalar per episode ((E,) arrays).

    Returns
    -------
    callable
        ``evaluate(columns) -> (E,) bool`` over a mapping like ``fields``.

    Raises
    ------
    BadOptionError
        Not an expression of the language, or a field that is not one number per episode.
    UnknownFieldError
        A name that is no field (the message lists the fields).
    """
    names: list[str] = []
    fn = _build(expr, _parse(expr).body, names)
    known = list(fields)
    for n in names:
        if n not in known:
            raise UnknownFieldError(f"--where {expr!r}: no episode field {n!r}; the fields are "
                                    f"{sorted(known)} (Dict keys joined by '.')")
        if isinstance(fields, Mapping) and np.ndim(fields[n]) != 1:
            raise BadOptionError(f"--where {expr!r}: field {n!r} has shape {np.shape(fields[n])[1:]} per episode; "
                                 "only scalar fields can be compared")

    def evaluate(columns: Mapping[str, np.ndarray]) -> np.ndarray:
        n = len(columns["episode_id"]) if "episode_id" in columns else len(next(iter(columns.values())))
        out = np.broadcast_to(np.asarray(fn(columns)), (n,))
        if out.dtype != bool:
            raise BadOptionError(f"--where {expr!r} gives {out.dtype} values, not true/false: compare the "
                                 "field, e.g. 'x > 0'")
        return np.array(out)

    return evaluate


def _build(expr: str, node: ast.AST, names: list[str]) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    """The evaluator of ``node``; every node type not listed here is refused."""
    if isinstance(node, ast.BoolOp):
        parts = [_build(expr, v, names) for v in node.values]
        combine = np.logical_and if isinstance(node.op, ast.And) else np.logical_or
        return lambda c: combine.reduce([_bool(expr, p(c)) for p in parts])
    if isinstance(node, ast.UnaryOp):
        inner = _build(expr, node.operand, names)
        if isinstance(node.op, ast.Not):
            return lambda c: ~_bool(expr, inner(c))
        if isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
            sign = -1 if isinstance(node.op, ast.USub) else 1
            return lambda c: sign * inner(c)
        raise _refuse(expr, node, "a sign is allowed before numbers only")
    if isinstance(node, ast.Compare):
        ops = []
        for op in node.ops:
            if type(op) not in _CMP:
                raise _refuse(expr, node, f"operator {type(op).__name__} is not allowed")
            ops.append(_CMP[type(op)])
        _check_text(expr, node, [node.left, *node.comparators])
        operands = [_build(expr, n, names) for n in [node.left, *node.comparators]]

        def compare(c: Mapping[str, np.ndarray]) -> np.ndarray:
            vals = [o(c) for o in operands]
            if len({v.dtype.kind in "US" for v in vals}) > 1:  # numpy would answer False, not refuse
                raise _refuse(expr, node, "text (the task strings of a store with a task dictionary, or quoted "
                                          "strings) compares only with text")
            res = [op(a, b) for op, a, b in zip(ops, vals[:-1], vals[1:])]
            return np.logical_and.reduce(res) if len(res) > 1 else res[0]

        return compare
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or (isinstance(v, (int, float, str)) and not isinstance(v, complex)):
            arr = np.asarray(v)
            return lambda c: arr
        raise _refuse(expr, node, f"constant {v!r} is not a number or a string")
    name = _field_name(node)
    if name is not None:
        name = _unescape(name)
        if any(part.startswith("__") for part in name.split("/")):
            raise _refuse(expr, node, f"{name.replace('/', '.')!r} is no field name (names starting with '__' are "
                                      "never fields)")
        if name not in names:
            names.append(name)
        return lambda c: np.asarray(c[name])
    raise _refuse(expr, node, f"{type(node).__name__} is not allowed")


def _check_text(expr: str, node: ast.AST, operands: list[ast.AST]) -> None:
    """Quoted strings compare only with text fields (:data:`TEXT_FIELDS`).  A text field compared with
    a number is checked when evaluated: a store without a task dictionary may keep a numeric episode
    data column named ``task`` (its values are numbers then)."""
    strings = any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in operands)
    others = [n for n in operands if not (isinstance(n, ast.Constant) and isinstance(n.value, str))]
    if strings and any(_field_name(n) not in TEXT_FIELDS for n in others):
        raise _refuse(expr, node, f"quoted strings compare only with text fields ({', '.join(TEXT_FIELDS)})")


def _bool(expr: str, v: np.ndarray) -> np.ndarray:
    if np.asarray(v).dtype != bool:
        raise BadOptionError(f"--where {expr!r}: and/or/not need true/false operands (comparisons or bool fields); "
                             f"got {np.asarray(v).dtype} values")
    return np.asarray(v)
