"""A store on disk: the root zarr group, its schema attributes, the commit record and
the tables inside it.  This module owns the commit protocol (DESIGN.md 3):

1. data first: rows go into chunk files (written whole, or into pre-sized mapped files
   beyond the committed rows);
2. before a ring overwrites rows the last commit still counts, it commits a record that
   no longer counts them (:meth:`Store.ensure_evicted`);
3. rewrites of committed rows (set_at, remove_at) are staged in ``.trajstore-staging``,
   named by a commit record, then moved into place (:meth:`Store.rewrite`);
4. the commit record goes last (:meth:`Store.commit`).
"""

from __future__ import annotations

import datetime
import os
import shutil
import time
import warnings
from typing import Any, Callable, Iterable

import numpy as np
import zarr

from trajstore._optional import missing
from trajstore.errors import (
    BadOptionError,
    ClosedError,
    DamagedStoreError,
    FormatVersionError,
    LockedError,
    NotATrajstoreError,
    ReadOnlyError,
    StoreExistsError,
    StoreNotFoundError,
    TrajstoreError,
)
from trajstore.storage.confined import OPEN_FLAGS
from trajstore.storage.fields.base import Field
from trajstore.storage.fields.layout import FieldSpec, open_field, parse_compressor
from trajstore.storage.head import (FORMAT_VERSION, HEAD_KEY, LOCK_KEY, MPLOCK_KEY, PREV_KEY, Head, HeadWatch, TableState,
                                    read_head, write_head)
from trajstore.storage.locks import WriterLock
from trajstore.storage.schema import TableSchema, array_rows, check_head_tables, check_pending, check_rows_fit, check_schema, read_root
from trajstore.storage.location import STAGING_DIR, TMP_DIR, Location, open_zarr_group, resolve_location
from trajstore.spaces import space_from_json
from trajstore.core.table import Table

__all__ = ["Store", "TableSpec"]

ATTRS_KEY = "trajstore"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("trajstore")
    except Exception:
        return "0+unknown"


class _WriteOp:
    """Reusable context manager for :meth:`Store.write_op` (cheaper than a generator per append)."""

    __slots__ = ("store",)

    def __init__(self, store: "Store") -> None:
        self.store = store

    def __enter__(self) -> None:
        s = self.store
        if s.multiprocessing:
            assert s.lock is not None
            s.lock.acquire_op()
            try:
                s.refresh()
                if s.committed.pending:  # left by a writer that died mid-rewrite
                    s._roll_forward(s.committed)
                for listener in s.op_listeners:
                    listener()
            except BaseException:
                s.lock.release_op()
                raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        s = self.store
        if s.multiprocessing:
            assert s.lock is not None
            try:
                if exc_type is None:
                    s.commit(state=s.buffer_state())
            finally:
                s.lock.release_op()


class TableSpec:
    """What :meth:`Store.create` needs to lay out one table."""

    def __init__(self, name: str, capacity: int | None, fields: list[FieldSpec]):
        self.name, self.capacity, self.fields = name, capacity, fields


