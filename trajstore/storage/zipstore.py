"""Writing a ``.zip`` store: once, start to end, published by rename.

A zip cannot replace or delete one entry, so trajstore never updates a zip in place: a zip
store is written by a copy (``dumps("x.zip")``, ``trajstore copy``), every key once and the
commit record last, and is read-only afterwards.  :class:`ZipWriter` is the zarr store such a
copy writes through:

- entries go to a temp file beside the target (``.<name>.<hex>.partial``), renamed onto the
  target by :meth:`ZipWriter.close`; a copy that fails (a full disk...) or is never closed
  leaves whatever zip was at the target whole, and no reader ever sees a half-written zip;
- while a zip is at the target and was not erased, reads see that zip (so ``create`` and
  ``copy_to`` find an existing store there and refuse it unless told to overwrite) and a
  write is refused; deleting keys (what ``overwrite`` does) drops the old content as a whole,
  since a zip cannot lose single entries (it stays on disk until the new one replaces it);
- writing a key twice is refused: that is a buffer being created or updated in the zip, which
  the format cannot hold (build it in a folder or in memory, then ``dumps`` it to the zip).

A zip is meant for sharing, so :func:`write_zip` (what ``dumps("x.zip")`` and ``trajstore copy
... x.zip`` use) writes it small: raw fields are re-encoded with the compressed row-block layout
(:data:`ZIP_COMPRESSOR`; fields already compressed keep their codec), only chunks holding
committed rows are written (an unbounded table's arrays are sized to its rows; a ring keeps its
capacity and its unwritten chunks are simply absent, i.e. zarr's fill value), and the result is an
ordinary trajstore store that zarr reads array by array.  ``compressor="none"`` keeps raw chunks
(trimmed the same way).
"""

from __future__ import annotations

import copy
import os
import threading
import time
import uuid
import weakref
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

import numpy as np

from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import ZipStore

from trajstore.errors import NotATrajstoreError, ReadOnlyError, StoreExistsError

if TYPE_CHECKING:
    from trajstore.core.store import Store

__all__ = ["ZIP_COMPRESSOR", "ZipWriter", "check_zip_file", "write_zip", "zip_read_only_error"]

#: Codec given to raw fields of a store written to a ``.zip`` (compressor="auto").
ZIP_COMPRESSOR = "lz4"
#: Chunks encoded per block while writing a zip (bounded memory: about this many bytes decoded).
_BLOCK_BYTES = 16 << 20


def zip_read_only_error(path: str) -> ReadOnlyError:
    """The error for opening the existing zip ``path`` as a writer."""
    return ReadOnlyError(f"{path}: a .zip store is read-only (written once, by dumps() or `trajstore copy`): open it "
                         "with read_only=True, or copy it to a folder (`trajstore copy STORE.zip FOLDER`) and open that")


def _discard(zf: zipfile.ZipFile, tmp: str) -> None:
    """Drop an unfinished temp zip (the writer failed or was never closed)."""
    try:
        zf.close()
    except Exception:
        pass
    try:
        os.unlink(tmp)
    except OSError:
        pass


