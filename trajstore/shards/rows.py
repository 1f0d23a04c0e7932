"""The rows of every shard as one :class:`~trajstore.sampling.source.EpisodeSource`.

Global logical row ``i`` is row ``i - cum[k]`` of shard ``k`` (shards in name order, ``cum`` the
cumulative row counts of the view), found by ``searchsorted`` on ``cum``: O(log shards) per row,
so uniform sampling over every row of every shard costs what it costs on one store plus that.
The samplers of :mod:`trajstore.sampling` (uniform rows, sequence windows, per-field windows)
run unchanged on it.

Consistency: the view (which shards, how many rows each) changes only in :meth:`ShardedRows.sync`
/ :meth:`ShardedRows.refresh`, never while a read is pinned; a read under a pinned view reads
each shard under the commit record that view holds, and :meth:`ShardedRows.rows_intact` asks
every shard whether its rows survived.  The view's record (:class:`ShardedHead`) has an
``epoch`` that changes whenever a shard's rows were rewritten or evicted, or the shards changed
(global row numbers then no longer name the rows they named).  The retry loop of
:func:`~trajstore.sampling.source.sample_consistent` follows anchors across such changes by
absolute rows (a shard's serial number times :data:`ROW_STRIDE` plus the shard's own absolute
row) and redraws only those whose shard evicted or rewrote them, or left the view: shards that
are small rings evict rows on almost every commit, and a reader that redrew its whole sample
at every eviction of any shard gave up while two writers filled 128-row rings.

Episode ids: episode ``e`` of shard ``k`` is global episode ``k * 2**40 + e``
(:data:`EPISODE_STRIDE`), so ids of different shards never meet and a window never crosses a
shard: the frame's id differs from the anchor's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.core.ring import distinct
from trajstore.errors import DamagedStoreError
from trajstore.sampling.source import EpisodeSource
from trajstore.shards.gather import CrossShardField, cross_shard_field
from trajstore.shards.watch import CommitChecks
from trajstore.storage.fields.base import Field
from trajstore.storage.head import Head, TableState

__all__ = ["EPISODE_STRIDE", "ROW_STRIDE", "ShardedHead", "ShardedRows"]

#: Global episode id = shard position * EPISODE_STRIDE + the shard's own episode id.
EPISODE_STRIDE = 1 << 40
#: Absolute row of the sampling retry loop = shard serial * ROW_STRIDE + the shard's absolute row
#: (a shard holding 2**40 rows is far beyond any store).
ROW_STRIDE = 1 << 40
#: ``one_run`` over windows up to this many rows reads their ids across shards (one gather)
#: instead of asking each shard's run index (a call per shard).
ONE_RUN_READ_SPAN = 64


@dataclass
class ShardedHead(Head):
    """The record of a view of every shard: one :class:`Head` per shard (``parts``, in name order)."""

    parts: tuple[Head, ...] = field(default_factory=tuple)
    names: tuple[str, ...] = field(default_factory=tuple)


def _record_folder(src: Any) -> str | None:
    """The local folder holding a shard's commit record (None for a URL)."""
    loc = getattr(getattr(getattr(src, "buffer", None), "_store", None), "loc", None)
    head = getattr(loc, "head_path", None)
    return None if head is None else os.path.dirname(head)


