"""The episode index of a trajectory buffer: which episode-data row holds which episode id,
where each episode's last step is, and eviction of data whose episode left the step ring.

Everything here is derived from the stored arrays (the episode-id column of the episode
table, the step-id column of the step table) and cached in RAM until they change, so
opening a store stays a metadata operation: the caches fill on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from trajstore.core.ring import distinct
from trajstore.core.table import Table
from trajstore.storage.runs_file import SavedRuns

if TYPE_CHECKING:
    from trajstore.core.store import Store

__all__ = ["EpisodeIndex", "RunIndex", "done_fields", "done_field_names", "all_done", "done_at", "episode_numbers",
           "scalar_field", "leaf_name", "TERMINATED_NAMES", "TRUNCATED_NAMES", "DONE_NAMES"]


# -- episodes of a ReplayBuffer: ends flagged by done-like fields --------------------------------
# A ReplayBuffer store has no episode ids; its episodes end after a row flagged by any done-like
# field, and the rows before a ring's first flag are a (partial) episode too.  This is the one
# rule: ``trajstore episodes``/``info`` (summary) and the datasets all use it.
TERMINATED_NAMES = ("terminated", "terminal", "terminals")
TRUNCATED_NAMES = ("truncated", "timeout", "timeouts")
DONE_NAMES = ("done", "dones")


def leaf_name(t: Table, j: int) -> str:
    """The path of field ``j`` of table ``t`` within the table (``"obs/pos"``)."""
    p = t.fields[j].spec.array_path
    return p[len(t.name) + 1:] if p.startswith(t.name + "/") else p


def scalar_field(t: Table, names: tuple[str, ...]) -> int | None:
    """Index of the first one-element field of ``t`` whose leaf name is in ``names``, or None."""
    for j, f in enumerate(t.fields):
        if leaf_name(t, j) in names and int(np.prod(f.spec.row_shape, dtype=np.int64)) == 1:
            return j
    return None


def done_fields(t: Table) -> dict[str, int] | None:
    """The done-like fields of step table ``t`` (``{"terminated"|"truncated"|"done": field index}``),
    or None when it has none: scalar (one-element) leaves named as :func:`done_field_names` says."""
    found = (("terminated", scalar_field(t, TERMINATED_NAMES)), ("truncated", scalar_field(t, TRUNCATED_NAMES)),
             ("done", scalar_field(t, DONE_NAMES)))
    return {k: j for k, j in found if j is not None} or None


def done_field_names() -> str:
    """The leaf names :func:`done_fields` looks for, for messages."""
    return ", ".join(TERMINATED_NAMES + TRUNCATED_NAMES + DONE_NAMES)


def all_done(t: Table, fields: dict[str, int]) -> np.ndarray:
    """Whether each committed logical row ends an episode, (count,) bool."""
    done = np.zeros(t.count, bool)
    for j in fields.values():
        done |= t.read_contiguous(0, t.count, [j])[0].reshape(t.count).astype(bool)
    return done


def done_at(t: Table, fields: dict[str, int], rows: np.ndarray) -> np.ndarray:
    """Whether logical ``rows`` (any shape) end an episode: any done-like field set (as
    :func:`all_done`, for a few rows instead of the whole column)."""
    flat = np.asarray(rows, np.int64).reshape(-1)
    done = np.zeros(len(flat), bool)
    for a in t.gather(flat, list(fields.values())):
        done |= a.reshape(len(flat)).astype(bool)
    return done.reshape(np.shape(rows))


def episode_numbers(done: np.ndarray, axis: int = -1) -> np.ndarray:
    """Episode number of each row along ``axis`` given its done flags, counted from 0 at the first
    row: a row after a flagged row starts the next episode (an exclusive cumulative sum), int64.

    On a whole column these are the CLI's episode ids; on windows of consecutive rows, frames
    with the anchor's number lie in the anchor's episode.
    """
    d = np.asarray(done, bool)
    return np.cumsum(d, axis=axis, dtype=np.int64) - d


class EpisodeIndex:
    """Id lookups and eviction for one trajectory store.

    Parameters
    ----------
    store : Store
        Owner of the commit record (rewrites go through it).
    steps : Table
        The step table; field ``step_id_field`` holds each step's episode id.
    episodes : Table or None
        The episode-data table; field ``episode_id_field`` holds each row's episode id.
    current_id : callable
        Returns the id of the episode being recorded (its data is never evicted).
    """

    def __init__(self, store: "Store", steps: Table, step_id_field: int, episodes: Table | None,
                 episode_id_field: int, current_id: Callable[[], int]) -> None:
        self.store, self.steps, self.episodes = store, steps, episodes
        self.step_id_field, self.episode_id_field = step_id_field, episode_id_field
        self.current_id = current_id
        self._ids: np.ndarray | None = None  # episode id of each logical episode row
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None
        self._last: dict[int, int] | None = None  # episode id -> absolute row of its last step
        self._min_last: int | None = None  # earliest last step among episodes with data (None: unknown)

    def forget(self) -> None:
        """Drop every cache (the arrays changed under us)."""
        self._ids = self._sorted = self._last = self._min_last = None

    # -- lookups ---------------------------------------------------------------------------
    def column(self) -> np.ndarray:
        """Episode id of every logical episode-data row, shape (E,) int64."""
        if self._ids is None:
            t = self.episodes
            self._ids = np.zeros(0, np.int64) if t is None else t.read_contiguous(0, t.count, [self.episode_id_field])[0]
            self._sorted = None
        return self._ids

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Episode-data rows of ``ids`` (any shape, int64); -1 where an id has no data."""
        col = self.column()
        if self._sorted is None:
            order = np.argsort(col, kind="stable")
            self._sorted = (col[order], order)
        keys, order = self._sorted
        if len(keys) == 0:
            return np.full(ids.shape, -1, np.int64)
        pos = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
        return np.where(keys[pos] == ids, order[pos], -1)

    def last_rows(self) -> dict[int, int]:
        """Absolute row of the last step of every episode with steps present (built once, O(rows))."""
        if self._last is None:
            t = self.steps
            ids = t.read_contiguous(0, t.count, [self.step_id_field])[0]
            uniq, last = np.unique(ids[::-1], return_index=True)
            self._last = dict(zip(uniq.tolist(), (t.state.start + len(ids) - 1 - last).tolist()))
        return self._last

    # -- writes -------------------------------------------------------------------------------
    def set_row(self, episode_id: int, arrays: list[np.ndarray]) -> None:
        """Write episode data (one row per leaf array): in place for a known id, else a new row."""
        et = self.episodes
        assert et is not None
        row = int(self.lookup(np.array([episode_id]))[0])
        if row >= 0:
            self.store.rewrite(et.rewrite_plan_set(np.array([row]), arrays, list(range(len(arrays)))), lambda: None)
        else:
            before = et.state.start
            et.extend(arrays + [np.array([episode_id], np.int64)], 1)
            col = np.concatenate([self.column(), [episode_id]])
            self._ids = col[et.state.start - before :]  # a full ring dropped its oldest row
            self._min_last = None
        self._sorted = None

    def after_step_block(self, lo: int, arrays: list[np.ndarray]) -> None:
        """Step-table listener, per block of rows written: remember each episode's last step."""
        if self._last is not None:
            ids = arrays[self.step_id_field]
            uniq, last = np.unique(ids[::-1], return_index=True)
            for eid, k in zip(uniq.tolist(), (len(ids) - 1 - last).tolist()):
                self._last[eid] = lo + k

    def after_step_extend(self) -> None:
        """Step-table listener, once per extend call: evict the data of episodes left without
        steps (per call, not per block: an episode that gets steps again later in the same call
        keeps its data, whatever the ring's block size)."""
        if self.episodes is not None and self.steps.capacity is not None and self.episodes.count:
            self.evict_dead()

    def evict_dead(self) -> None:
        """Drop the episode rows whose episode has no step left in the ring.

        Checked only once the ring's start passes the earliest last step among episodes with
        data, so a steady stream costs O(episode rows) per evicted episode.  Dead rows at the
        front just advance the table's start; dead rows behind a live one (data set out of
        order) are removed by a staged rewrite, so they never push a live episode's data out of
        a bounded episode table.
        """
        t, et = self.steps, self.episodes
        assert et is not None
        if self._min_last is not None and self._min_last >= t.state.start:
            return
        last = self.last_rows()
        col = self.column()
        lasts = np.fromiter((last.get(e, -1) for e in col.tolist()), np.int64, len(col))
        dead = (lasts < t.state.start) & (col != self.current_id())
        self._min_last = int(lasts[~dead].min()) if (~dead).any() else None
        if not dead.any():
            return
        k = int(np.argmin(dead)) if not dead.all() else len(dead)  # length of the dead prefix
        for e in col[dead].tolist():
            last.pop(e, None)
        if dead[k:].any():
            rows = np.flatnonzero(dead)
            self.store.rewrite(et.rewrite_plan_remove(rows), lambda: setattr(et.state, "end", et.state.end - len(rows)))
        else:
            et.state.start += k
        self._ids = col[~dead]
        self._sorted = None


