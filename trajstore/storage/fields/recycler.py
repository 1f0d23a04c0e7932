"""Recycled return batches: the memory of large arrays a read returned earlier, reused once
nothing references them any more.

Why: every ``sample`` (``rb[idx]``, a view's read, ``get_sequences``) returns new arrays, and a
batch of large rows (image frames) costs more to allocate than its size suggests.  numpy takes
an array of a few MB or more from a fresh ``mmap`` (or from a heap that glibc grows for it and
trims again on free), and the kernel faults in and zeroes every page on first touch; with
transparent huge pages on ``madvise`` numpy asks for huge pages, and the kernel may stall
compacting memory to provide them.  For frames that a fast codec decodes (gymnasium renders
as JPEG) that was a large share of ``sample``'s time, against a decode loop that fills one
array again and again.  Filling memory used before costs none of it.

How: :func:`take` hands out 1-D ``uint8`` arrays (each owning its memory) of at least
:data:`MIN_BYTES`, keeping a reference to each (at most :data:`MAX_ARRAYS`, at most
:func:`byte_cap` bytes in all; oldest dropped first, those still in use last).  An array is
handed out again only when the recycler's own reference is its last one, as CPython's
reference count tells (``sys.getrefcount``): the batch a caller holds, any view of it (whose
``.base`` is the recycled array), a ``torch.from_numpy`` tensor or a ``memoryview`` of it all
hold a reference, so memory in use is never handed out twice.  A new array is uninitialised
memory anyway: reuse changes nothing a caller can rely on.  A training loop ``batch =
rb.sample(256)`` still holds batch ``n`` while call ``n + 1`` runs, so it cycles through two
arrays per field.

Only on CPython with the GIL (reference counts are what tells an array is free); after
``fork`` the child starts with an empty recycler.  :func:`set_batch_recycling` turns it off (and
releases what it holds), :func:`release_recycled_batches` releases what it holds; both are
public in ``trajstore.images``.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from typing import Any

import numpy as np

from trajstore.errors import BadOptionError

__all__ = ["MAX_ARRAYS", "MIN_BYTES", "available", "batch_recycling", "byte_cap", "held", "recycled",
           "release_recycled_batches", "set_batch_recycling", "take"]

#: Arrays of fewer bytes are left to numpy: below about 1 MiB a fresh array costs little more
#: than a reused one (glibc serves it from its heap), and a small batch is not worth a lock.
MIN_BYTES = 1 << 20

#: At most this many arrays held (two per field of a typical loop's batch, for a few fields).
MAX_ARRAYS = 8


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # (no sysconf, e.g. Windows)
        return None


def byte_cap() -> int:
    """The most bytes the recycler holds: 1 GiB, or an eighth of physical memory where that is
    less (two batches of 256 frames of 480x640x3 are 472 MB; what it holds is memory such a loop
    needed anyway while it held one batch and read the next)."""
    ram = _physical_memory()
    return 1 << 30 if ram is None else min(1 << 30, ram // 8)


def _gil() -> bool:
    enabled = getattr(sys, "_is_gil_enabled", None)  # (3.13+: False in a free-threaded interpreter)
    return True if enabled is None else bool(enabled())


def available() -> bool:
    """Whether this interpreter can recycle: CPython with the GIL."""
    return sys.implementation.name == "cpython" and _gil()


def _count(arrays: list[np.ndarray], i: int) -> int:
    return sys.getrefcount(arrays[i])


#: The reference count of an array referenced by nothing but the recycler's list, as
#: :func:`_count` reads it (measured, not assumed: the interpreter's own references may differ).
_FREE = _count([np.empty(1, np.uint8)], 0)


class _Recycler:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrays: list[np.ndarray] = []  # least recently handed out first
        self.nbytes = 0

    def take(self, nbytes: int) -> np.ndarray | None:
        if nbytes > _cap:
            return None
        with self.lock:
            arrays = self.arrays
            for i in range(len(arrays)):
                if arrays[i].nbytes == nbytes and _count(arrays, i) <= _FREE:
                    got = arrays.pop(i)  # (referenced here now: no other caller can take it)
                    arrays.append(got)
                    return got
            got = np.empty(nbytes, np.uint8)
            arrays.append(got)
            self.nbytes += nbytes
            self.trim(1)
            return got

    def trim(self, keep: int) -> None:
        """Drop arrays (free ones first, oldest first; never the newest ``keep``) until within the
        bounds."""
        arrays = self.arrays
        while len(arrays) > keep and (len(arrays) > MAX_ARRAYS or self.nbytes > _cap):
            free = [i for i in range(len(arrays) - keep) if _count(arrays, i) <= _FREE]
            self.nbytes -= arrays.pop(free[0] if free else 0).nbytes

    def release(self) -> int:
        with self.lock:
            n, self.nbytes = self.nbytes, 0
            self.arrays.clear()
            return n


_cap = byte_cap()
_recycler = _Recycler()
_on = available()


def _after_fork() -> None:
    global _recycler
    _recycler = _Recycler()  # (a fresh lock too: another thread may have held the parent's)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def take(nbytes: int) -> np.ndarray | None:
    """A 1-D ``uint8`` array of ``nbytes`` (uninitialised: fresh, or recycled), or None where the
    recycler does not serve it (off, fewer than :data:`MIN_BYTES`, more than :func:`byte_cap`)."""
    if not _on or nbytes < MIN_BYTES:
        return None
    return _recycler.take(nbytes)


def recycled(shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
    """An uninitialised C-contiguous array of ``shape`` / ``dtype`` on recycled memory (a view of
    an array of :func:`take`), or None where the recycler does not serve it (see :func:`take`;
    dtypes holding Python objects or of subarrays never)."""
    if not _on:
        return None
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < MIN_BYTES or dt.hasobject or dt.subdtype is not None:  # (np.empty expands a subarray dtype's shape)
        return None
    got = _recycler.take(nbytes)
    return None if got is None else got.view(dt).reshape(shape)


def batch_recycling() -> bool:
    """Whether large returned batches are recycled (the default where :func:`available`)."""
    return _on


def set_batch_recycling(on: bool, max_bytes: int | None = None) -> None:
    """Turn recycling of large returned batches on or off (off releases what is held).

    ``max_bytes``: the most bytes held (None: :func:`byte_cap`); arrays beyond it are released,
    and a batch larger than it is never recycled.  Where recycling is not :func:`available`,
    turning it on does nothing.

    Raises
    ------
    BadOptionError
        ``on`` is not a bool, or ``max_bytes`` not an int >= 0.
    """
    global _on, _cap
    if not isinstance(on, bool):
        raise BadOptionError(f"set_batch_recycling takes True or False; got {on!r}")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise BadOptionError(f"set_batch_recycling: max_bytes must be an int >= 0 or None; got {max_bytes!r}")
    _on = on and available()
    _cap = byte_cap() if max_bytes is None else max_bytes
    if not _on:
        release_recycled_batches()
    with _recycler.lock:
        _recycler.trim(0)


def release_recycled_batches() -> int:
    """Release every array held (those still in use stay alive with their users): the bytes
    the recycler held."""
    return _recycler.release()


def held() -> tuple[int, int]:
    """(arrays, bytes) the recycler holds, in use or free."""
    with _recycler.lock:
        return len(_recycler.arrays), _recycler.nbytes
