"""The commit protocol of an open store (docs/design.md 3), the base class of :class:`~trajstore.core.store.Store`.

1. data first: rows go into chunk files (written whole, or into pre-sized mapped files
   beyond the committed rows);
2. before a ring overwrites rows the last commit still counts, it commits a record that
   no longer counts them (:meth:`StoreCommits.ensure_evicted`);
3. rewrites of committed rows (set_at, remove_at) are staged in ``.trajstore-staging``,
   named by a commit record, then moved into place (:meth:`StoreCommits.rewrite`);
4. the commit record goes last (:meth:`StoreCommits.commit`).

Readers adopt newer records with :meth:`StoreCommits.refresh` and check that rows they read
stayed intact with :meth:`StoreCommits.rows_intact`.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Iterable

import numpy as np
import zarr

from trajstore.core.table import Table
from trajstore.errors import ClosedError, LockedError, ReadOnlyError
from trajstore.storage.fields.base import Field
from trajstore.storage.head import Head, HeadWatch, TableState, read_head, write_head
from trajstore.storage.lease import RemoteLease
from trajstore.storage.location import STAGING_DIR, Location
from trajstore.storage.locks import WriterLock
from trajstore.storage.published import Publisher, add_dimension_names
from trajstore.storage.schema import TableSchema, check_pending

__all__ = ["StoreCommits", "consolidate_metadata"]


class StoreCommits:
    """The commit-protocol half of :class:`~trajstore.core.store.Store`: writing, evicting,
    rewriting and adopting commit records.  :class:`Store` sets every attribute declared here."""

    loc: Location
    group: zarr.Group
    writable: bool
    closed: bool
    multiprocessing: bool
    lock: WriterLock | None
    lease: RemoteLease | None = None  # a remote store's writer lease (storage.lease)
    opener_pid: int
    fsync: bool
    commit_interval: float
    committed: Head
    tables: dict[str, Table]
    schema: dict[str, TableSchema]
    refresh_listeners: list[Callable[[], None]]
    op_listeners: list[Callable[[], None]]
    _watch: HeadWatch
    _last_commit: float
    _op: WriteOp
    _publisher: Publisher | None = None

    def check_writable(self) -> None:
        if self.closed:
            raise ClosedError("I/O operation on a closed buffer: its store was closed (and its writer lock "
                              "released); reopen it with load_from to write")
        if not self.writable:
            raise ReadOnlyError(f"{self.loc.url}: the buffer is open read-only")
        if self.forked:
            raise LockedError(f"{self.loc.url}: this process was forked from the store's writer, which "
                              "keeps writing it; open the store again here (read_only=True to read), or "
                              "use multiprocessing=True in every writer")

    @property
    def forked(self) -> bool:
        """This process is a fork of a single writer's: it holds no lock and must not write.

        Also true for stores without a lock file (remote, in memory): their single writer is the
        process that opened them.  A multiprocessing writer's forked child may write."""
        if self.lock is not None and self.lock.forked_child:
            return True
        return not self.multiprocessing and os.getpid() != self.opener_pid

    def write_record(self, head: Head) -> None:
        """Commit ``head`` as the next generation: the remote lease checked, plain zarr readers' shapes
        published around the record (storage/published.py)."""
        if self.lease is not None:  # remote: never replace a record another writer committed
            self.lease.check(self.committed.generation)
        head.generation = self.committed.generation + 1
        # Plain zarr readers' view (storage/published.py): shapes drop rows before the record, gain them after.
        pub = self.publisher()
        pub.before_commit(self.committed, head, fsync=self.fsync)
        if self.loc.transaction is not None:  # icechunk: shapes and record in one commit, no order to keep
            pub.after_commit(head)
        write_head(self.loc, head, fsync=self.fsync)
        self.committed = head
        self._watch.wrote()
        if self.loc.transaction is None:
            pub.after_commit(head)

    def publisher(self) -> Publisher:
        """The :class:`~trajstore.storage.published.Publisher` of this writer's commits."""
        if self._publisher is None:
            self._publisher = Publisher(self.loc, self.schema)
        return self._publisher

    def current_head(self) -> Head:
        """A record of the tables' rows as they are now (the committed record's state, no pending rewrite)."""
        head = self.committed.copy()
        for name, t in self.tables.items():
            head.tables[name] = TableState(t.state.start, t.state.end, t.state.allocated)
        head.pending = None
        return head

    def commit(self, *, fsync: bool | None = None, state: dict[str, Any] | None = None,
               evict: dict[str, int] | None = None, seal: bool = True) -> None:
        """Write all buffered data, then the commit record naming it.

        ``evict`` maps table names to an absolute row below which the record must not count
        rows (the writer is about to overwrite their slots): see :meth:`ensure_evicted`.
        ``seal=False`` (the writer's timed commits) lets a video field keep the episode it is
        recording in memory, and the record then counts rows up to that episode's start
        (:meth:`Table.flush <trajstore.core.table.Table.flush>`).
        """
        self.check_writable()
        if self.lease is not None:  # remote: not even the data goes out over another writer's commit
            self.lease.check(self.committed.generation)
        if self.committed.pending:  # a rewrite whose chunks could not all be moved into place
            self._roll_forward(self.committed)
        fsync = self.fsync if fsync is None else fsync
        evict = evict or {}
        ends = {name: t.flush(fsync, evict.get(name), seal=seal) for name, t in self.tables.items()}
        head = self.current_head()
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
            self.write_record(head)
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
            self.commit(state=self.buffer_state(), seal=False)

    state_provider: Callable[[], dict[str, Any]] | None = None

    def buffer_state(self) -> dict[str, Any] | None:
        """The owning buffer's state for the next commit record (None: keep the last one's)."""
        return self.state_provider() if self.state_provider else None

    def _close_publisher(self) -> None:
        """Remove the temp files kept for publishing metadata (storage/published.py); at close."""
        if self._publisher is not None:
            self._publisher.close()

    def metadata_changed(self) -> None:
        """A table's allocation grew: nothing to write.  The allocation lives in the commit record
        only (arrays are sized from it in memory); the shapes plain readers see are published
        around each commit record (:meth:`write_record`)."""

    def rewrite(self, changes: Iterable[tuple[Field, int, np.ndarray]],
                apply_state: Callable[[], None]) -> None:
        """Replace whole chunks of committed rows crash-atomically.

        ``changes`` are staged first; ``apply_state`` then updates the in-memory table
        states, and one commit record names both the new state and the staged chunks (from
        that instant the store is "after"); the chunks are then moved into place.
        """
        self.check_writable()
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
        head = self.current_head()
        if self.state_provider:
            head.state = self.state_provider()
        head.epoch += 1
        head.pending = {"prefix": prefix, "chunks": staged}
        if self.fsync and self.loc.is_local:
            os.sync()
        try:
            self.write_record(head)
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
        self.write_record(done)
        self.loc.delete_prefix(prefix)

    def _fields_by_path(self) -> dict[str, Field]:
        return {f.spec.array_path: f for t in self.tables.values() for f in t.fields}

    def _apply_pending(self, pending: dict[str, Any] | None, staged: bool) -> None:
        """Read the chunks ``pending`` names from its staging prefix (``staged``) or from their
        place again; ``pending`` is checked against the schema first."""
        if not pending:
            return
        check_pending(pending, self.schema, {n: t.state.allocated for n, t in self.tables.items()}, str(self.loc.url))
        for t in self.tables.values():
            # A rewrite that grew the table stages chunks past this reader's reservation.
            t.match_allocation()
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
        if self._publisher is not None:
            self._publisher.forget()  # another writer committed (and published) since
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

    def write_op(self) -> "WriteOp":
        """Context of one write operation: in multiprocessing mode it is serialized with the
        other writers (inter-process lock), sees their commits, and commits at its end."""
        self.check_writable()
        return self._op


class WriteOp:
    """Reusable context manager for :meth:`Store.write_op` (cheaper than a generator per append)."""

    __slots__ = ("store",)

    def __init__(self, store: StoreCommits) -> None:
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


def consolidate_metadata(loc: Location) -> None:
    """Give arrays just created their dimension names (storage/published.py), then write
    consolidated metadata (zarr warns about our non-zarr keys at the root; they are expected)."""
    add_dimension_names(loc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(loc.zstore)
