"""The saved run index of a trajectory store (``trajstore.runs``): where each run of equal step
episode ids starts, so a reader's first windowed sample does not scan every id.

Building the run index reads and compares every step id: 16 ms and 80 MB of mapped ids on a
10 M-row store, paid by every fresh reader process (each DataLoader worker) on its first
``within_episode`` sample, and on a remote store a fetch of every id chunk.  A writer saves the
index when it closes; a reader whose commit record still names those rows loads it instead and
scans only the rows appended since.

The file is a cache, never part of the committed data:

- keyed by the commit record's ``epoch`` (it moves when rows are rewritten, removed or cleared)
  and the absolute rows ``[begin, end)`` it covers; a reader uses it only when the epoch is the
  same and ``end`` is within the committed rows, so appends since keep it valid;
- a writer removes it when it opens the store (:func:`take_runs`) and writes it again at close,
  so a store with a writer at work, or one killed, has none, and rows rolled back and written
  anew (a damaged record replaced by an older one) are never described by an old file;
- a file that is malformed or implausible is ignored by readers (they scan, as without one) and
  reported by ``trajstore verify``, which also checks that its runs are the ids' runs.

Layout (little-endian): ``b"TSRUNS\\x00\\x01"``, then int64 ``epoch, begin, end, n``, then ``n``
int64 run starts (absolute rows, increasing, the first ``begin``) and ``n`` int64 run ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trajstore.errors import DamagedStoreError, TrajstoreError
from trajstore.storage.head import Head, TableState
from trajstore.storage.keys import RUNS_KEY
from trajstore.storage.location import Location

__all__ = ["RUNS_TABLE", "SavedRuns", "encode_runs", "decode_runs", "runs_limit", "worth_saving", "take_runs",
           "load_runs", "save_runs", "disagreement"]

#: The table whose ids the runs describe (a trajectory store's step table).
RUNS_TABLE = "step_data"

_MAGIC = b"TSRUNS\x00\x01"
_HEADER = len(_MAGIC) + 4 * 8
#: Runs are saved only when they average at least this many rows: the file is then at most a
#: quarter of the id column, and shorter runs are not worth a file (the scan is the same cost).
MIN_MEAN_RUN = 8


@dataclass(frozen=True)
class SavedRuns:
    """Runs of equal step ids over absolute rows ``[begin, end)``, as of commit epoch ``epoch``.

    Attributes
    ----------
    starts : (R,) int64
        Absolute row where each run starts; increasing, ``starts[0] == begin``, all below ``end``.
    ids : (R,) int64
        Each run's episode id (neighbouring runs differ).
    """

    epoch: int
    begin: int
    end: int
    starts: np.ndarray
    ids: np.ndarray

    def usable(self, epoch: int, st: TableState) -> bool:
        """Whether these runs describe committed rows of a table in state ``st`` at ``epoch``:
        same epoch, rows all committed or since evicted, some of them still present."""
        return self.epoch == epoch and self.end <= st.end and self.end > st.start and self.end > self.begin

    def from_row(self, start: int) -> "SavedRuns":
        """The runs of rows from ``start`` on (the first one cut to begin there): rows a ring has
        evicted are dropped, so what a reader keeps is bounded by the rows present, whatever
        ``begin`` the file names (a ring's absolute rows grow without bound)."""
        if start <= self.begin:
            return self
        k = max(int(np.searchsorted(self.starts, start, side="right")) - 1, 0)
        starts = self.starts[k:].copy()
        starts[0] = start
        return SavedRuns(self.epoch, start, self.end, starts, self.ids[k:].copy())


def worth_saving(n_runs: int, rows: int) -> bool:
    """Whether ``n_runs`` runs over ``rows`` rows are saved (see :data:`MIN_MEAN_RUN`)."""
    return rows > 0 and 0 < n_runs and n_runs * MIN_MEAN_RUN <= rows


def runs_limit(st: TableState, capacity: int | None) -> int:
    """The most bytes a runs file may hold for a table in state ``st``: a valid one covers at
    most the rows committed now (or a ring's capacity), in runs of :data:`MIN_MEAN_RUN` rows."""
    rows = max(st.count, capacity or 0)
    return _HEADER + 16 * (rows // MIN_MEAN_RUN + 1)


def encode_runs(saved: SavedRuns) -> bytes:
    """The bytes of a runs file."""
    head = np.array([saved.epoch, saved.begin, saved.end, len(saved.starts)], "<i8")
    return b"".join([_MAGIC, head.tobytes(), np.asarray(saved.starts, "<i8").tobytes(),
                     np.asarray(saved.ids, "<i8").tobytes()])


def decode_runs(data: bytes, where: str) -> SavedRuns:
    """Parse and check a runs file.

    Raises
    ------
    DamagedStoreError
        Not a runs file, a size that disagrees with its run count, or runs that cannot be a run
        index (not increasing from ``begin``, past ``end``, neighbours with one id).
    """
    def bad(why: str) -> DamagedStoreError:
        return DamagedStoreError(f"{where}: {RUNS_KEY} {why}")

    if len(data) < _HEADER or data[: len(_MAGIC)] != _MAGIC:
        raise bad(f"is not a runs file (expected {_HEADER} or more bytes starting {_MAGIC!r}; "
                  f"got {len(data)} bytes starting {data[:8]!r})")
    epoch, begin, end, n = (int(v) for v in np.frombuffer(data, "<i8", 4, len(_MAGIC)))
    if epoch < 0 or begin < 0 or end <= begin or n < 1 or n > end - begin:
        raise bad(f"names epoch {epoch}, rows [{begin}, {end}) in {n} runs; expected a non-negative epoch and "
                  "from 1 to end - begin runs over begin < end")
    if len(data) != _HEADER + 16 * n:
        raise bad(f"holds {len(data)} bytes; {n} runs take {_HEADER + 16 * n}")
    starts = np.frombuffer(data, "<i8", n, _HEADER).astype(np.int64)
    ids = np.frombuffer(data, "<i8", n, _HEADER + 8 * n).astype(np.int64)
    if starts[0] != begin or starts[-1] >= end or (n > 1 and not (starts[1:] > starts[:-1]).all()):
        raise bad(f"run starts are not increasing from row {begin} and below row {end}")
    if n > 1 and not (ids[1:] != ids[:-1]).all():
        raise bad("has neighbouring runs with the same id")
    return SavedRuns(epoch, begin, end, starts, ids)


def take_runs(loc: Location, head: Head, capacity: int | None) -> SavedRuns | None:
    """A writer's open: the saved runs that still describe ``head``'s rows, or None; the file is
    removed either way (rows this writer rewrites, or a later writer rolls back, would make it lie)."""
    saved = load_runs(loc, head, capacity)
    if loc.exists(RUNS_KEY):
        loc.delete(RUNS_KEY)
    return saved


def load_runs(loc: Location, head: Head, capacity: int | None) -> SavedRuns | None:
    """The saved runs when present, well formed and usable for ``head``'s step rows
    (``capacity``: the step table's ring capacity or None); None otherwise (the caller scans the
    ids, as without a file)."""
    st = head.tables.get(RUNS_TABLE)
    if st is None or head.pending is not None:
        return None
    try:
        data = loc.get(RUNS_KEY, limit=runs_limit(st, capacity))
        saved = None if data is None else decode_runs(data, str(loc.url))
    except (TrajstoreError, OSError):  # a cache: whatever is wrong with it, the ids still answer
        return None
    return saved if saved is not None and saved.usable(head.epoch, st) else None


def save_runs(loc: Location, saved: SavedRuns) -> bool:
    """Write ``saved`` as the store's runs file (atomically); False when it is not worth a file
    (:func:`worth_saving`) and any old one was removed instead."""
    if not worth_saving(len(saved.starts), saved.end - saved.begin):
        if loc.exists(RUNS_KEY):
            loc.delete(RUNS_KEY)
        return False
    loc.put(RUNS_KEY, encode_runs(saved))
    return True


def disagreement(saved: SavedRuns, ids: np.ndarray, start: int) -> int | None:
    """The first absolute row where ``saved`` disagrees with the step ids, or None when its runs
    are exactly the runs of ``ids`` (the committed ids, logical row 0 being absolute row ``start``)
    over the rows both cover.  ``saved`` must be usable for the same commit record."""
    saved = saved.from_row(start)  # the first run may begin before the rows still present
    lo = saved.begin
    seg = np.asarray(ids[lo - start : saved.end - start])
    if not len(seg):
        return None
    exp = np.concatenate([[0], np.flatnonzero(seg[1:] != seg[:-1]) + 1]) + lo
    got, got_ids, exp_ids = saved.starts, saved.ids, seg[exp - lo]
    n = min(len(got), len(exp))
    differ = np.flatnonzero((got[:n] != exp[:n]) | (got_ids[:n] != exp_ids[:n]))
    i = int(differ[0]) if len(differ) else n  # the first run that differs (n: one list is longer)
    if i == len(got) == len(exp):
        return None
    return int(min(got[i] if i < len(got) else saved.end, exp[i] if i < len(exp) else saved.end))