class ZipWriter(ZipStore):
    """A zarr ``ZipStore`` that writes a new zip at ``target`` (see the module docstring)."""

    def __init__(self, target: str | os.PathLike[str], *, compression: int = zipfile.ZIP_STORED) -> None:
        self.target = Path(target)
        super().__init__(self.target.with_name(f".{self.target.name}.{uuid.uuid4().hex}.partial"), mode="x",
                         compression=compression)
        self._lock = threading.RLock()
        self._started = False  # the temp zip exists (created by the first write)
        self._written: set[str] = set()
        self._finalizer: weakref.finalize | None = None
        self._old: ZipStore | None = None  # the zip at the target, shown until erased
        self._foreign = False  # something that is no readable zip is at the target
        if os.path.lexists(self.target):
            try:
                old = ZipStore(self.target, mode="r")
                old._sync_open()
                self._old = old
            except (OSError, zipfile.BadZipFile, ValueError):
                self._foreign = True

    # -- state ---------------------------------------------------------------------------
    def _sync_open(self) -> None:
        self._is_open = True  # the temp zip is created by the first write, not by opening

    async def _open(self) -> None:
        self._sync_open()

    def _showing_old(self) -> bool:
        return self._old is not None

    def _erase_old(self) -> None:
        """Drop the target's old content from view (it is replaced on disk at :meth:`close`)."""
        if self._old is not None:
            self._old.close()
            self._old = None
        self._foreign = False

    def _start(self, key: str) -> None:
        """Before writing ``key``: refuse what a zip cannot do, create the temp zip on first use."""
        if self._old is not None or self._foreign:
            raise StoreExistsError(f"{self.target}: a file already exists there; pass overwrite=True to replace a "
                                   "store (remove a file that is no trajstore store by hand)")
        if key in self._written:
            self._abandon()
            raise ReadOnlyError(f"{self.target}: a .zip store is written once, start to end, by dumps() or `trajstore "
                                f"copy`; it cannot be created or updated in place ({key} was written twice). Create "
                                "the buffer in a folder or in memory (cache_path=None) and dumps() it to the zip")
        if not self._started:
            self._zf = zipfile.ZipFile(self.path, mode="x", compression=self.compression, allowZip64=self.allowZip64)
            self._started = True
            self._finalizer = weakref.finalize(self, _discard, self._zf, str(self.path))
        self._written.add(key)

    def _abandon(self) -> None:
        """Give up the temp zip (nothing is published)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._started = False
        self._written.clear()

    # -- reads: the old zip until it is erased, then what was written ---------------------
    async def get(self, key: str, prototype: BufferPrototype, byte_range: Any = None) -> Buffer | None:
        if self._old is not None:
            return await self._old.get(key, prototype, byte_range)
        if not self._started:
            return None
        return await super().get(key, prototype, byte_range)

    async def get_partial_values(self, prototype: BufferPrototype, key_ranges: Any) -> list[Buffer | None]:
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def exists(self, key: str) -> bool:
        if self._old is not None:
            return await self._old.exists(key)
        return self._started and await super().exists(key)

    async def list(self) -> AsyncIterator[str]:
        if self._old is not None:
            async for k in self._old.list():
                yield k
        elif self._started:
            async for k in super().list():
                yield k

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        async for k in self.list():
            if k.startswith(prefix):
                yield k

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        if self._old is not None:
            async for k in self._old.list_dir(prefix):
                yield k
        elif self._started:
            async for k in super().list_dir(prefix):
                yield k

    # -- writes --------------------------------------------------------------------------
    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        with self._lock:
            self._start(key)
            info = zipfile.ZipInfo(filename=key, date_time=time.localtime(time.time())[:6])
            info.external_attr = 0o644 << 16  # -rw-r--r--
            # JSON (zarr metadata, the commit record) deflates 5-10x and is read once at open;
            # chunks are stored as the store's codecs encoded them (deflating lz4 frames saves
            # ~7% and costs zlib's speed on every write and read).
            info.compress_type = zipfile.ZIP_DEFLATED if key.endswith(".json") else self.compression
            self._zf.writestr(info, value.to_bytes())

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not await self.exists(key):
            await self.set(key, value)

    async def delete(self, key: str) -> None:
        """Deleting from an old zip erases all of it (see the module docstring); a key of the
        new zip cannot be deleted (zarr's ZipStore rule)."""
        self._check_writable()
        if self._old is not None or self._foreign:
            self._erase_old()
        elif self._started:
            await super().delete(key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        if self._old is not None or self._foreign:
            self._erase_old()
        elif self._started:
            await super().delete_dir(prefix)

    async def clear(self) -> None:
        self._check_writable()
        self._erase_old()
        self._abandon()

    def abort(self) -> None:
        """Give up: drop what was written (the temp file) and leave the target as it was.  For a
        copy that failed half way; :meth:`close` would publish the partial zip."""
        self._is_open = False
        if self._old is not None:
            self._old.close()
            self._old = None
        self._abandon()

    def close(self) -> None:
        """Finish the zip and rename it onto the target (nothing happens when nothing was
        written).  On failure the temp file is removed and the target left as it was."""
        self._is_open = False
        if self._old is not None:
            self._old.close()
            self._old = None
        if not self._started:
            return
        assert self._finalizer is not None
        self._finalizer.detach()
        self._finalizer = None
        self._started = False
        try:
            with self._lock:
                self._zf.close()  # writes the central directory: a full disk shows here
            os.replace(self.path, self.target)
        except BaseException:
            _discard(self._zf, str(self.path))
            raise

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"a .zip store being written ({self.target}) cannot be pickled")

    def __repr__(self) -> str:
        return f"ZipWriter('{self.target}')"


# -- reading -------------------------------------------------------------------------------------
def check_zip_file(path: str) -> None:
    """Raise :class:`NotATrajstoreError` naming ``path`` and what it is when it is no zip file
    (zipfile's own "File is not a zip file" names neither)."""
    import stat

    from trajstore.storage.confined import file_kind

    try:
        st = os.stat(path)
    except OSError:
        return  # missing: the caller says so
    if not stat.S_ISREG(st.st_mode):  # never read a FIFO or a device to find out
        what = f"a {file_kind(st.st_mode)}"
    elif zipfile.is_zipfile(path):
        return
    elif st.st_size == 0:
        what = "an empty file"
    else:
        with open(path, "rb") as f:
            start = f.read(16)
        what = f"a file of {st.st_size} bytes that is no zip archive (it starts with {start!r})"
    raise NotATrajstoreError(f"{path} is {what}, not a trajstore store: a store path ending in .zip must be a zip "
                             "written by dumps() or `trajstore copy` (other stores are folders or URLs)")


# -- writing a store into a zip ------------------------------------------------------------------
def _zip_layout(store: "Store", path: str, row_shape: tuple[int, ...], dtype: np.dtype, capacity: int | None,
                rows: int, src_chunk_rows: int, compressor: Any, chunk_rows: int | None) -> tuple[Any, Any]:
    """``(FieldSpec, zarr compressors)`` of one field of a table holding ``rows`` committed rows
    in the zip (see :func:`write_zip`)."""
    from trajstore.storage.fields.spec import FieldSpec, _raw_row_align, make_field_spec, parse_compressor

    import zarr

    codecs = store.group[path].metadata.codecs  # type: ignore[union-attr]
    src = [c for c in codecs if isinstance(c, zarr.abc.codec.BytesBytesCodec)]  # compressors, not the bytes codec
    choice = compressor
    if isinstance(choice, str) and choice == "auto":
        choice = "keep" if src else ZIP_COMPRESSOR
    if isinstance(choice, str) and choice == "keep":
        if src:  # the source's own codec, as configured (row blocks included)
            return FieldSpec(path, row_shape, dtype, chunk_rows or src_chunk_rows, "compressed"), tuple(src)
        choice = None
    spec = make_field_spec(path, row_shape, dtype, capacity=capacity, compressor=choice, chunk_rows=chunk_rows)
    if chunk_rows is None:
        # Chunks are stored whole, padding included (a compressed chunk still pays per block for
        # its padding: 85 demo rows in 1 MiB lz4 chunks were 5 KiB a field): no chunk much bigger
        # than the committed rows.  Raw chunks stay whole pages (a copy back into a folder is
        # memory-mapped again); compressed ones a power of two.
        if spec.layout == "raw":
            align = _raw_row_align(max(spec.row_bytes, 1))
            spec.chunk_rows = min(spec.chunk_rows, -(-max(rows, 1) // align) * align)
        else:
            spec.chunk_rows = min(spec.chunk_rows, 1 << max(rows - 1, 0).bit_length())
    if spec.layout == "raw":
        return spec, None
    codec, _label = parse_compressor(spec.compressor, spec.dtype)
    return spec, codec


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
        The ``.zip`` to write; it appears there complete (temp file + rename) or not at all.
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
    import zarr
    from zarr.storage import MemoryStore

    from trajstore.storage.fields.spec import chunk_key
    from trajstore.storage.head import HEAD_KEY, LOCK_KEY, MPLOCK_KEY, TableState, write_head
    from trajstore.core.ring import contiguous_runs
    from trajstore.storage.schema import check_schema
    from trajstore.storage.location import STAGING_DIR, TMP_DIR, Location
    from trajstore.core.store import ATTRS_KEY, _consolidate, _progress

    target = os.fspath(target)
    head = store.committed.copy()
    head.pending = None
    attrs = copy.deepcopy(store.attrs)
    plans = []  # (table, field, spec, compressors)
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
    check_schema(attrs, target)  # what open would refuse is refused before a byte is written

    # The zip's metadata, made by zarr as Store.create makes it, in memory.
    mem = Location(MemoryStore(), None, None)
    group = zarr.create_group(mem.zstore, attributes={ATTRS_KEY: attrs})
    for _t, _f, spec, codec, alloc in plans:
        group.create_array(spec.array_path, shape=(alloc, *spec.row_shape), chunks=(spec.chunk_rows, *spec.row_shape),
                           dtype=spec.dtype, compressors=codec, filters=None,
                           fill_value=np.zeros((), spec.dtype)[()], config={"write_empty_chunks": True})
    _consolidate(mem)

    writer = ZipWriter(target, compression=zip_compression)
    loc = Location(writer, target, None)
    try:
        if loc.exists("zarr.json") or loc.exists(HEAD_KEY):
            if not overwrite:
                raise StoreExistsError(f"{target}: a store already exists here")
            writer._erase_old()
        for key in mem.list_prefix(""):
            loc.put(key, mem.get(key, limit=1 << 62) or b"")  # every key listed holds bytes
        arrays = tuple(spec.array_path + "/" for _t, _f, spec, _c, _a in plans)
        for key in store.loc.list_prefix(""):  # the dataset description and other root files
            # Not the commit record nor a kept copy of an older one (its allocation is the source's).
            if (key in (LOCK_KEY, MPLOCK_KEY) or key.startswith(("trajstore.head", TMP_DIR, STAGING_DIR, *arrays))
                    or key == "zarr.json" or key.endswith("/zarr.json")):
                continue
            data = store.loc.get(key)
            if data is not None:
                loc.put(key, data)
        bar = _progress(sum(t.count for t in store.tables.values() for _ in t.fields), f"write {target}", progress,
                        unit="row")
        try:
            for t, f, spec, _codec, alloc in plans:
                C, ndim = spec.chunk_rows, len(spec.row_shape) + 1
                runs = contiguous_runs(t.state.start, t.state.end, t.capacity)
                needed = sorted({k for p, _o, m in runs for k in range(p // C, (p + m - 1) // C + 1)})
                z = zarr.open_array(mem.zstore, path=spec.array_path, mode="r+").with_config({"write_empty_chunks": True})
                for k0, k1 in _chunk_blocks(needed, max(1, _BLOCK_BYTES // max(C * spec.row_bytes, 1))):
                    lo, hi = k0 * C, min(k1 * C, alloc)
                    data = np.zeros((hi - lo, *spec.row_shape), spec.dtype)  # rows not committed: the fill value
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
        finally:
            bar.close()
        write_head(loc, head)  # the commit record last, as in every copy
    except BaseException:
        writer.abort()  # a zip cut short is never published
        raise
    loc.close()  # publishes the zip (rename onto the target)
