"""The one way foreign bytes enter trajstore: every import (D4RL, robomimic, Minari, Diffusion
Policy, LeRobot, SB3 replay-buffer pickles) and :func:`~trajstore.interop.open_diffusion_policy`
open their sources here.

A foreign file is input, as a store is (docs/design.md, invariants 7 and 10): nothing it says may make trajstore read a
file outside it, block on a special file, allocate without bound, recurse without bound or raise
anything but a :mod:`trajstore.errors` type.  The rules are the store's own
(:mod:`trajstore.storage.confined`, :mod:`trajstore.storage.schema`), applied to each format:

- files: :func:`open_file` opens the file a caller named without blocking (``O_NONBLOCK``: a
  FIFO is refused by ``fstat`` before any read) and :func:`open_below` a file inside a foreign
  folder with no link anywhere below that folder (``main_data.hdf5`` linked out of a Minari
  dataset is refused);
  :func:`check_folder` walks a foreign folder (bounded entries) refusing links and special files;
- HDF5 (:func:`open_hdf5`): h5py reads the open file object, never a path; every link of the file
  is walked once before any value is read (:func:`check_hdf5`): external and soft links,
  datasets stored outside the file (external raw storage, virtual datasets), objects reached
  twice (hard-link cycles), nesting deeper than :data:`~trajstore.storage.schema.MAX_DEPTH` and
  more than :data:`MAX_LINKS` links are refused, each dataset's declared shape, chunk and size
  checked (:func:`check_declared`); attributes are read only below a size (:func:`read_attr`);
- zarr (:func:`open_zarr`): the store's own confined location (links, special files, metadata
  sizes: :class:`~trajstore.storage.confined.ConfinedLocalStore`), zip entries checked against
  the same read bounds;
- JSON a foreign file carries (:func:`parse_json`): size and nesting bounded.

Every refusal is a :class:`~trajstore.errors.ForeignFileError` (a
:class:`~trajstore.errors.DamagedStoreError`) naming the file and the offending object, raised
before anything is written to an import's destination.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trajstore.errors import (
    DamagedStoreError,
    ForeignFileError,
    NotATrajstoreError,
    StoreNotFoundError,
    TrajstoreError,
)
from trajstore.storage.confined import MAX_META_BYTES, OPEN_FLAGS, Confinement, file_kind, read_limit
from trajstore.storage.schema import (
    MAX_ARRAY_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_DEPTH,
    MAX_ROW_ELEMENTS,
    load_json,
)
from trajstore.storage.tree_check import check_tree

__all__ = ["open_file", "open_below", "check_folder", "h5py_module", "open_hdf5", "check_hdf5", "check_declared",
           "check_expansion", "zarr_stored_bytes",
           "read_attr", "read_rows", "parse_json", "open_zarr", "check_rows", "MAX_LINKS", "MAX_EXPANSION",
           "MAX_FOREIGN_FILE_BYTES", "MAX_FOLDER_ENTRIES"]

#: Links (groups and datasets) walked in one HDF5 file: a robomimic file of 10,000 demos of 40
#: datasets each is 400,000.
MAX_LINKS = 1 << 20
#: Entries (files and folders) of one foreign folder walked (a Minari dataset, a zarr folder).
MAX_FOLDER_ENTRIES = 1 << 22
#: Decoded bytes a dataset may declare per byte it stores (deflate reaches about 1,000 on
#: zeros): more is a dataset whose rows are not in the file (unwritten chunks read as the fill
#: value) or a decompression bomb; either would make an import run for as long as it declares.
MAX_EXPANSION = 1 << 16
#: Bytes of one foreign file (an HDF5 file holds at most a few arrays of MAX_ARRAY_BYTES).
MAX_FOREIGN_FILE_BYTES = 1 << 48


# -- files and folders ----------------------------------------------------------------------------
def _not_regular(path: str, mode: int, what: str) -> ForeignFileError:
    return ForeignFileError(f"{what}: {path} is a {file_kind(mode)}, not a regular file; trajstore never follows "
                            "links or opens special files of a source it imports")


def _regular(fd: int, path: str, what: str) -> Any:
    """``fd`` as an unbuffered binary file object, once ``fstat`` shows a regular file of a
    plausible size (the fd is closed otherwise); blocking reads again."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode, what)
        if st.st_size > MAX_FOREIGN_FILE_BYTES:
            raise ForeignFileError(f"{what}: {path} holds {st.st_size} bytes; at most {MAX_FOREIGN_FILE_BYTES} are "
                                   "read")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def open_file(path: str, what: str) -> Any:
    """The regular file ``path`` a caller named opened for reading (an unbuffered ``io.FileIO``;
    close it), without blocking on a FIFO.  A link the caller named is followed (their choice,
    as a store's own root may be a link); a file that a foreign folder names goes through
    :func:`open_below` instead, which follows none.

    Raises
    ------
    StoreNotFoundError
        Nothing is at ``path``.
    ForeignFileError
        ``path`` is a FIFO, a device or another special file, or too large.
    """
    try:
        fd = os.open(path, os.O_RDONLY | (OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0)))
    except FileNotFoundError:
        raise StoreNotFoundError(f"{what}: {path}: no such file") from None
    except IsADirectoryError:
        raise NotATrajstoreError(f"{what}: {path} is a folder; expected a file") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK):
            raise _not_regular(path, os.lstat(path).st_mode, what) from None
        raise
    return _regular(fd, path, what)


