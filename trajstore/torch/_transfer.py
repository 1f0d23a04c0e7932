"""How a batch made in a DataLoader worker process reaches the main process: as one buffer.

torch pickles every tensor of a batch on its own: each is copied into a new shared-memory
segment (zero-filled first) whose file descriptor is then handed over through a socket handshake
with the worker (1.5-2 ms per tensor measured on the loaded 2-core machine), which made a batch of three
small fields cost more to move than to read.  A worker batch (:class:`WorkerBatch`) instead lays
all of its arrays out in one flat buffer, written once by the worker, and pickles as that buffer
plus a small description of the fields:

- a batch is written into a segment of the worker's pool of shared-memory files (``memfd``),
  which are reused: the main process maps each segment once (the only descriptor handshake, per
  segment, not per batch), so only a description of the batch (segment, offsets, dtypes, shapes)
  crosses the pipe;
- the main process copies a batch of at most :data:`COPY_OUT_BYTES` out of its segment when it
  unpickles it and marks the segment free again in its header at once (a copy of 24 KiB costs a few
  microseconds; moving the same bytes through the pipe cost more, see docs/offline.md); a larger
  batch is viewed in place and its segment marked free when the last tensor viewing it is freed;
- a batch that finds no free segment (a prefetch deeper than the pool, or a training loop that holds
  many large batches) crosses inside the pickle through the pipe up to :data:`PIPE_MAX_BYTES`, in a
  fresh torch shared-memory tensor above.  Whatever the prefetch, a segment is only reused once the
  main process has marked it free.

Segments are anonymous files: nothing is ever left in ``/dev/shm``; a worker's segments go with the
worker, and the main process unmaps those of exited (or killed) workers when it maps the next segment.

Either way the main process rebuilds the same nesting of tensors as views into that buffer.

A dataset's batches (:func:`pack_read`) are not even copied into their segment: from a dataset's
second batch on (the first one tells its size) the worker takes a segment before reading, and the
fields decode or gather the batch's rows straight into it (``trajstore.storage.fields.out``); only
what was made elsewhere (episode ids, masks, normalized values) is copied in after them.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from collections.abc import Callable, Mapping
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

from trajstore.storage.fields.image import share_decode_threads
from trajstore.storage.fields.out import rows_into

__all__ = ["PIPE_MAX_BYTES", "WorkerBatch", "in_worker", "pack", "pack_read"]

PIPE_MAX_BYTES = 1 << 16  # smaller batches cross in the pipe when no segment is free, larger ones in shared memory
COPY_OUT_BYTES = 1 << 16  # the main process copies batches up to this size out of their segment
POOL_MIN_BYTES = 1  # batches of at least this size are written into a segment of the worker's pool
POOL_SEGMENTS = 8  # shared-memory segments per worker process, at most ...
POOL_BYTES = 512 << 20  # ... and at most this many bytes of them (but always room for 2 segments)
_ALIGN = 64
_HEADER = 64  # segment header: byte 0 = in use (set by the worker, cleared by the main process), byte 1 = mapped


_shared_in = 0  # the worker process whose decode threads were set to its share


def in_worker() -> bool:
    """True in a DataLoader worker process.  The first call in a worker gives it its share of the
    CPUs for decoding frames (:func:`trajstore.images.share_decode_threads` with ``num_workers``):
    ``num_workers`` processes each decoding on every CPU would oversubscribe them."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return False
    global _shared_in
    if _shared_in != os.getpid():
        _shared_in = os.getpid()
        share_decode_threads(max(1, int(info.num_workers)))
    return True


# A leaf of a batch's layout: [offset, end, dtype string, shape] (a list: the layout's trees only
# hold dicts and tuples otherwise, and a list of builtins pickles without any Python-level reduce).
_Leaf = list[Any]