class ShardedRows(EpisodeSource):
    """Every shard's rows as one :class:`~trajstore.sampling.source.EpisodeSource` (used as a
    :class:`~trajstore.sampling.source.RowSource` only, for ReplayBuffer shards).

    ``sources`` (one row source per shard: the shards' read-only buffers' ``row_source()``) and
    ``names`` (the shard names) are kept in name order by ``discover``.

    Parameters
    ----------
    name : str
        The dataset root, for messages.
    discover : callable
        ``discover(force)`` brings :attr:`sources` and :attr:`names` up to date (new shards) and
        returns True when they changed; ``force=False`` may skip listing (rate-limited).
    reopen : tuple or None
        Picklable recipe that opens the dataset's rows in another process.
    """

    def __init__(self, name: str, discover: Callable[[bool], bool],
                 reopen: tuple[Callable[..., Any], tuple[Any, ...]] | None) -> None:
        self.name = name
        self.sources: list[Any] = []
        self.names: list[str] = []
        self.last_read: Head | None = None
        self._discover = discover
        self._reopen = reopen
        self.step_leaves: list[int] = []
        self.episode_leaves: list[int] = []
        self._pinned = 0
        self._touched: set[int] = set()  # shards a pinned read used: the only ones its check refreshes
        self._touched_all = False  # a cross-shard gather: every shard counts as used
        self._index: dict[str, int] = {}
        self._plans: dict[tuple[int, ...], list[int] | None] = {}
        self._epoch = 0
        self._generation = 0
        self._cum = np.zeros(1, np.int64)
        self._record = ShardedHead()
        self._checks = CommitChecks()  # which shards' records to check before / after a read
        # Batch reads of per-row fields across shards (gather.py): per field tuple, the fields'
        # cross-shard views (None: read shard by shard); each shard's first row and ring capacity
        # (0: unbounded) under the view.
        self._cross: dict[tuple[int, ...], list[CrossShardField] | None] = {}
        self._starts = np.zeros(0, np.int64)
        self._caps = np.zeros(0, np.int64)
        self._ring = False
        # Serial numbers of shard names, given in order of first sight and never reused while
        # this view lives (absolute rows, see absolute_rows); each view shard's serial.
        self._serials: dict[str, int] = {}
        self._serial_names: list[str] = []
        self._serial_of = np.zeros(0, np.int64)

    # -- the view --------------------------------------------------------------------------------
    def set_shards(self, names: list[str], sources: list[Any]) -> None:
        """The shards now open (``discover`` calls this): names in order, and their row sources."""
        self.names, self.sources = names, sources
        self._index = {n: i for i, n in enumerate(names)}
        self._cross = {}
        self._checks.update([(n, _record_folder(src)) for n, src in zip(names, sources)])
        self._plans = {}
        if sources:
            self.step_leaves = list(getattr(sources[0], "step_leaves", []))
            self.episode_leaves = list(getattr(sources[0], "episode_leaves", []))

    def adopt(self) -> bool:
        """Recompute the view from the shards as they are now; True when it changed."""
        parts = tuple(s.record for s in self.sources)
        names = tuple(self.names)
        old = self._record
        same = names == old.names and len(parts) == len(old.parts) and all(
            a is b or (a.generation == b.generation and a.epoch == b.epoch) for a, b in zip(parts, old.parts))
        if same:
            return False
        # A new epoch whenever rows a reader may have read under the old view are gone (a shard
        # evicted or rewrote rows, a shard vanished): the retry loop then draws the whole sample
        # again.  Global row numbers moving (rows added to an earlier shard, a shard sorting in
        # front) need none: a read pinned the old view and read the rows it numbered.
        before = dict(zip(old.names, old.parts))
        intact = set(names) >= set(old.names) and all(
            before[n] is p or s.rows_intact(before[n]) for n, s, p in zip(names, self.sources, parts) if n in before)
        order_kept = [n for n in names if n in before] == list(old.names)
        if not (intact and order_kept):
            self._epoch += 1
        self._generation += 1
        counts = np.array([s.count for s in self.sources], np.int64)
        self._starts = np.array([s.committed[0] for s in self.sources], np.int64)
        self._caps = np.array([s.capacity or 0 for s in self.sources], np.int64)
        self._ring = bool(self._caps.any())
        for n in names:
            if n not in self._serials:
                self._serials[n] = len(self._serial_names)
                self._serial_names.append(n)
        self._serial_of = np.array([self._serials[n] for n in names], np.int64)
        for s in self.sources:  # map the chunk files of the rows the view counts (a no-op when mapped)
            s.table.prepare_reads()
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        total = int(self._cum[-1])
        self._record = ShardedHead(self._generation, self._epoch, {"rows": TableState(0, total, total)}, {}, None,
                                   parts, names)
        return True

    @property
    def count(self) -> int:
        return int(self._cum[-1])

    @property
    def start(self) -> int:
        return 0

    @property
    def capacity(self) -> int | None:
        return None

    @property
    def live(self) -> bool:
        return True

    @property
    def record(self) -> Head:
        return self._record

    @property
    def committed(self) -> tuple[int, int]:
        return 0, self.count

    @property
    def reopen(self) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        return self._reopen

    @property
    def cum(self) -> np.ndarray:
        """(shards + 1,) int64: global row of each shard's first row, then the total."""
        return self._cum

    def close(self) -> None:
        """Stop watching the shard folders (the dataset closes its shards)."""
        self._checks.close()

    def _to_check(self, touched: set[int] | None = None) -> list[int]:
        """Positions of the shards whose record may have changed (among ``touched``, when given)."""
        names = self._checks.due(self.names, None if touched is None else {self.names[k] for k in touched})
        return [self._index[n] for n in names if n in self._index]

    def sync(self) -> None:
        if self._pinned:
            return
        found = self._discover(False)
        changed = False
        for k in self._to_check():  # the shards' records that may have changed, as a single store checks its own
            changed = self.sources[k].refresh() or changed
        if changed or found:
            self.adopt()

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        # Shards are refreshed only by sync / refresh / refresh_all, never by a read, so pinning
        # the view pins every shard (episodes() pins the shards themselves: their episode tables sync).
        if not self._pinned:
            self._touched, self._touched_all = set(), False
        self._pinned += 1
        try:
            yield
        finally:
            self._pinned -= 1

    def refresh(self) -> bool:
        """After a pinned read: adopt the newest commit of the shards that read used (the others'
        rows were not read, so whether they changed does not matter to it); True when the view
        changed.  :meth:`refresh_all` adopts everything."""
        changed = False
        for k in self._to_check(None if self._touched_all else self._touched):
            changed = self.sources[k].refresh() or changed
        return self.adopt() if changed else False

    def refresh_all(self) -> bool:
        """Adopt new shards and every shard's newest commit; True when the view changed."""
        found = self._discover(True)
        self._to_check()  # events so far are covered by the checks below
        for s in self.sources:
            s.refresh()
        return self.adopt() or found

    def rows_intact(self, before: Head) -> bool:
        if not isinstance(before, ShardedHead):
            return False
        if before is self._record:
            return True
        now = self._record
        current = dict(zip(now.names, now.parts))
        for n, part in zip(before.names, before.parts):
            cur = current.get(n)
            if cur is None:
                return False
            if cur is not part and not self.sources[self._index[n]].rows_intact(part):
                return False
        return True

    def absolute_rows(self, rows: np.ndarray) -> np.ndarray:
        k, local = self.locate(rows)
        return self._serial_of[k] * ROW_STRIDE + self._starts[k] + local

    def logical_rows(self, absolute: np.ndarray, before: Head) -> np.ndarray | None:
        if not isinstance(before, ShardedHead):
            return None
        serial, shard_row = np.divmod(np.asarray(absolute, dtype=np.int64), ROW_STRIDE)
        out = np.full(serial.shape, -1, np.int64)
        then = dict(zip(before.names, before.parts))
        now = self._record
        for sn in distinct(serial).tolist():
            name = self._serial_names[sn]
            k, part = self._index.get(name), then.get(name)
            if k is None or part is None or k >= len(now.parts):
                continue  # the shard left the view: its anchors are drawn again
            cur = now.parts[k]
            if cur.epoch != part.epoch or cur.generation < part.generation:
                continue  # rewritten (or a new store under the old name): nothing of it is kept
            sel = serial == sn
            local = shard_row[sel] - self._starts[k]  # below the shard's start: evicted
            out[sel] = np.where(local >= 0, local + self._cum[k], -1)
        return out

    # -- rows to shards --------------------------------------------------------------------------
    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, local row)`` of global logical ``rows`` (any shape), O(log shards) each."""
        r = np.asarray(rows, dtype=np.int64)
        k = np.searchsorted(self._cum, r, side="right") - 1
        k = np.clip(k, 0, max(len(self.sources) - 1, 0))
        return k, r - self._cum[k]

    def _per_shard(self, rows: np.ndarray, read: Callable[[int, np.ndarray], list[np.ndarray]]) -> list[np.ndarray]:
        """``read(shard position, local rows)`` for the rows of each shard, put back in ``rows`` order."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if not self.sources:
            raise DamagedStoreError(f"{self.name}: rows were asked of a dataset without shards")
        k, local = self.locate(rows)
        if rows.size == 0 or (k == k[0]).all():
            self._touched.add(int(k[0]) if rows.size else 0)
            return read(int(k[0]) if rows.size else 0, local)
        order = np.argsort(k, kind="stable")
        ks = k[order]
        bounds = np.flatnonzero(np.diff(ks)) + 1
        self._touched.update(ks[np.concatenate([[0], bounds])].tolist())
        out: list[np.ndarray] | None = None
        for sel in np.split(order, bounds):
            got = read(int(k[sel[0]]), local[sel])
            if out is None:
                out = [np.empty((len(rows), *a.shape[1:]), a.dtype) for a in got]
            for o, a in zip(out, got):
                o[sel] = a
        assert out is not None
        return out

    def _table_fields(self, leaves: Sequence[int]) -> list[int] | None:
        """The step table's field numbers of per-row ``leaves`` (the same in every shard: one space,
        one layout), or None when one is not stored per row (episode data)."""
        key = tuple(leaves)
        if key not in self._plans:
            src = self.sources[0]
            stored = [src.leaf_field(j) for j in leaves]
            self._plans[key] = (None if any(f is None for f in stored)
                                else [src.table.fields.index(f) for f in stored])
        return self._plans[key]

    def read_rows(self, rows: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        fields = self._table_fields(leaves) if self.sources else None
        if fields is not None:  # per-row leaves: straight from the shards' tables (a batch touches many shards)
            got = self._gather(rows, fields)
            if got is not None:
                return got
            return self._per_shard(rows, lambda k, r: self.sources[k].table.gather(r, fields))
        step = [j for j in leaves if j in self.step_leaves]
        if step and len(step) < len(leaves) and len(self.sources) > 1:
            # Step leaves across shards at once; episode leaves (one lookup per episode table) per shard.
            ep = [j for j in leaves if j not in step]
            by_leaf = dict(zip(step, self.read_rows(rows, step)))
            by_leaf.update(zip(ep, self._per_shard(rows, lambda k, r: self.sources[k].read_rows(r, ep))))
            return [by_leaf[j] for j in leaves]
        return self._per_shard(rows, lambda k, r: self.sources[k].read_rows(r, leaves))

    def _cross_fields(self, fields: tuple[int, ...]) -> list[CrossShardField] | None:
        """Cross-shard views of the step table's ``fields`` (rebuilt when a shard re-reserved one)."""
        if fields in self._cross:
            cross = self._cross[fields]
            if cross is None or all(c.current() for c in cross):
                return cross
        made = [cross_shard_field([s.table.fields[j] for s in self.sources]) for j in fields]
        cross = None if any(c is None for c in made) else [c for c in made if c is not None]
        self._cross[fields] = cross
        return cross

    def _gather(self, rows: np.ndarray, fields: Sequence[int]) -> list[np.ndarray] | None:
        """Fields ``fields`` of global logical ``rows`` (any shape) with one numpy gather per field
        across all shards, or None when the fields are not memory-mapped in every shard."""
        got = self._gather_k(rows, fields)
        return None if got is None else got[1]

    def _gather_k(self, rows: np.ndarray, fields: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]] | None:
        """:meth:`_gather`, and the shard of each row."""
        if len(self.sources) < 2:
            return None  # one shard: its table's own gather
        cross = self._cross_fields(tuple(fields))
        if cross is None:
            return None
        k, local = self.locate(rows)
        phys = local + self._starts[k]
        if self._ring:
            cap = self._caps[k]
            phys = np.where(cap > 0, phys % np.maximum(cap, 1), phys)
        if not all(c.fits(k, phys) for c in cross):
            # A shard's range is smaller than the view's rows (its table not grown yet): grow,
            # rebuild, and read shard by shard if it still does not fit.
            for s in self.sources:
                s.table.prepare_reads()
            self._cross.pop(tuple(fields), None)
            cross = self._cross_fields(tuple(fields))
            if cross is None or not all(c.fits(k, phys) for c in cross):
                return None
        self._touched_all = True
        return k, [c.take(k, phys) for c in cross]

    def _id_field(self) -> int | None:
        """The step table's field of episode ids (trajectory shards; None for ReplayBuffer shards)."""
        layout = getattr(getattr(self.sources[0], "buffer", None), "layout", None) if self.sources else None
        return None if layout is None else int(layout.id_field)

    def _windows(self, first: np.ndarray, length: int, fields: Sequence[int],
                 ids: bool = False) -> list[np.ndarray] | None:
        """Fields ``fields`` of the blocks of ``length`` rows from global logical rows ``first``
        (B,), across all shards at once: (B, length, ...) each; ``ids``: the one field is episode
        ids, made global.  A block inside one shard and contiguous in its range is one ``memcpy``;
        the others (across a shard's end or a ring's wrap point) are read row by row.  None when
        the fields are not memory-mapped in every shard."""
        if len(self.sources) < 2 or not first.size:
            return None
        cross = self._cross_fields(tuple(fields))
        if cross is None:
            return None
        k, local = self.locate(first)
        phys = local + self._starts[k]
        ok = (local >= 0) & (local + length <= self._cum[k + 1] - self._cum[k])
        if self._ring:
            cap = self._caps[k]
            wrapped = phys % np.maximum(cap, 1)
            ok &= (cap == 0) | (wrapped + length <= cap)
            phys = np.where(cap > 0, wrapped, phys)
        for c in cross:
            ok &= c.contiguous(k, phys, length)
        stride = np.int64(EPISODE_STRIDE)
        if ok.all():
            out = [c.take_windows(k, phys, length) for c in cross]
            self._touched_all = True
            return [out[0].astype(np.int64) + (k * stride)[:, None]] if ids else out
        rest = np.flatnonzero(~ok)
        rows = np.minimum(first[rest, None] + np.arange(length)[None, :], self.count - 1)
        got = self._gather_k(rows, fields)
        if got is None:
            return None
        k_rest, arrays = got
        if ids:
            arrays = [arrays[0].astype(np.int64) + k_rest * stride]
        good = np.flatnonzero(ok)
        res = []
        for c, a in zip(cross, arrays):
            o = np.empty((len(first), length, *a.shape[2:]), a.dtype)
            o[rest] = a
            if good.size:
                w = c.take_windows(k[good], phys[good], length)
                o[good] = w.astype(np.int64) + (k[good] * stride)[:, None] if ids else w
            res.append(o)
        return res

    def gather_windows(self, first: np.ndarray, length: int, leaves: Sequence[int]) -> list[np.ndarray]:
        first = np.asarray(first, dtype=np.int64)
        fields = self._table_fields(leaves) if len(self.sources) > 1 else None
        if fields is not None:  # every block read across shards at once
            got = self._windows(first, length, fields)
            if got is not None:
                return got
        k_first, _ = self.locate(first)
        k_last, _ = self.locate(first + length - 1)
        inside = k_first == k_last
        if inside.all():
            return self._per_shard(first, lambda k, r: self.sources[k].gather_windows(r, length, leaves))
        # Windows across a shard boundary (their frames past the boundary are invalid: other ids):
        # read row by row.
        rows = first[:, None] + np.arange(length)[None, :]
        rows = np.minimum(rows, self.count - 1)
        return [a.reshape(len(first), length, *a.shape[1:]) for a in self.read_rows(rows.ravel(), leaves)]

    def leaf_field(self, leaf: int) -> Field | None:
        return None  # a field per shard: see :meth:`ShardedDataset.dask_leaves`

    # -- episodes ---------------------------------------------------------------------------------
    @property
    def current_episode_id(self) -> int:
        return -1  # one live episode per shard: ShardedDataset.episodes() marks them

    def step_ids(self, rows: np.ndarray) -> np.ndarray:
        r = np.asarray(rows, dtype=np.int64)
        id_field = self._id_field()
        got = self._gather_k(r, [id_field]) if id_field is not None and r.size else None
        if got is not None:  # all shards' ids at once
            return got[1][0].astype(np.int64) + got[0] * EPISODE_STRIDE

        def read(k: int, local: np.ndarray) -> list[np.ndarray]:
            return [self.sources[k].step_ids(local) + k * EPISODE_STRIDE]

        return self._per_shard(r.reshape(-1), read)[0].reshape(r.shape)

    def window_ids(self, first: np.ndarray, length: int) -> np.ndarray:
        id_field = self._id_field()
        got = self._windows(np.asarray(first, dtype=np.int64), length, [id_field], ids=True) if id_field is not None else None
        if got is not None:
            return got[0]
        rows = np.asarray(first, dtype=np.int64)[:, None] + np.arange(length)[None, :]
        return self.step_ids(np.minimum(rows, self.count - 1))

    def one_run(self, first: np.ndarray, span: int) -> np.ndarray:
        first = np.asarray(first, dtype=np.int64)
        k, local = self.locate(first)
        ok = (first + span < self._cum[k + 1]) & (first >= 0)
        id_field = self._id_field()
        if id_field is not None and span <= ONE_RUN_READ_SPAN and first.size:
            # Short windows: read their ids across all shards at once and compare (a window that
            # ok says lies in one shard has that shard's ids only).
            got = self._windows(np.clip(first, 0, max(self.count - 1, 0)), span + 1, [id_field], ids=True)
            if got is not None:
                ids = got[0]
                return ok & (ids == ids[:, :1]).all(axis=1)
        out = np.zeros(len(first), bool)
        shards = distinct(k[ok]).tolist()
        self._touched.update(shards)
        for shard in shards:
            sel = ok & (k == shard)
            out[sel] = self.sources[shard].one_run(local[sel], span)
        return out

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._touched.update(range(len(self.sources)))
        parts = [s.runs() for s in self.sources]
        if not parts:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        first = np.concatenate([p[0] + self._cum[k] for k, p in enumerate(parts)]).astype(np.int64)
        lengths = np.concatenate([p[1] for p in parts]).astype(np.int64)
        ids = np.concatenate([p[2] + k * EPISODE_STRIDE for k, p in enumerate(parts)]).astype(np.int64)
        return first, lengths, ids

    def read_episode_rows(self, anchors: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        return self._per_shard(anchors, lambda k, r: self.sources[k].read_episode_rows(r, leaves))

    def episode_data_stale(self, rows: np.ndarray, before: Head) -> np.ndarray:
        """(B,) bool: which global logical ``rows`` (of the current view) may have read their
        episode's data, under view record ``before``, from a slot that their shard's episode-data
        ring reused since: each shard answers for its own rows against its own record in
        ``before`` (:meth:`TrajectoryRows.episode_data_stale <trajstore.buffers.rows.TrajectoryRows.episode_data_stale>`).
        Without it the retry loop kept another episode's data (episode 10's for episode 6's steps)."""
        rows = np.asarray(rows, np.int64)
        out = np.zeros(rows.shape, bool)
        if not isinstance(before, ShardedHead) or not rows.size:
            return out
        then = dict(zip(before.names, before.parts))
        k, local = self.locate(rows)
        for shard in distinct(k.ravel()).tolist():
            part, ask = then.get(self.names[shard]), getattr(self.sources[shard], "episode_data_stale", None)
            if part is None or ask is None:  # a shard new to the view (none of its rows was read), or no episode data
                continue
            sel = k == shard
            out[sel] = ask(local[sel], part)
        return out