class Store:
    """An open store.  Use :meth:`create` or :meth:`open`; buffers wrap one of these."""

    def __init__(self, loc: Location, group: zarr.Group, attrs: dict[str, Any], head: Head, *, writable: bool,
                 multiprocessing: bool, lock: WriterLock | None, options: dict[str, Any],
                 schema: dict[str, TableSchema] | None = None):
        self.loc = loc
        self.group = group
        self.attrs = attrs
        self.writable = writable
        self.closed = False  # after close() every write raises ClosedError (nothing may touch the store)
        self.multiprocessing = multiprocessing
        self.lock = lock
        self.opener_pid = os.getpid()  # a forked child is not this store's writer (see ``forked``)
        self.options = options
        self.fsync = bool(options.get("fsync", False))
        self.commit_interval = float(options.get("commit_interval", 1.0))
        self.committed = head  # the record on disk, as this process last wrote or read it
        self._watch = HeadWatch(loc)  # nothing watched yet: a reader's first refresh reads the record
        self._last_commit = time.monotonic()
        self.tables: dict[str, Table] = {}
        self._op = _WriteOp(self)
        self.refresh_listeners: list[Callable[[], None]] = []  # called after adopting a newer commit record
        self.op_listeners: list[Callable[[], None]] = []  # multiprocessing: called at the start of each write op
        # Every name, shape and count is checked before it becomes a path, a mapping or a loop
        # (DESIGN.md 3.7); a record read later by refresh is checked against the same schema.
        self.schema = schema = check_schema(attrs, str(loc.url)) if schema is None else schema
        check_head_tables(head, schema, str(loc.url))
        self._watch.check = lambda h: check_head_tables(h, schema, str(loc.url))
        try:
            for name, tspec in schema.items():
                st = head.tables[name]
                fields = []
                for fs in tspec.fields:
                    spec = FieldSpec(fs.path, fs.shape, fs.dtype, fs.chunk_rows, fs.layout)
                    fields.append(open_field(loc, spec, group, st.allocated, writable))
                self.tables[name] = Table(self, name, tspec.capacity, fields, TableState(st.start, st.end, st.allocated))
        except BaseException as e:
            for t in self.tables.values():
                for f in t.fields:
                    f.close()
            if isinstance(e, TrajstoreError) or not isinstance(e, Exception):
                raise
            # zarr's array metadata (codecs, fill value) or the address-space reservation of a raw field
            raise DamagedStoreError(f"{loc.url}: the arrays cannot be opened ({type(e).__name__}: {e})") from None
        if head.pending:
            if writable and (lock is None or lock.sole):
                self._roll_forward(head)
            else:  # a reader, or a multiprocessing writer that rolls forward under the op lock
                self._apply_pending(head.pending, staged=True)

    # -- create / open -------------------------------------------------------------------
    @classmethod
    def create(cls, cache_path: Any, kind: str, tables: list[TableSpec], schema: dict[str, Any], *,
               storage_options: dict[str, Any] | None, overwrite: bool, multiprocessing: bool,
               options: dict[str, Any]) -> "Store":
        attrs = {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "created_by": f"trajstore {_version()}",
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tables": {t.name: {
                "capacity": t.capacity,
                "fields": [{"path": f.array_path, "shape": list(f.row_shape), "dtype": f.dtype.str.lstrip("<>|="),
                            "chunk_rows": f.chunk_rows, "layout": f.layout} for f in t.fields],
            } for t in tables},
            **schema,
        }
        # What open would refuse (sizes past its limits...) is refused before a byte is written.
        check_schema(attrs, str(cache_path))
        loc = resolve_location(cache_path, read_only=False, storage_options=storage_options, must_exist=False)
        # Lock first: overwrite=True must never erase a store another writer has open.
        lock = WriterLock(loc, shared=multiprocessing) if loc.is_local else None
        try:
            if lock is not None and not lock.sole:
                raise LockedError(f"{loc.url}: other writers have this store open; it cannot be created anew")
            if loc.exists("zarr.json") or loc.exists(HEAD_KEY):
                if not overwrite:
                    raise StoreExistsError(f"{loc.url}: a store already exists here; pass overwrite=True to replace "
                                           "it or use load_from to open it")
                _erase(loc)
            elif loc.local_root is not None and any(p.name not in (TMP_DIR, LOCK_KEY, MPLOCK_KEY) for p in loc.local_root.iterdir()):
                if not overwrite:
                    raise StoreExistsError(f"{loc.url}: the folder is not empty and holds no trajstore store; "
                                           "pass overwrite=True to use it anyway")
                _erase(loc)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        # Not mode="w": that would delete the lock file we hold.
        group = zarr.create_group(loc.zstore, attributes={ATTRS_KEY: attrs}, overwrite=False)
        head = Head()
        for t in tables:
            alloc = t.capacity if t.capacity is not None else max(f.chunk_rows for f in t.fields)
            for f in t.fields:
                compressors, _label = parse_compressor(f.compressor if f.layout != "raw" else None, f.dtype)
                group.create_array(
                    f.array_path, shape=(alloc, *f.row_shape), chunks=(f.chunk_rows, *f.row_shape), dtype=f.dtype,
                    compressors=compressors, filters=None, fill_value=np.zeros((), f.dtype)[()],
                    config={"write_empty_chunks": True},
                )
            head.tables[t.name] = TableState(0, 0, alloc)
        group.attrs[ATTRS_KEY] = attrs
        _consolidate(loc)
        write_head(loc, head, fsync=bool(options.get("fsync")))
        group = open_zarr_group(loc, mode="r+")
        store = cls(loc, group, attrs, head, writable=True, multiprocessing=multiprocessing, lock=lock, options=options)
        if lock is not None:
            lock.share()
        return store

    @classmethod
    def open(cls, path: Any, kind: str | tuple[str, ...] | None, *, read_only: bool, multiprocessing: bool,
             storage_options: dict[str, Any] | None, options: dict[str, Any]) -> "Store":
        """Open an existing store.

        A store is input (DESIGN.md 3.7): its root metadata, every field's array metadata and the
        commit record are read as bounded regular files inside the root and checked against each
        other (:mod:`trajstore.schema`) before zarr parses them, anything is mapped or allocated, or
        a writer cleans or rolls anything forward.

        Raises
        ------
        StoreNotFoundError, NotATrajstoreError, FormatVersionError, DamagedStoreError, LockedError
        """
        loc = resolve_location(path, read_only=read_only, storage_options=storage_options, must_exist=True)
        where = str(loc.url)
        root = read_root(loc)
        if root is None:
            if loc.local_root is not None and not any(loc.local_root.iterdir()):
                raise StoreNotFoundError(f"no store at {loc.url!r}: the folder is empty")
            raise NotATrajstoreError(f"{loc.url}: not a trajstore store (no zarr.json at its root)")
        attrs = check_attrs(loc, root["attributes"][ATTRS_KEY])
        kinds = (kind,) if isinstance(kind, str) else kind
        if kinds is not None and attrs.get("kind") not in kinds:
            raise NotATrajstoreError(f"{loc.url}: holds a {attrs.get('kind')!r} store; expected {' or '.join(kinds)}")
        schema = check_schema(attrs, where)
        # Local arrays' own zarr.json files are read too (cheap; zarr reads them when a writer grows).
        rows = array_rows(loc, schema, root, fresh=loc.is_local or not read_only)
        try:
            group = open_zarr_group(loc, mode="r" if read_only else "r+")
        except TrajstoreError:
            raise
        except Exception as e:
            raise DamagedStoreError(f"{loc.url}: zarr cannot open the store's metadata ({type(e).__name__}: {e})") from None
        lock = None
        if not read_only and loc.is_local:
            lock = WriterLock(loc, shared=multiprocessing)
        try:
            head = read_head(loc)
            check_head_tables(head, schema, where)
            check_rows_fit(loc, schema, head, rows, root)
            if lock is not None and lock.sole:
                # Temp files are only removed when no other writer can be using them.
                if lock.previous_unclean:
                    _clean_orphans(loc, head)
                else:
                    loc.delete_prefix(TMP_DIR)
            store = cls(loc, group, attrs, head, writable=not read_only, multiprocessing=multiprocessing,
                        lock=lock, options=options, schema=schema)
            if lock is not None:
                lock.share()
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        return store

    # -- commit protocol -----------------------------------------------------------------
    def _check_writable(self) -> None:
        if self.closed:
            raise ClosedError("I/O operation on a closed buffer: its store was closed (and its writer lock "
                              "released); reopen it with load_from to write")
        if not self.writable:
            raise ReadOnlyError(f"{self.loc.url}: the buffer is open read-only")
        if self.forked:
            raise LockedError(f"{self.loc.url}: this process was forked from the store's writer, which "
                              "keeps writing it; open the store again here (read_only=True to read), or "
                              "use multiprocessing=True in every writer")

    def space(self, table: str) -> Any:
        """The gymnasium space stored for ``table`` (``None`` when the store has none).

        Raises
        ------
        DamagedStoreError
            The stored space does not decode (unknown type, bounds that gymnasium refuses...).
        """
        obj = self.attrs.get("spaces", {}).get(table)
        if obj is None:
            return None
        try:
            return space_from_json(obj)
        except Exception as e:  # the space JSON is input: anything it makes gymnasium raise
            raise DamagedStoreError(f"{self.loc.url}: the stored space of {table!r} cannot be decoded "
                                    f"({type(e).__name__}: {e})") from None

    @property
    def forked(self) -> bool:
        """This process is a fork of a single writer's: it holds no lock and must not write.

        Also true for stores without a lock file (remote, in memory): their single writer is the
        process that opened them.  A multiprocessing writer's forked child may write."""
        if self.lock is not None and self.lock.forked_child:
            return True
        return not self.multiprocessing and os.getpid() != self.opener_pid

    def _write_head(self, head: Head) -> None:
        head.generation = self.committed.generation + 1
        write_head(self.loc, head, fsync=self.fsync)
        self.committed = head
        self._watch.wrote()

    def _current_head(self) -> Head:
        head = self.committed.copy()
        for name, t in self.tables.items():
            head.tables[name] = TableState(t.state.start, t.state.end, t.state.allocated)
        head.pending = None
        return head

    def commit(self, *, fsync: bool | None = None, state: dict[str, Any] | None = None,
               evict: dict[str, int] | None = None) -> None:
        """Write all buffered data, then the commit record naming it.

        ``evict`` maps table names to an absolute row below which the record must not count
        rows (the writer is about to overwrite their slots): see :meth:`ensure_evicted`.
        """
        self._check_writable()
        if self.committed.pending:  # a rewrite whose chunks could not all be moved into place
            self._roll_forward(self.committed)
        fsync = self.fsync if fsync is None else fsync
        evict = evict or {}
        ends = {name: t.flush(fsync, evict.get(name)) for name, t in self.tables.items()}
        head = self._current_head()
        for name, end in ends.items():
            head.tables[name].end = end  # an eviction record may leave a compressed ring's last chunk out
        for name, min_start in evict.items():
            st = head.tables[name]
            st.start = max(st.start, min(min_start, st.end))
        if state is not None:
            head.state = state
        old = self.fsync
        self.fsync = fsync
        try:
            self._write_head(head)
        finally:
            self.fsync = old
        self._last_commit = time.monotonic()

    def ensure_evicted(self, table: Table, min_start: int, guard: int) -> None:
        """Before rows whose absolute number is below ``min_start`` are overwritten, commit a
        record that no longer counts them (nor ``guard`` rows more, so that a ring being filled
        commits once per ``guard`` rows rather than on every append).

        The record is a full commit: it also names every row written since the last commit, so
        a writer that fills the ring faster than ``commit_interval`` never leaves a record whose
        start has run past its end (readers would see the ring empty, and a crash would lose it).
        """
        c = self.committed.tables[table.name]
        if c.start >= min_start or c.end <= c.start:  # nothing committed is in the way
            return
        self.commit(state=self.buffer_state(), evict={table.name: min_start + guard})

    def commit_due(self) -> bool:
        """``commit_interval`` seconds have passed since the last commit."""
        return time.monotonic() - self._last_commit >= self.commit_interval

    def after_write(self) -> None:
        """Commit every ``commit_interval`` seconds of writing, so a crash loses little."""
        if not self.multiprocessing and self.commit_due():
            self.commit(state=self.buffer_state())

    state_provider: Callable[[], dict[str, Any]] | None = None

    def buffer_state(self) -> dict[str, Any] | None:
        """The owning buffer's state for the next commit record (None: keep the last one's)."""
        return self.state_provider() if self.state_provider else None

    def metadata_changed(self) -> None:
        """Array shapes grew: refresh consolidated metadata before any row beyond the old shape is committed."""
        _consolidate(self.loc)

    def rewrite(self, changes: Iterable[tuple[Field, int, np.ndarray]],
                apply_state: Callable[[], None]) -> None:
        """Replace whole chunks of committed rows crash-atomically.

        ``changes`` are staged first; ``apply_state`` then updates the in-memory table
        states, and one commit record names both the new state and the staged chunks (from
        that instant the store is "after"); the chunks are then moved into place.
        """
        self._check_writable()
        self.commit(state=self.buffer_state())
        prefix = f"{STAGING_DIR}/{self.committed.generation + 1}"
        staged: dict[str, list[int]] = {}
        fields: dict[str, Field] = {}
        for f, k, data in changes:
            f.stage_chunk(prefix, k, data)
            staged.setdefault(f.spec.array_path, []).append(k)
            fields[f.spec.array_path] = f
        before = {name: TableState(t.state.start, t.state.end, t.state.allocated) for name, t in self.tables.items()}
        apply_state()
        head = self._current_head()
        if self.state_provider:
            head.state = self.state_provider()
        head.epoch += 1
        head.pending = {"prefix": prefix, "chunks": staged}
        if self.fsync and self.loc.is_local:
            os.sync()
        try:
            self._write_head(head)
        except BaseException:
            if self._on_disk_generation() != head.generation:
                # The record naming the change is not there: the store is still "before", and so
                # is this writer again (the staged chunks are orphans, removed by a later open).
                for name, st in before.items():
                    self.tables[name].state = st
                for listener in self.refresh_listeners:
                    listener()
                raise
            self.committed = head  # written after all (a later step, e.g. an fsync, failed)
        try:
            self._roll_forward(head)
        except BaseException:
            # The store is "after": until a later commit finishes moving the staged chunks into
            # place (commit() retries first), this writer reads them where they are staged.
            self._apply_pending(head.pending, staged=True)
            raise

    def _on_disk_generation(self) -> int | None:
        """Generation of the commit record on disk (None when it cannot be read)."""
        try:
            return read_head(self.loc).generation
        except Exception:
            return None

    def _roll_forward(self, head: Head) -> None:
        """Move staged chunks into place and commit a record without ``pending``.

        ``pending`` is checked first (:func:`trajstore.storage.schema.check_pending`): the prefix is
        ``.trajstore-staging/<int>`` and every chunk a field's, so nothing outside the store is
        renamed or deleted; a staged file that is a link is refused (``Location.rename``).
        """
        check_pending(head.pending, self.schema, {n: t.allocated for n, t in head.tables.items()}, str(self.loc.url))
        pending = head.pending or {}
        prefix = pending["prefix"]
        by_path = self._fields_by_path()
        for path, ks in pending["chunks"].items():
            f = by_path[path]
            for k in ks:
                key = f"{path}/c/{k}" + "/0" * len(f.spec.row_shape)
                if self.loc.exists(f"{prefix}/{key}"):
                    self.loc.rename(f"{prefix}/{key}", key)
            f.remap(ks)
        done = head.copy()
        done.pending = None
        self._write_head(done)
        self.loc.delete_prefix(prefix)

    def _fields_by_path(self) -> dict[str, Field]:
        return {f.spec.array_path: f for t in self.tables.values() for f in t.fields}

    def _apply_pending(self, pending: dict[str, Any] | None, staged: bool) -> None:
        """Read the chunks ``pending`` names from its staging prefix (``staged``) or from their
        place again; ``pending`` is checked against the schema first."""
        if not pending:
            return
        check_pending(pending, self.schema, {n: t.state.allocated for n, t in self.tables.items()}, str(self.loc.url))
        by_path = self._fields_by_path()
        for path, ks in pending["chunks"].items():
            by_path[path].remap(ks, pending["prefix"] if staged else "")

    # -- readers -------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Adopt the newest commit record (readers, and writers in multiprocessing mode).

        Returns True when the record changed.  Local stores first ask :class:`HeadWatch` whether
        the record file was replaced, so calling this before every read costs a ``stat``.
        """
        if not self._watch.changed():
            return False
        head = self._watch.read()
        if head.generation == self.committed.generation:
            return False
        old = self.committed
        if old.pending and old.pending != head.pending:
            self._apply_pending(old.pending, staged=False)
        if head.epoch != old.epoch:
            for t in self.tables.values():
                for f in t.fields:
                    f.reload()
        for t in self.tables.values():
            s = head.tables[t.name]
            t.state = TableState(s.start, s.end, s.allocated)
            for f in t.fields:
                f.drop_cache()
        self._apply_pending(head.pending, staged=True)
        self.committed = head
        for listener in self.refresh_listeners:
            listener()
        return True

    def rows_intact(self, old: Head) -> bool:
        """Whether every row that commit record ``old`` counted is still stored, unchanged, under
        the latest record: no rewrite since (same epoch) and no ring slot of those rows reused.  A
        ring slot is reused only after a record that no longer counts its row, so a ring whose
        start did not move past ``old``'s still holds all of ``old``'s rows (a start that moved
        back, after an eviction record, names rows that were never overwritten)."""
        new = self.committed
        if new.epoch != old.epoch:
            return False
        return all(t.capacity is None or new.tables[name].start <= old.tables[name].start
                   for name, t in self.tables.items())

    def write_op(self) -> "_WriteOp":
        """Context of one write operation: in multiprocessing mode it is serialized with the
        other writers (inter-process lock), sees their commits, and commits at its end."""
        self._check_writable()
        return self._op

    # -- copy ------------------------------------------------------------------------------
    def copy_to(self, dst: Any, *, storage_options: dict[str, Any] | None = None, progress: bool | None = None,
                overwrite: bool = True) -> None:
        """Copy every key of this store to ``dst`` (head last), with an optional progress bar."""
        target = resolve_location(dst, read_only=False, storage_options=storage_options, must_exist=False)
        if target.url == self.loc.url and target.url is not None:
            raise BadOptionError("copy_to needs a different destination")
        if target.exists("zarr.json") or target.exists(HEAD_KEY):
            if not overwrite:
                raise StoreExistsError(f"{target.url}: a store already exists here")
            _erase(target)
        try:
            self._copy_keys(target, progress)
        except BaseException:
            from trajstore.storage.zipstore import ZipWriter

            if isinstance(target.zstore, ZipWriter):
                target.zstore.abort()  # a zip cut short is never published
            raise
        target.close()

    def _copy_keys(self, target: Location, progress: bool | None) -> None:
        """Every data key, then the commit record (a copy cut short has none: not a store)."""
        skip = (LOCK_KEY, MPLOCK_KEY, HEAD_KEY, PREV_KEY)  # the copy's writer keeps its own previous record
        keys = [k for k in self.loc.list_prefix("") if k not in skip and not k.startswith((TMP_DIR, STAGING_DIR))]
        bar = _progress(len(keys), f"copy to {target.url}", progress)
        try:
            for key in keys:
                if self.loc.is_local and target.is_local:
                    dest = target.path(key)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    # Never through a link: the source by a checked descriptor, the copy replacing
                    # whatever a copy cut short left there (but not a link's target).
                    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | OPEN_FLAGS, 0o644)
                    with os.fdopen(self.loc.open_inside(key, os.O_RDONLY), "rb") as src, os.fdopen(fd, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                else:
                    data = self.loc.get(key)
                    if data is not None:
                        target.put(key, data)
                bar.update(1)
        finally:
            bar.close()
        head = self.committed.copy()
        head.pending = None
        write_head(target, head, fsync=self.fsync)

    def close(self) -> None:
        self.closed = True
        self._watch.close()
        for t in self.tables.values():
            for f in t.fields:
                f.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def check_attrs(loc: Location, attrs: Any) -> dict[str, Any]:
    """The trajstore attributes of a store's root group, first checks: ``NotATrajstoreError`` when
    there are none, ``FormatVersionError`` when the format is newer than this trajstore reads,
    ``DamagedStoreError`` for a ``format_version`` that is not an integer from 1.  The rest of the
    schema is checked by :func:`trajstore.storage.schema.check_schema`."""
    if not isinstance(attrs, dict):
        raise NotATrajstoreError(f"{loc.url}: a zarr group, but not a trajstore store (no '{ATTRS_KEY}' attribute)")
    version = attrs.get("format_version")
    if type(version) is int and version > FORMAT_VERSION:
        raise FormatVersionError(f"{loc.url}: format version {version!r} is newer than this trajstore reads "
                                 f"({FORMAT_VERSION}); upgrade trajstore")
    if type(version) is not int or version < 1:
        raise DamagedStoreError(f"{loc.url}: format_version is {version!r:.40} ({type(version).__name__}); expected "
                                f"an integer from 1 to {FORMAT_VERSION}")
    if not isinstance(attrs.get("kind"), str):
        raise DamagedStoreError(f"{loc.url}: kind is {attrs.get('kind')!r:.40}; expected a string such as 'ReplayBuffer'")
    return attrs


def _consolidate(loc: Location) -> None:
    """Write consolidated metadata (zarr warns about our non-zarr keys at the root; they are expected)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(loc.zstore)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool | None, unit: str = "file") -> Any:
    """A tqdm bar when asked (``None``: only on a terminal and when tqdm is installed)."""
    import sys

    if enabled is False or (enabled is None and not sys.stderr.isatty()):
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if enabled:
            raise missing("tqdm", "progress bars") from None
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit)


