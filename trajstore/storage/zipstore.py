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

:func:`trajstore.core.zipcopy.write_zip` writes a store into one; :class:`ZipReader` is the
zarr store every zip is read through (reads bounded by what each entry claims).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
import zipfile
from pathlib import Path
from typing import Any, AsyncIterator

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import ZipStore

from trajstore.errors import DamagedStoreError, NotATrajstoreError, ReadOnlyError, StoreExistsError
from trajstore.storage.confined import read_limit

__all__ = ["ZipReader", "ZipWriter", "check_zip_file", "zip_read_only_error"]



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


class ZipReader(ZipStore):
    """zarr's read-only ``ZipStore`` whose reads never inflate more than an entry claims: zarr's own
    reads ``f.read()`` an entry whole, and zipfile inflates the whole deflate stream before it
    cuts it to the claimed size (a 700 KB entry claiming 1,296 bytes took 1 GiB).  Here every read
    asks for at most the claimed bytes (zipfile then inflates at most that much per step, and a
    stream longer than its claim fails its CRC), and a claim above
    :func:`~trajstore.storage.confined.read_limit` is refused.  Every zip trajstore reads (its own
    stores, a Diffusion Policy ``.zarr.zip``) is read through it."""

    def _get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        if not self._is_open:
            self._sync_open()
        try:
            info = self._zf.getinfo(key)
        except KeyError:
            return None
        size = info.file_size
        if size > read_limit(key):
            raise DamagedStoreError(f"{self.path}: zip entry {key[:200]!r} expands to {size} bytes; at most "
                                    f"{read_limit(key)} are read from one file")
        lo, hi = 0, size
        if isinstance(byte_range, RangeByteRequest):
            lo, hi = min(byte_range.start, size), min(byte_range.end, size)
        elif isinstance(byte_range, OffsetByteRequest):
            lo = min(byte_range.offset, size)
        elif isinstance(byte_range, SuffixByteRequest):
            lo = max(0, size - byte_range.suffix)
        elif byte_range is not None:
            raise TypeError(f"unexpected byte_range {byte_range!r}")
        with self._zf.open(info) as f:
            if lo:
                f.seek(lo)  # zipfile seeks by reading in bounded steps
            return prototype.buffer.from_bytes(f.read(max(hi - lo, 0)))


class ZipWriter(ZipStore):
    """A zarr ``ZipStore`` that writes a new zip at ``target`` (see the module docstring)."""

    def __init__(self, target: str | os.PathLike[str], *, compression: int = zipfile.ZIP_STORED) -> None:
        self.target = Path(target)
        # zarr annotates mode as "r"/"w"/"a"; it hands it to zipfile.ZipFile, which also takes "x"
        super().__init__(self.target.with_name(f".{self.target.name}.{uuid.uuid4().hex}.partial"),
                         mode="x", compression=compression)  # type: ignore[arg-type]
        self._lock = threading.RLock()
        self._started = False  # the temp zip exists (created by the first write)
        self._written: set[str] = set()
        self._finalizer: weakref.finalize[..., Any] | None = None
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

    def erase_old(self) -> None:
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
            self.erase_old()
        elif self._started:
            await super().delete(key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        if self._old is not None or self._foreign:
            self.erase_old()
        elif self._started:
            await super().delete_dir(prefix)

    async def clear(self) -> None:
        self._check_writable()
        self.erase_old()
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
