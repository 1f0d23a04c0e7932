"""What a stored field is (:class:`FieldSpec`) and the layout policy: chunk sizes, codecs, chunk keys.

Shared by both storage engines (:mod:`trajstore.mapped` and :mod:`trajstore.chunked`);
:func:`trajstore.storage.fields.layout.open_field` picks the engine of a field.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import zarr
import zarr.abc.codec  # (zarr imports it; named so a type checker sees zarr.abc)
from zarr.core.array import AsyncArray

from trajstore.errors import BadOptionError
from trajstore.storage.fields import _syscalls
from trajstore.storage.fields._rowblocks import small_blocks as _small_blocks
from trajstore.storage.fields._rowblocks import small_rows_codec, unsplit_typesize
from trajstore.storage.location import Location

__all__ = [
    "CACHE_BYTES",
    "COMPRESSED_CHUNK_BYTES",
    "SMALL_ROWS_CHUNK_BYTES",
    "PWRITE_BYTES",
    "RAW_CHUNK_BYTES",
    "RAW_CHUNK_MAX_BYTES",
    "RAW_CHUNK_MIN_ROWS",
    "SMALL_ROWS_BLOCK_BYTES",
    "FieldSpec",
    "check_compressor_keys",
    "chunk_key",
    "create_codecs",
    "field_compressor",
    "make_field_spec",
    "open_zarr_array",
    "parse_compressor",
    "refuse_video",
    "row_block_codec",
    "sized_array",
]

#: Raw chunks aim at this many bytes: a huge page (2 MiB), so every chunk gets a huge-page-aligned
#: slot (_vmap.slot_bytes) and a first read maps its 2 MiB page-cache folio in one fault.  At 1 MiB,
#: (17,) float32 rows were faulted in 64 KiB at a time (about 8,000 faults over the first 200
#: sequence batches of a 10 M-row store, 1,300 at 2 MiB) and a first read mapped twice as many
#: files (916 for that store: 28 ms, 13 ms at 2 MiB).  A small store does not pay a whole chunk on
#: disk: chunk files get their blocks as rows arrive (trajstore.storage.fields.mapped).
RAW_CHUNK_BYTES = 2 << 20
#: ... and hold at least this many rows, up to RAW_CHUNK_MAX_BYTES: every raw chunk file is one
#: memory mapping, and Linux allows a process 65,530 (vm.max_map_count).  With 1 MiB chunks a
#: million (84,84,4) frames were 27,000 mappings per field (obs and next_obs: over 54,000), and
#: the first read of a store mapped thousands of files; 256-row chunks make that 3,900 per field.
RAW_CHUNK_MIN_ROWS = 256
RAW_CHUNK_MAX_BYTES = 16 << 20
#: Compressed chunks are decoded whole on a random read, so they are kept smaller.
COMPRESSED_CHUNK_BYTES = 1 << 20
#: ... and lz4 fields of small rows (new stores) at most 512 KiB (rows a power of two: 4,096 rows,
#: 278 KB of (17,) float32): a random row's ``blosc_getitem`` walks the chunk's table of 2 KiB blocks
#: (512 of them in 1 MiB: 8,600 instructions of its 14,000), and a 10-million-row field is 2,442
#: chunks, whose frames all stay mapped (up to 16,382 frames a process: _rowblocks.MAPS).
SMALL_ROWS_CHUNK_BYTES = 512 << 10
#: Writes of at least this many bytes use pwrite instead of stores into the mapping.
PWRITE_BYTES = 64 << 10
#: Decoded chunks a ChunkedField keeps in RAM (clean ones; dirty ones are never dropped).
CACHE_BYTES = 256 << 20


def chunk_key(array_path: str, k: int, ndim: int) -> str:
    """zarr v3 default chunk key of chunk ``k`` along axis 0 (other axes are one chunk)."""
    return f"{array_path}/c/{k}" + "/0" * (ndim - 1)


def parse_compressor(compressor: Any, dtype: np.dtype) -> tuple[Any, str]:
    """Map the user's ``compressor`` option to zarr ``compressors=`` and a short label.

    Accepts ``None``/``"none"`` (raw), ``"lz4"``, ``"zstd"``, a zarr bytes-to-bytes codec,
    or a numcodecs codec (wrapped with ``zarr.codecs.numcodecs``).
    """
    if compressor is None or compressor == "none":
        return None, "none"
    if isinstance(compressor, str):
        names: dict[str, tuple[Literal["lz4", "zstd"], int]] = {"lz4": ("lz4", 5), "zstd": ("zstd", 3)}
        if compressor not in names:
            raise BadOptionError(f"compressor must be None, 'lz4', 'zstd', an image codec ('jpeg:90', 'png', "
                                 f"'webp-lossless'...: trajstore.storage.fields.image_codecs.FORMATS) or a codec "
                                 f"object; got {compressor!r}")
        cname, level = names[compressor]
        codec = zarr.codecs.BloscCodec(cname=cname, clevel=level, shuffle="shuffle", typesize=dtype.itemsize)
        return codec, compressor
    if isinstance(compressor, zarr.abc.codec.BytesBytesCodec):
        return compressor, type(compressor).__name__
    if hasattr(compressor, "get_config") and hasattr(compressor, "codec_id"):
        import zarr.codecs.numcodecs as zn

        cfg = {k: v for k, v in compressor.get_config().items() if k != "id"}
        wrapper = getattr(zn, type(compressor).__name__, None)
        if wrapper is None:
            raise BadOptionError(f"numcodecs codec {compressor!r} has no zarr v3 wrapper in zarr.codecs.numcodecs")
        return wrapper(**cfg), compressor.codec_id
    raise BadOptionError(f"compressor must be None, 'lz4', 'zstd' or a codec object; got {compressor!r}")


#: Rows of at least this many bytes are compressed one row per blosc block (see row_block_codec).
ROW_BLOCK_MIN_BYTES = 4 << 10
#: ... and at most this many (a larger row is a chunk of its own anyway).
ROW_BLOCK_MAX_BYTES = 1 << 20
#: Blosc block size of zstd fields with rows under ROW_BLOCK_MIN_BYTES (a random row decodes one block);
#: lz4 ones: trajstore.storage.fields._rowblocks.SMALL_ROWS_LZ4_BLOCK_BYTES.
SMALL_ROWS_BLOCK_BYTES = 16 << 10


def row_block_codec(compressor: str, dtype: np.dtype, row_bytes: int) -> Any:
    """A blosc codec whose blocks hold exactly one row (rows under ROW_BLOCK_MIN_BYTES: blocks of
    SMALL_ROWS_BLOCK_BYTES), or None where the policy does not apply.

    A blosc frame (what zarr's ``blosc`` codec writes for a chunk) is a 16-byte header, a table of
    block offsets, then blocks compressed independently: it is a small shard with its index at
    the front.  With one row per block a random row is read by decoding one block
    (:class:`trajstore.storage.fields.chunked.ChunkedField`, through ``blosc_getitem``), not the whole chunk,
    and every zarr reader still decodes the chunk as usual.

    c-blosc splits lz4 blocks by byte position when ``typesize <= 16`` and then enforces 64 KiB
    blocks, so one-byte dtypes are declared with a ``typesize`` in 17..255 that divides the row
    (``noshuffle``: a byte shuffle of uint8 data is a no-op, compression is unchanged).  Wider
    dtypes keep their byte shuffle (it matters for their ratio); zstd honours their block size;
    lz4 ones are declared with a ``typesize`` above 16 that is a multiple of the item size
    (:func:`~trajstore.storage.fields._rowblocks.unsplit_typesize`; stores created before issue 35
    kept the item size, and 64 KiB blocks).
    """
    if compressor not in ("lz4", "zstd") or row_bytes > ROW_BLOCK_MAX_BYTES:
        return None
    blosc: dict[Any, tuple[Literal["lz4", "zstd"], int]] = {"lz4": ("lz4", 5), "zstd": ("zstd", 3)}
    cname, level = blosc[compressor]
    if row_bytes < ROW_BLOCK_MIN_BYTES:
        # lz4: a typesize above 16, so that c-blosc keeps small blocks (it enlarges the blocks of
        # lz4 with a typesize up to 16 to 64 KiB or more, decoded whole for every random row):
        # trajstore.storage.fields._rowblocks.small_rows_codec.
        small = small_rows_codec(level, dtype, row_bytes) if cname == "lz4" else None
        if small is not None:
            return small
        # zstd (never split: it keeps this block size) and lz4 rows without such a typesize.
        return zarr.codecs.BloscCodec(cname=cname, clevel=level, shuffle="shuffle", typesize=dtype.itemsize,
                                      blocksize=SMALL_ROWS_BLOCK_BYTES)
    if dtype.itemsize == 1:
        ts = next((t for t in (*range(32, 256), *range(17, 32)) if row_bytes % t == 0), None)
        if ts is None:
            return None
        return zarr.codecs.BloscCodec(cname=cname, clevel=level, shuffle="noshuffle", typesize=ts, blocksize=row_bytes)
    # lz4: a typesize above 16 (a multiple of the item size: the shuffle still groups bytes of the
    # same significance), so that the block is the row and not 64 KiB (issue 35).
    ts = unsplit_typesize(dtype.itemsize, row_bytes) if cname == "lz4" else None
    return zarr.codecs.BloscCodec(cname=cname, clevel=level, shuffle="shuffle", typesize=ts or dtype.itemsize,
                                  blocksize=row_bytes)


class FieldSpec:
    """Static description of one stored field (written once into the store's attributes)."""

    def __init__(self, array_path: str, row_shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int, layout: str,
                 compressor: Any = None):
        self.array_path = array_path
        self.compressor = compressor  # only used at create; afterwards zarr's metadata holds the codec
        self.row_shape = tuple(int(s) for s in row_shape)
        self.dtype = np.dtype(dtype)
        self.chunk_rows = int(chunk_rows)
        self.layout = layout  # "raw", "compressed", "image" or "video"

    @property
    def row_bytes(self) -> int:
        """Uncompressed bytes of one row: ``prod(row_shape) * dtype.itemsize``."""
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        """What the store's attributes record of the field: ``path``, ``chunk_rows`` and
        ``layout`` (row shape, dtype and codec are in the array's own zarr metadata)."""
        return {"path": self.array_path, "chunk_rows": self.chunk_rows, "layout": self.layout}


def raw_row_align(row_bytes: int) -> int:
    """Smallest row count whose bytes fill whole pages, so chunks tile an address range."""
    return _syscalls.PAGE // math.gcd(row_bytes, _syscalls.PAGE)


def _names(key: str, array_path: str) -> bool:
    """Whether the ``compressor`` dict key ``key`` names the field ``array_path``: its whole path,
    its leaf name (the path after the table) or a leading part of that name up to a ``.`` or ``/``."""
    leaf = array_path.split("/", 1)[-1]
    return key in (array_path, leaf) or leaf.startswith((key + ".", key + "/"))


def field_compressor(compressor: Any, array_path: str) -> Any:
    """The compressor of field ``array_path`` when ``compressor`` is a dict ``{leaf name: compressor}``
    (key ``"*"``: every other field; without it other fields are raw); else ``compressor``."""
    if not isinstance(compressor, dict):
        return compressor
    return next((v for k, v in compressor.items() if k != "*" and _names(k, array_path)), compressor.get("*"))


def check_compressor_keys(compressor: Any, array_paths: list[str]) -> None:
    """Refuse (BadOptionError) a ``compressor`` dict with a key that names none of ``array_paths``."""
    if not isinstance(compressor, dict):
        return
    bad = [k for k in compressor if k != "*" and not (isinstance(k, str) and any(_names(k, p) for p in array_paths))]
    if bad:
        leaves = [p.split("/", 1)[-1] for p in array_paths]
        raise BadOptionError(f"compressor keys {bad} name no field; the fields are {leaves} (or '*' for all others)")


#: Video fields' nominal chunk rows (their zarr array holds no chunks; the table grows by them).
VIDEO_CHUNK_ROWS = 256


def refuse_video(specs: list[FieldSpec], where: str) -> None:
    """Raise BadOptionError naming the first video field of ``specs``: ``where`` (e.g. "a
    ReplayBuffer") keeps no episodes to encode."""
    for s in specs:
        if s.layout == "video":
            raise BadOptionError(f"{s.array_path}: video ({s.compressor.label}) is kept per episode, in the step data "
                                 f"of an unbounded TrajectoryReplayBuffer; {where} has no episodes to encode: use a "
                                 "per-frame image codec such as 'jpeg:90'")


#: Image fields: shards of at most this many decoded bytes (the writer holds the one it fills
#: decoded) and at most IMAGE_SHARD_MAX_ROWS frames.
IMAGE_SHARD_BYTES = 32 << 20
IMAGE_SHARD_MAX_ROWS = 1024


def make_field_spec(
    array_path: str,
    row_shape: tuple[int, ...],
    dtype: np.dtype,
    *,
    capacity: int | None,
    compressor: Any,
    chunk_rows: int | None,
) -> FieldSpec:
    """Choose the layout and chunk rows of a new field (see RAW_CHUNK_BYTES / COMPRESSED_CHUNK_BYTES /
    IMAGE_SHARD_BYTES); ``compressor`` may be a dict by field (:func:`field_compressor`).

    Raises
    ------
    BadOptionError
        An image codec for frames it cannot hold (:func:`~.image_codecs.parse_image_compressor`).
    """
    from trajstore.storage.fields.image_codecs import parse_image_compressor
    from trajstore.storage.fields.video_codec import parse_video_compressor

    compressor = field_compressor(compressor, array_path)
    row_bytes = max(int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize, 1)
    video = parse_video_compressor(compressor, tuple(row_shape), np.dtype(dtype))
    if video is not None:
        if capacity is not None:
            raise BadOptionError(f"{array_path}: video ({video.label}) is kept per episode in unbounded "
                                 f"TrajectoryReplayBuffer step data; a ring (capacity {capacity}) would overwrite "
                                 "the middle of episodes: use a per-frame image codec such as 'jpeg:90'")
        return FieldSpec(array_path, row_shape, dtype, chunk_rows or VIDEO_CHUNK_ROWS, "video", video)
    image = parse_image_compressor(compressor, tuple(row_shape), np.dtype(dtype))
    if image is not None:
        rows = chunk_rows or 1 << int(math.log2(min(max(IMAGE_SHARD_BYTES // row_bytes, 1), IMAGE_SHARD_MAX_ROWS)))
        if capacity is not None:
            rows = min(rows, capacity)
        return FieldSpec(array_path, row_shape, dtype, max(rows, 1), "image", image)
    if compressor is not None and compressor != "none":
        target = COMPRESSED_CHUNK_BYTES
        if isinstance(compressor, str):
            codec = row_block_codec(compressor, np.dtype(dtype), row_bytes)
            if compressor == "lz4" and row_bytes < ROW_BLOCK_MIN_BYTES and _small_blocks(codec):
                # blosc_getitem walks the whole block table for every row: fewer blocks per chunk
                target = SMALL_ROWS_CHUNK_BYTES
            compressor = codec or compressor
        rows = chunk_rows or 1 << max(int(math.log2(max(target // row_bytes, 1))), 0)
        if capacity is not None:
            rows = min(rows, capacity)
        return FieldSpec(array_path, row_shape, dtype, max(rows, 1), "compressed", compressor)
    align = raw_row_align(row_bytes)
    rows = chunk_rows or max(RAW_CHUNK_BYTES // row_bytes, min(RAW_CHUNK_MIN_ROWS, RAW_CHUNK_MAX_BYTES // row_bytes), 1)
    if capacity is not None:
        rows = min(rows, capacity)
    rows = -(-rows // align) * align  # round up to whole pages
    return FieldSpec(array_path, row_shape, dtype, rows, "raw")


def create_codecs(spec: FieldSpec) -> dict[str, Any]:
    """zarr ``create_array`` codec arguments of a new field: ``compressors`` (raw: none), or for an
    image field a ``sharding_indexed`` serializer of one-frame inner chunks encoded by its
    :class:`~.image_codecs.ImageCodec` (index: ``bytes`` little-endian then ``crc32c``, at the end)."""
    if spec.layout == "video":  # no chunks: frames are in the field's video segments (.video)
        from trajstore.storage.fields.video_codec import VIDEO_ATTR

        return {"compressors": None, "attributes": {VIDEO_ATTR: spec.compressor.to_dict()}}
    if spec.layout == "image":
        sharding = zarr.codecs.ShardingCodec(
            chunk_shape=(1, *spec.row_shape), codecs=[spec.compressor],
            index_codecs=[zarr.codecs.BytesCodec(endian="little"), zarr.codecs.Crc32cCodec()], index_location="end")
        return {"serializer": sharding, "compressors": None}
    return {"compressors": parse_compressor(spec.compressor if spec.layout != "raw" else None, spec.dtype)[0]}


def open_zarr_array(loc: Location, spec: FieldSpec, allocated: int, writable: bool) -> zarr.Array[Any]:
    """The field's zarr array, re-read from the store and sized to ``allocated`` rows
    (:func:`sized_array`: nothing is written)."""
    z = zarr.open_array(loc.zstore, path=spec.array_path, mode="r+" if writable else "r")
    return sized_array(z, allocated).with_config({"write_empty_chunks": True})


def sized_array(z: zarr.Array[Any], rows: int) -> zarr.Array[Any]:
    """A handle on array ``z`` whose shape has ``rows`` rows, in memory only.

    The shape in a field's ``zarr.json`` is what plain zarr readers see (the committed rows,
    :mod:`trajstore.storage.published`); trajstore reads and writes rows up to the allocation its
    commit record names, so its handles are sized from that, and growing writes no metadata.
    """
    if z.shape[0] == rows:
        return z
    a = z._async_array
    meta = a.metadata.update_shape((rows, *z.shape[1:]))
    return zarr.Array(AsyncArray(meta, a.store_path, a.config))