def _erase(loc: Location) -> None:
    """Remove an existing store's keys (``overwrite=True``); links are unlinked, never followed."""
    if loc.local_root is not None:
        for name in os.listdir(loc.local_root):
            if name in (LOCK_KEY, MPLOCK_KEY):
                continue
            loc.delete_prefix(name)
        return
    loc.delete_prefix("")


def _clean_orphans(loc: Location, head: Head) -> None:
    """After a writer died: drop temp files, zarr's ``*.partial`` leftovers and unreferenced staging.

    Only ever deletes inside the store: a link (``.trajstore-tmp``, ``.trajstore-staging`` or one
    below them) is unlinked, never followed.  ``head.pending`` was checked against the schema.
    """
    assert loc.local_root is not None
    loc.delete_prefix(TMP_DIR)
    keep = (head.pending or {}).get("prefix")
    staging = loc.local_root / STAGING_DIR
    if os.path.islink(staging) or (os.path.lexists(staging) and not os.path.isdir(staging)):
        loc.delete_prefix(STAGING_DIR)
    elif os.path.isdir(staging):
        for name in os.listdir(staging):
            if keep is None or f"{STAGING_DIR}/{name}" != keep:
                loc.delete_prefix(f"{STAGING_DIR}/{name}")
    for dirpath, _dirs, files in os.walk(loc.local_root):  # followlinks=False: linked folders are not entered
        for name in files:
            if name.endswith(".partial"):
                os.unlink(os.path.join(dirpath, name))  # a link is removed itself
