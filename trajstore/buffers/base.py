"""``StoredBuffer``: what every store-backed buffer shares (ReplayBuffer, TrajectoryReplayBuffer):
opening state, committing (flush / dumps / close), uniform sampling that stays consistent
while a writer fills a ring, and pickling as a small handle.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from trajstore.buffers.backend import Backend
from trajstore.buffers.rows import BufferRows
from trajstore.buffers.views import BatchBase
from trajstore.core.stager import RowStager
from trajstore.core.store import BEFORE_OPEN, Store, in_zarr_loop, register_before_pools_stop
from trajstore.core.table import Table
from trajstore.errors import BadOptionError, ClosedError
from trajstore.sampling.source import put_rows, read_consistent, sample_consistent
from trajstore.storage.location import Location

_T = TypeVar("_T")

__all__ = ["StoredBuffer", "as_generator"]

# Writers left open at interpreter exit are committed by an atexit hook.  It is registered
# after zarr's own (zarr is imported first), so it runs before zarr stops its event loop;
# a commit from __del__ during finalization could wait forever on that loop.
_OPEN: "weakref.WeakSet[StoredBuffer]" = weakref.WeakSet()
# Writers collected where they cannot commit (inside zarr's event-loop thread, which a commit
# waits on): kept alive here and committed before the next store opens (core.store.BEFORE_OPEN),
# or at exit.
_DEFERRED: list["StoredBuffer"] = []


def _close_deferred() -> None:
    while _DEFERRED:
        try:
            _DEFERRED.pop().close()
        except Exception:  # one broken buffer must not stop the others' commits
            pass


BEFORE_OPEN.append(_close_deferred)


def _commit_all_before_pools_stop() -> None:
    """Commit every open writer, and the deferred ones, while Python's thread pools still take work.

    A threading exit hook: it runs when the main thread ends, before concurrent.futures' own hook
    (registered earlier, run later) stops the pools, and before any atexit hook.  From an atexit
    hook a compressed field's commit fails (zarr encodes on the default executor: "cannot schedule
    new futures after shutdown") and the rows written since the last commit were lost.  While
    other non-daemon threads still run, they may be writing into these buffers: then nothing is
    done here and the atexit hook commits after they are joined, as before."""
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        return
    _close_deferred()
    _each_open("flush")


register_before_pools_stop(_commit_all_before_pools_stop)


@atexit.register
def _close_all() -> None:
    _close_deferred()
    _each_open("close")


def _each_open(method: str) -> None:
    """Call ``method`` ("flush" or "close") of every open buffer, exiting anyway: one broken
    buffer must not stop the others' commits."""
    for buf in list(_OPEN):
        try:
            getattr(buf, method)()
        except Exception:
            pass


def as_generator(rng: np.random.Generator | int | None, default: np.random.Generator) -> np.random.Generator:
    """``rng`` as a Generator: ``None`` gives ``default``, an int seeds a new one."""
    if rng is None:
        return default
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


