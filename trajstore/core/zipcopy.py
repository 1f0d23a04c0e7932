"""Copying a store into a ``.zip``: small, trimmed, committed rows only.

A zip is meant for sharing, so :func:`write_zip` (what ``dumps("x.zip")`` and ``trajstore copy
... x.zip`` use) writes it small: raw fields are re-encoded with the compressed row-block layout
(:data:`ZIP_COMPRESSOR`; fields already compressed keep their codec), only chunks holding
committed rows are written (an unbounded table's arrays are sized to its rows; a ring keeps its
capacity and its unwritten chunks are simply absent, i.e. zarr's fill value), and the result is an
ordinary trajstore store that zarr reads array by array.  ``compressor="none"`` keeps raw chunks
(trimmed the same way).

The zip itself is written through :class:`trajstore.storage.zipstore.ZipWriter`.
"""

from __future__ import annotations

import copy
import os
import zipfile
from typing import Any

import numpy as np
import zarr
import zarr.abc.codec  # (zarr imports it; named so a type checker sees zarr.abc)
from zarr.storage import MemoryStore

from trajstore.core.commit import consolidate_metadata
from trajstore.core.progress import progress_bar
from trajstore.core.ring import contiguous_runs
from trajstore.core.store import ATTRS_KEY, Store
from trajstore.errors import BadOptionError, StoreExistsError
from trajstore.storage.fields.image import ImageField, write_shard
from trajstore.storage.fields.image_codecs import image_codec_of
from trajstore.storage.fields.spec import (
    FieldSpec,
    chunk_key,
    create_codecs,
    field_compressor,
    make_field_spec,
    raw_row_align,
)
from trajstore.storage.head import (
    HEAD_KEY,
    LOCK_KEY,
    MPLOCK_KEY,
    Head,
    TableState,
    write_head,
)
from trajstore.storage.keys import PRIORITIES_DIR
from trajstore.storage.location import STAGING_DIR, TMP_DIR, Location
from trajstore.storage.publish import destination_full
from trajstore.storage.published import DATASET_ATTR, root_attribute, set_root_attribute
from trajstore.storage.schema import check_schema
from trajstore.storage.zipstore import ZipWriter

__all__ = ["ZIP_COMPRESSOR", "write_zip"]

#: Codec given to raw fields of a store written to a ``.zip`` (compressor="auto").
ZIP_COMPRESSOR = "lz4"
#: Chunks encoded per block while writing a zip (bounded memory: about this many bytes decoded).
_BLOCK_BYTES = 16 << 20