def open_below(root: str, key: str, what: str) -> Any:
    """The regular file ``key`` below the folder ``root`` (a foreign dataset's own folder), with no
    symbolic link on the way below ``root`` (:class:`~trajstore.storage.confined.Confinement`).

    Raises
    ------
    StoreNotFoundError
        Nothing is at ``key``.
    ForeignFileError
        A link or special file at ``key`` or at a folder on the way to it.
    """
    try:
        fd = Confinement(Path(root), root).open(key, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreNotFoundError(f"{what}: {os.path.join(root, key)}: no such file") from None
    except DamagedStoreError as e:
        raise ForeignFileError(f"{what}: {e}") from None
    return _regular(fd, os.path.join(root, key), what)


def check_folder(root: str, what: str) -> None:
    """Walk the foreign folder ``root`` (without following anything): every entry below it must be
    a real folder or a regular file, at most :data:`MAX_FOLDER_ENTRIES` of them.

    Raises
    ------
    ForeignFileError
        Naming the first link or special file found, or the count.
    """

    def refuse(path: str, mode: int | None) -> Exception:
        if mode is None:
            return ForeignFileError(f"{what}: {root} holds more than {MAX_FOLDER_ENTRIES} files and folders")
        return _not_regular(path, mode, what)

    check_tree(root, MAX_FOLDER_ENTRIES, refuse)


def parse_json(raw: Any, where: str, key: str) -> Any:
    """JSON text (str or bytes) a foreign file carries, at most
    :data:`~trajstore.storage.confined.MAX_META_BYTES` and nested at most
    :data:`~trajstore.storage.schema.MAX_DEPTH` deep.

    Raises
    ------
    ForeignFileError
        Too large, too deeply nested, or not JSON; naming ``where`` and ``key``.
    """
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else bytes(raw)
    if len(data) > MAX_META_BYTES:
        raise ForeignFileError(f"{where}: {key} holds {len(data)} bytes of JSON; at most {MAX_META_BYTES} are read")
    try:
        return load_json(data, where, key)
    except DamagedStoreError as e:
        raise ForeignFileError(str(e)) from None


# -- declared sizes --------------------------------------------------------------------------------
def check_declared(shape: tuple[int, ...], dtype: Any, chunks: tuple[int, ...] | None, where: str) -> None:
    """A foreign array's declared ``shape`` (rows along axis 0), ``dtype`` and ``chunks`` within
    the limits of trajstore's own stores, before anything is allocated from them: elements per
    row (:data:`~trajstore.storage.schema.MAX_ROW_ELEMENTS`: also what a Box's bounds allocate),
    bytes per chunk, chunks and bytes per array.

    Raises
    ------
    ForeignFileError
        Naming ``where`` and the size.
    """
    row_shape = tuple(int(s) for s in shape[1:])
    elements = int(np.prod(row_shape, dtype=object)) if row_shape else 1
    if elements > MAX_ROW_ELEMENTS:
        raise ForeignFileError(f"{where}: rows of shape {list(row_shape)} hold more than {MAX_ROW_ELEMENTS} elements; "
                               "not plausible")
    row_bytes = max(elements * np.dtype(dtype).itemsize, 1)
    rows = int(shape[0]) if shape else 1
    if rows * row_bytes > MAX_ARRAY_BYTES:
        raise ForeignFileError(f"{where}: {rows} rows of {row_bytes} bytes; more than {MAX_ARRAY_BYTES} bytes, not "
                               "plausible")
    if chunks:
        chunk_bytes = int(np.prod([int(c) for c in chunks], dtype=object)) * np.dtype(dtype).itemsize
        count = int(np.prod([-(-int(s) // max(int(c), 1)) for s, c in zip(shape, chunks)], dtype=object))
        if chunk_bytes > MAX_CHUNK_BYTES or count > MAX_CHUNKS:
            raise ForeignFileError(f"{where}: chunks of {list(chunks)} ({chunk_bytes} bytes), {count} of them; at most "
                                   f"{MAX_CHUNK_BYTES} bytes per chunk and {MAX_CHUNKS} chunks are read")


def check_expansion(declared: int, stored: int, where: str, *, slack: int) -> None:
    """An array declaring ``declared`` decoded bytes stores at least 1 / :data:`MAX_EXPANSION` of
    them (beyond ``slack`` bytes): more is an array whose rows are not in the source (unwritten
    chunks read as the fill value: 10**12 rows declared by a file of a few KB) or a
    decompression bomb, either of which an import would read for as long as it declares.

    Raises
    ------
    ForeignFileError
        Naming ``where`` and both sizes.
    """
    if declared > MAX_EXPANSION * max(stored, slack):
        raise ForeignFileError(f"{where} declares {declared} bytes but stores {stored}; more than {MAX_EXPANSION} "
                               "times what it holds (unwritten rows or a decompression bomb), not read")


def zarr_stored_bytes(src: str, prefix: str) -> int:
    """Bytes the foreign zarr store ``src`` (a folder checked by :func:`check_folder`, or a zip)
    holds under ``prefix`` (an array's folder: its chunks and metadata), as stored (compressed)."""
    if os.path.isdir(src):
        total, stack = 0, [os.path.join(src, prefix)]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for e in entries:
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif stat.S_ISREG(st.st_mode):
                    total += st.st_size
        return total
    import zipfile

    with zipfile.ZipFile(src) as zf:
        return sum(i.compress_size for i in zf.infolist() if i.filename.startswith(prefix + "/"))


def check_rows(rows: int, where: str) -> None:
    """``rows`` steps fit a trajstore store (its episode-id column, 8 bytes a row).

    Raises
    ------
    ForeignFileError
        Naming ``where``.
    """
    if rows * 8 > MAX_ARRAY_BYTES:
        raise ForeignFileError(f"{where}: {rows} rows; more than a trajstore store holds")


# -- HDF5 -----------------------------------------------------------------------------------------
def h5py_module(what: str) -> Any:
    """h5py, or :class:`~trajstore.errors.MissingDependencyError` naming ``what`` needs it."""
    try:
        import h5py  # type: ignore[import-untyped]  # h5py ships no type information
    except ImportError:
        from trajstore._optional import missing

        raise missing("h5py", what) from None
    return h5py


@contextlib.contextmanager
def open_hdf5(h5py: Any, path: str, what: str, *, below: str | None = None) -> Iterator[Any]:
    """The HDF5 file ``path`` (or the key ``path`` below the folder ``below``) opened read-only
    through a file object (:func:`open_file` / :func:`open_below`), its every link walked and
    checked (:func:`check_hdf5`) before it is yielded.

    Raises
    ------
    NotATrajstoreError
        Not an HDF5 file.
    ForeignFileError
        What :func:`open_file` and :func:`check_hdf5` refuse.
    """
    fobj = open_below(below, path, what) if below is not None else open_file(path, what)
    src = os.path.join(below, path) if below is not None else path
    try:
        try:
            f = h5py.File(fobj, "r")
        except OSError as e:
            raise NotATrajstoreError(f"{what}: {src} is not an HDF5 file ({e})") from None
        with f:
            check_hdf5(h5py, f, src)
            yield f
    finally:
        fobj.close()


def check_hdf5(h5py: Any, f: Any, src: str) -> None:
    """Walk every link of the open HDF5 file ``f`` once (iteratively, never recursing) and refuse
    what an import never needs and could be made to read outside the file, forever or without
    bound: external links, soft links, an object reached by two links (a hard-link cycle),
    groups nested deeper than :data:`~trajstore.storage.schema.MAX_DEPTH`, more than
    :data:`MAX_LINKS` links, and datasets :func:`_check_dataset` refuses.  After it, plain
    ``f[name]`` lookups of an importer reach only checked objects inside the file.

    The walk uses h5py's low-level API (one link iteration per group, one object open per
    link): the high-level ``Group.get`` / ``Dataset`` properties cost about 1 ms per dataset.

    Raises
    ------
    ForeignFileError
        Naming ``src`` and the object.
    """
    h5l, h5o = h5py.h5l, h5py.h5o
    root = h5o.get_info(f.id)
    seen = {(root.fileno, root.addr)}
    stack: list[tuple[Any, str, int]] = [(f.id, "", 0)]
    total = 0
    while stack:
        gid, path, depth = stack.pop()
        total += gid.get_num_objs()  # the group's link count, before its names are listed
        if total > MAX_LINKS:
            raise ForeignFileError(f"{src}: more than {MAX_LINKS} links (groups and datasets); not plausible")
        links: list[tuple[bytes, int]] = []
        gid.links.iterate(lambda name, info, out=links: out.append((name, info.type)), info=True)
        for name, kind in links:
            where = f"{path}/{name.decode('utf-8', 'backslashreplace')}"
            if kind == h5l.TYPE_EXTERNAL:
                file, target = (v.decode("utf-8", "backslashreplace")[:200] for v in gid.links.get_val(name))
                raise ForeignFileError(f"{src}: {where} is an external link to {file}:{target}; trajstore reads "
                                       "nothing outside the file it imports")
            if kind != h5l.TYPE_HARD:
                what = "SoftLink" if kind == h5l.TYPE_SOFT else f"link of type {kind}"
                raise ForeignFileError(f"{src}: {where} is a {what}; the formats trajstore imports hold plain groups "
                                       "and datasets, and links are never followed")
            oid = h5o.open(gid, name)
            info = h5o.get_info(oid)
            if (info.fileno, info.addr) in seen:
                raise ForeignFileError(f"{src}: {where} is an object already reached by another link (a hard-link "
                                       "cycle or a shared object); not read")
            seen.add((info.fileno, info.addr))
            if info.type == h5o.TYPE_GROUP:
                if depth + 1 > MAX_DEPTH:
                    raise ForeignFileError(f"{src}: {where} nests groups deeper than {MAX_DEPTH} levels")
                stack.append((oid, where, depth + 1))
            elif info.type == h5o.TYPE_DATASET:
                _check_dataset(h5py, oid, f"{src}: {where}")


def _check_dataset(h5py: Any, did: Any, where: str) -> None:
    """A dataset (its low-level id) whose values are all inside the file and whose declared size
    is bounded (:func:`check_declared`, :data:`MAX_EXPANSION`, :func:`_check_chunks`)."""
    dcpl = did.get_create_plist()
    layout = dcpl.get_layout()
    if layout == h5py.h5d.VIRTUAL:
        raise ForeignFileError(f"{where} is a virtual dataset (it maps other files); trajstore reads nothing outside "
                               "the file it imports")
    if dcpl.get_external_count():
        name = dcpl.get_external(0)[0]
        name = name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else str(name)
        raise ForeignFileError(f"{where} keeps its values in external files ({name[:200]}...); trajstore reads "
                               "nothing outside the file it imports")
    shape = tuple(did.shape) if did.shape is not None else ()
    dtype = did.dtype
    chunks = tuple(dcpl.get_chunk()) if layout == h5py.h5d.CHUNKED else None
    check_declared(shape, dtype, chunks, where)
    size = int(np.prod(shape, dtype=object)) * dtype.itemsize if shape else dtype.itemsize
    check_expansion(size, int(did.get_storage_size()), where, slack=1024)
    if chunks is not None and dcpl.get_nfilters():
        _check_chunks(did, chunks, dtype, where)


def _check_chunks(did: Any, chunks: tuple[int, ...], dtype: np.dtype[Any], where: str) -> None:
    """Each stored chunk of a filtered (compressed) dataset is at most its decoded size plus
    deflate's worst overhead on incompressible data: HDF5's deflate filter grows its output
    until the stream ends, so a chunk storing more than it decodes to (a deflate bomb: 256 KiB
    inflating to 256 MiB for a 1,200-byte chunk) would allocate what the stream says, not
    what the dataset declares.  Within this bound a chunk decodes to at most about 1,000 times
    its declared size (deflate's ratio)."""
    chunk_bytes = int(np.prod(chunks, dtype=object)) * dtype.itemsize
    limit = chunk_bytes + chunk_bytes // 1000 + 1024

    def visit(info: Any) -> None:
        if info.size > limit:
            raise ForeignFileError(f"{where}: the chunk at {tuple(info.chunk_offset)} stores {info.size} bytes for "
                                   f"{chunk_bytes} decoded; more than any compression stores (a decompression bomb), "
                                   "not read")

    if hasattr(did, "chunk_iter"):  # h5py 3.8+ with HDF5 1.14 (older: the expansion bound only)
        did.chunk_iter(visit)


def read_attr(node: Any, name: str, where: str, limit: int = MAX_META_BYTES) -> Any:
    """The attribute ``name`` of an HDF5 object (None when missing), read only when it stores at
    most ``limit`` bytes.

    Raises
    ------
    ForeignFileError
        A larger attribute.
    """
    if name not in node.attrs:
        return None
    size = int(node.attrs.get_id(name).get_storage_size())
    if size > limit:
        raise ForeignFileError(f"{where}: attribute {name!r} stores {size} bytes; at most {limit} are read")
    return node.attrs[name]


def read_rows(d: Any, lo: int, hi: int, where: str) -> np.ndarray:
    """Rows ``lo:hi`` of a checked HDF5 dataset; a read error (a damaged file, a filter that fails)
    as :class:`~trajstore.errors.DamagedStoreError`."""
    try:
        return np.asarray(d[lo:hi])
    except (OSError, ValueError, RuntimeError) as e:
        # h5py reports a filter that fails, or cannot allocate its output, as an OSError; a
        # chunk's decoded size is bounded by check_declared, so this is the file, not the machine.
        raise DamagedStoreError(f"{where}: rows {lo}:{hi} cannot be read ({type(e).__name__}: {e}); the file is "
                                "damaged") from None


# -- zarr -----------------------------------------------------------------------------------------
def open_zarr(src: str, what: str) -> tuple[Any, Any]:
    """``(location, root group)`` of the foreign zarr store ``src`` (a folder, format 2 or 3, or a
    ``.zip``), read-only through trajstore's own confined location: no link or special file below
    the folder is opened, metadata files are read up to
    :func:`~trajstore.storage.confined.read_limit`, and every zip entry is checked to expand to
    at most that bound before zarr reads one whole.  Close the location when done.

    Raises
    ------
    NotATrajstoreError
        Not a zarr group.
    DamagedStoreError
        A zip entry claiming too much; what the confined store refuses.
    """
    from trajstore.storage.location import resolve_location

    loc = resolve_location(src, read_only=True, must_exist=True)
    try:
        if not loc.is_local:
            _check_zip_entries(src)
        return loc, _open_root(loc.zstore, src, what)
    except BaseException:
        loc.close()
        raise


def _check_zip_entries(src: str) -> None:
    """Every entry of the zip ``src`` expands to at most what a folder read takes of such a file
    (:func:`~trajstore.storage.confined.read_limit`): zarr reads an entry whole, so an entry
    claiming more (a deflate bomb) is refused before it is.  (zipfile never returns more than an
    entry claims, so a claim that lies is bounded too, and its CRC fails.)"""
    import zipfile

    with zipfile.ZipFile(src) as zf:
        for info in zf.infolist():
            if info.file_size > read_limit(info.filename):
                raise ForeignFileError(f"{src}: zip entry {info.filename[:200]!r} expands to {info.file_size} bytes; "
                                       f"at most {read_limit(info.filename)} are read from one file")


def _open_root(zstore: Any, src: str, what: str) -> Any:
    """The root group of the store in ``zstore`` (format 2 or 3), read-only."""
    import zarr

    try:
        return zarr.open_group(zstore, mode="r")
    except TrajstoreError:
        raise
    except Exception as e:  # noqa: BLE001  # zarr raises many kinds for "not a group here" and bad metadata
        raise NotATrajstoreError(f"{what}: {src} is not a zarr group ({type(e).__name__}: {e}); expected a Diffusion "
                                 "Policy replay buffer (data/<key> arrays and meta/episode_ends)") from None