def _layout(value: Any, leaves: list[tuple[_Leaf, np.ndarray]], pos: list[int]) -> Any:
    """The tree of ``value`` with each array replaced by its leaf (appended to ``leaves`` with the array)."""
    if isinstance(value, Mapping):
        return {k: _layout(v, leaves, pos) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_layout(v, leaves, pos) for v in value)
    a = np.asarray(value)
    leaf = [pos[0], pos[0] + a.nbytes, a.dtype.str, a.shape]  # a dtype string pickles much faster
    leaves.append((leaf, a))
    pos[0] += -(-a.nbytes // _ALIGN) * _ALIGN
    return leaf


def _views(base: np.ndarray, tree: Any) -> Any:
    """Tensors viewing the uint8 array ``base`` (numpy views: each keeps ``base`` alive)."""
    if isinstance(tree, list):
        return torch.from_numpy(base[tree[0]: tree[1]].view(tree[2]).reshape(tree[3]))
    if isinstance(tree, dict):
        return {k: _views(base, v) for k, v in tree.items()}
    return tuple(_views(base, v) for v in tree)


def _filled(tree: Any, tensors: Any) -> Any:
    """``tree`` with its leaves replaced, in order, by the items of the iterator ``tensors``."""
    if isinstance(tree, list):
        return next(tensors)
    if isinstance(tree, dict):
        return {k: _filled(v, tensors) for k, v in tree.items()}
    return tuple(_filled(v, tensors) for v in tree)


class _Segment:
    """One shared-memory file of a worker's pool."""

    def __init__(self, seg_id: int, size: int) -> None:
        self.id, self.size = seg_id, size
        self.fd = os.memfd_create(f"trajstore-batch-{os.getpid()}-{seg_id}", os.MFD_CLOEXEC)  # (named for /proc/*/maps)
        os.ftruncate(self.fd, _HEADER + size)
        self.map = mmap.mmap(self.fd, _HEADER + size)

    @property
    def free(self) -> bool:
        return self.map[0] == 0

    def close(self) -> None:
        os.close(self.fd)
        try:
            self.map.close()
        except BufferError:  # still viewed in this process: unmapped when the last view goes
            pass


class _Pool:
    """The shared-memory segments of one worker process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = os.urandom(8).hex()
        self.segments: list[_Segment] = []
        self.next_id = 0

    def acquire(self, nbytes: int) -> _Segment | None:
        """A free segment of at least ``nbytes`` (marked in use), or None when every segment is taken
        (or the platform has no ``memfd``)."""
        if not hasattr(os, "memfd_create"):
            return None
        fits = [s for s in self.segments if s.free and nbytes <= s.size <= 2 * nbytes + (1 << 20)]
        if fits:
            seg = fits[0]
        else:
            held = sum(seg.size for seg in self.segments)
            if len(self.segments) >= 2 and (len(self.segments) >= POOL_SEGMENTS or held + nbytes > POOL_BYTES):
                free = [s for s in self.segments if s.free]  # free but of the wrong size: replace one
                if not free:
                    return None
                self.segments.remove(free[0])
                free[0].close()
            seg = _Segment(self.next_id, nbytes)
            self.next_id += 1
            self.segments.append(seg)
        seg.map[0] = 1
        return seg


_pool: _Pool | None = None


def _worker_pool() -> _Pool:
    global _pool
    if _pool is None or _pool.pid != os.getpid():
        _pool = _Pool()
    return _pool


# In the main process: (worker token, segment id) -> (worker pid, mapping), each segment mapped once.
_mapped: dict[tuple[str, int], tuple[int, mmap.mmap]] = {}


def _alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there (no memfd segments anyway)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _segment_map(pid: int, token: str, seg_id: int, size: int, fd: Any) -> mmap.mmap:
    key = (token, seg_id)
    if key in _mapped:
        if fd is not None:
            os.close(fd.detach())
        return _mapped[key][1]
    if fd is None:
        raise RuntimeError(f"batch segment {seg_id} of DataLoader worker {pid} was never mapped in this process")
    for k in [k for k, (p, _) in _mapped.items() if not _alive(p)]:  # segments of exited workers
        _mapped.pop(k, None)  # unmapped once no tensor views them
    local = fd.detach()
    try:
        mm = mmap.mmap(local, _HEADER + size)
    finally:
        os.close(local)
    mm[1] = 1
    _mapped[key] = (pid, mm)
    return mm


def _release(mm: mmap.mmap) -> None:
    mm[0] = 0


def _unpack_segment(pid: int, token: str, seg_id: int, size: int, nbytes: int, fd: Any, tree: Any) -> dict[str, Any]:
    mm = _segment_map(pid, token, seg_id, size, fd)
    if nbytes <= COPY_OUT_BYTES:  # copied out: the segment is free again at once
        base = np.frombuffer(mm, np.uint8, count=nbytes, offset=_HEADER).copy()
        mm[0] = 0
        return _views(base, tree)
    base = np.frombuffer(mm, np.uint8, count=nbytes, offset=_HEADER)
    weakref.finalize(base, _release, mm).atexit = False  # alive while any tensor views the batch
    return _views(base, tree)


def _unpack(payload: Any, tree: Any) -> dict[str, Any]:
    """In the receiving process: the batch as tensors viewing the one buffer that crossed."""
    if isinstance(payload, torch.Tensor):
        base = payload.numpy()  # keeps the shared-memory tensor alive
    else:
        base = np.frombuffer(payload, np.uint8)  # a bytearray: writable
    return _views(base, tree)


class WorkerBatch(dict):
    """``{field: tensor}`` made in a worker: every tensor is a view into one flat buffer, and the
    batch pickles as that buffer (see the module docstring).  The main process receives a plain
    ``dict`` of tensors."""

    _payload: Any  # bytearray ("pipe"), shared-memory uint8 tensor ("shm") or None ("pool")
    _nbytes: int
    _tree: Any
    _how: str
    _segment: _Segment | None = None

    def __reduce__(self) -> Any:
        seg = self._segment
        if seg is not None:
            pool = _worker_pool()
            fd = None if seg.map[1] else DupFd(seg.fd)  # the main process maps each segment once
            return (_unpack_segment, (pool.pid, pool.token, seg.id, seg.size, self._nbytes, fd, self._tree))
        return (_unpack, (self._payload, self._tree))


class _Arena:
    """A segment of the worker's pool that the fields decode a batch straight into (an allocator
    for :func:`trajstore.storage.fields.out.rows_into`): arrays are carved from it one after the
    other; one that does not fit is left to ``np.empty`` (and copied by :func:`pack`)."""

    def __init__(self, seg: _Segment) -> None:
        self.seg, self.used = seg, 0
        self.wanted = 0  # bytes every allocation asked for (what the next batch's segment should hold)
        self.base = np.frombuffer(seg.map, np.uint8, count=seg.size, offset=_HEADER)
        self.addr = self.base.ctypes.data

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
        nbytes = math.prod(shape) * dtype.itemsize
        step = -(-nbytes // _ALIGN) * _ALIGN
        self.wanted += step
        if self.used + step > self.seg.size:
            return None
        a = self.base[self.used: self.used + nbytes].view(dtype).reshape(shape)
        self.used += step
        return a

    def offset_of(self, a: np.ndarray) -> int | None:
        """Where ``a`` lies in the segment when it is a whole C-contiguous region of it, else None."""
        if not a.flags.c_contiguous or a.base is None:
            return None
        off = a.ctypes.data - self.addr
        return off if 0 <= off and off + a.nbytes <= self.used else None


def pack_read(read: Callable[[], Mapping[str, Any]], key: Any) -> WorkerBatch:
    """:func:`pack` of ``read()``, the arrays it reads allocated in the shared-memory segment the
    batch will cross in (no copy) when the previous batch of ``key`` (a dataset's id) crossed in one."""
    want = _hints.get(key, 0)
    # Small batches (copied out by the main process) are read as usual and copied in: for 256 vector
    # rows that cost the worker about 20 us less than gathering them into the segment.
    seg = _worker_pool().acquire(want) if want > COPY_OUT_BYTES else None
    if seg is None:
        batch = pack(read())
        _hints[key] = batch._nbytes
        return batch
    arena = _Arena(seg)
    done: WorkerBatch | None = None
    try:
        with rows_into(arena):
            arrays = read()
        done = pack(arrays, arena)
    finally:
        if done is None or done._segment is not seg:
            seg.map[0] = 0  # not the batch's segment after all (or the read raised): free again
    _hints[key] = max(done._nbytes, arena.wanted)
    return done


# Worker process: bytes the previous batch of each dataset (by id) needed.
_hints: dict[Any, int] = {}


def _placed(leaves: list[tuple[_Leaf, np.ndarray]], arena: _Arena) -> tuple[list[bool], int]:
    """Lay ``leaves`` out in ``arena``'s segment: those the fields allocated there keep their place,
    the others go after them.  Returns which leaves must be copied and the bytes used."""
    copy: list[bool] = []
    taken: list[tuple[int, int]] = []  # regions of the segment leaves keep in place
    end = arena.used
    for leaf, a in leaves:
        off = arena.offset_of(a)
        if off is not None and all(off + a.nbytes <= lo or hi <= off for lo, hi in taken):
            leaf[0], leaf[1] = off, off + a.nbytes
            taken.append((off, off + a.nbytes))
            copy.append(False)
        else:
            leaf[0], leaf[1] = end, end + a.nbytes
            end += -(-a.nbytes // _ALIGN) * _ALIGN
            copy.append(True)
    return copy, max([end, *(hi for _, hi in taken)])


def _relaid(leaves: list[tuple[_Leaf, np.ndarray]]) -> int:
    """Lay ``leaves`` out anew one after the other from offset 0; returns the bytes used."""
    end = 0
    for leaf, a in leaves:
        leaf[0], leaf[1] = end, end + a.nbytes
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    return end


def pack(arrays: Mapping[str, Any], arena: _Arena | None = None) -> WorkerBatch:
    """One :class:`WorkerBatch` holding (copies of) the numpy arrays of ``arrays`` (nested dicts /
    tuples); with ``arena``, arrays already in its segment stay where they are (not copied)."""
    leaves: list[tuple[_Leaf, np.ndarray]] = []
    pos = [0]
    tree = _layout(arrays, leaves, pos)
    total = pos[0]
    copy = [True] * len(leaves)
    seg = None
    if arena is not None:
        copy, used = _placed(leaves, arena)
        if used <= arena.seg.size:
            seg, total = arena.seg, used
        else:  # the batch outgrew the segment: laid out anew in another
            arena.wanted = max(arena.wanted, used)
            copy, total = [True] * len(leaves), _relaid(leaves)
    if seg is None and total >= POOL_MIN_BYTES:
        seg = _worker_pool().acquire(total)
    payload: Any = None
    if seg is not None:
        how = "pool"
        buf = np.frombuffer(seg.map, np.uint8, count=total, offset=_HEADER)
    elif total > PIPE_MAX_BYTES:
        how = "shm"
        payload = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(total))
        buf = payload.numpy()
    else:
        how = "pipe"
        payload = bytearray(total)
        buf = np.frombuffer(payload, np.uint8)
    tensors = []
    for (leaf, a), c in zip(leaves, copy):
        if c:  # (an array the fields allocated in the segment is already its own view of it)
            dst = buf[leaf[0]: leaf[1]].view(a.dtype).reshape(a.shape)
            dst[...] = a
            a = dst
        tensors.append(torch.from_numpy(a))
    out = WorkerBatch(_filled(tree, iter(tensors)))
    out._payload, out._nbytes, out._tree, out._how, out._segment = payload, total, tree, how, seg
    return out
