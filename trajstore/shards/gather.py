"""Rows of many shards' memory-mapped fields gathered with one numpy call per field.

Each shard's raw field is one reserved address range with its chunk files mapped into it
(:func:`trajstore.storage.fields.mapped.mapped_rows`).  Gathering a batch shard by shard costs a
few numpy calls per shard the batch touches, which at 64 shards is most of a batch's time.
:class:`CrossShardField` views the bytes from the lowest to the highest of those ranges as one
array and gathers every row of a batch by its byte offset (shard's range + chunk slot + row), so
a batch costs one fancy index per field whatever the number of shards.

Memory safety: every offset read lies inside its own shard's reserved range (rows are checked
against each range's extent before the gather, vectorized); addresses between ranges are never
read.  A range is unmapped only when its field re-reserves a larger one (``grow``) or closes;
:meth:`CrossShardField.current` (identity and base address of every range) is checked before
each gather, and a stale view is rebuilt.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from trajstore.storage.fields.mapped import mapped_rows

__all__ = ["CrossShardField", "cross_shard_field"]

_GET_VA, _GET_BASE = operator.attrgetter("_va"), operator.attrgetter("base")


def _va(field: Any) -> Any:
    return mapped_rows(field)


def cross_shard_field(fields: Sequence[Any]) -> CrossShardField | None:
    """A :class:`CrossShardField` over one field of every shard (``fields``: one per shard, in
    shard order), or None when a shard's field is not memory-mapped (compressed, the portable
    engine) or the shards store it differently (dtype, row shape): the caller reads per shard."""
    vas = [_va(f) for f in fields]
    if not vas or any(v is None for v in vas):
        return None
    v0 = vas[0]
    if v0.row_bytes == 0 or any(v.dtype != v0.dtype or v.row_shape != v0.row_shape for v in vas):
        return None
    return CrossShardField(list(fields), vas)


class CrossShardField:
    """One field of every shard as one byte range (see the module docstring).

    Parameters
    ----------
    fields : list
        Each shard's field (shard order).
    vas : list of VirtualArray
        Their reserved ranges, as they are now.
    """

    def __init__(self, fields: list[Any], vas: list[Any]) -> None:
        self.fields, self.vas = fields, vas
        v0 = vas[0]
        self.dtype, self.row_shape, self.row_bytes = v0.dtype, tuple(v0.row_shape), int(v0.row_bytes)
        self._bases = [int(v.base) for v in vas]
        lo = min(self._bases)
        hi = max(b + int(v.nbytes) for b, v in zip(self._bases, vas))
        buf = memoryview((ctypes.c_char * (hi - lo)).from_address(lo)).cast("B")
        self._buf, self._nbytes = buf, hi - lo
        self._windows: dict[int, np.ndarray] = {}  # window length -> view of overlapping windows
        # One element per byte position, each element a whole row: view[off] is the row at byte off.
        self._rows = np.ndarray((hi - lo - self.row_bytes + 1,), np.dtype((np.void, self.row_bytes)),
                                buffer=buf, strides=(1,))
        self.base = np.array(self._bases, np.int64) - lo
        self.chunk_rows = np.array([v.chunk_rows for v in vas], np.int64)
        self.stride = np.array([v.stride for v in vas], np.int64)
        self.extent = np.array([v.n_chunks * v.chunk_rows for v in vas], np.int64)  # rows each range holds
        c0, s0 = int(self.chunk_rows[0]), int(self.stride[0])
        self._uniform = (c0, s0) if ((self.chunk_rows == c0) & (self.stride == s0)).all() else None
        self.tiled = self.stride == self.chunk_rows * self.row_bytes  # chunks end to end: rows run on across chunks

    def current(self) -> bool:
        """Whether every shard's field still has the range this view was built on (a field gives
        its range up only for a new one, ``grow``, or when its buffer closes, which sets ``base`` 0)."""
        return list(map(_GET_VA, self.fields)) == self.vas and all(map(_GET_BASE, self.vas))

    def fits(self, k: np.ndarray, phys: np.ndarray) -> bool:
        """Whether physical rows ``phys`` of shards ``k`` all lie inside their shards' ranges."""
        return bool(((phys >= 0) & (phys < self.extent[k])).all())

    def _offsets(self, k: np.ndarray, phys: np.ndarray) -> np.ndarray:
        if self._uniform is not None:
            c, s = self._uniform
            q, r = np.divmod(phys, c)
            return self.base[k] + q * s + r * self.row_bytes
        q, r = np.divmod(phys, self.chunk_rows[k])
        return self.base[k] + q * self.stride[k] + r * self.row_bytes

    def contiguous(self, k: np.ndarray, phys: np.ndarray, length: int) -> np.ndarray:
        """(B,) bool: whether physical rows ``phys[b] .. phys[b] + length - 1`` of shard ``k[b]``
        lie one after another in its range (inside it, and inside one chunk unless chunks are tiled)."""
        c = self.chunk_rows[k]
        return (phys >= 0) & (phys + length <= self.extent[k]) & (self.tiled[k] | (phys % c + length <= c))

    def take_windows(self, k: np.ndarray, phys: np.ndarray, length: int) -> np.ndarray:
        """Copies of ``length`` consecutive rows from each of ``phys`` (B,) of shards ``k`` (B,):
        (B, length, *row_shape), one ``memcpy`` per window.  Every window must be :meth:`contiguous`."""
        size = length * self.row_bytes
        view = self._windows.get(length)
        if view is None:  # windows overlap: element i is the window starting at byte i
            view = self._windows[length] = np.ndarray((self._nbytes - size + 1,), np.dtype((np.void, size)),
                                                      buffer=self._buf, strides=(1,))
        out = view[self._offsets(k, phys)]
        return out.view(self.dtype).reshape(len(phys), length, *self.row_shape)

    def take(self, k: np.ndarray, phys: np.ndarray) -> np.ndarray:
        """Copies of physical rows ``phys`` (any shape, int64) of shards ``k`` (same shape):
        ``(*phys.shape, *row_shape)`` of the field's dtype.  Call :meth:`fits` first."""
        out = self._rows[self._offsets(k, phys)]
        return out.view(self.dtype).reshape(*phys.shape, *self.row_shape)
