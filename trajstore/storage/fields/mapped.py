"""``MappedField``: a raw field on a local folder, its chunk files memory-mapped side by side.

Uncompressed chunks (codec ``bytes``, little-endian).  Each chunk file is created at full size
and memory-mapped into one reserved address range (:mod:`._vmap`, each chunk at a 2 MiB
boundary when it spans one); the writer copies rows straight into the page cache and readers
gather with one numpy fancy index.  zarr-python is used
only for metadata.  Raw chunk files are allocated whole (``posix_fallocate``) before they are
mapped, so a store into a mapping never meets a full disk (which would be ``SIGBUS``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

import numpy as np

from trajstore.errors import DamagedStoreError, MappingLimitError
from trajstore.storage.confined import full_disk as _full_disk
from trajstore.storage.fields import _syscalls, _vmap
from trajstore.storage.fields.spec import (
    PWRITE_BYTES,
    FieldSpec,
    chunk_key,
)
from trajstore.storage.location import Location, fsync_dir

__all__ = ["MappedField"]


class MappedField:
    """A raw field on a local folder, memory-mapped chunk by chunk into one virtual array
    (a :class:`~trajstore.storage.fields.base.Field`)."""

    keeps_partial_chunk = False  # rows are in the mapped file as soon as they are written

    def __init__(self, loc: Location, spec: FieldSpec, allocated: int, writable: bool):
        self.loc, self.spec, self.writable = loc, spec, writable
        self.C = spec.chunk_rows
        self._ndim = len(spec.row_shape) + 1
        self._synced: set[int] = set()  # chunks written since the last fsync
        self._last_k = -1
        self._fds: dict[int, int] = {}  # writer: open chunk files for pwrite of large blocks
        self._va = self._reserve(allocated)
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
                if self._map(k) or not create:
                    continue  # a reader leaves a never-written chunk unmapped: zeros, as zarr reads it
                self._create_chunk_file(self._path(k))
                if not self._map(k):
                    raise DamagedStoreError(f"chunk file {self._path(k)} vanished right after it was created")

    def _create_chunk_file(self, path: str) -> None:
        """Create chunk file ``path`` full size, zero-filled and with its blocks allocated.

        Allocated, not sparse: the writer stores rows through a shared mapping, and a store into
        a hole that a full filesystem cannot fill is ``SIGBUS``.  Reserving here turns a full disk
        into a :class:`StoreFullError` before any row is written.  Built under a temp name and
        renamed, so a chunk file is never seen half-made; on failure the temp file is removed.
        """
        tmp = None
        try:
            tmp = self.loc.new_tmp_path()
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                _syscalls.reserve(fd, self._va.chunk_bytes, fresh=True)
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
            raise _full_disk(e, path, f"create chunk file ({self._va.chunk_bytes} bytes)")

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
            raise DamagedStoreError(str(e)) from None
        except OSError as e:
            name = self._file_name(key)
            if e.errno == errno.ENOMEM:
                raise MappingLimitError(e.errno, f"cannot map chunk {k} of {self.spec.array_path}: the process has "
                                        "reached its limit of memory mappings (vm.max_map_count; see "
                                        "trajstore.errors.MappingLimitError)", name) from None
            if e.errno in _syscalls._MAP_UNSUPPORTED:  # (reserve() raises none of these: it falls back)
                assert e.errno is not None  # it is in the set
                # The store's first mapping worked (trajstore.storage.fields.layout.mapping_ok), this one did not:
                # a file on another filesystem, or a system that changed its mind.
                raise OSError(e.errno, f"cannot memory-map chunk {k} of {self.spec.array_path} "
                              f"({os.strerror(e.errno)}); set the environment variable {_syscalls.NO_MMAP_ENV}=1 to "
                              "read and write raw fields without memory mappings", name) from None
            raise _full_disk(e, name, "reserve space for a chunk file created sparse")
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
        if self._va.holds(phys_lo, data):
            pass  # stored in place already
        elif data.nbytes >= PWRITE_BYTES:
            self._pwrite(phys_lo, data)
        else:
            self._va.put(phys_lo, data)
        if k_lo != self._last_k or k_hi != k_lo:  # per-step appends stay in one chunk: skip the set update
            self._synced.update(range(k_lo, k_hi + 1))
            self._last_k = k_hi

    def _pwrite(self, phys_lo: int, data: np.ndarray) -> None:
        """Large blocks go through ``pwrite`` into the page cache: first writes to a fresh page of
        a mapping fault one page at a time, which costs more than the copy itself."""
        buf = np.ascontiguousarray(data, dtype=self._va.dtype).reshape(-1).view(np.uint8)
        row_bytes = self._va.row_bytes
        pos, n = 0, len(data)
        while pos < n:
            k, off = divmod(phys_lo + pos, self.C)
            take = min(self.C - off, n - pos)
            fd = self._fds.get(k)
            if fd is None:
                if len(self._fds) >= 8:  # appends touch one or two chunks at a time
                    os.close(self._fds.pop(next(iter(self._fds))))
                # Confined as _map is (no link anywhere on the way, nothing outside the store), in one
                # openat2 call: resolving the path in Python cost more than the open (1 us per add).
                fd = self._fds[k] = self.loc.open_inside(chunk_key(self.spec.array_path, k, self._ndim), os.O_WRONLY)
            try:
                # numpy's stubs give ndarray __buffer__ only from Python 3.12 on
                os.pwrite(fd, buf[pos * row_bytes : (pos + take) * row_bytes], off * row_bytes)  # type: ignore[arg-type]
            except OSError as e:  # the chunk's space is reserved, so only a file made elsewhere gets here
                raise _full_disk(e, self._path(k), f"write rows into chunk {k}")
            pos += take

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

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        """Write a full chunk under the staging ``prefix``; returns its key (relative to the prefix)."""
        key = chunk_key(self.spec.array_path, k, self._ndim)
        try:
            self.loc.put(f"{prefix}/{key}", np.ascontiguousarray(data, dtype=self._va.dtype).tobytes())
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
