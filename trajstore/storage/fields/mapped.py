"""``MappedField``: a raw field on a local folder, its chunk files memory-mapped side by side.

Uncompressed chunks (codec ``bytes``, little-endian).  Each chunk file has the full size of a
chunk (what zarr's ``bytes`` codec reads) and is memory-mapped into one reserved address range
(:mod:`._vmap`, each chunk at a 2 MiB boundary when it spans one); the writer copies rows
straight into the page cache and readers gather with one numpy fancy index.  zarr-python is used
only for metadata.

Disk blocks grow with the rows: a new chunk file is sparse past its first :data:`GROW_FIRST_BYTES`,
and the writer allocates more (``fallocate``, doubling up to :data:`GROW_MAX_STEP_BYTES` a step)
before it stores rows there, so a store into a mapping never meets a full disk (which would be
``SIGBUS``): a full disk is a :class:`~trajstore.errors.StoreFullError` before any row of the
write is stored.  The holes past the written rows read as zeros (zarr's fill value), take no
disk, and are what a small store saved against chunk files allocated whole (2 MiB per field).

A reader maps the chunk files of the committed rows; a file missing there, or shorter than a
chunk, is a :class:`~trajstore.errors.DamagedStoreError` naming the field and the rows, raised
when the chunk is mapped (once per chunk file, not per row).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from trajstore.errors import DamagedStoreError, MappingLimitError
from trajstore.storage.confined import full_disk as _full_disk
from trajstore.storage.fields import _syscalls, _vmap
from trajstore.storage.fields.base import edit_chunk
from trajstore.storage.fields.folios import PieceFiller, zero_piece
from trajstore.storage.fields.spec import (
    PWRITE_BYTES,
    FieldSpec,
    chunk_key,
)
from trajstore.storage.location import Location, fsync_dir

__all__ = ["GROW_FIRST_BYTES", "GROW_MAX_STEP_BYTES", "MappedField", "in_place_writes_work", "mapped_rows"]

#: Bytes of a new chunk file allocated when it is created (the rest is a hole until rows reach it):
#: a small store's field takes this much, not a whole chunk (2 MiB).
GROW_FIRST_BYTES = 16 << 10
#: Each later allocation doubles what a chunk file has, by at most this many bytes: a few
#: ``fallocate`` calls per chunk file (8 for a 2 MiB chunk), never more than this ahead of the rows.
GROW_MAX_STEP_BYTES = 1 << 20


class MappedField:
    """A raw field on a local folder, memory-mapped chunk by chunk into one virtual array
    (a :class:`~trajstore.storage.fields.base.Field`)."""

    keeps_partial_chunk = False  # rows are in the mapped file as soon as they are written
    open_from: int | None = None  # every row written goes out at flush

    def end_run(self, row: int) -> None:
        """Episodes are not this engine's concern (video fields encode them)."""

    def __init__(self, loc: Location, spec: FieldSpec, allocated: int, writable: bool, sole: bool = False):
        self.loc, self.spec, self.writable = loc, spec, writable
        self.C = spec.chunk_rows
        self._ndim = len(spec.row_shape) + 1
        self._synced: set[int] = set()  # chunks written since the last fsync
        self._last_k = -1
        self._fds: dict[int, int] = {}  # writer: open chunk files for pwrite of large blocks
        # Writer: bytes at the start of chunk file k known to have disk blocks (allocated by this
        # process, or found so); stores into the mapping stay below it (see _make_room).
        self._room: dict[int, int] = {}
        # Writer: chunk files this process created and has stored nothing into yet.  Their first
        # rows go in by pwrite: the first store through the mapping of a new file faults into the
        # filesystem's journal (ext4 page_mkwrite: 1-10 ms on a busy disk, more the more files
        # were just made), where a pwrite takes 10-20 us; an import of 3,000 one-chunk fields
        # spent most of its time there.
        self._fresh: set[int] = set()
        self._va = self._reserve(allocated)
        # Writer: the 2 MiB pieces of the chunk files it makes, filled with zeros as rows reach them
        # (only the store's only writer: not multiprocessing=True).
        self._pieces = PieceFiller(self.C, self._va.row_bytes, self._va.chunk_bytes, sole and writable)
        self.allocated = allocated

    def _reserve(self, allocated: int) -> _vmap.VirtualArray:
        return _vmap.VirtualArray(-(-allocated // self.C), self.C, self.spec.row_shape, self.spec.dtype, self.writable)

    def _path(self, k: int, prefix: str = "") -> str:
        key = chunk_key(self.spec.array_path, k, self._ndim)
        return str(self.loc.path(f"{prefix}/{key}" if prefix else key))

    def grow(self, allocated: int) -> None:
        """Re-reserve a larger range and map the same chunk files into it (no metadata is
        written: the allocation is the commit record's, the shape plain readers see is published
        with each commit)."""
        old = self._va
        self._va = self._reserve(allocated)
        try:
            with self.loc.held_root():
                for k in np.flatnonzero(old.mapped).tolist():
                    self._map(k)  # a file gone meanwhile reads as zeros, as a missing chunk does
        finally:
            old.close()
        self.allocated = allocated

    def ensure_mapped(self, phys_lo: int, phys_hi: int, create: bool) -> None:
        """Map every chunk file touching rows ``[phys_lo, phys_hi)``; the writer creates missing ones."""
        if phys_hi <= phys_lo:
            return
        k_lo, k_hi = phys_lo // self.C, (phys_hi - 1) // self.C + 1
        todo = np.flatnonzero(~self._va.mapped[k_lo:k_hi])
        if not len(todo):
            return
        with self.loc.held_root():
            for k in (todo + k_lo).tolist():
                if self._map(k):
                    continue
                if not create:
                    # Rows the commit record counts (a reader maps only those) with no chunk file:
                    # deleted, or a record naming rows never written.  Zeros would be wrong data.
                    lo, hi = max(phys_lo, k * self.C), min(phys_hi, (k + 1) * self.C)
                    raise DamagedStoreError(f"{self.spec.array_path}: rows {lo}..{hi - 1} (physical) are committed, "
                                            f"but their chunk file {self._path(k)} is missing; run `trajstore verify` "
                                            "(and `trajstore repair` to keep the rows before it)")
                room = self._create_chunk_file(self._path(k))
                if not self._map(k):
                    raise DamagedStoreError(f"chunk file {self._path(k)} vanished right after it was created")
                self._room[k] = room
                self._fresh.add(k)
                self._pieces.made(k)

    def _create_chunk_file(self, path: str) -> int:
        """Create chunk file ``path``: full size, zero-filled, its first :data:`GROW_FIRST_BYTES`
        allocated and the rest a hole (:meth:`_make_room` allocates more before rows reach it).
        Returns the bytes allocated: the whole chunk where the filesystem cannot preallocate
        (then zeros are written, which allocates them just as well).

        A full disk is a :class:`StoreFullError` here, before any row is written.  Built under a
        temp name and renamed, so a chunk file is never seen half-made; on failure the temp file
        is removed.
        """
        tmp, size = None, self._va.chunk_bytes
        try:
            tmp = self.loc.new_tmp_path()
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                os.ftruncate(fd, size)  # full size first: allocating then changes no size
                room = min(GROW_FIRST_BYTES, size)
                _syscalls.reserve(fd, room, fresh=True)
                if not _syscalls.reserve_range(fd, 0, room):
                    # The kernel cannot allocate here without writing (posix_fallocate wrote zeros):
                    # growing in place would be unsafe, so the file is allocated whole now.
                    _syscalls.reserve(fd, size, fresh=True)
                    room = size
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            raise _full_disk(e, path, f"create chunk file ({size} bytes)")
        return room

    def _make_room(self, phys_lo: int, phys_hi: int) -> None:
        """Make sure the disk blocks under rows ``[phys_lo, phys_hi)`` are allocated before they are
        stored through the mapping (a store into a hole on a full disk is ``SIGBUS``).

        Each chunk file touched is allocated from what this process knows it has up to the end of
        the rows, at least doubled (by at most :data:`GROW_MAX_STEP_BYTES`), so a run of appends
        calls ``fallocate`` a few times per chunk file.  A chunk file first touched by this process
        (reopened, or replaced by a rewrite) is allocated from its start: blocks it already has
        cost nothing to allocate again.

        Raises
        ------
        StoreFullError
            The disk is full: nothing of the write has been stored yet.
        """
        C, rb, room = self.C, self._va.row_bytes, self._room
        for k in range(phys_lo // C, (phys_hi - 1) // C + 1):
            need = (min(phys_hi - k * C, C)) * rb
            have = room.get(k, 0)
            if need <= have:
                continue
            size = self._va.chunk_bytes
            new = min(size, max(-(-need // _syscalls.PAGE) * _syscalls.PAGE,
                                min(max(2 * have, GROW_FIRST_BYTES), have + GROW_MAX_STEP_BYTES)))
            try:
                ok = _syscalls.reserve_range(self._fd(k), have, new - have)
            except OSError as e:
                raise _full_disk(e, self._path(k), f"allocate bytes {have}..{new - 1} of chunk file {k}")
            # Where the filesystem cannot preallocate, the files this version made there were
            # written whole (_create_chunk_file); nothing more can be done for older sparse ones.
            room[k] = new if ok else size

    def _file_name(self, key: str) -> str:
        """Chunk file ``key`` as errors name it (built only for one: not per file mapped)."""
        return f"{self.loc.local_root}/{key}"

    def _map(self, k: int, prefix: str = "") -> bool:
        """Map chunk file ``k`` (under the staging ``prefix`` if given); False when there is none.

        The file is opened through the store's confinement (no link, no special file, nothing
        outside the store), so a tampered store cannot make a writer store rows elsewhere.
        """
        key = chunk_key(self.spec.array_path, k, self._ndim)
        key = f"{prefix}/{key}" if prefix else key
        try:
            # The fstat that showed it a regular file also gives map_chunk its size: one per chunk file.
            fd, st = self.loc.open_inside(key, os.O_RDWR if self.writable else os.O_RDONLY, with_stat=True)
        except FileNotFoundError:
            name = self._file_name(key)
            with contextlib.suppress(OSError):  # only metadata is looked at: nothing is followed or opened
                if stat.S_ISDIR(os.lstat(name).st_mode):
                    raise DamagedStoreError(f"chunk file {name!r} is a folder, not a regular file; not mapped")
            return False
        try:
            self._va.map_chunk(k, fd, lambda: self._file_name(key), st)
        except EOFError as e:
            raise DamagedStoreError(f"{self.spec.array_path}: rows {k * self.C}..{(k + 1) * self.C - 1} "
                                    f"(physical): {e}") from None
        except OSError as e:
            name = self._file_name(key)
            if e.errno == errno.ENOMEM:
                raise MappingLimitError(e.errno, f"cannot map chunk {k} of {self.spec.array_path}: the process has "
                                        "reached its limit of memory mappings (vm.max_map_count; see "
                                        "trajstore.errors.MappingLimitError)", name) from None
            if e.errno in _syscalls.MAP_UNSUPPORTED:  # (reserve() raises none of these: it falls back)
                assert e.errno is not None  # it is in the set
                # The store's first mapping worked (trajstore.storage.fields.layout.mapping_ok), this one did not:
                # a file on another filesystem, or a system that changed its mind.
                raise OSError(e.errno, f"cannot memory-map chunk {k} of {self.spec.array_path} "
                              f"({os.strerror(e.errno)}); set the environment variable {_syscalls.NO_MMAP_ENV}=1 to "
                              "read and write raw fields without memory mappings", name) from None
            raise _full_disk(e, name, f"map chunk {k} of {self.spec.array_path}")
        finally:
            os.close(fd)
        return True

    def remap(self, ks: list[int], prefix: str = "") -> None:
        """Map chunk files again (after they were replaced by rename), optionally from a staging prefix.

        A staged file that is gone has already been moved into place: the main file is it.  A
        mapping keeps its file's content even if the file is renamed afterwards.
        """
        self._close_fds(ks)  # they may name replaced files
        for k in ks:
            self._room.pop(k, None)  # a new file: its blocks are not known
            self._fresh.discard(k)
            self._pieces.forget(k)
            if not ((prefix and self._map(k, prefix)) or self._map(k)) and self._va.mapped[k]:
                self._va.unmap_chunk(k)

    def prepare_rows(self, phys_lo: int, phys_hi: int) -> np.ndarray | None:
        """A writable view of physical rows ``[phys_lo, phys_hi)`` in this writer's mapping, ready
        for rows to be stored into it one at a time: their chunk file mapped (created when
        missing) and their pages faulted in for writing in one call (``_vmap.VirtualArray.populate``).

        Rows stored there are handed to the table as usual, the view itself as their data:
        :meth:`write` then copies nothing.  The caller makes sure the rows may be overwritten
        (a ring's eviction record committed first: ``StoreCommits.ensure_evicted``).

        Returns
        -------
        numpy.ndarray or None
            None where the rows are better staged (the caller's ``pwrite`` reads nothing): pages not
            all in the page cache (``_vmap.VirtualArray.resident``), a read-only field, rows in two
            chunks that lie apart, or a kernel without ``MADV_POPULATE_WRITE``.
        """
        view = self._va.block(phys_lo, phys_hi) if self.writable and phys_hi > phys_lo else None
        if view is None:
            return None
        self.ensure_mapped(phys_lo, phys_hi, create=True)
        self._make_room(phys_lo, phys_hi)  # before the caller stores rows into the view
        self._pieces.hi_row = max(self._pieces.hi_row, phys_hi)  # the caller stores rows there next
        if not self._va.resident(phys_lo, phys_hi):
            return None  # stores would read the pages from disk first (a new chunk file, or a ring larger than RAM)
        try:
            ok = self._va.populate(phys_lo, phys_hi)
        except OSError as e:
            k = phys_lo // self.C
            if e.errno == errno.EFAULT:
                raise DamagedStoreError(f"chunk file {self._path(k)} is shorter than its mapping (changed by "
                                        "another program?); rows are not written into it") from None
            raise _full_disk(e, self._path(k), f"prepare rows {phys_lo}..{phys_hi - 1} of chunk {k} for writing")
        return view if ok else None

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        """Copy ``data`` (n, *row_shape) into physical rows ``[phys_lo, phys_lo + n)`` (nothing to
        copy when ``data`` is those rows themselves: a :meth:`prepare_rows` view)."""
        n = len(data)
        k_lo, k_hi = phys_lo // self.C, (phys_lo + n - 1) // self.C
        mapped = self._va.mapped
        if not (mapped[k_lo] and mapped[k_hi]) or (k_hi - k_lo > 1 and not mapped[k_lo : k_hi + 1].all()):
            self.ensure_mapped(phys_lo, phys_lo + n, create=True)
        if (phys_lo + n - k_hi * self.C) * self._va.row_bytes > self._room.get(k_hi, 0) or k_hi != k_lo:
            self._make_room(phys_lo, phys_lo + n)
        if self._va.holds(phys_lo, data):
            pass  # stored in place already
        elif data.nbytes >= PWRITE_BYTES:
            self._pwrite(phys_lo, data, widen=True)
        elif self._fresh and not self._fresh.isdisjoint(range(k_lo, k_hi + 1)):
            # Closed again after: one descriptor per new file would pile up over thousands of fields.
            opened = [k for k in range(k_lo, k_hi + 1) if k not in self._fds]
            try:
                if phys_lo + n > self._pieces.next_row:
                    self._fill_pieces(phys_lo, phys_lo + n)
                self._pwrite(phys_lo, data)
            finally:
                self._close_fds(opened)
            self._fresh.difference_update(range(k_lo, k_hi + 1))
        else:
            if phys_lo + n > self._pieces.next_row:
                self._fill_pieces(phys_lo, phys_lo + n)
            self._va.put(phys_lo, data)
        if phys_lo + n > self._pieces.hi_row:
            self._pieces.hi_row = phys_lo + n
        if k_lo != self._last_k or k_hi != k_lo:  # per-step appends stay in one chunk: skip the set update
            self._synced.update(range(k_lo, k_hi + 1))
            self._last_k = k_hi

    def _pwrite(self, phys_lo: int, data: np.ndarray, widen: bool = False) -> None:
        """Large blocks go through ``pwrite`` into the page cache: first writes to a fresh page of
        a mapping fault one page at a time, which costs more than the copy itself.  With ``widen``
        the block is written with zeros around it out to the edges of the 2 MiB pieces of a new
        chunk file that it starts and ends in (:meth:`.folios.PieceFiller.around`)."""
        buf = np.ascontiguousarray(data, dtype=self._va.dtype).reshape(-1).view(np.uint8)
        row_bytes = self._va.row_bytes
        pos, n = 0, len(data)
        while pos < n:
            k, off = divmod(phys_lo + pos, self.C)
            take = min(self.C - off, n - pos)
            fd = self._fd(k)
            a, b = off * row_bytes, (off + take) * row_bytes
            rows = buf[pos * row_bytes : (pos + take) * row_bytes]
            lead, pad = self._pieces.around(k, a, b) if widen else (0, 0)
            if pad and not self._reserve_to(k, b + pad):
                self._pieces.not_filled(k)
                pad = 0
            try:  # (numpy's stubs give ndarray __buffer__ only from Python 3.12 on: the ignores)
                if lead or pad:
                    zeros = zero_piece()
                    os.pwritev(fd, [zeros[:lead], rows, zeros[:pad]], a - lead)  # type: ignore[list-item]
                else:
                    os.pwrite(fd, rows, a)  # type: ignore[arg-type]
            except OSError as e:  # the chunk's space is reserved, so only a file made elsewhere gets here
                raise _full_disk(e, self._path(k), f"write rows into chunk {k}")
            pos += take

    def _fill_pieces(self, phys_lo: int, phys_hi: int) -> None:
        """Before rows ``[phys_lo, phys_hi)`` are stored through the mapping (or by a small
        ``pwrite``): zeros over each whole 2 MiB piece they reach that holds nothing yet
        (:mod:`.folios`), then the piece mapped writable in one call (``populate``), so the
        stores land in one folio without a fault per page."""
        for k, q in self._pieces.pieces_to_fill(phys_lo, phys_hi):
            if not self._reserve_to(k, q + _syscalls.HUGE):
                self._pieces.not_filled(k)
                continue
            try:
                os.pwrite(self._fd(k), zero_piece(), q)  # type: ignore[arg-type]
                self._va.populate(*self._pieces.piece_rows(k, q))
            except OSError:
                self._pieces.not_filled(k)  # the rows' own room was made before (_make_room)

    def _reserve_to(self, k: int, upto: int) -> bool:
        """Allocate chunk file ``k``'s disk blocks up to byte ``upto`` (zeros about to be written
        there); False where that fails (a full disk: the zeros are left out, never the rows)."""
        have = self._room.get(k, 0)
        if have >= upto:
            return True
        try:
            if _syscalls.reserve_range(self._fd(k), have, upto - have):
                self._room[k] = upto
        except OSError:
            return False
        return True

    def _fd(self, k: int) -> int:
        """This writer's open descriptor of chunk file ``k`` (for ``pwrite`` and ``fallocate``)."""
        fd = self._fds.get(k)
        if fd is None:
            if len(self._fds) >= 8:  # appends touch one or two chunks at a time
                os.close(self._fds.pop(next(iter(self._fds))))
            # Confined as _map is (no link anywhere on the way, nothing outside the store), in one
            # openat2 call: resolving the path in Python cost more than the open (1 us per add).
            fd = self._fds[k] = self.loc.open_inside(chunk_key(self.spec.array_path, k, self._ndim), os.O_WRONLY)
        return fd

    def _close_fds(self, ks: list[int] | None = None) -> None:
        for k in list(self._fds) if ks is None else ks:
            fd = self._fds.pop(k, None)
            if fd is not None:
                os.close(fd)

    def gather(self, phys: np.ndarray) -> np.ndarray:
        return self._va.take(phys)

    def gather_windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        """Copies of ``length`` consecutive physical rows from each of ``phys`` (B,): (B, length, ...)
        (one ``memcpy`` per window: :meth:`trajstore.storage.fields._vmap.VirtualArray.windows`)."""
        return self._va.windows(phys, length)

    def read_range(self, lo: int, hi: int, copy: bool = True) -> np.ndarray:
        return self._va.rows(lo, hi, copy)

    def read_chunk(self, k: int) -> np.ndarray:
        return self._va.chunks[k].copy()

    def edited_chunk(self, k: int, offs: np.ndarray, values: np.ndarray | None = None,
                     src: np.ndarray | None = None) -> np.ndarray:
        return edit_chunk(self, k, offs, values, src)

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        """Write a full chunk under the staging ``prefix``; returns its key (relative to the prefix).

        The zero pages after its last non-zero byte become a hole again (:func:`_syscalls.punch_hole`),
        so a rewrite (``set_at``, ``remove_at``, episode edits) leaves a partly filled chunk file
        as small on disk as appends made it; the writer allocates them again before it stores
        rows there (:meth:`remap` forgets what it knew of the file)."""
        key = chunk_key(self.spec.array_path, k, self._ndim)
        raw = np.ascontiguousarray(data, dtype=self._va.dtype).reshape(-1).view(np.uint8)
        try:
            self.loc.put(f"{prefix}/{key}", raw.tobytes())
            words = np.flatnonzero(raw.view(np.uint64))  # (a chunk is whole pages: 8-byte words)
            used = -(-(int(words[-1]) + 1) * 8 // _syscalls.PAGE) * _syscalls.PAGE if len(words) else 0
            if used < len(raw):
                fd = self.loc.open_inside(f"{prefix}/{key}", os.O_WRONLY)
                try:
                    _syscalls.punch_hole(fd, used, len(raw) - used)
                finally:
                    os.close(fd)
        except OSError as e:
            raise _full_disk(e, self.loc.path(f"{prefix}/{key}"), f"stage chunk {k} of {self.spec.array_path}")
        return key

    def reload(self) -> None:
        """Map every mapped chunk file again (a rewrite replaced them by rename)."""
        self.remap([int(k) for k in np.flatnonzero(self._va.mapped)])

    def drop_cache(self) -> None:
        """Nothing to drop: mapped pages are the files themselves."""

    def flush(self, fsync: bool, hold: int | None = None) -> None:
        """Rows are in the page cache as soon as they are written; ``fsync`` makes them durable
        (``hold`` is for compressed fields: a mapped chunk needs no writing out)."""
        if fsync:
            for k in sorted(self._synced):
                if self._va.mapped[k]:
                    try:
                        self._va.sync(k)
                    except OSError as e:
                        raise _full_disk(e, self._path(k), f"msync chunk {k}")
            dirs = {os.path.dirname(self._path(k)) for k in self._synced}
            for d in dirs:
                fsync_dir(Path(d))
            # Only an fsync makes them durable: chunks written before a plain flush stay listed.
            self._synced.clear()
            self._last_k = -1

    def close(self) -> None:
        self._close_fds()
        self._va.close()


def in_place_writes_work() -> bool:
    """Whether this kernel populates a mapped range for writing without reading it from the file
    (``MADV_POPULATE_WRITE``, probed once): what writing rows in place needs."""
    return _syscalls.populate_write_works()


def mapped_rows(field: Any) -> Any:
    """The :class:`~trajstore.storage.fields._vmap.VirtualArray` mapping ``field``'s rows, when it
    is a memory-mapped field with a live mapping; otherwise None (compressed or portable fields,
    a closed one)."""
    va = getattr(field, "_va", None)
    return va if isinstance(va, _vmap.VirtualArray) and va.base else None
