"""The seam between buffers and what reads them: :class:`RowSource`, and the one retry loop.

Samplers (uniform rows, sequence windows), dask arrays and the torch datasets read rows through
a :class:`RowSource` (an :class:`EpisodeSource` when they need episode boundaries), never
through a buffer's private attributes.  ``ReplayBuffer.row_source()`` and
``TrajectoryReplayBuffer.row_source()`` return one; anything else that can name its rows, read
them and tell whether a commit changed them (a sharded dataset, a store opened in place) plugs
into the same samplers by implementing it.

Rows are *logical*: ``0 .. count - 1`` in the commit record the source currently sees, oldest
first; ``start`` is the absolute row number of logical row 0 (rings count absolute rows from
the first row ever written).  A *leaf* is one array of the source's space, numbered as the
buffer's ``ValuePlan`` numbers them.

Readers of a live store (another process commits while they read) must not return rows a
writer replaced meanwhile.  :func:`read_consistent` and :func:`sample_consistent` are the
single retry loop, seqlock style: read under a pinned commit record, check the record again
afterwards, and retry (or redraw and read again only the samples whose rows were evicted) until
the rows read were intact throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from trajstore.errors import BadOptionError, ConcurrentWriteError, EmptyBufferError
from trajstore.storage.fields.base import Field
from trajstore.storage.head import Head

__all__ = ["RowSource", "EpisodeSource", "read_consistent", "sample_consistent", "put_rows", "rows_after_start",
           "check_batch_size"]

_T = TypeVar("_T")

#: Attempts before a reader gives up on a store a writer keeps changing under it.
READ_ATTEMPTS = 1000
SAMPLE_ATTEMPTS = 100


@runtime_checkable
class RowSource(Protocol):
    """Rows of one table, read consistently.

    Attributes
    ----------
    name : str
        What messages call the source (its path, or ``"in-memory buffer"``).
    count : int
        Rows in the commit record the source sees now (no refresh).
    start : int
        Absolute row number of logical row 0.
    capacity : int or None
        Ring capacity (None: unbounded).
    live : bool
        Whether another process may commit while this one reads (a reader, or a
        multiprocessing writer): reads must then be checked with the retry loop.
    record : Head
        The commit record the source sees now.
    committed : tuple (int, int)
        Absolute rows ``[start, end)`` that record names (a writer may hold more, uncommitted).
    last_read : Head or None
        The record whose rows the last consistent read returned (set by the retry loop).  The
        package never reads it back: it is how the concurrency tests (tests/_workers.py,
        tests/test_live_readers.py) learn which record a read that raced a writer returned.
    reopen : tuple (callable, args) or None
        Picklable recipe that opens the same rows read-only in another process
        (``fn(*args)`` returns a RowSource); None for in-memory sources.
    """

    name: str
    last_read: Head | None

    @property
    def count(self) -> int: ...

    @property
    def start(self) -> int: ...

    @property
    def capacity(self) -> int | None: ...

    @property
    def live(self) -> bool: ...

    @property
    def record(self) -> Head: ...

    @property
    def committed(self) -> tuple[int, int]: ...

    @property
    def reopen(self) -> tuple[Callable[..., RowSource], tuple[Any, ...]] | None: ...

    def sync(self) -> None:
        """Before reading: adopt the latest commit (readers) or hand staged rows to the tables
        (writers), unless a consistent read in progress pinned the record."""

    def pinned(self) -> AbstractContextManager[None]:
        """While inside, :meth:`sync` keeps the current record (re-entrant)."""

    def refresh(self) -> bool:
        """Adopt the newest commit record; True when it changed."""

    def rows_intact(self, before: Head) -> bool:
        """Whether every row ``before`` counted is still stored unchanged under :attr:`record`."""

    def absolute_rows(self, rows: np.ndarray) -> np.ndarray:
        """Numbers of logical ``rows`` (B,) of the current record that keep naming the same
        stored rows under later records, until a rewrite (what :meth:`logical_rows` maps back)."""

    def logical_rows(self, absolute: np.ndarray, before: Head) -> np.ndarray | None:
        """Logical rows, under :attr:`record`, of the rows that :meth:`absolute_rows` numbered
        ``absolute`` under record ``before``: -1 where a row is no longer stored (a ring evicted
        it); None when ``before``'s rows were rewritten, so none can be followed."""

    def read_rows(self, rows: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        """Leaves ``leaves`` of logical ``rows`` (B,) int64: one (B, *leaf.shape) array each."""

    def gather_windows(self, first: np.ndarray, length: int, leaves: Sequence[int]) -> list[np.ndarray]:
        """Blocks of ``length`` consecutive rows from logical rows ``first`` (B,): one
        (B, length, *leaf.shape) array per per-row leaf in ``leaves``."""

    def leaf_field(self, leaf: int) -> Field | None:
        """The stored field holding per-row leaf ``leaf``; None when the leaf is not stored per
        row of this table (episode data of a trajectory buffer)."""


@runtime_checkable
class EpisodeSource(RowSource, Protocol):
    """A :class:`RowSource` whose rows are steps of episodes (each row has an episode id).

    Attributes
    ----------
    step_leaves : list of int
        Leaves stored per step (read per row).
    episode_leaves : list of int
        Leaves stored per episode (read once per anchor's episode).
    current_episode_id : int
        The episode being recorded.
    """

    step_leaves: list[int]
    episode_leaves: list[int]

    @property
    def current_episode_id(self) -> int: ...

    def step_ids(self, rows: np.ndarray) -> np.ndarray:
        """Episode ids of logical ``rows`` (any shape in, same shape out), int64."""

    def window_ids(self, first: np.ndarray, length: int) -> np.ndarray:
        """(B, length) int64 episode ids of the blocks of rows starting at logical ``first``."""

    def one_run(self, first: np.ndarray, span: int) -> np.ndarray:
        """(B,) bool: logical rows ``first[b] .. first[b] + span`` all have one episode id
        (answered from the run index, without reading ids)."""

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first, lengths, ids)``: logical first row, length and episode id of every run of
        equal ids, in row order."""

    def read_episode_rows(self, anchors: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        """Episode leaves ``leaves`` of the episodes of logical ``anchors`` (zeros where an
        episode has no episode data yet)."""

    def episode_data_stale(self, rows: np.ndarray, before: Head) -> np.ndarray:
        """(B,) bool: of logical ``rows`` (stored under the current record), those whose episode
        data a read under record ``before`` may have taken from a slot the episode-data ring
        reused since; :func:`sample_consistent` reads them again."""


def check_batch_size(value: Any, what: str | None = None, *, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``: the batch size of sampler ``what`` (named in the message).

    Raises
    ------
    BadOptionError
        Not an int (bools refused), or below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise BadOptionError(f"{what + ': ' if what else ''}batch_size must be an int {bound}; got {value!r}")
    return int(value)


def rows_after_start(src: RowSource, absolute: np.ndarray, before: Head) -> np.ndarray | None:
    """:meth:`RowSource.logical_rows` of a source whose absolute rows are its logical rows plus
    :attr:`~RowSource.start`, a start that only grows within an epoch (a store, a selection of
    its episodes): what the start passed was evicted."""
    if src.record.epoch != before.epoch:
        return None
    rows = np.asarray(absolute, dtype=np.int64) - src.start
    rows[rows < 0] = -1
    return rows


def _until_intact(src: RowSource, read: Callable[[], _T], mend: Callable[[Head], bool] | None,
                  attempts: int, gave_up: str) -> _T:
    """``read()`` under a pinned record until the rows of the record it started under are intact
    afterwards.  After a failed check, ``mend(before)`` returns True to accept the read as it is
    (the rows it actually read are intact) or False to run ``read`` again (``mend`` may have
    changed what it reads); without ``mend`` the whole read runs again."""
    for _ in range(attempts):
        before = src.record
        with src.pinned():
            out = read()
        if not src.refresh() or src.rows_intact(before) or (mend is not None and mend(before)):
            src.last_read = before
            return out
    raise ConcurrentWriteError(f"{src.name}: {gave_up}")


def read_consistent(src: RowSource, read: Callable[[], _T]) -> _T:
    """``read()`` as of one commit record: indices resolved inside ``read`` against ``src.count``
    and the rows read come from the same record.  Sources nobody else commits to read once.

    Raises
    ------
    ConcurrentWriteError
        A writer rewrote or evicted the rows being read 1000 times in a row.
    """
    if not src.live:
        return read()
    src.sync()
    return _until_intact(src, read, None, READ_ATTEMPTS,
                         "the writer rewrote or evicted the rows being read 1000 times in a row; read fewer rows at a time")


def sample_consistent(src: RowSource, draw: Callable[[int], np.ndarray], read: Callable[[np.ndarray], _T],
                      size: int, put: Callable[[_T, np.ndarray, _T], None] | None = None, *,
                      reach_back: int = 0) -> _T:
    """``read(draw(size))``, consistent for readers of a live store.

    ``draw(k)`` returns k logical rows (anchors) of the current record; ``read`` reads the rows
    it is given.  After a read the record is checked again: anchors whose rows a writer evicted
    meanwhile (so their slots may have been reused while they were read) are drawn again from
    the current record, all of those read after a rewrite, and read again, until every anchor
    was read intact.  Redrawing only the evicted anchors keeps the others' draw order, so a
    sample stays iid.

    Anchors are followed across records by their absolute rows (:meth:`RowSource.absolute_rows`,
    :meth:`RowSource.logical_rows`): a sharded source, whose shards evict rows in the middle of
    the global numbering, redraws only the anchors its shards evicted, as one store does.

    Parameters
    ----------
    src : RowSource
        The rows sampled.
    draw : callable
        ``draw(k)``: k anchors (logical rows of the current record), (k,) int64.
    read : callable
        ``read(anchors)``: what is returned for those anchors, every array in it with one
        leading entry per anchor.
    size : int
        Anchors per sample.
    put : callable, optional
        ``put(out, positions, part)``: write ``part`` (what ``read`` returned for the anchors at
        ``positions`` of the sample) into those positions of ``out`` (what it returned for all).
        Given, a retry reads only the redrawn anchors and keeps what was read intact of the
        others, so the rows of one sample may come from successive records, each intact when
        read.  Rings that writers turn over in a few reads need it: every check then finds
        some anchors evicted, and a retry that read every anchor again rarely got through
        (``test_ring_shards_while_a_reader_samples``: up to 100 attempts, then
        ``ConcurrentWriteError``; with ``put`` at most 5).  None: every retry reads every
        anchor, and all rows returned are rows of the last record checked.
    reach_back : int, optional
        How many rows before its anchor ``read`` may read (windows with negative offsets).  A
        ring evicts its oldest rows first, so an anchor is intact when the earliest row read
        for it is: with ``reach_back`` > 0 that row, ``max(anchor - reach_back, 0)``, is the one
        checked.  Checking the anchor alone would keep windows whose earlier frames a writer
        overwrote while they were read.

    Raises
    ------
    BadOptionError
        ``size`` is not an int >= 0.
    EmptyBufferError
        The source holds no rows (or a writer emptied it meanwhile).
    ConcurrentWriteError
        A writer evicts rows faster than this reader can sample them.
    """
    check_batch_size(size)
    src.sync()
    if src.count == 0:
        raise EmptyBufferError(f"cannot sample from an empty buffer ({src.name})")
    anchors = draw(size)
    if not src.live:
        return read(anchors)
    # The first attempt, inline: most reads see no commit meanwhile, and then cost one pinned read
    # and one check (the retry machinery below is built only when a commit came).  Absolute rows
    # are taken under the pinned record, as every attempt takes them.
    before = src.record
    with src.pinned():
        absolute = src.absolute_rows(anchors)
        earliest = src.absolute_rows(np.maximum(anchors - reach_back, 0)) if reach_back > 0 else None
        got = read(anchors)
    if not src.refresh() or src.rows_intact(before):
        src.last_read = before
        return got
    return _sample_again(src, draw, read, size, put, reach_back, (before, absolute, earliest, got))


def _sample_again(src: RowSource, draw: Callable[[int], np.ndarray], read: Callable[[np.ndarray], _T], size: int,
                  put: Callable[[_T, np.ndarray, _T], None] | None, reach_back: int,
                  first: tuple[Head, np.ndarray, np.ndarray | None, _T]) -> _T:
    """The retry loop of :func:`sample_consistent` after its first attempt (``first``: the record
    it started under, the absolute rows of its anchors and of their earliest rows, what it read)
    found that a commit came while it read."""
    before, absolute, earliest, got = first
    # anchors: the sample's logical rows (those of positions not yet read intact: of the current
    # record); todo: positions the next attempt reads; absolute: their absolute rows as of that
    # read; earliest: those of the earliest rows read for them (reach_back); out: the sample with
    # every position read intact so far (with put); got: the last read.  (The first attempt read
    # every position; mend sets every anchor from its absolute row before any is read again.)
    st: dict[str, Any] = {"anchors": np.zeros(size, np.int64), "todo": np.arange(size), "absolute": absolute,
                          "earliest": earliest, "out": None, "got": got}

    def attempt() -> _T:
        rows = st["anchors"][st["todo"]]
        st["absolute"] = src.absolute_rows(rows)
        if reach_back > 0:
            st["earliest"] = src.absolute_rows(np.maximum(rows - reach_back, 0))
        st["got"] = read(rows)
        return st["got"]

    # EpisodeSource.episode_data_stale: asked only of sources that read episode data.
    episode_data_stale = getattr(src, "episode_data_stale", None) if getattr(src, "episode_leaves", None) else None

    def followed(absolute: np.ndarray, before: Head) -> np.ndarray:
        rows = src.logical_rows(absolute, before)
        if rows is None:  # rewritten: none of the rows just read can be followed
            return np.full(len(absolute), -1, np.int64)
        return rows

    def mend(before: Head) -> bool:
        if src.count == 0:
            raise EmptyBufferError(f"{src.name}: the buffer was emptied while it was sampled")
        rows = followed(st["absolute"], before)
        stale = rows < 0
        if reach_back > 0:
            stale |= followed(st["earliest"], before) < 0
        # Anchors still stored whose episode data may have come from a reused episode-data slot:
        # read again as they are (not drawn again: their rows are there, so the sample stays uniform).
        again = (~stale & episode_data_stale(np.where(stale, 0, rows), before) if episode_data_stale
                 else np.zeros_like(stale))
        if not stale.any() and not again.any():  # rows were evicted, but none of those read: they are intact
            return True
        if stale.any():
            rows[stale] = draw(int(stale.sum()))
        todo = st["todo"]
        st["anchors"][todo] = rows
        if put is not None:  # keep what was read intact; the next attempt reads the redrawn anchors
            if st["out"] is None:
                st["out"] = st["got"]  # (the first attempt read every position)
            else:
                put(st["out"], todo, st["got"])
            st["todo"] = todo[stale | again]
        return False

    if mend(before):  # the rows the first attempt read are intact
        src.last_read = before
        return got
    got = _until_intact(src, attempt, mend, SAMPLE_ATTEMPTS - 1,
                        "the writer evicts rows faster than this reader can sample them")
    if st["out"] is None:
        return got
    assert put is not None  # out is kept only with put
    put(st["out"], st["todo"], got)
    return cast(_T, st["out"])


def put_rows(out: Sequence[np.ndarray], positions: np.ndarray, part: Sequence[np.ndarray]) -> None:
    """The ``put`` of :func:`sample_consistent` for reads that return one array per leaf, each
    with one leading entry per anchor."""
    for o, p in zip(out, part):
        o[positions] = p