class StoredBuffer(BatchBase):
    """Base of buffers whose rows live in a :class:`~trajstore.core.store.Store`.

    Subclasses set ``self._table`` (the table whose rows are the buffer's rows), register
    their row stagers in ``self._stagers`` and implement :meth:`_read_rows`.
    """

    _table: Table
    _stagers: list[RowStager]

    def __init__(self, store: Store, backend: Backend, open_args: dict[str, Any]) -> None:
        self._store = store
        self._backend = backend
        self._open_args = open_args
        self._rng = np.random.default_rng()
        self._closed = False
        # Objects committed with this buffer (PrioritizedSampler: its priorities), held weakly.
        self._followers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._stagers = []
        _OPEN.add(self)

    @classmethod
    def _open_store(cls, kind: str, path: Any, build: Callable[[Store, Backend, dict[str, Any]], "StoredBuffer"], *,
                    backend: str, device: Any, read_only: bool, multiprocessing: bool,
                    storage_options: dict[str, Any] | None, options: dict[str, Any]) -> "StoredBuffer":
        """Shared body of ``load_from``: open the store, then ``build(store, backend, open_args)``;
        the store is closed again if building the buffer fails (e.g. a space mismatch)."""
        bk = Backend(backend, device)
        store = Store.open(path, kind, read_only=read_only, multiprocessing=multiprocessing,
                           storage_options=storage_options, options=options)
        try:
            return build(store, bk, dict(backend=backend, device=device, storage_options=storage_options,
                                         options=options))
        except BaseException:
            store.close()
            raise

    # -- subclass hook ------------------------------------------------------------------------
    def _read_rows(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        """Like :meth:`_read` but without synchronizing first."""
        raise NotImplementedError  # abstract

    # -- what the package's own tools read (maintenance, interop, shards, metadata, CLI) -------------
    @property
    def store(self) -> Store:
        """The :class:`~trajstore.core.store.Store` holding the rows: its tables, commit record and
        location."""
        return self._store

    @property
    def rows_table(self) -> Table:
        """The store's table whose rows are the buffer's rows (a trajectory buffer: its step data)."""
        return self._table

    @property
    def default_rng(self) -> np.random.Generator:
        """The generator draws use when given no ``rng`` (this handle's own)."""
        return self._rng

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` released the store (reads and writes then raise ClosedError)."""
        return self._closed

    def pinned(self) -> "_Pin":
        """Reads inside keep the commit record they started on (a consistent read must see one
        record throughout); re-entrant, so a read inside a read stays pinned."""
        pin = self.__dict__.get("_pin")
        if pin is None:
            pin = self._pin = _Pin(self)
        return pin

    # -- state ---------------------------------------------------------------------------------
    def _drain(self) -> None:
        for st in self._stagers:
            st.drain()

    _pinned = 0  # > 0 while a consistent read runs (nested: one per level): it must see one commit record throughout

    def _sync(self) -> None:
        """Before reading: a writer hands staged appends to its tables; readers (and
        multi-process writers) adopt the latest commit, unless a read in progress pinned it."""
        if self._closed:
            raise ClosedError("I/O operation on a closed buffer")
        for st in self._stagers:
            if st.pending:
                st.drain()
        if (not self._store.writable or self._store.multiprocessing) and not self._pinned:
            self._store.refresh()

    #: Make reads current: staged appends handed to the tables, the latest commit adopted by a
    #: reader (:meth:`_sync` itself: one call less on every sample).
    sync_reads = _sync

    def __len__(self) -> int:
        self._sync()
        return self._table.count

    @property
    def count(self) -> int:
        """Rows present (``len(self)``)."""
        return len(self)

    @property
    def offset(self) -> int:
        """Physical row of logical row 0 (ring buffers; 0 when unbounded)."""
        self._sync()
        return self._table.offset

    @property
    def capacity(self) -> int | None:
        """Ring size in rows (steps, for a trajectory buffer), fixed at ``create``.

        Returns
        -------
        int or None
            ``None`` for an unbounded buffer, which grows as rows are added.
        """
        return self._table.capacity

    @property
    def full(self) -> bool:
        """Whether a ring holds ``capacity`` rows, so the next row added evicts the oldest.

        Returns
        -------
        bool
            Always False for an unbounded buffer.

        Raises
        ------
        ClosedError
            The buffer was closed.
        """
        return self.capacity is not None and len(self) == self.capacity

    @property
    def read_only(self) -> bool:
        """Whether this handle was opened read-only (``load_from(..., read_only=True)``).

        Returns
        -------
        bool
            True: writes raise :class:`~trajstore.errors.ReadOnlyError`, :meth:`flush` does
            nothing and reads follow the writer's commits.
        """
        return not self._store.writable

    @property
    def cache_path(self) -> str | None:
        """Where the store lives, as given to ``create``/``load_from``.

        Returns
        -------
        str or None
            The local folder, ``.zip`` file or fsspec URL; ``None`` for an in-memory buffer.
        """
        return self._store.loc.url

    @property
    def location(self) -> Location:
        """The :class:`~trajstore.storage.location.Location` the store lives at: its keys, and on
        an icechunk location its ``transaction`` (the snapshot read, the bytes fetched)."""
        return self._store.loc

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """The fsspec options the store was opened with (None for local folders and defaults)."""
        return self._open_args.get("storage_options")

    @property
    def multiprocessing(self) -> bool:
        """Whether the store was opened for several writer processes (``multiprocessing=True``).

        Returns
        -------
        bool
            True: writes are serialized by an inter-process lock and each write operation
            commits, and the buffer pickles as a handle that reopens the store.
        """
        return self._store.multiprocessing

    @property
    def check_bounds(self) -> bool:
        """Whether this handle's writes refuse Box values outside the bounds (``create`` /
        ``load_from`` keyword; a setting of the handle, not saved in the store)."""
        return bool(self._open_args.get("check_bounds", False))

    # -- reads -----------------------------------------------------------------------------------
    def _read(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        # No refresh here: ``idx`` was just resolved against len(self), i.e. the current commit.
        if self._closed:
            raise ClosedError("I/O operation on a closed buffer")
        self._drain()
        return self._read_rows(idx, leaf_ids)

    def row_source(self) -> "BufferRows":
        """This buffer's rows as a :class:`~trajstore.sampling.source.RowSource`: what samplers,
        sequence windows, dask arrays and the torch datasets read it through."""
        src = self.__dict__.get("_row_source")
        if src is None:
            src = self._row_source = self._make_row_source()
        return src

    def _make_row_source(self) -> "BufferRows":
        return BufferRows(self)

    def _consistent(self, read: Callable[[], _T]) -> _T:
        """``read()`` as of one commit record (see :func:`~trajstore.sampling.source.read_consistent`).
        Every read of this buffer and of its views (``get_slice``, ``get_column``) goes through here."""
        return read_consistent(self.row_source(), read)

    def sample(self, batch_size: int, *, rng: np.random.Generator | int | None = None) -> Any:
        """``batch_size`` rows drawn uniformly with replacement.

        ``rng`` is a ``numpy.random.Generator`` (or a seed); by default the buffer's own.  A
        reader of a ring that a writer is filling re-checks the commit record after reading and
        redraws rows evicted meanwhile, so it never returns a half-overwritten row.

        Raises
        ------
        BadOptionError
            ``batch_size`` is not an int >= 0.
        EmptyBufferError
            The buffer holds no rows (or a writer emptied it meanwhile).
        """
        gen = as_generator(rng, self._rng)
        leaves = self._all_leaves
        arrays = sample_consistent(self.row_source(), lambda k: gen.integers(0, self._table.count, size=k),
                                   lambda idx: self._read_rows(idx, leaves), batch_size, put_rows)
        return self._plan.from_arrays([self._backend.out(a) for a in arrays])

    # -- committing ----------------------------------------------------------------------------------
    def flush(self, fsync: bool | None = None) -> None:
        """Commit everything written so far.

        ``fsync=True`` makes it durable against power loss too; ``None`` follows the store's
        ``fsync`` option (default False: safe against process crashes only)."""
        if self.read_only:
            return
        self._store.check_writable()
        if self._store.multiprocessing:
            # Under the op lock, on top of the other writers' latest commit: committing this
            # handle's stale view would drop their rows.
            with self._store.write_op():
                self._drain()
                if fsync:
                    self._store.commit(fsync=True, state=self._state())
        else:
            self._drain()
            self._store.commit(fsync=fsync, state=self._state())
        for follower in list(self._followers):
            follower.buffer_flushed(fsync)

    def attach(self, follower: Any) -> None:
        """Commit ``follower`` with this buffer: every :meth:`flush` ends with
        ``follower.buffer_flushed(fsync)`` and :meth:`close` calls ``follower.buffer_closing()``
        before it releases the store (a :class:`~trajstore.PrioritizedSampler` writes and releases
        its priorities there, so ``buffer.close()`` alone keeps them).  Held weakly."""
        self._followers.add(follower)

    def _state(self) -> dict[str, Any] | None:
        """Buffer-specific state saved in the commit record (None: keep what is there)."""
        return None

    def dumps(self, path: str | os.PathLike[str] | None = None, *, storage_options: dict[str, Any] | None = None,
              progress: bool | None = None, compressor: Any = "auto") -> None:
        """Make everything written so far durable and consistent.

        To the buffer's own ``cache_path`` (or ``path=None``) this is one commit: chunks being
        filled are written and the commit record replaced (milliseconds at any size).  To another
        path it copies the store there (progress bar on a terminal) and leaves this one open.

        A ``.zip`` is a file meant for sharing, so it is written small: only chunks holding
        committed rows, raw fields compressed (``compressor``: ``"auto"`` (default) compresses raw
        fields with lz4 row blocks and keeps compressed ones; ``"keep"`` keeps every field's codec;
        ``"none"`` stores raw chunks; ``"lz4"``/``"zstd"`` or a codec for every field).  Folders and
        URLs get a byte copy, whose layout is the store's own (``compressor`` must stay ``"auto"``
        or ``"keep"``; ``trajstore copy --compressor`` re-encodes them).
        """
        self.flush()
        if path is None or self._same_path(path):
            return
        p = os.fspath(path)
        if "://" not in p and "::" not in p and p.endswith(".zip") and not os.path.isdir(p):
            from trajstore.core.zipcopy import write_zip

            write_zip(self._store, p, compressor=compressor, progress=progress)
            return
        if not (isinstance(compressor, str) and compressor in ("auto", "keep")):
            raise BadOptionError(f"dumps({p!r}, compressor={compressor!r}): a folder or URL copy keeps the store's "
                             "layout; re-encode with `trajstore copy SRC DST --compressor ...`, or dumps to a .zip")
        self._store.copy_to(path, storage_options=storage_options, progress=progress)

    def _same_path(self, path: Any) -> bool:
        own = self._store.loc.url
        if own is None:
            return False
        if "://" in own or "://" in os.fspath(path):
            return os.fspath(path).rstrip("/") == own.rstrip("/")
        return os.path.abspath(os.fspath(path)) == os.path.abspath(own)

    def close(self) -> None:
        """Commit (writers) and release files, maps and the writer lock."""
        if self._closed:
            return
        try:
            if not self._store.forked:  # a forked child's copy: the parent commits, not us
                self.flush()
                if not self.read_only:
                    self._after_last_commit()
                for follower in list(self._followers):
                    follower.buffer_closing()
        finally:
            self._release()

    def _after_last_commit(self) -> None:
        """A writer's close, after its last commit and before the lock is released (derived
        files that describe the committed rows are written here)."""

    def _release(self) -> None:
        self._store.close()
        self._closed = True
        _OPEN.discard(self)

    def __enter__(self) -> "StoredBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # the atexit hook already committed; zarr's loop may be gone
        try:
            if os.getpid() != self._store.opener_pid:
                # A copy inherited through fork: garbage collection may run anywhere in the child,
                # even inside zarr's event-loop setup (whose lock a commit would take again and
                # deadlock on), and the rows belong to the parent.  Release, never commit.
                self._release()
            elif not self._closed and in_zarr_loop():
                # Collected in zarr's IO thread (buffers sit in reference cycles, so the cyclic
                # collector frees them in whichever thread it runs): a commit here would wait on
                # this very loop.  Keep the buffer alive; it commits at the next open or at exit.
                _DEFERRED.append(self)
            else:
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "writer"
        return (f"{type(self).__name__}({self.cache_path!r}, {mode}, len={self._table.count}, "
                f"capacity={self.capacity}, space={self.single_space})")

    # -- pickling -----------------------------------------------------------------------------------
    def __reduce__(self) -> Any:
        name = type(self).__name__
        if self.cache_path is None:
            raise TypeError(f"an in-memory {name} (cache_path=None) cannot be pickled")
        if not (self.read_only or self.multiprocessing):
            raise TypeError(f"a single-writer {name} cannot be pickled: open it with multiprocessing=True, "
                            "or pickle a read-only one (load_from(..., read_only=True))")
        a = self._open_args
        kwargs = dict(backend=a["backend"], device=a["device"], read_only=self.read_only,
                      multiprocessing=self.multiprocessing, storage_options=a["storage_options"],
                      **{k: v for k, v in a["options"].items() if k in ("fsync", "commit_interval")})
        if self.check_bounds:  # a policy of the handle: the copy in another process keeps it
            kwargs["check_bounds"] = True
        return (_reopen, (type(self), self.cache_path, kwargs))


class _Pin:
    """:meth:`StoredBuffer.pinned`: one per buffer, entered once per consistent read (a
    generator-based context manager cost more than the rest of a small read's bookkeeping)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: StoredBuffer) -> None:
        self.buffer = buffer

    def __enter__(self) -> None:
        self.buffer._pinned += 1

    def __exit__(self, *exc: Any) -> None:
        self.buffer._pinned -= 1


def _reopen(cls: Any, path: str, kwargs: dict[str, Any]) -> StoredBuffer:
    return cls.load_from(path, **kwargs)  # cls: as in _reopen_rows
