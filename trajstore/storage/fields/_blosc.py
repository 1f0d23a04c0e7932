"""Blosc frames read block by block: the header and offset checks that make a frame safe to hand to
c-blosc, and ``blosc_getitem`` (from numcodecs' extension) to decode a row range of it.

A blosc frame is a 16-byte header, a table of block offsets and independently compressed blocks, so
a row stored in its own block (:func:`trajstore.storage.fields.spec.row_block_codec`) decodes alone.  Frames
are input: :func:`check_frame` refuses one whose header or offsets point outside it.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable

import numpy as np

__all__ = ["GETITEM", "Frame", "check_frame"]


def _load_getitem() -> Callable[[int, int, int, int], int] | None:  # pragma: no cover - depends on the numcodecs build
    """c-blosc's ``blosc_getitem`` from the numcodecs extension (it exports it), or None."""
    try:
        import numcodecs.blosc as nb

        fn = ctypes.CDLL(nb.__file__).blosc_getitem
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


GETITEM = _load_getitem()
_HEADER = struct.Struct("<BBBBiii")
_MEMCPYED = 0x02


class Frame:
    """One encoded chunk (a checked blosc frame) and a way to decode a row range of it."""

    __slots__ = ("addr", "buf", "owner", "typesize")

    def __init__(self, buf: np.ndarray, typesize: int, owner: object):
        self.buf, self.addr, self.typesize, self.owner = buf, buf.ctypes.data, typesize, owner


def check_frame(buf: np.ndarray, nbytes: int) -> int | None:
    """The typesize of the blosc frame ``buf`` of ``nbytes`` decoded bytes after checking that its
    header and block offsets stay inside it; None when it is not a blosc 1 frame (the caller then
    decodes it whole through zarr, which reports garbage).  Raises ValueError on a frame whose
    header or offsets do not fit (so c-blosc never reads outside ``buf``)."""
    n = len(buf)
    if n < 16:
        return None
    # numpy's stubs give ndarray __buffer__ only from Python 3.12 on
    version, _vlz, flags, typesize, nb, blocksize, cbytes = _HEADER.unpack_from(buf, 0)  # type: ignore[arg-type]
    if version != 2:
        return None
    if nb != nbytes or cbytes != n or typesize < 1:
        raise ValueError(f"blosc header says {nb} bytes decoded / {cbytes} encoded; expected {nbytes} / {n}")
    if flags & _MEMCPYED:
        if n < 16 + nbytes:
            raise ValueError("a stored (uncompressed) blosc frame shorter than its data")
        return typesize
    if blocksize < 1 or blocksize > nbytes:
        raise ValueError(f"blosc block size {blocksize} outside 1..{nbytes}")
    nblocks = -(-nbytes // blocksize)
    first = 16 + 4 * nblocks
    if first > n:
        raise ValueError(f"blosc offset table of {nblocks} blocks does not fit {n} bytes")
    starts = buf[16:first].view("<i4")
    if len(starts) and (int(starts.min()) < first or int(starts.max()) >= n):
        raise ValueError("a blosc block offset points outside the frame")
    return typesize