class _Boundaries:
    """Bitmap of run starts: bit ``r - base`` is set when absolute row ``r`` starts a run.

    One bit per covered row (the size of a 32-row table of int32), so "does any run start in
    rows ``(lo, lo + span]``" is one unaligned 8-byte load per window: O(1), where a binary search
    over the run starts costs log2(runs) dependent cache misses on a large store.
    """

    MAX_SPAN = 56  # an 8-byte load at byte (lo + 1) // 8 holds bits (lo, lo + 56]
    _SLACK = 1 << 15  # rows kept below the covered range: a reader's ring start moving back fits

    def __init__(self) -> None:
        self.base = 0
        self._bytes = np.zeros(0, np.uint8)
        self._words = self._bytes.view(np.uint64)

    def reset(self, lo: int, hi: int, starts: np.ndarray) -> None:
        """Cover absolute rows ``[lo, hi)`` whose runs start at ``starts`` (nothing else marked)."""
        self.base = max(lo - self._SLACK, 0) // 8 * 8
        self._alloc(np.zeros(self._need(hi), np.uint8))
        self.mark(starts, True)

    def covers(self, lo: int) -> bool:
        return lo >= self.base and len(self._bytes) > 0

    def extend(self, hi: int, lo: int) -> None:
        """Make room up to row ``hi``; forget bytes wholly below row ``lo`` once they are half."""
        drop = max(lo - self._SLACK - self.base, 0) // 8
        if drop > len(self._bytes) // 2:
            self.base += 8 * drop
            self._alloc(self._bytes[drop:].copy())
        need = self._need(hi)
        if need > len(self._bytes):
            grown = np.zeros(max(need, 2 * len(self._bytes)), np.uint8)
            grown[: len(self._bytes)] = self._bytes
            self._alloc(grown)

    def mark(self, rows: np.ndarray, on: bool) -> None:
        """Set (``on``) or clear the bits of absolute ``rows`` (all inside the covered range)."""
        pos = np.asarray(rows, np.int64) - self.base
        if len(pos) > 1 and not (pos[1:] > pos[:-1]).all():
            pos = distinct(pos)
        if not len(pos):
            return
        # Bits of rows sharing a byte are merged first (ufunc.at, which merges them itself, took
        # 2.4 ms for the 20,000 runs of a 10 M-row store; reduceat over sorted rows 0.2 ms).
        at = pos >> 3
        first = np.flatnonzero(np.concatenate([[True], at[1:] != at[:-1]]))
        bits = np.bitwise_or.reduceat((1 << (pos & 7)).astype(np.uint8), first)
        if on:
            self._bytes[at[first]] |= bits
        else:
            self._bytes[at[first]] &= ~bits

    def none_in(self, lo: np.ndarray, span: int) -> np.ndarray:
        """Whether no run starts in rows ``(lo[b], lo[b] + span]``, (B,) bool; ``span <= MAX_SPAN``."""
        q = lo + (1 - self.base)
        words = self._words[q >> 3]
        mask = np.uint64((1 << span) - 1)
        return ((words >> (q & 7).astype(np.uint64)) & mask) == 0

    def _need(self, hi: int) -> int:
        return (hi - self.base) // 8 + 9  # + 8 bytes: the last load reads past the last row

    def _alloc(self, data: np.ndarray) -> None:
        self._bytes = data
        # Overlapping 8-byte words at every byte offset (stride 1): unaligned loads.
        self._words = np.ndarray((max(len(data) - 7, 0),), "<u8", buffer=data, strides=(1,))


