"""Ring indexing: user indices to logical rows, logical rows to physical rows.

A table's rows are identified by absolute numbers ``start <= a < end`` that only grow
(until ``clear``); row ``a`` lives at physical row ``a % capacity`` of every array
(``a`` itself for an unbounded table, whose ``start`` is always 0).  The logical row
``i`` a user sees is ``start + i``, so ``offset == start % capacity`` as in UniEnv.
"""

from __future__ import annotations

import numbers
from typing import Any, overload

import numpy as np

from trajstore._optional import to_numpy
from trajstore.errors import BadIndexError, IndexOutOfRangeError

__all__ = ["normalize_index", "physical", "contiguous_runs", "distinct", "IndexLike"]

IndexLike = Any  # int | slice | Ellipsis | sequence/array/tensor of ints or bools


def normalize_index(idx: IndexLike, length: int) -> int | np.ndarray:
    """Resolve ``idx`` against ``length`` rows.

    Returns
    -------
    int or numpy.ndarray
        A non-negative ``int`` for a single row (an unbatched read), otherwise an int64
        array of shape (B,) of logical rows (a batched read).

    Raises
    ------
    IndexOutOfRangeError
        (an ``IndexError``) An int out of ``[-length, length)``, an array element out of range, or a bool mask
        whose length is not ``length``.
    BadIndexError
        (a ``TypeError``) Anything that is not an int, slice, ``...``, int array or bool mask.
    """
    if isinstance(idx, numbers.Integral) and not isinstance(idx, bool):
        i = int(idx)
        if not -length <= i < length:
            raise IndexOutOfRangeError(f"index {i} is out of range for a buffer of length {length}")
        return i + length if i < 0 else i
    if isinstance(idx, slice):
        return np.arange(*idx.indices(length), dtype=np.int64)
    if idx is Ellipsis:
        return np.arange(length, dtype=np.int64)
    if isinstance(idx, (str, bytes, float, bool)) or idx is None:
        raise BadIndexError(f"buffer indices must be int, slice, ..., int array or bool mask; got {type(idx).__name__}")
    arr = to_numpy(idx)
    if arr.ndim == 0 and arr.dtype.kind in "iu":
        return normalize_index(int(arr), length)
    if arr.dtype == bool:
        if arr.shape != (length,):
            raise IndexOutOfRangeError(f"boolean mask has shape {arr.shape}; expected ({length},) to match the buffer length")
        return np.flatnonzero(arr).astype(np.int64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BadIndexError(f"index arrays must be 1-D integers or booleans; got shape {arr.shape} dtype {arr.dtype}")
    out = arr.astype(np.int64, copy=True)
    lo, hi = out.min(), out.max()  # two reductions; the common all-non-negative case needs no more
    if lo < 0:
        out[out < 0] += length
        lo, hi = out.min(), out.max()
    if lo < 0 or hi >= length:
        bad = arr[(out < 0) | (out >= length)][0]
        raise IndexOutOfRangeError(f"index {int(bad)} is out of range for a buffer of length {length}")
    return out


@overload
def physical(logical: int, start: int, capacity: int | None) -> int: ...
@overload
def physical(logical: np.ndarray, start: int, capacity: int | None) -> np.ndarray: ...
def physical(logical: np.ndarray | int, start: int, capacity: int | None) -> np.ndarray | int:
    """Physical rows of logical rows ``logical`` of a table whose first row is ``start``."""
    if capacity is None:
        return logical + start
    return (logical + start) % capacity


def contiguous_runs(abs_lo: int, abs_hi: int, capacity: int | None) -> list[tuple[int, int, int]]:
    """Split absolute rows ``[abs_lo, abs_hi)`` into physically contiguous pieces.

    Returns ``(physical_start, data_offset, n)`` triples: at most two for a ring (the
    second after the wrap point), one for an unbounded table.
    """
    n = abs_hi - abs_lo
    if n <= 0:
        return []
    if capacity is None:
        return [(abs_lo, 0, n)]
    p = abs_lo % capacity
    first = min(n, capacity - p)
    runs = [(p, 0, first)]
    if first < n:
        runs.append((0, first, n - first))
    return runs


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of an integer array, sorted: ``np.unique(values)`` (1-D).

    For read paths: a process's first plain ``np.unique`` imports ``numpy.ma`` (40-60 ms), which
    landed in the first batch a DataLoader worker or a fresh reader served.
    """
    a = np.sort(np.asarray(values).reshape(-1))
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a
