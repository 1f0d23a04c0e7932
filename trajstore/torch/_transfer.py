"""How a batch made in a DataLoader worker process reaches the main process: as one buffer.

torch pickles every tensor of a batch on its own: each is copied into a new shared-memory
segment whose file descriptor is then handed over through a socket handshake with the worker
(about 0.3-1 ms per tensor on a busy 2-core machine), which made a batch of three small fields
cost more to move than to read.  A worker batch (:class:`WorkerBatch`) instead lays all of its
arrays out in one flat buffer, written once by the worker, and pickles as that buffer plus a
small description of the fields:

- below :data:`SHM_MIN_BYTES` the buffer travels inside the pickle through the worker's pipe
  (one bytes object; no descriptor handshake, which costs more than copying a few hundred KiB);
- from :data:`SHM_MIN_BYTES` on it is one shared-memory tensor (one descriptor per batch, no
  copy of the data on either side).

Either way the main process rebuilds the same nesting of tensors as views into that buffer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["SHM_MIN_BYTES", "WorkerBatch", "in_worker", "pack"]

SHM_MIN_BYTES = 1 << 20  # batches at least this large cross in shared memory, smaller ones in the pipe
_ALIGN = 64


def in_worker() -> bool:
    """True in a DataLoader worker process."""
    return torch.utils.data.get_worker_info() is not None


class _Leaf:
    __slots__ = ("dtype", "offset", "shape")

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.offset, self.dtype, self.shape = offset, dtype, shape

    def __reduce__(self) -> Any:
        return (_Leaf, (self.offset, self.dtype, self.shape))


def _layout(value: Any, leaves: list[np.ndarray], pos: list[int]) -> Any:
    """The tree of ``value`` with each array replaced by its :class:`_Leaf` (appended to ``leaves``)."""
    if isinstance(value, Mapping):
        return {k: _layout(v, leaves, pos) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_layout(v, leaves, pos) for v in value)
    a = np.asarray(value)
    leaf = _Leaf(pos[0], torch.from_numpy(np.empty(0, a.dtype)).dtype, tuple(a.shape))
    leaves.append(a)
    pos[0] += -(-a.nbytes // _ALIGN) * _ALIGN
    return leaf


def _views(flat: torch.Tensor, tree: Any) -> Any:
    if isinstance(tree, _Leaf):
        itemsize = torch.empty(0, dtype=tree.dtype).element_size()
        n = int(np.prod(tree.shape, dtype=np.int64))
        return flat[tree.offset: tree.offset + n * itemsize].view(tree.dtype).view(tree.shape)
    if isinstance(tree, dict):
        return {k: _views(flat, v) for k, v in tree.items()}
    return tuple(_views(flat, v) for v in tree)


def _unpack(payload: Any, tree: Any) -> dict[str, Any]:
    """In the receiving process: the batch as tensors viewing the one buffer that crossed."""
    if isinstance(payload, torch.Tensor):
        flat = payload
    elif len(payload):
        flat = torch.frombuffer(payload, dtype=torch.uint8)  # a bytearray: writable, kept alive by the views
    else:
        flat = torch.empty(0, dtype=torch.uint8)
    return _views(flat, tree)


class WorkerBatch(dict):
    """``{field: tensor}`` made in a worker: every tensor is a view into one flat buffer, and the
    batch pickles as that buffer (see the module docstring).  The main process receives a plain
    ``dict`` of tensors."""

    _flat: torch.Tensor
    _tree: Any
    _shared: bool

    def __reduce__(self) -> Any:
        if self._shared:
            payload: Any = self._flat
        else:
            payload = bytearray(self._flat.numpy().data)
        return (_unpack, (payload, self._tree))


def pack(arrays: Mapping[str, Any]) -> WorkerBatch:
    """One :class:`WorkerBatch` holding (copies of) the numpy arrays of ``arrays`` (nested dicts / tuples)."""
    leaves: list[np.ndarray] = []
    pos = [0]
    tree = _layout(arrays, leaves, pos)
    total = pos[0]
    shared = total >= SHM_MIN_BYTES
    if shared:
        flat = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(total))
    else:
        flat = torch.empty(total, dtype=torch.uint8)
    buf = flat.numpy()
    for leaf, a in zip(_iter_leaves(tree), leaves):
        buf[leaf.offset: leaf.offset + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    out = WorkerBatch(_views(flat, tree))
    out._flat, out._tree, out._shared = flat, tree, shared
    return out


def _iter_leaves(tree: Any) -> Any:
    if isinstance(tree, _Leaf):
        yield tree
    else:
        for v in (tree.values() if isinstance(tree, dict) else tree):
            yield from _iter_leaves(v)
