"""Rows of many shards' memory-mapped fields gathered with one numpy call per field.

Each shard's raw field is one reserved address range with its chunk files mapped into it
(:class:`trajstore.storage.fields._vmap.VirtualArray`).  Gathering a batch shard by shard costs a
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
from collections.abc import Sequence
from typing import Any

import numpy as np

from trajstore.storage.fields import _vmap

__all__ = ["CrossShardField", "cross_shard_field"]


def _va(field: Any) -> Any:
    va = getattr(field, "_va", None)
    return va if isinstance(va, _vmap.VirtualArray) and va.base else None


def cross_shard_field(fields: Sequence[Any]) -> CrossShardField | None:
    """A :class:`CrossShardField` over one field of every shard (``fields``: one per shard, in
    shard order), or None when a shard's field is not memory-mapped (compressed, the portable
    engine) or the shards store it differently (dtype, row shape): the caller reads per shard."""
    vas = [_va(f) for f in fields]
    if not vas or any(v is None for v in vas):
        return None
    v0 = vas[0]
    if any(v.dtype != v0.dtype or v.row_shape != v0.row_shape for v in vas):
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
        # One element per byte position, each element a whole row: view[off] is the row at byte off.
        self._rows = np.ndarray((hi - lo - self.row_bytes + 1,), np.dtype((np.void, self.row_bytes)),
                                buffer=buf, strides=(1,))
        self.base = np.array(self._bases, np.int64) - lo
        self.chunk_rows = np.array([v.chunk_rows for v in vas], np.int64)
        self.stride = np.array([v.stride for v in vas], np.int64)
        self.extent = np.array([v.n_chunks * v.chunk_rows for v in vas], np.int64)  # rows each range holds
        c0, s0 = int(self.chunk_rows[0]), int(self.stride[0])
        self._uniform = (c0, s0) if ((self.chunk_rows == c0) & (self.stride == s0)).all() else None

    def current(self) -> bool:
        """Whether every shard's field still has the range this view was built on."""
        return all(f._va is v and v.base == b for f, v, b in zip(self.fields, self.vas, self._bases))

    def fits(self, k: np.ndarray, phys: np.ndarray) -> bool:
        """Whether physical rows ``phys`` of shards ``k`` all lie inside their shards' ranges."""
        return bool(((phys >= 0) & (phys < self.extent[k])).all())

    def take(self, k: np.ndarray, phys: np.ndarray) -> np.ndarray:
        """Copies of physical rows ``phys`` (any shape, int64) of shards ``k`` (same shape):
        ``(*phys.shape, *row_shape)`` of the field's dtype.  Call :meth:`fits` first."""
        if self._uniform is not None:
            c, s = self._uniform
            q, r = np.divmod(phys, c)
            off = self.base[k] + q * s + r * self.row_bytes
        else:
            q, r = np.divmod(phys, self.chunk_rows[k])
            off = self.base[k] + q * self.stride[k] + r * self.row_bytes
        out = self._rows[off]
        return out.view(self.dtype).reshape(*phys.shape, *self.row_shape)
