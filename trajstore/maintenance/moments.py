"""The numbers behind ``trajstore stats``: per array, the count, min, max, mean and std of the
finite values and the NaN/inf counts over every committed row, in one streaming pass.

Rows are read a bounded block at a time (:func:`trajstore.maintenance.summary.iter_blocks`), so
memory stays bounded by a block whatever the store's size.  Per-episode statistics with quantiles,
kept in the store, are :mod:`trajstore.sampling.field_stats`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from trajstore.core.store import Store
from trajstore.core.table import Table
from trajstore.maintenance.summary import iter_blocks, select_fields

__all__ = ["field_stats", "merge_stats"]


def _chan(na: int, ma: float, m2a: float, nb: int, mb: float, m2b: float) -> tuple[int, float, float]:
    """Count, mean and sum of squared deviations (M2) of two disjoint sets of values, from each
    one's (Chan, Golub and LeVeque's pairwise update: no pass over the values again)."""
    n = na + nb
    d = mb - ma
    return n, ma + d * nb / n, m2a + m2b + d * d * na * nb / n


class _Moments:
    """Streaming count/mean/M2 (Chan et al.) plus min/max and NaN/inf counts of finite values."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0
        self.min: float | None = None
        self.max: float | None = None
        self.nan = self.inf = 0

    def add(self, a: np.ndarray) -> None:
        x = a.reshape(-1)
        if x.dtype.kind == "f":
            nan = np.isnan(x)
            inf = np.isinf(x)
            bad_nan, bad_inf = int(nan.sum()), int(inf.sum())
            self.nan += bad_nan
            self.inf += bad_inf
            if bad_nan or bad_inf:
                x = x[~(nan | inf)]
        if x.size == 0:
            return
        x64 = x.astype(np.float64)
        mn, mx = x.min().item(), x.max().item()
        self.min = mn if self.min is None else min(self.min, mn)
        self.max = mx if self.max is None else max(self.max, mx)
        nb, mb = x64.size, float(x64.mean())
        m2b = float(((x64 - mb) ** 2).sum())
        self.n, self.mean, self.m2 = _chan(self.n, self.mean, self.m2, nb, mb, m2b)

    def result(self) -> dict[str, Any]:
        return {"count": self.n, "min": self.min, "max": self.max,
                "mean": self.mean if self.n else None, "std": math.sqrt(self.m2 / self.n) if self.n else None,
                "nan": self.nan, "inf": self.inf}


def field_stats(store: Store, field: str | None = None, *, progress: Callable[[int], None] | None = None,
                all_tables: bool = True) -> list[dict[str, Any]]:
    """Per array: ``path, table, rows, dtype, count`` (finite values), ``min, max, mean, std`` of
    the finite values and ``nan``/``inf`` counts over every committed row, read a bounded block of
    rows at a time.  ``progress(rows)`` is called after each block."""
    if field is None and all_tables:
        sel = [(t, j) for t in store.tables.values() for j in range(len(t.fields))]
    else:
        sel = select_fields(store, field)
    by_table: dict[str, list[int]] = {}
    tables: dict[str, Table] = {}
    for t, j in sel:
        by_table.setdefault(t.name, []).append(j)
        tables[t.name] = t
    out = []
    for name, which in by_table.items():
        t = tables[name]
        acc = {j: _Moments() for j in which}
        for _lo, arrays in iter_blocks(t, which):
            for j, a in zip(which, arrays):
                acc[j].add(a)
            if progress is not None:
                progress(len(arrays[0]))
        for j in which:
            f = t.fields[j]
            out.append({"path": f.spec.array_path, "table": name, "rows": t.count, "shape": list(f.spec.row_shape),
                        "dtype": str(f.spec.dtype), **acc[j].result()})
    return out


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two :func:`field_stats` entries of one array over disjoint rows (e.g. two shards), as one:
    count, mean and std merged pairwise, min/max, rows and NaN/inf counts combined."""
    out = dict(a, rows=a["rows"] + b["rows"], nan=a["nan"] + b["nan"], inf=a["inf"] + b["inf"])
    na, nb = a["count"], b["count"]
    if not nb:
        return out
    if not na:
        return dict(out, count=nb, min=b["min"], max=b["max"], mean=b["mean"], std=b["std"])
    n, mean, m2 = _chan(na, a["mean"], a["std"] ** 2 * na, nb, b["mean"], b["std"] ** 2 * nb)
    return dict(out, count=n, min=min(a["min"], b["min"]), max=max(a["max"], b["max"]), mean=mean,
                std=math.sqrt(m2 / n))
