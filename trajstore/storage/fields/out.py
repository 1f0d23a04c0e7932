"""Where the arrays a read returns are allocated: recycled memory, ``np.empty``, or memory a caller provides.

A DataLoader worker of ``trajstore.torch`` hands every batch to the main process in one
shared-memory buffer.  When the fields decode (or gather) the batch's rows straight into that
buffer, the batch is not copied there afterwards (for image rows that copy cost about as much as
decoding lz4 frames).  Two context managers, both for the calls in their block (this thread and
context only):

- :func:`rows_into` offers an allocator (``(shape, dtype) -> array or None``);
- :func:`returned_rows` marks the reads whose arrays are returned to the caller as they are
  (a dataset's batch): only there do the fields' ``gather`` (:func:`new_rows`) take memory from
  the offered allocator.  Everything else (what a read keeps: indexes, caches) keeps ``np.empty``,
  so nothing long-lived ever lands in memory the caller reuses.

An allocator may return None (no room left): ``np.empty`` then.

Without an allocator, arrays of at least ``recycler.MIN_BYTES`` come from
:mod:`trajstore.storage.fields.recycler`: the memory of a batch returned earlier that nothing
references any more (a fresh large array costs page faults and the kernel zeroing its pages on
every call; see there), else ``np.empty``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from trajstore.storage.fields import recycler

__all__ = ["Allocator", "allocating", "new_rows", "returned_rows", "rows_into", "temporary_rows"]

#: ``(shape, dtype) -> array`` of that shape and dtype (C-contiguous, uninitialised), or None.
Allocator = Callable[[tuple[int, ...], "np.dtype[Any]"], "np.ndarray | None"]

_offered: contextvars.ContextVar[Allocator | None] = contextvars.ContextVar("trajstore_rows_offered", default=None)
_active: contextvars.ContextVar[Allocator | None] = contextvars.ContextVar("trajstore_rows_active", default=None)


def allocating(nbytes: int = 0) -> bool:
    """Whether :func:`new_rows` allocates rows of ``nbytes`` in all otherwise than numpy would: from
    an allocator here, or from the recycler (reads that would otherwise let numpy allocate may
    then take the route through :func:`new_rows`)."""
    return _active.get() is not None or (nbytes >= recycler.MIN_BYTES and recycler.batch_recycling())


def new_rows(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` / ``dtype`` for rows a read returns: from
    the allocator offered by :func:`rows_into` inside :func:`returned_rows`, else (at least
    ``recycler.MIN_BYTES``) on recycled memory, else ``np.empty``."""
    alloc = _active.get()
    if alloc is not None:
        got = alloc(tuple(int(n) for n in shape), np.dtype(dtype))
        if got is not None:
            return got
    got = recycler.recycled(shape, dtype)
    return np.empty(shape, dtype) if got is None else got


@contextlib.contextmanager
def _set(var: contextvars.ContextVar[Allocator | None], value: Allocator | None) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def rows_into(alloc: Allocator | None) -> contextlib.AbstractContextManager[None]:
    """Offer ``alloc`` to the reads of the block that :func:`returned_rows` marks."""
    return _set(_offered, alloc)


def temporary_rows() -> contextlib.AbstractContextManager[None]:
    """Within the block, :func:`new_rows` is ``np.empty`` (a field's temporaries inside a read)."""
    return _set(_active, None)


def returned_rows() -> contextlib.AbstractContextManager[None]:
    """Within the block, the fields' ``gather`` allocates the arrays it returns with the allocator
    :func:`rows_into` offered (if any): use it around a read whose arrays the caller returns as they are."""
    return _set(_active, _offered.get())
