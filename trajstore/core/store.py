"""A store's lifecycle: create, open, copy and close the root zarr group, its schema attributes,
the commit record and the tables inside it.

The commit protocol a store follows while it is open is :mod:`trajstore.core.commit`
(:class:`~trajstore.core.commit.StoreCommits`, the base class of :class:`Store`).
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import os
import sys
import threading
import time
import types
from typing import Any, Callable

import numpy as np
import zarr
import zarr.api.asynchronous as zarr_async
import zarr.core.sync as zarr_sync
from zarr.storage import MemoryStore

from trajstore.core.commit import StoreCommits, WriteOp, consolidate_metadata
from trajstore.core.progress import progress_bar
from trajstore.core.table import Table
from trajstore.errors import (
    BadOptionError,
    DamagedStoreError,
    FormatVersionError,
    LockedError,
    NotATrajstoreError,
    StoreExistsError,
    StoreNotFoundError,
    TrajstoreError,
)
from trajstore.spaces import space_from_json
from trajstore.storage.array_meta import array_rows, read_root
from trajstore.storage.confined import OPEN_FLAGS
from trajstore.storage.fields.layout import FieldSpec, create_codecs, open_field
from trajstore.storage.fields.video_copy import linked_copy
from trajstore.storage.fields.video_pack import is_pack_key
from trajstore.storage.head import (
    FORMAT_VERSION,
    HEAD_KEY,
    LOCK_KEY,
    MPLOCK_KEY,
    PREV_KEY,
    Head,
    HeadWatch,
    TableState,
    read_head,
    write_head,
)
from trajstore.storage.lease import BROKEN_DIR, LEASE_KEY, RemoteLease, needs_lease
from trajstore.storage.location import (
    STAGING_DIR,
    TMP_DIR,
    Location,
    open_zarr_group,
    resolve_location,
)
from trajstore.storage.locks import WriterLock
from trajstore.storage.publish import destination_full, partial_path, publish, remove_entry
from trajstore.storage.published import dimension_names, file_identity
from trajstore.storage.runs_file import RUNS_TABLE, SavedRuns, take_runs
from trajstore.storage.schema import (
    TableSchema,
    check_head_tables,
    check_schema,
)
from trajstore.storage.sparse import copy_file_data

__all__ = ["Store", "TableSpec"]

ATTRS_KEY = "trajstore"

#: Called before any store is created or opened.  The buffers layer registers the commit of writers
#: that were collected where they could not commit (inside zarr's event-loop thread): they still
#: hold their writer lock, which the store about to open may need.
BEFORE_OPEN: list[Callable[[], None]] = []


def in_zarr_loop() -> bool:
    """Whether a commit (zarr's ``sync``) must not start here: this thread runs zarr's event loop,
    which the commit would wait on, or this thread is inside a ``sync`` call of its own.

    Objects collected there must not commit.  The second case is the cyclic collector running a
    finalizer while ``sync`` waits in ``concurrent.futures.wait``, which holds the outer future's
    lock: the loop thread then blocks on that lock to report the outer call done, and a commit
    started from the finalizer waits on the loop for ever (seen as a hung test_views.py under
    pytest-xdist).  Any other running loop (Jupyter's, a user's ``asyncio.run``) does not stop a
    commit."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    zarr_loop = getattr(zarr_sync, "loop", [None])[0]
    if zarr_loop is not None and running is zarr_loop:
        return True
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:  # a finalizer's stack is short above the interrupted code: cheap
        if frame.f_code is _ZARR_SYNC_CODE:
            return True
        frame = frame.f_back
    return False


def register_before_pools_stop(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the main thread ends, before Python's thread pools stop taking work.

    A threading exit hook (``threading._register_atexit``; a plain atexit hook where CPython has
    none): it runs before concurrent.futures' own hook, registered earlier and so run later, and
    before every atexit hook.  Writes through zarr (its codecs encode on the default executor) only
    work until then: from an atexit hook they fail with "cannot schedule new futures after
    shutdown".  Every exit-time commit of trajstore registers here."""
    getattr(threading, "_register_atexit", atexit.register)(fn)


#: The code of zarr's blocking ``sync`` (a frame of it on a thread's stack: a call waiting on the loop).
_ZARR_SYNC_CODE = zarr_sync.sync.__code__


def _before_open() -> None:
    for fn in BEFORE_OPEN:
        fn()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("trajstore")
    except Exception:
        return "0+unknown"


class TableSpec:
    """What :meth:`Store.create` needs to lay out one table."""

    def __init__(self, name: str, capacity: int | None, fields: list[FieldSpec]):
        self.name, self.capacity, self.fields = name, capacity, fields



def _read_root_of_kind(loc: Location, kind: str | tuple[str, ...] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(root metadata, trajstore attributes)`` of the store at ``loc``, its kind one of ``kind``
    (None: any).

    Raises
    ------
    StoreNotFoundError
        An empty local folder.
    NotATrajstoreError
        No root ``zarr.json``, or a store of another kind (a ReplayBuffer where a trajectory store
        is expected names ``trajstore convert``).
    """
    root = read_root(loc)
    if root is None:
        if loc.local_root is not None and not any(loc.local_root.iterdir()):
            raise StoreNotFoundError(f"no store at {loc.url!r}: the folder is empty")
        raise NotATrajstoreError(f"{loc.url}: not a trajstore store (no zarr.json at its root)")
    attrs = check_attrs(loc, root["attributes"][ATTRS_KEY])
    kinds = (kind,) if isinstance(kind, str) else kind
    if kinds is not None and attrs.get("kind") not in kinds:
        hint = ("; a ReplayBuffer whose rows flag episode ends (terminated/truncated or done) becomes one with "
                "`trajstore convert SRC DST` (trajstore.to_trajectory)"
                if attrs.get("kind") == "ReplayBuffer" and "TrajectoryReplayBuffer" in kinds else "")
        raise NotATrajstoreError(f"{loc.url}: holds a {attrs.get('kind')!r} store; expected {' or '.join(kinds)}"
                                 + hint)
    return root, attrs


def _clean_at_open(loc: Location, head: Head, previous_unclean: bool) -> None:
    """What the sole writer opening a store removes: after an unclean end every orphan the record
    does not name (:func:`_clean_orphans`), else the temp folder's files."""
    if previous_unclean:
        _clean_orphans(loc, head)
    else:
        loc.delete_prefix(TMP_DIR, keep_folder=True)

class Store(StoreCommits):
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
        self._op = WriteOp(self)
        self.refresh_listeners: list[Callable[[], None]] = []  # called after adopting a newer commit record
        self.op_listeners: list[Callable[[], None]] = []  # multiprocessing: called at the start of each write op
        # A writer's open removes the saved run index (storage.runs_file) and hands it over here.
        self.saved_runs: SavedRuns | None = None
        # Every name, shape and count is checked before it becomes a path, a mapping or a loop
        # (docs/design.md 3.7); a record read later by refresh is checked against the same schema.
        self.schema = schema = check_schema(attrs, str(loc.url)) if schema is None else schema
        check_head_tables(head, schema, str(loc.url))
        self._watch.check = lambda h: check_head_tables(h, schema, str(loc.url))
        try:
            for name, tspec in schema.items():
                st = head.tables[name]
                fields = []
                for fs in tspec.fields:
                    spec = FieldSpec(fs.path, fs.shape, fs.dtype, fs.chunk_rows, fs.layout)
                    fields.append(open_field(loc, spec, group, st.allocated, writable, sole=not multiprocessing))
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
        """Create a new store of ``kind`` with ``tables`` and open it for writing.

        Parameters
        ----------
        cache_path : str, os.PathLike or None
            A local folder, any fsspec URL, or None for an in-memory store (a ``.zip`` is written
            by ``dumps`` or ``trajstore copy``, never created in place).
        kind : {"ReplayBuffer", "TrajectoryReplayBuffer"}
            Recorded in the root attributes; ``open`` checks it.
        tables : list of TableSpec
            Capacity and field layouts of each table.
        schema : dict
            More root attributes (the spaces as JSON).
        storage_options : dict or None
            fsspec options of a URL.
        overwrite : bool
            Replace a store already at ``cache_path`` (never one another writer holds open).
        multiprocessing : bool
            Let several processes write (each write under the op lock).
        options : dict
            Store options (``fsync``, ``commit_interval``...), saved in the root attributes.

        Raises
        ------
        StoreExistsError
            A store (or other data) is at ``cache_path`` and ``overwrite`` is False.
        LockedError
            ``overwrite=True`` but another writer holds the store.
        DamagedStoreError
            The layout is outside what ``open`` accepts (sizes past the format's limits), checked
            before any byte is written.
        """
        _before_open()
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
        _one_process_per_session(loc, multiprocessing)
        # Lock first: overwrite=True must never erase a store another writer has open.
        lock = WriterLock(loc, shared=multiprocessing) if loc.is_local else None
        lease = None
        try:
            lease = RemoteLease.acquire(loc, multiprocessing=multiprocessing) if needs_lease(loc) else None
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
            if lease is not None:
                lease.release()
            raise
        # Not mode="w": that would delete the lock file we hold.  The root carries the schema only once
        # every array exists (below): zarr reads and rewrites the root's zarr.json for each array it
        # creates, so a schema of n fields there made creating n arrays cost O(n**2) (3,000 fields: 23 ms
        # more per array).  Meanwhile a marker says whose store this is.
        marker = {k: attrs[k] for k in ("format_version", "kind", "created_by", "created_at")}
        zarr.create_group(loc.zstore, attributes={ATTRS_KEY: marker}, overwrite=False)
        # The metadata is made by zarr in memory, then each file is written to the store once (the
        # root last): zarr's create_array reads and writes every parent group's zarr.json for each
        # array, 8 store calls each a hop to zarr's IO thread, which cost 7 ms an array on a loaded
        # machine (most of a D4RL import with 3,000 info keys).
        files: dict[str, Any] = {}
        mem = Location(MemoryStore(files), None, None)
        group = zarr.create_group(mem.zstore, attributes={ATTRS_KEY: marker})
        head = Head()

        async def make_arrays() -> None:  # in one sync call: each sync call is a thread hop (2 ms loaded)
            for t in tables:
                alloc = t.capacity if t.capacity is not None else max(f.chunk_rows for f in t.fields)
                for f in t.fields:
                    # Shape: what plain zarr readers see, the committed rows (none yet; a ring: its slots).
                    await zarr_async.create_array(
                        mem.zstore, name=f.array_path, shape=(alloc if t.capacity is not None else 0, *f.row_shape),
                        chunks=(f.chunk_rows, *f.row_shape), dtype=f.dtype,
                        **create_codecs(f), filters=None, fill_value=np.zeros((), f.dtype)[()],
                        config={"write_empty_chunks": True},
                        dimension_names=dimension_names(f.array_path, len(f.row_shape)),
                    )
                head.tables[t.name] = TableState(0, 0, alloc)

        zarr_sync.sync(make_arrays())
        group.attrs[ATTRS_KEY] = attrs
        consolidate_metadata(mem)
        for key in sorted(files, key=lambda k: k == "zarr.json"):
            loc.put(key, files[key].to_bytes())
        write_head(loc, head, fsync=bool(options.get("fsync")))
        group = open_zarr_group(loc, mode="r+")
        store = cls(loc, group, attrs, head, writable=True, multiprocessing=multiprocessing, lock=lock, options=options)
        store.lease = lease
        if lock is not None:
            lock.share()
        return store

    @classmethod
    def open(cls, path: Any, kind: str | tuple[str, ...] | None, *, read_only: bool, multiprocessing: bool,
             storage_options: dict[str, Any] | None, options: dict[str, Any]) -> "Store":
        """Open an existing store.

        A store is input (docs/design.md 3.7): its root metadata, every field's array metadata and the
        commit record are read as bounded regular files inside the root and checked against each
        other (:mod:`trajstore.schema`) before zarr parses them, anything is mapped or allocated, or
        a writer cleans or rolls anything forward.

        Raises
        ------
        StoreNotFoundError, NotATrajstoreError, FormatVersionError, DamagedStoreError, LockedError
        """
        _before_open()
        loc = resolve_location(path, read_only=read_only, storage_options=storage_options, must_exist=True)
        _one_process_per_session(loc, multiprocessing and not read_only)
        where = str(loc.url)
        root_id = None if read_only else file_identity(loc, "zarr.json")  # before the read: see Publisher.seed
        root, attrs = _read_root_of_kind(loc, kind)
        schema = check_schema(attrs, where)
        # Every array's metadata is checked (local arrays' own zarr.json files too: cheap, and zarr
        # reads them when a writer grows); the rows they record are not used (see below).
        seen: dict[str, Any] | None = None if read_only else {}
        array_rows(loc, schema, root, fresh=loc.is_local or not read_only, seen=seen)
        try:
            group = open_zarr_group(loc, mode="r" if read_only else "r+")
        except TrajstoreError:
            raise
        except Exception as e:
            raise DamagedStoreError(f"{loc.url}: zarr cannot open the store's metadata ({type(e).__name__}: {e})") from None
        lock = lease = None
        if not read_only and loc.is_local:
            lock = WriterLock(loc, shared=multiprocessing)
        try:
            if not read_only and needs_lease(loc):
                lease = RemoteLease.acquire(loc, multiprocessing=multiprocessing)
            head = read_head(loc)
            check_head_tables(head, schema, where)
            # (Array shapes need not match the record: trajstore sizes its arrays from the record's
            # allocation; a shape that lags it, a writer killed between record and metadata, is
            # harmless. array_rows checked each one is plausible.)
            if lock is not None and lock.sole:  # temp files are only removed when no other writer can be using them
                _clean_at_open(loc, head, lock.previous_unclean)
            store = cls(loc, group, attrs, head, writable=not read_only, multiprocessing=multiprocessing,
                        lock=lock, options=options, schema=schema)
            store.lease = lease
            if not read_only:
                # The metadata just read and checked serves the first commit's publish (it reads
                # nothing while each file is the one read here).
                store.publisher().seed(root, seen or {}, root_id)
                steps = schema.get(RUNS_TABLE)
                store.saved_runs = take_runs(loc, head, steps.capacity if steps is not None else None)
            if lock is not None:
                lock.share()
        except BaseException:
            if lock is not None:
                lock.release()
            if lease is not None:
                lease.release()
            raise
        return store

    # -- metadata ------------------------------------------------------------------------
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

    # -- copy ------------------------------------------------------------------------------
    def copy_to(self, dst: Any, *, storage_options: dict[str, Any] | None = None, progress: bool | None = None,
                overwrite: bool = True, stage: bool = True) -> None:
        """Copy every key of this store to ``dst`` (head last), with an optional progress bar.

        A local folder is built beside ``dst`` and put into place by
        :func:`trajstore.storage.publish.publish`: ``dst`` is its old store or the whole copy at
        every instant, and a copy that fails leaves it as it was with nothing beside it (a full
        disk: :class:`StoreFullError` naming ``dst``).  A non-empty folder that holds no store is
        refused (:class:`StoreExistsError`): replacing it would delete files that are not a
        store's.  A URL is written in place (an object store has no rename): a copy cut short has
        no commit record and is no store.  ``stage=False`` writes a local folder in place too: for a
        caller that built its name beside the destination and publishes it itself
        (``trajstore copy`` compares and verifies the copy first).
        """
        p = os.fspath(dst) if isinstance(dst, (str, os.PathLike)) else None
        if stage and p is not None and "://" not in p and "::" not in p and not (
                p.endswith(".zip") and not os.path.isdir(p)):
            self._copy_to_folder(os.path.abspath(os.path.expanduser(p)), progress, overwrite)
            return
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

    def _copy_to_folder(self, root: str, progress: bool | None, overwrite: bool) -> None:
        """:meth:`copy_to` a local folder: built under a temporary name beside it, then published."""
        if self.loc.local_root is not None and os.path.abspath(self.loc.local_root) == root:
            raise BadOptionError("copy_to needs a different destination")
        if os.path.lexists(root):
            if not os.path.isdir(root) or os.path.islink(root):
                raise StoreExistsError(f"{root}: is a file or link, not a store folder; remove it or copy elsewhere")
            names = set(os.listdir(root))
            if names and not names & {"zarr.json", HEAD_KEY}:
                raise StoreExistsError(f"{root}: the folder holds files but no trajstore store; a copy would replace "
                                       "them: remove them or copy elsewhere")
            if names and not overwrite:
                raise StoreExistsError(f"{root}: a store already exists here")
        build = partial_path(root)
        try:
            target = resolve_location(build, read_only=False, must_exist=False)
            try:
                self._copy_keys(target, progress)
            finally:
                target.close()
            publish([(build, root)], overwrite=overwrite)
        except BaseException as e:
            remove_entry(build)
            raise destination_full(e, root)  # e itself unless a full disk (then its cause)

    def data_keys(self) -> list[str]:
        """Every key a copy of this store takes: all but the commit record (written last), the
        previous record, locks, leases, temp or staging files and video packs (a linked segment is
        copied as the plain segment of its packets: :func:`~trajstore.storage.fields.video_copy.linked_copy`).
        Node metadata comes first, parents before children: a transactional target (icechunk)
        takes a chunk only into an array it knows."""
        skip = (LOCK_KEY, MPLOCK_KEY, LEASE_KEY, HEAD_KEY, PREV_KEY)  # the copy's writer keeps its own previous record
        keys = [k for k in self.loc.list_prefix("") if k not in skip and not is_pack_key(k)
                and not k.startswith((TMP_DIR, STAGING_DIR, BROKEN_DIR + "/"))]
        meta = sorted((k for k in keys if k == "zarr.json" or k.endswith("/zarr.json")), key=lambda k: k.count("/"))
        return meta + [k for k in keys if k not in set(meta)]

    def _copy_keys(self, target: Location, progress: bool | None) -> None:
        """Every data key, then the commit record (a copy cut short has none: not a store)."""
        keys = self.data_keys()
        bar = progress_bar(len(keys), f"copy to {target.url}", progress)
        try:
            for key in keys:
                plain = linked_copy(self.loc, key)  # a linked video segment: its packets, held
                if plain is not None:
                    target.put(key, plain)
                elif self.loc.is_local and target.is_local:
                    dest = target.path(key)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    # Never through a link: the source by a checked descriptor, the copy replacing
                    # whatever a copy cut short left there (but not a link's target).
                    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | OPEN_FLAGS, 0o644)
                    with os.fdopen(self.loc.open_inside(key, os.O_RDONLY), "rb") as src, os.fdopen(fd, "wb") as out:
                        copy_file_data(src.fileno(), out.fileno())  # holes stay holes (raw chunk files)
                else:
                    data = self.loc.get(key)
                    if data is not None:
                        target.put(key, data)
                bar.update(1)
        finally:
            bar.close()
        head = self.committed.copy()
        head.pending = None
        if target.transaction is not None:  # (icechunk: the copy is one commit, named for what it is)
            target.transaction.message = f"copy from {self.loc.url}"
        write_head(target, head, fsync=self.fsync)

    def close(self) -> None:
        """Release maps, descriptors and the writer lock; every later write raises ClosedError.
        Commits nothing: buffers flush before they close their store."""
        self.closed = True
        self._watch.close()
        for t in self.tables.values():
            for f in t.fields:
                f.close()
        self._close_publisher()  # while the lock is held: its temp files are this writer's
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self.loc.transaction is not None:  # icechunk: drop what no commit named, unlock a local repository
            self.loc.transaction.close()


def _one_process_per_session(loc: Location, multiprocessing: bool) -> None:
    """Refuse ``multiprocessing=True`` writers of an icechunk location: each process would commit
    its own session, and every commit after another's would be refused (ConcurrentWriteError)."""
    if multiprocessing and loc.transaction is not None:
        loc.close()
        raise BadOptionError(f"{loc.url}: multiprocessing=True writers are not supported on an icechunk location "
                             "(each process commits its own session); write from one process, or one shard per "
                             "process (docs/scale.md)")


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


def _erase(loc: Location) -> None:
    """Remove an existing store's keys (``overwrite=True``); links are unlinked, never followed."""
    if loc.local_root is not None:
        for name in os.listdir(loc.local_root):
            if name in (LOCK_KEY, MPLOCK_KEY):
                continue
            loc.delete_prefix(name)
        return
    for key in loc.list_prefix(""):
        # Not the writer's own lease, taken before erasing, nor the tombstones of leases taken over
        # (one deleted could let a late rival delete this writer's lease: storage/lease.py).
        if key != LEASE_KEY and not key.startswith(BROKEN_DIR + "/"):
            loc.delete(key)


def _clean_orphans(loc: Location, head: Head) -> None:
    """After a writer died: drop temp files, zarr's ``*.partial`` leftovers and unreferenced staging.

    Only ever deletes inside the store: a link (``.trajstore-tmp``, ``.trajstore-staging`` or one
    below them) is unlinked, never followed.  ``head.pending`` was checked against the schema.
    """
    assert loc.local_root is not None
    loc.delete_prefix(TMP_DIR, keep_folder=True)
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
