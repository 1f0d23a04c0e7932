"""Copying a file's bytes without filling its holes.

Raw chunk files have the full size of a chunk but disk blocks only where rows were written (the
rest is a hole: :mod:`trajstore.storage.fields.mapped`).  A byte-for-byte copy would write the
holes out as zeros and give every field of a small store a whole chunk (2 MiB) again, so copies
between local folders go through :func:`copy_file_data`, which copies the data regions only and
leaves holes where the source has them.
"""

from __future__ import annotations

import errno
import os

__all__ = ["copy_file_data"]

_BLOCK = 1 << 20


def copy_file_data(src: int, dst: int) -> None:
    """Copy the content of the open file ``src`` into the empty open file ``dst``: its data
    regions (``lseek`` ``SEEK_DATA``/``SEEK_HOLE``), then ``dst`` sized like ``src``, so every
    hole of ``src`` stays a hole and reads as zeros.  Where the filesystem cannot say where its
    data lies, every byte is copied.

    Raises
    ------
    OSError
        A read or write failed (``ENOSPC`` on a full disk).
    """
    size = os.fstat(src).st_size
    pos = 0
    while pos < size:
        try:
            start = os.lseek(src, pos, os.SEEK_DATA)
            end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data past pos: the rest is a hole
                break
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            start, end = pos, size  # no SEEK_DATA here: copy every byte
        while start < end:
            block = os.pread(src, min(_BLOCK, end - start), start)
            if not block:  # the file shrank meanwhile: what is left reads as zeros
                end = start
                break
            done = 0
            while done < len(block):
                done += os.pwrite(dst, block[done:], start + done)
            start += len(block)
        pos = end
    os.ftruncate(dst, size)