def _zip_layout(store: "Store", path: str, row_shape: tuple[int, ...], dtype: np.dtype, capacity: int | None,
                rows: int, src_chunk_rows: int, compressor: Any, chunk_rows: int | None) -> tuple[Any, Any]:
    """``(FieldSpec, zarr create_array codec arguments)`` of one field of a table holding ``rows``
    committed rows in the zip (see :func:`write_zip`).  An image field keeps its codec under
    ``"auto"`` and ``"keep"``."""
    codecs = store.group[path].metadata.codecs  # type: ignore[union-attr]
    src = [c for c in codecs if isinstance(c, zarr.abc.codec.BytesBytesCodec)]  # compressors, not the bytes codec
    image = image_codec_of(codecs)
    choice = compressor
    if isinstance(choice, dict):  # field by field (trajstore copy --compressor cam=png): others keep theirs
        choice = field_compressor({**choice, "*": choice.get("*", "keep")}, path)
    if isinstance(choice, str) and choice == "auto":
        choice = "keep" if src or image is not None else ZIP_COMPRESSOR
    if isinstance(choice, str) and choice == "keep":
        if image is not None:  # frames stay as they are encoded (copied as bytes, see write_zip)
            spec = FieldSpec(path, row_shape, dtype, chunk_rows or src_chunk_rows, "image", image)
            return spec, create_codecs(spec)
        if src:  # the source's own codec, as configured (row blocks included)
            return FieldSpec(path, row_shape, dtype, chunk_rows or src_chunk_rows, "compressed"), {"compressors": tuple(src)}
        choice = None
    spec = make_field_spec(path, row_shape, dtype, capacity=capacity, compressor=choice, chunk_rows=chunk_rows)
    if spec.layout == "video":  # segments are written as episodes end, into a folder or URL
        raise BadOptionError(f"{path}: a .zip copy cannot hold video fields ({spec.compressor.label}); copy to a "
                             "folder or URL, or name a per-frame image codec such as 'jpeg:90'")
    if chunk_rows is None:
        # Chunks are stored whole, padding included (a compressed chunk still pays per block for
        # its padding: 85 demo rows in 1 MiB lz4 chunks were 5 KiB a field): no chunk much bigger
        # than the committed rows.  Raw chunks stay whole pages (a copy back into a folder is
        # memory-mapped again); compressed ones a power of two.
        if spec.layout == "raw":
            align = raw_row_align(max(spec.row_bytes, 1))
            spec.chunk_rows = min(spec.chunk_rows, -(-max(rows, 1) // align) * align)
        else:
            spec.chunk_rows = min(spec.chunk_rows, 1 << max(rows - 1, 0).bit_length())
    return spec, create_codecs(spec)


def _copy_frames(f: ImageField, loc: Location, spec: FieldSpec, runs: list[tuple[int, int, int]], needed: list[int],
                 bar: Any) -> None:
    """An image field's committed frames into the zip as the bytes they are stored as (no decode,
    no encode: a lossy frame keeps its quality), in shards of ``spec.chunk_rows`` frames."""
    C, ndim = spec.chunk_rows, len(spec.row_shape) + 1
    for k in needed:
        frames = [b""] * C  # rows not committed: never written (zarr's fill value)
        for p, _o, m in runs:
            a, b = max(p, k * C), min(p + m, (k + 1) * C)
            if a < b:
                frames[a - k * C : b - k * C] = f.encoded_rows(np.arange(a, b))
                bar.update(b - a)
        loc.put(chunk_key(spec.array_path, k, ndim), write_shard(frames))


def _chunk_blocks(needed: list[int], per_block: int) -> list[tuple[int, int]]:
    """Runs ``[k0, k1)`` of consecutive chunk numbers from sorted ``needed``, each at most ``per_block`` long."""
    out: list[tuple[int, int]] = []
    for k in needed:
        if out and out[-1][1] == k and k - out[-1][0] < per_block:
            out[-1] = (out[-1][0], k + 1)
        else:
            out.append((k, k + 1))
    return out


def write_zip(store: "Store", target: str | os.PathLike[str], *, compressor: Any = "auto",
              chunk_rows: int | None = None, progress: bool | None = None, overwrite: bool = True,
              zip_compression: int = zipfile.ZIP_STORED) -> None:
    """Write the committed rows of ``store`` as a new store in the zip file ``target``.

    Parameters
    ----------
    store : Store
        The source, flushed (its tables' states are what is copied).
    target : path
        The ``.zip`` to write; it appears there complete (temp file + rename) or not at all (a
        full disk: :class:`~trajstore.errors.StoreFullError` naming it, the temp file removed).
    compressor : "auto", "keep", "none", None, "lz4", "zstd" or a codec
        ``"auto"``: raw fields get :data:`ZIP_COMPRESSOR` row blocks, compressed fields keep their
        codec; ``"keep"``: every field keeps its codec (raw stays raw); ``"none"``/``None``: raw;
        else that codec for every field (as ``create(compressor=...)``).
    chunk_rows : int, optional
        Rows per chunk in the zip (default: the layout's own choice).
    progress : bool, optional
        A progress bar (``None``: on a terminal, when tqdm is installed).
    overwrite : bool
        Replace a trajstore zip already at ``target`` (a file that is no store is never replaced).
    zip_compression : int
        ``zipfile`` compression of the members (default stored: chunks are compressed already).

    Only chunks holding committed rows are written, an unbounded table's arrays are sized to its
    rows and a ring's keep its capacity (chunks it never wrote are absent: zarr's fill value).
    Rows keep their physical places, so the commit record is the source's (without a pending
    rewrite).  Everything is encoded by zarr itself (arrays created in a ``MemoryStore``, whose
    keys are moved into the zip a block of chunks at a time), so any zarr reader reads the zip.
    """
    target = os.fspath(target)
    head = store.committed.copy()
    head.pending = None
    attrs = copy.deepcopy(store.attrs)
    plans = _zip_plans(store, head, attrs, compressor, chunk_rows)
    check_schema(attrs, target)  # what open would refuse is refused before a byte is written
    mem = _zip_metadata(store, attrs, plans)
    writer = ZipWriter(target, compression=zip_compression)
    loc = Location(writer, target, None)
    try:
        if loc.exists("zarr.json") or loc.exists(HEAD_KEY):
            if not overwrite:
                raise StoreExistsError(f"{target}: a store already exists here")
            writer.erase_old()
        for key in mem.list_prefix(""):
            loc.put(key, mem.get(key, limit=1 << 62) or b"")  # every key listed holds bytes
        _copy_root_files(store, loc, plans)
        bar = progress_bar(sum(t.count for t in store.tables.values() for _ in t.fields), f"write {target}", progress,
                        unit="row")
        try:
            for plan in plans:
                _copy_rows(plan, mem, loc, bar)
        finally:
            bar.close()
        write_head(loc, head)  # the commit record last, as in every copy
    except BaseException as e:
        writer.abort()  # a zip cut short is never published
        raise destination_full(e, target)  # e itself unless a full disk
    try:
        loc.close()  # publishes the zip (rename onto the target; removes the temp file on failure)
    except OSError as e:
        raise destination_full(e, target)  # the central directory did not fit


#: One array of the zip: its source table and field, its spec and compressors there, rows allocated.
_Plan = tuple[Any, Any, FieldSpec, Any, int]


def _zip_plans(store: "Store", head: Head, attrs: dict[str, Any], compressor: Any,
               chunk_rows: int | None) -> list[_Plan]:
    """Each field's layout in the zip; ``head``'s tables are sized (an unbounded table to its
    rows, a ring to its capacity) and ``attrs``' field entries get the zip's chunk rows and layout."""
    plans: list[_Plan] = []
    for name, t in store.tables.items():
        t.prepare_reads()
        st = t.state
        alloc = t.capacity if t.capacity is not None else st.end
        head.tables[name] = TableState(st.start, st.end, alloc)
        meta = {fj["path"]: fj for fj in attrs["tables"][name]["fields"]}
        for f in t.fields:
            s = f.spec
            spec, codec = _zip_layout(store, s.array_path, s.row_shape, s.dtype, t.capacity, t.count, s.chunk_rows,
                                      compressor, chunk_rows)
            meta[s.array_path]["chunk_rows"] = spec.chunk_rows
            meta[s.array_path]["layout"] = spec.layout
            plans.append((t, f, spec, codec, alloc))
    return plans


def _zip_metadata(store: "Store", attrs: dict[str, Any], plans: list[_Plan]) -> Location:
    """The zip's metadata, made by zarr as Store.create makes it, in a memory location (with the
    dataset description's mirror for plain readers; the description file itself is copied with
    the root files)."""
    mem = Location(MemoryStore(), None, None)
    group = zarr.create_group(mem.zstore, attributes={ATTRS_KEY: attrs})
    for _t, _f, spec, codec, alloc in plans:
        group.create_array(spec.array_path, shape=(alloc, *spec.row_shape), chunks=(spec.chunk_rows, *spec.row_shape),
                           dtype=spec.dtype, **codec, filters=None,
                           fill_value=np.zeros((), spec.dtype)[()], config={"write_empty_chunks": True})
    consolidate_metadata(mem)
    dataset = root_attribute(store.loc, DATASET_ATTR)
    if dataset is not None:
        set_root_attribute(mem, DATASET_ATTR, dataset)
    return mem


def _copy_root_files(store: "Store", loc: Location, plans: list[_Plan]) -> None:
    """The dataset description and other root files into the zip: not the commit record nor a kept
    copy of an older one (its allocation is the source's), nor a sampler's priorities (a store of
    their own, which a zip's readers never look for), nor metadata, locks, temp files or chunks."""
    arrays = tuple(spec.array_path + "/" for _t, _f, spec, _c, _a in plans)
    for key in store.loc.list_prefix(""):
        if (key in (LOCK_KEY, MPLOCK_KEY)
                or key.startswith(("trajstore.head", TMP_DIR, STAGING_DIR, PRIORITIES_DIR + "/", *arrays))
                or key == "zarr.json" or key.endswith("/zarr.json")):
            continue
        blob = store.loc.get(key)
        if blob is not None:
            loc.put(key, blob)


def _copy_rows(plan: _Plan, mem: Location, loc: Location, bar: Any) -> None:
    """One field's committed rows into the zip, encoded by zarr in ``mem`` a block of chunks at a
    time (rows not committed: the fill value), each chunk moved into the zip once written."""
    t, f, spec, _codec, alloc = plan
    C, ndim = spec.chunk_rows, len(spec.row_shape) + 1
    runs = contiguous_runs(t.state.start, t.state.end, t.capacity)
    needed = sorted({k for p, _o, m in runs for k in range(p // C, (p + m - 1) // C + 1)})
    if isinstance(f, ImageField) and spec.compressor == f.codec:
        _copy_frames(f, loc, spec, runs, needed, bar)  # frames as the bytes they are
        return
    z = zarr.open_array(mem.zstore, path=spec.array_path, mode="r+").with_config({"write_empty_chunks": True})
    for k0, k1 in _chunk_blocks(needed, max(1, _BLOCK_BYTES // max(C * spec.row_bytes, 1))):
        lo, hi = k0 * C, min(k1 * C, alloc)
        data = np.zeros((hi - lo, *spec.row_shape), spec.dtype)
        n = 0
        for p, _o, m in runs:
            a, b = max(p, lo), min(p + m, hi)
            if a < b:
                data[a - lo:b - lo] = f.read_range(a, b)
                n += b - a
        z[lo:hi] = data
        for k in range(k0, k1):
            key = chunk_key(spec.array_path, k, ndim)
            raw = mem.get(key, limit=1 << 62)
            if raw is not None:
                loc.put(key, raw)
                mem.delete(key)
        bar.update(n)
