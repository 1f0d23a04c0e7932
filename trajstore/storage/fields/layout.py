"""Per-field row storage: one zarr array per leaf, read and written by physical row.

Two layouts, both ordinary zarr v3 arrays that any zarr reader opens:

``MappedField`` ("raw" layout on a local folder)
    Uncompressed chunks (codec ``bytes``, little-endian).  Each chunk file is created at
    full size and memory-mapped into one contiguous virtual array (:mod:`._vmap`); the
    writer copies rows straight into the page cache and readers gather with one numpy
    fancy index.  zarr-python is used only for metadata.

``ImageField`` ("image" layout: frames encoded one by one, :mod:`.image`)
    Shards of one-frame inner chunks; a row decodes its frame alone, a batch on a thread pool.

``VideoField`` ("video" layout: one encoded stream per episode, :mod:`.video`)
    Frames held raw until their episode ends, then encoded as one segment.

``ChunkedField`` (compressed layouts, and every non-local store)
    Reads and writes go through zarr-python a whole chunk at a time.  The writer keeps
    the chunks it is filling in RAM and writes them out complete on ``flush``; decoded
    chunks are cached (bounded) and dropped whenever another process may have changed them.

Both engines (:mod:`trajstore.mapped`, :mod:`trajstore.chunked`) expose the same small
interface used by :class:`trajstore.core.table.Table`.  A raw field gets the mapped engine only where
``MAP_FIXED`` mappings of the store's files work (:func:`mapping_ok`): elsewhere (macOS, Windows,
``TRAJSTORE_NO_MMAP=1``, a filesystem that refuses shared mappings) it gets ``ChunkedField``,
which reads and writes the same bytes.

A full disk (``ENOSPC``/``EDQUOT``) surfaces as :class:`trajstore.errors.StoreFullError` from
``write``/``flush``/``stage_chunk``/``grow``, raised before anything beyond the rows being
written changed: the blocks of raw chunk files are allocated (``posix_fallocate``) before rows
are stored there through a mapping, so a store into a mapping never meets a full disk (which
would be ``SIGBUS``).
"""

from __future__ import annotations

import os

import zarr

from trajstore.errors import DamagedStoreError
from trajstore.storage.fields import _syscalls
from trajstore.storage.fields.base import Field, gather_windows_by_rows
from trajstore.storage.fields.chunked import ChunkedField
from trajstore.storage.fields.image import ImageField
from trajstore.storage.fields.mapped import MappedField
from trajstore.storage.fields.spec import (
    FieldSpec,
    check_compressor_keys,
    chunk_key,
    create_codecs,
    make_field_spec,
    parse_compressor,
    sized_array,
)
from trajstore.storage.fields.video import VideoField
from trajstore.storage.location import Location

__all__ = [
    "ChunkedField",
    "FieldSpec",
    "ImageField",
    "MappedField",
    "VideoField",
    "check_compressor_keys",
    "chunk_key",
    "create_codecs",
    "gather_windows_by_rows",
    "make_field_spec",
    "mapping_ok",
    "open_field",
    "parse_compressor",
]


# Local store root -> whether its files map (one probe per store and process).
_MAPS: dict[str, bool] = {}


def mapping_ok(loc: Location) -> bool:
    """Whether raw fields of the local store ``loc`` can use the mapped engine: the process can map
    (:data:`trajstore.storage.fields._syscalls.AVAILABLE`), and a first mapping of one of the store's files works
    (:func:`trajstore.storage.fields._syscalls.mapping_works` on the root ``zarr.json``; nothing is written, so a
    read-only open probes too).  Answered once per store root."""
    if not _syscalls.AVAILABLE or loc.local_root is None:
        return False
    root = str(loc.local_root)
    ok = _MAPS.get(root)
    if ok is None:
        ok = True  # nothing to probe with (an empty zarr.json cannot be mapped): trust the system
        try:
            fd = loc.open_inside("zarr.json", os.O_RDONLY)
        except (OSError, DamagedStoreError):
            fd = -1
        if fd >= 0:
            try:
                if os.fstat(fd).st_size > 0:
                    ok = _syscalls.mapping_works(fd)
            finally:
                os.close(fd)
        if len(_MAPS) > 4096:  # a process opening very many stores: forget, probe again
            _MAPS.clear()
        _MAPS[root] = ok
    return ok and _syscalls.AVAILABLE


def open_field(loc: Location, spec: FieldSpec, group: zarr.Group, allocated: int, writable: bool,
               sole: bool = False) -> Field:
    """The right reader/writer for ``spec`` on ``loc``: the mapped engine for raw fields of a local
    store whose chunk bytes tile pages (where :func:`mapping_ok`), else ``ChunkedField``.  ``sole``:
    this process is the store's only writer (not ``multiprocessing=True``)."""
    tiles_pages = spec.row_bytes > 0 and (spec.chunk_rows * spec.row_bytes) % _syscalls.PAGE == 0
    if spec.layout == "raw" and loc.is_local and tiles_pages and mapping_ok(loc):
        return MappedField(loc, spec, allocated, writable, sole)
    # Sized from the commit record's allocation: the shape in zarr.json is the published rows.
    zarray = sized_array(group[spec.array_path], allocated).with_config({"write_empty_chunks": True})  # type: ignore[arg-type]
    if spec.layout == "image":
        return ImageField(loc, spec, zarray, writable)
    if spec.layout == "video":
        return VideoField(loc, spec, zarray, writable)
    return ChunkedField(loc, spec, zarray, writable)
