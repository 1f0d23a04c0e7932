"""Helpers shared by the command modules: arguments, output, progress bars, errors."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Sequence

import numpy as np

from trajstore.core.progress import progress_bar

__all__ = ["CLIError", "json_arg", "add_store_args", "print_json", "sanitize_json", "error_text", "fmt_bytes", "fmt_num",
           "print_table", "progress"]


class CLIError(Exception):
    """A problem to report as one line; ``code`` is the exit status (1: problem, 2: usage)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def json_arg(text: str) -> dict[str, Any]:
    """argparse type of ``--storage-options`` and friends: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"anon\": true}}'; got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of counts such as ``--limit``: an int >= 1 (else ``ArgumentTypeError``)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {n}")
    return n


def non_negative_int(text: str) -> int:
    """argparse type of options where 0 is allowed: an int >= 0 (else ``ArgumentTypeError``)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {n}")
    return n


def add_store_args(p: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    """Add the arguments every store command takes: ``PATH``, ``--storage-options`` and (with
    ``json_flag``) ``--json``."""
    p.add_argument("path", metavar="PATH", help="store: a folder, a .zip file or an fsspec URL (memory://, s3://...)")
    p.add_argument("--storage-options", type=json_arg, default=None, metavar="JSON",
                   help="fsspec options for a URL, as a JSON object (e.g. '{\"anon\": true}')")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")


def _default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return _finite(o.item())
    if isinstance(o, np.ndarray):
        return [_default(x) if isinstance(x, np.generic) else x for x in o.tolist()]
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


def sanitize_json(o: Any) -> Any:
    """``o`` as strict JSON values: NaN becomes null and infinities strings, numpy scalars and
    arrays numbers and lists."""
    if isinstance(o, float):
        return _finite(o)
    if isinstance(o, dict):
        return {k: sanitize_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [sanitize_json(v) for v in o]
    if isinstance(o, np.ndarray):
        return sanitize_json(o.tolist())
    if isinstance(o, np.generic):
        return _finite(o.item())
    return o


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented strict JSON: numpy scalars and arrays as numbers and lists, NaN
    as null, infinities as strings."""
    print(json.dumps(sanitize_json(obj), indent=2, default=_default, allow_nan=False))


def error_text(e: BaseException) -> str:
    """An error as the CLI prints it: one line (a KeyError's message without its quotes; the
    type's name when it has no message)."""
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(msg.split()) or type(e).__name__


def fmt_bytes(n: float | None) -> str:
    """A byte count for people, in binary units (``"512 B"``, ``"1.5 MiB"``); ``"-"`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def fmt_num(v: Any) -> str:
    """A table cell: ``"-"`` for None, ``"yes"``/``"no"`` for bools, ints as they are, floats with
    at most 4 decimals (4 significant digits when very large or small)."""
    if v is None:
        return "-"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.4g}"
        return f"{v:.4f}".rstrip("0").rstrip(".") if v != int(v) else f"{v:.1f}"
    return str(v)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[str] = (), indent: str = "") -> None:
    """A plain aligned text table (numbers right-aligned when named in ``right``)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        out = [v.rjust(w) if h in right else v.ljust(w) for v, w, h in zip(vals, widths, headers)]
        return (indent + "  ".join(out)).rstrip()

    print(line(list(headers)))
    for r in cells:
        print(line(r))


def print_spaces(spaces_text: dict[str, str]) -> None:
    """The ``spaces`` block of ``info``: each table's space as an indented tree."""
    print("spaces")
    for name, tree in spaces_text.items():
        print(f"  {name}:")
        for line in tree.splitlines():
            print(f"    {line}")


def progress(total: int, desc: str, unit: str = "it") -> Any:
    """The CLI's bar: :func:`~trajstore.core.progress.progress_bar` on a terminal with tqdm
    installed (cleared when done), silent otherwise."""
    return progress_bar(total, desc, None, unit, leave=False)
