"""What a store holds, as plain data: the numbers behind ``trajstore info``."""

from __future__ import annotations

import os
from typing import Any

import gymnasium


from .spaces import space_from_json
from .store import Store

__all__ = ["store_info", "space_tree"]


def space_tree(space: gymnasium.Space, indent: str = "") -> str:
    """A readable multi-line rendering of a (nested) space."""
    if not isinstance(space, (gymnasium.spaces.Dict, gymnasium.spaces.Tuple)):
        return f"{indent}{space}"
    items = space.spaces.items() if isinstance(space, gymnasium.spaces.Dict) else enumerate(space.spaces)
    lines = []
    for key, sub in items:
        if isinstance(sub, (gymnasium.spaces.Dict, gymnasium.spaces.Tuple)):
            lines += [f"{indent}{key}: {type(sub).__name__}", space_tree(sub, indent + "  ")]
        else:
            lines.append(f"{indent}{key}: {sub}")
    return "\n".join(lines)


def store_info(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summary of the store at ``path`` (opened read-only; nothing is written).

    Returns
    -------
    dict
        ``path, kind, format_version, created_by, created_at, tables`` (rows, capacity, offset
        per table), ``spaces`` (JSON), ``spaces_text`` (rendered), ``arrays`` (path, shape,
        dtype, chunk_rows, codec, stored_bytes), ``stored_bytes``, ``logical_bytes`` (committed
        rows x row size) and ``compression_ratio`` (logical / stored bytes of the arrays).
    """
    store = Store.open(path, None, read_only=True, multiprocessing=False, storage_options=storage_options, options={})
    try:
        sizes: dict[str, int] = {}
        for key, n in store.loc.iter_sizes(""):
            top = key.rsplit("/c/", 1)[0] if "/c/" in key else None
            if top is not None:
                sizes[top] = sizes.get(top, 0) + n
        arrays, logical = [], 0
        for name, table in store.tables.items():
            for f in table.fields:
                z = store.group[f.spec.array_path]
                codecs = [c.to_dict()["name"] for c in z.metadata.codecs if c.to_dict()["name"] != "bytes"]
                arrays.append({
                    "path": f.spec.array_path, "shape": [int(s) for s in z.shape], "dtype": str(f.spec.dtype),
                    "chunk_rows": f.spec.chunk_rows, "codec": "+".join(codecs) or "none",
                    "committed_rows": table.count, "stored_bytes": sizes.get(f.spec.array_path, 0),
                })
                logical += table.count * f.spec.row_bytes
        stored_total = sum(n for _k, n in store.loc.iter_sizes(""))
        stored_arrays = sum(a["stored_bytes"] for a in arrays)
        spaces = store.attrs.get("spaces", {})
        return {
            "path": store.loc.url,
            "kind": store.attrs.get("kind"),
            "format_version": store.attrs.get("format_version"),
            "created_by": store.attrs.get("created_by"),
            "created_at": store.attrs.get("created_at"),
            "generation": store.committed.generation,
            "tables": {n: {"rows": t.count, "capacity": t.capacity, "offset": t.offset} for n, t in store.tables.items()},
            "spaces": spaces,
            "spaces_text": {n: space_tree(space_from_json(s)) for n, s in spaces.items()},
            "arrays": arrays,
            "stored_bytes": stored_total,
            "logical_bytes": logical,
            "compression_ratio": float(logical / stored_arrays) if stored_arrays else float("nan"),
            "state": store.committed.state,
        }
    finally:
        store.close()


