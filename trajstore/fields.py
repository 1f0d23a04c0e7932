"""Per-field row storage: one zarr array per leaf, read and written by physical row.

Two layouts, both ordinary zarr v3 arrays that any zarr reader opens:

``MappedField`` ("raw" layout on a local folder)
    Uncompressed chunks (codec ``bytes``, little-endian).  Each chunk file is created at
    full size and memory-mapped into one contiguous virtual array (:mod:`._vmap`); the
    writer copies rows straight into the page cache and readers gather with one numpy
    fancy index.  zarr-python is used only for metadata.

``ChunkedField`` (compressed layouts, and every non-local store)
    Reads and writes go through zarr-python a whole chunk at a time.  The writer keeps
    the chunks it is filling in RAM and writes them out complete on ``flush``; decoded
    chunks are cached (bounded) and dropped whenever another process may have changed them.

Both engines (:mod:`trajstore.mapped`, :mod:`trajstore.chunked`) expose the same small
interface used by :class:`trajstore.table.Table`.

A full disk (``ENOSPC``/``EDQUOT``) surfaces as :class:`trajstore.errors.StoreFullError` from
``write``/``flush``/``stage_chunk``/``grow``, raised before anything beyond the rows being
written changed: raw chunk files are allocated whole (``posix_fallocate``) before they are
mapped, so a store into a mapping never meets a full disk (which would be ``SIGBUS``).
"""

from __future__ import annotations

import zarr

from . import _vmap
from .chunked import ChunkedField
from .fieldspec import (
    FieldSpec,
    chunk_key,
    gather_windows_by_rows,
    make_field_spec,
    parse_compressor,
)
from .mapped import MappedField
from .storage import Location

__all__ = [
    "ChunkedField",
    "FieldSpec",
    "MappedField",
    "chunk_key",
    "gather_windows_by_rows",
    "make_field_spec",
    "open_field",
    "parse_compressor",
]


def open_field(loc: Location, spec: FieldSpec, group: zarr.Group, allocated: int, writable: bool) -> MappedField | ChunkedField:
    """The right reader/writer for ``spec`` on ``loc``."""
    if spec.layout == "raw" and loc.is_local and _vmap.SUPPORTED and (spec.chunk_rows * spec.row_bytes) % _vmap.PAGE == 0 and spec.row_bytes:
        return MappedField(loc, spec, allocated, writable)
    zarray = group[spec.array_path].with_config({"write_empty_chunks": True})  # type: ignore[union-attr]
    return ChunkedField(loc, spec, zarray, writable)  # type: ignore[arg-type]
