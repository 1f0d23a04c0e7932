"""Argument checks of :class:`~trajstore.sampling.prioritized.PrioritizedSampler`: every value a
caller hands it is checked here, before the sampler changes anything, and refused with a specific
error from :mod:`trajstore.errors` that says what was expected and what arrived.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trajstore._optional import to_numpy
from trajstore.errors import BadIndexError, BadOptionError, BadValueError, IndexOutOfRangeError

__all__ = ["F32_MAX", "positive_float", "indices", "priorities"]

#: Largest priority (they are stored as float32).
F32_MAX = float(np.finfo(np.float32).max)


def positive_float(name: str, value: Any, *, allow_zero: bool = True) -> float:
    """``value`` as a finite float >= 0 (> 0 without ``allow_zero``): a sampler option ``name``.

    Raises
    ------
    BadOptionError
        Not a real number (bools refused), not finite, negative, or 0 where refused.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise BadOptionError(f"PrioritizedSampler: {name} must be a float; got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise BadOptionError(f"PrioritizedSampler: {name} must be a finite float {'>= 0' if allow_zero else '> 0'}; "
                             f"got {value!r}")
    return v


def indices(values: Any, count: int, what: str) -> np.ndarray:
    """Logical rows ``values`` (numpy, list or torch) as a (B,) int64 array, each in ``[0, count)``.

    Raises
    ------
    BadIndexError
        Not integers, or not 1-D.
    IndexOutOfRangeError
        An index outside ``[0, count)`` (the message names the first one and its position).
    """
    idx = to_numpy(values)
    if idx.dtype == bool or not np.issubdtype(idx.dtype, np.integer):
        raise BadIndexError(f"{what}: indices must be integers (the indices sample() returned); got dtype "
                            f"{idx.dtype}")
    if idx.ndim > 1:
        raise BadIndexError(f"{what}: indices must be a 1-D array; got shape {idx.shape}")
    idx = idx.astype(np.int64, copy=False).reshape(-1)
    bad = (idx < 0) | (idx >= count)
    if bad.any():
        j = int(np.argmax(bad))
        raise IndexOutOfRangeError(f"{what}: index {int(idx[j])} (position {j}) is out of range: expected logical "
                                   f"rows 0..{count - 1} ({count} rows)")
    return idx


def priorities(values: Any, n: int) -> np.ndarray:
    """``values`` (one per index, or one for all ``n``) as (n,) float64 priorities.

    Raises
    ------
    BadValueError
        Not numbers; neither ``n`` values nor one; a value that is negative, NaN, infinite or
        beyond float32's range (priorities are stored as float32).
    """
    p = to_numpy(values)
    if not (np.issubdtype(p.dtype, np.floating) or np.issubdtype(p.dtype, np.integer)) or p.dtype == bool:
        raise BadValueError(f"update_priorities: priorities must be numbers; got dtype {p.dtype}")
    shape = p.shape
    p = p.astype(np.float64).reshape(-1) if p.ndim <= 1 else p
    if p.ndim != 1 or (p.size != n and p.size != 1):
        raise BadValueError(f"update_priorities: expected {n} priorities (one per index) or one for all; "
                            f"got shape {shape}")
    bad = ~np.isfinite(p) | (p < 0) | (p > F32_MAX)
    if bad.any():
        j = int(np.argmax(bad))
        raise BadValueError(f"update_priorities: priorities must be finite, >= 0 and at most {F32_MAX:.4g} "
                            f"(they are stored as float32); got {float(p[j])!r} at position {j}")
    return np.full(n, p[0]) if p.size == 1 else p
