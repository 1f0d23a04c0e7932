"""A file's bytes written from pieces: bytes and spans of other open files (:class:`FileSpan`).

An import that keeps a foreign file's bytes as they are (LeRobot's MP4 packets becoming a video
segment, :meth:`~trajstore.storage.fields.video.VideoField.adopt`) hands
:meth:`~trajstore.storage.location.Location.put` the segment as ``[head, FileSpan(mp4, offset,
length), tail]``: locally the span is copied file to file by the kernel (``copy_file_range``, else
``pread``/``write`` in bounded blocks), never held in this process's memory; elsewhere the pieces
are joined into one ``bytes`` first.  A span is read from the file object the caller opened (a
confined, size-checked open of the foreign file), at most ``length`` bytes, and a file that ends
before them is a :class:`~trajstore.errors.ForeignFileError` naming it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any, NamedTuple, Union

from trajstore.errors import ForeignFileError

__all__ = ["FileSpan", "Pieces", "PutData", "join_pieces", "write_pieces"]

#: Bytes copied per call when the kernel cannot copy file to file (``copy_file_range`` refused).
BLOCK = 16 << 20
#: ``copy_file_range`` failures that mean "not here" (another filesystem, an old kernel, a sandbox
#: refusing the call): the copy goes on through this process.  Anything else (a full disk) is raised.
_NOT_HERE = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM, errno.EBADF}


class FileSpan(NamedTuple):
    """``length`` bytes at ``offset`` of the open file ``file`` (an object with ``fileno()``, such as
    :class:`io.FileIO`; a closed one raises ValueError when the span is written); ``where`` names
    the file in errors."""

    file: Any
    offset: int
    length: int
    where: str


Pieces = Sequence[Union[bytes, bytearray, FileSpan]]
#: What :meth:`~trajstore.storage.location.Location.put` writes under a key: bytes, or pieces.
PutData = Union[bytes, bytearray, Pieces]


def _short(span: FileSpan, done: int) -> ForeignFileError:
    return ForeignFileError(f"{span.where}: the file ends {done} bytes into the {span.length} bytes at offset "
                            f"{span.offset} that were to be kept")


def _copy_through(src: int, dst: int, span: FileSpan, done: int) -> None:
    """The rest of ``span`` (from ``done``) copied through this process's memory, a block at a time."""
    while done < span.length:
        data = os.pread(src, min(BLOCK, span.length - done), span.offset + done)
        if not data:
            raise _short(span, done)
        view, put = memoryview(data), 0
        while put < len(view):  # (a regular file writes short only when the disk fills)
            put += os.write(dst, view[put:])
        done += len(data)


def _copy_span(dst: int, span: FileSpan) -> None:
    src, done = span.file.fileno(), 0
    copy = getattr(os, "copy_file_range", None)
    while done < span.length and copy is not None:
        try:
            n = copy(src, dst, span.length - done, span.offset + done)
        except OSError as e:
            if e.errno not in _NOT_HERE:
                raise
            break
        if n == 0:
            raise _short(span, done)
        done += n
    _copy_through(src, dst, span, done)


def write_pieces(fd: int, pieces: Pieces) -> None:
    """Write ``pieces`` in order at the file position of ``fd`` (a new regular file)."""
    for p in pieces:
        if isinstance(p, FileSpan):
            _copy_span(fd, p)
            continue
        view, done = memoryview(p), 0
        while done < len(view):
            done += os.write(fd, view[done:])


def join_pieces(pieces: Pieces) -> bytes:
    """``pieces`` as one ``bytes`` (for a store that is not a local folder)."""
    out = []
    for p in pieces:
        if not isinstance(p, FileSpan):
            out.append(bytes(p))
            continue
        src, done = p.file.fileno(), 0
        while done < p.length:
            data = os.pread(src, min(BLOCK, p.length - done), p.offset + done)
            if not data:
                raise _short(p, done)
            out.append(data)
            done += len(data)
    return b"".join(out)