class RunIndex:
    """Runs of equal step ids: the absolute row where each run starts, and its id.

    Two int64 per run (not per row), so the episode table is a grouping of runs instead of a
    scan of every row, and checking that a window of rows lies in one run never reads the
    window's ids: a bitmap of the run starts (:class:`_Boundaries`, one bit per row) answers for
    windows of up to 57 rows in O(1), a binary search over the run starts for longer ones.
    Extended with the ids of the rows appended since the last use; rebuilt when the commit
    record's epoch moved (rows were rewritten, removed or cleared) or the rows it covers were
    all evicted.  The first use starts from the runs a writer saved at close
    (:mod:`trajstore.storage.runs_file`) when they still describe the committed rows, so a fresh
    reader scans only the rows appended since.

    Parameters
    ----------
    steps : Table
        The step table; field ``id_field`` holds each step's episode id.
    epoch : callable
        Returns the current commit-record epoch.
    saved : callable, optional
        Returns the saved runs (or None); called once, at the first use.
    """

    _NONE = np.iinfo(np.int64).max
    #: Ids read and compared at a time when covering new rows (512 KiB: they stay in the cache).
    _SCAN_ROWS = 1 << 16

    def __init__(self, steps: Table, id_field: int, epoch: Callable[[], int],
                 saved: Callable[[], SavedRuns | None] | None = None) -> None:
        self.steps, self.id_field, self.epoch = steps, id_field, epoch
        self._saved = saved
        #: Rows whose ids this index read and compared (tests and diagnostics: a reader that
        #: started from saved runs scans only the rows after them).
        self.scanned = 0
        # Capacity-doubling buffers: runs in [:_n]; _starts[_n] is a sentinel ("no later run").
        self._starts = np.full(1, self._NONE, np.int64)
        self._ids = np.zeros(1, np.int64)
        self._n = 0
        self._epoch: int | None = None
        self._begin = self._end = 0  # absolute rows [_begin, _end) are covered
        self._bounds = _Boundaries()  # the same run starts as a bitmap (for short windows)

    def _update(self) -> None:
        st = self.steps.state
        epoch = self.epoch()
        fresh = False  # the bitmap must be rebuilt from the runs
        if self._saved is not None:
            fresh = self._adopt_saved(self._saved(), epoch)
            self._saved = None
        if epoch != self._epoch or st.start >= self._end or st.end < self._end:
            self._replace(np.zeros(0, np.int64), np.zeros(0, np.int64))
            self._begin = self._end = st.start
            self._epoch = epoch
            fresh = True
        if st.start < self._begin:
            # A reader's ring start can move back: an eviction record runs a guard band ahead of
            # what the next commit keeps.  Cover the rows before (their ids are intact).
            new, new_ids, last = self._scan(st.start, self._begin, None)
            joined = self._n > 0 and last == int(self._ids[0])
            keep = slice(1 if joined else 0, self._n)
            self._replace(np.concatenate([new, self._starts[keep]]), np.concatenate([new_ids, self._ids[keep]]))
            if not fresh and self._bounds.covers(st.start):
                if joined:  # the old first run now starts earlier
                    self._bounds.mark(np.array([self._begin]), False)
                self._bounds.mark(new, True)
            else:
                fresh = True
            self._begin = st.start
        if st.end > self._end:
            new, new_ids, _ = self._scan(self._end, st.end, int(self._ids[self._n - 1]) if self._n else None)
            self._append(new, new_ids)
            if not fresh:
                self._bounds.extend(st.end, st.start)
                self._bounds.mark(new, True)
            self._end = st.end
        dead = self._first_live() if self._n > 2048 else 0  # runs wholly evicted
        if dead > self._n // 2:
            self._replace(self._starts[dead : self._n].copy(), self._ids[dead : self._n].copy())
            self._begin = max(self._begin, int(self._starts[0]))
        if fresh:
            self._bounds.reset(self._begin, self._end, self._starts[: self._n])

    def _adopt_saved(self, saved: SavedRuns | None, epoch: int) -> bool:
        """Start from saved runs that describe the committed rows; whether they were taken."""
        if saved is None or not saved.usable(epoch, self.steps.state):
            return False
        saved = saved.from_row(self.steps.state.start)  # the bitmap covers only rows present
        self._replace(saved.starts, saved.ids)
        self._begin, self._end, self._epoch = saved.begin, saved.end, epoch
        return True

    def saved(self) -> SavedRuns | None:
        """The runs of the rows present, to save (None: no rows)."""
        first, lengths, ids = self.runs()
        st = self.steps.state
        if not len(first):
            return None
        return SavedRuns(int(self.epoch()), st.start, st.end, first + st.start, ids)

    def _scan(self, lo: int, hi: int, before: int | None) -> tuple[np.ndarray, np.ndarray, int]:
        """Runs starting in absolute rows ``[lo, hi)`` (``lo < hi``), given the id of row ``lo - 1``
        (``before``; None: row ``lo`` starts a run).

        Returns
        -------
        starts : (R,) int64
            Absolute rows where a run starts.
        ids : (R,) int64
            The id of each of those runs.
        last : int
            The id of row ``hi - 1``.

        Read :data:`_SCAN_ROWS` ids at a time: a first use on a store of 10 M rows copied all 80 MB
        of ids into one fresh array and compared it with itself shifted (another 10 MB of flags),
        about 65 ms, most of it page faults and cache misses; blocks that stay in the cache take
        about 12 ms (docs/sampling.md).
        """
        st = self.steps.state
        self.scanned += hi - lo
        starts: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        prev = before
        flags = np.empty(self._SCAN_ROWS - 1, bool)
        for a in range(lo, hi, self._SCAN_ROWS):
            # A view of the mapped ids where the block lies in one chunk: copying every block
            # took about 4 of the 19 ms a 10 M-row scan took.
            block = self.steps.read_contiguous(a - st.start, min(a + self._SCAN_ROWS, hi) - st.start,
                                               [self.id_field], copy=False)[0]
            ne = np.not_equal(block[1:], block[:-1], out=flags[: len(block) - 1])
            new = np.flatnonzero(ne) + 1
            if prev is None or int(block[0]) != prev:
                new = np.concatenate([[0], new])
            starts.append(new + a)
            ids.append(block[new])
            prev = int(block[-1])
        assert prev is not None  # lo < hi: at least one block
        return np.concatenate(starts), np.concatenate(ids), prev

    def _first_live(self) -> int:
        """Index of the run holding the table's first row."""
        return max(int(np.searchsorted(self._starts[: self._n], self.steps.state.start, side="right")) - 1, 0)

    def _replace(self, starts: np.ndarray, ids: np.ndarray) -> None:
        """Set all runs (after a rebuild, a prepend or a compaction)."""
        n = len(starts)
        self._starts, self._ids = np.empty(max(n + 1, 1024), np.int64), np.empty(max(n + 1, 1024), np.int64)
        self._starts[:n], self._ids[:n] = starts, ids
        self._starts[n] = self._NONE
        self._n = n

    def _append(self, starts: np.ndarray, ids: np.ndarray) -> None:
        """Add runs at the end, in place (room doubles when needed: amortised O(1) per run)."""
        need = self._n + len(starts)
        if need + 1 > len(self._starts):
            size = max(need + 1, 2 * len(self._starts))
            self._starts = np.concatenate([self._starts[: self._n], np.empty(size - self._n, np.int64)])
            self._ids = np.concatenate([self._ids[: self._n], np.empty(size - self._n, np.int64)])
        self._starts[self._n : need], self._ids[self._n : need] = starts, ids
        self._starts[need] = self._NONE
        self._n = need

    def episodes_between(self, lo: int, hi: int, epoch: int, most_scan: int) -> int | None:
        """How many distinct ids the rows ``[lo, hi)`` (absolute, inside the table) hold, as of
        commit epoch ``epoch``; None when that epoch is not the index's, or covering the rows
        would read the ids of more than ``most_scan`` rows not yet scanned (a writer describing
        its commit pays for the rows it appended, not for a scan of the whole table)."""
        st = self.steps.state
        if epoch != self.epoch() or hi < lo:
            return None
        kept = self._epoch == epoch and self._begin <= st.start <= self._end
        if st.end - (self._end if kept else st.start) > most_scan:
            return None
        self._update()
        if not (self._begin <= lo and hi <= self._end):
            return None
        starts = self._starts[: self._n]
        first = max(int(np.searchsorted(starts, lo, side="right")) - 1, 0)
        last = int(np.searchsorted(starts, hi, side="left"))
        return int(len(np.unique(self._ids[first:last]))) if hi > lo else 0

    def one_run(self, lo: np.ndarray, span: int) -> np.ndarray:
        """Whether absolute rows ``lo[b] .. lo[b] + span`` (inside the table) share one id, (B,) bool."""
        self._update()
        if span <= _Boundaries.MAX_SPAN:
            return self._bounds.none_in(lo, span)
        nxt = self._starts[np.searchsorted(self._starts[: self._n], lo, side="right")]  # next run's start
        return nxt > lo + span

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs of the rows present, in row order: first logical row, length, id; (R,) int64 each."""
        self._update()
        st = self.steps.state
        k = self._first_live() if self._n else 0
        starts = np.maximum(self._starts[k : self._n], st.start)  # the first run may begin before the ring's start
        lengths = np.diff(np.append(starts, st.end))
        return starts - st.start, lengths, self._ids[k : self._n].copy()
