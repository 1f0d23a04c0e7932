"""Episode-level editing of a :class:`~trajstore.TrajectoryReplayBuffer` (issue 16).

:class:`EpisodeEditing` is a mixin of ``TrajectoryReplayBuffer``:

- ``select_episodes(ids)`` / ``filter_episodes(fn)`` return an :class:`EpisodeView`, a
  read-only view of the steps of some episodes.  It copies nothing: its rows are the parent's
  rows of those episodes, in row order, resolved again from the parent's run index whenever the
  parent's commit changes (so a ring that evicts steps, or the live episode that grows, shows
  in the view).  It reads through the parent's :class:`~trajstore.sampling.source.EpisodeSource`
  (:class:`~trajstore.buffers.rows.SelectionRows`), so the samplers and sequence windows of :mod:`trajstore.sampling`
  serve it unchanged, and a window never reaches a step outside the selection.
- ``remove_episodes(ids)`` deletes every step of those episodes and their episode-data rows in
  one crash-atomic rewrite (the commit protocol ``remove_at`` uses: staged chunks, one commit
  record naming them, then the chunks moved into place).
- :func:`episode_columns` is what ``filter_episodes`` (and ``trajstore filter --where``) sees
  of the episodes: one numpy array per column, one entry per episode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from trajstore.buffers.base import as_generator
from trajstore.buffers.episode_windows import read_episode
from trajstore.buffers.rows import SelectionRows, short_ids
from trajstore.buffers.trajectory_edits import remove_rows
from trajstore.buffers.trajectory_layout import TrajectoryData, as_trajectory_data
from trajstore.buffers.views import BatchBase
from trajstore.core.ring import IndexLike, normalize_index
from trajstore.errors import BadArgumentError, BadValueError, UnknownEpisodeError
from trajstore.sampling import field_windows as _fw
from trajstore.sampling import sequences as _seq
from trajstore.sampling.source import put_rows, read_consistent, sample_consistent

if TYPE_CHECKING:
    from trajstore.buffers.trajectory import TrajectoryReplayBuffer

__all__ = ["EpisodeEditing", "EpisodeView", "episode_columns", "TABLE_COLUMNS"]

#: The columns of the episode table every :func:`episode_columns` result has.
TABLE_COLUMNS = ("episode_id", "start", "length", "live", "has_data")


def _as_ids(ids: Any) -> np.ndarray:
    """``ids`` as a sorted, unique (K,) int64 array of episode ids (integers only)."""
    raw = np.asarray(ids.cpu().numpy() if hasattr(ids, "cpu") else ids)
    if raw.dtype == bool or (raw.size and raw.dtype.kind not in "iu"):
        raise BadArgumentError(f"episode ids must be integers (an int or a 1-D array of ints); got dtype {raw.dtype}")
    return np.unique(raw.astype(np.int64).reshape(-1))


def _data_names(buf: TrajectoryReplayBuffer) -> list[str]:
    """Column names of the episode-data leaves: their Dict keys joined by ``/`` (``"value"`` for an
    episode space that is a single leaf, as its array ``episode_data/value``)."""
    plan = buf.layout.episode_plan
    return [] if plan is None else [leaf.name or "value" for leaf in plan.leaves]


def episode_columns(buf: TrajectoryReplayBuffer, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """The episodes of ``buf`` as columns: what ``filter_episodes`` functions receive.

    Parameters
    ----------
    buf : TrajectoryReplayBuffer
        The buffer (its current commit).
    names : sequence of str, optional
        Episode-data columns to read (default: every one); the table columns are always there.

    Returns
    -------
    dict of str to numpy array
        One entry per episode with steps present, ordered by its first step (as
        ``buf.episodes()``): ``episode_id`` (E,) int64, ``start`` (E,) int64 (logical row of its
        first step), ``length`` (E,) int64 (steps), ``live`` (E,) bool (being recorded),
        ``has_data`` (E,) bool (episode data was set); then every episode-data leaf under its
        Dict keys joined by ``/`` (``"return"``, ``"info/success"``; ``"value"`` for a single-leaf
        episode space), (E, *leaf.shape) of the leaf's dtype, zeros where ``has_data`` is False.
        An episode-data key named like a table column replaces that column.

    Raises
    ------
    UnknownFieldError
        ``names`` holds a name that is no episode-data column (the message lists them).
    """
    from trajstore.errors import UnknownFieldError

    all_names = _data_names(buf)
    wanted = all_names if names is None else list(names)
    unknown = [n for n in wanted if n not in all_names]
    if unknown:
        raise UnknownFieldError(f"no episode field {unknown[0]!r}; the episode fields are "
                                f"{list(TABLE_COLUMNS) + all_names}")
    fields = [all_names.index(n) for n in wanted]

    def read() -> tuple[dict[str, np.ndarray], np.ndarray, list[np.ndarray]]:
        # The episode table and the data under one record: a ring that turned between two reads
        # gave starts and lengths of one record beside the data of the next.
        table = _seq.episode_table(buf.row_source())
        ids = table["episode_id"]
        if buf.layout.episode_table is None:
            return table, np.zeros(len(ids), bool), []
        index = buf.episode_index
        return table, index.lookup(ids) >= 0, (buf.layout.episode_rows(index, ids, fields) if fields else [])

    table, has, arrays = read_consistent(buf.row_source(), read)
    cols: dict[str, np.ndarray] = {k: table[k] for k in ("episode_id", "start", "length", "live")}
    cols["has_data"] = has
    cols.update(zip(wanted, arrays))
    return cols


class EpisodeView(BatchBase):
    """A read-only view of the steps of some episodes of a :class:`~trajstore.TrajectoryReplayBuffer`
    (``buffer.select_episodes(ids)``, ``buffer.filter_episodes(fn)``).

    Reads as its parent does (``len``, ``[idx]`` / ``get_at``, ``get_at_with_metadata``,
    ``sample``, ``get_sequences``, ``sample_sequences``, ``episodes``, ``get_episode``,
    ``get_slice``, ``get_column``), over the selected steps only: row ``i`` is the ``i``-th selected
    step in the parent's row order, and sequence windows never reach a step outside the
    selection.  Nothing is copied; every read reads the parent's store.

    Attributes
    ----------
    parent : TrajectoryReplayBuffer
        The buffer viewed.
    episode_ids : (K,) int64
        The selected episode ids, sorted (an evicted or removed one simply has no steps).
    """

    def __init__(self, parent: TrajectoryReplayBuffer, ids: np.ndarray) -> None:
        self.parent = parent
        self.episode_ids = ids
        self.single_space = parent.single_space
        self.step_space, self.episode_space = parent.step_space, parent.episode_space
        self._plan = parent.layout.plan
        self._backend = parent.output.backend
        self._rows = SelectionRows(parent.row_source(), ids)

    def row_source(self) -> SelectionRows:
        """The selected steps as an :class:`~trajstore.sampling.source.EpisodeSource`."""
        return self._rows

    def __len__(self) -> int:
        self._rows.sync()
        return self._rows.count

    def _read(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        return self.parent._read(int(self._rows.to_parent(idx)) if isinstance(idx, int) else self._rows.to_parent(idx),
                                 leaf_ids)

    def _consistent(self, read: Callable[[], Any]) -> Any:
        return read_consistent(self._rows, read)

    def get_at(self, idx: IndexLike) -> TrajectoryData:
        """Selected steps at ``idx`` with their episodes' data, as
        :meth:`TrajectoryReplayBuffer.get_at <trajstore.TrajectoryReplayBuffer.get_at>`.

        Parameters
        ----------
        idx : int, slice, ``...``, (B,) int array or (len,) bool mask
            Rows of the view (0 is the first selected step).

        Returns
        -------
        TrajectoryData
            ``step_data`` (one value, or leaves with leading axis B), ``episode_data`` (or None).
        """
        return as_trajectory_data(super().get_at(idx))

    def get_at_with_metadata(self, idx: IndexLike) -> tuple[TrajectoryData, dict[str, Any]]:
        """``(get_at(idx), {"episode_ids": ids})``, ids of shape () or (B,) int64."""

        def read() -> tuple[list[np.ndarray], Any]:
            i = normalize_index(idx, self._rows.count)
            rows = np.atleast_1d(np.asarray(i, np.int64))
            arrays = self.parent._read(self._rows.to_parent(rows), self._all_leaves)
            ids = self._rows.step_ids(rows)
            return ([a[0] for a in arrays], ids[0]) if isinstance(i, int) else (arrays, ids)

        arrays, ids = self._consistent(read)
        out = self._backend.out
        return (as_trajectory_data(self._plan.from_arrays([out(a) for a in arrays])),
                {"episode_ids": out(np.asarray(ids))})

    def sample(self, batch_size: int, *, rng: np.random.Generator | int | None = None) -> TrajectoryData:
        """``batch_size`` selected steps drawn uniformly with replacement (``rng``: a Generator or a
        seed; by default the parent's), as :meth:`get_at` returns a batch.

        Raises
        ------
        EmptyBufferError
            No selected episode has steps.
        """
        gen = as_generator(rng, self.parent.default_rng)
        src, leaves = self._rows, self._all_leaves
        arrays = sample_consistent(src, lambda k: gen.integers(0, src.count, size=k),
                                   lambda idx: src.read_rows(idx, leaves), batch_size, put_rows)
        return as_trajectory_data(self._plan.from_arrays([self._backend.out(a) for a in arrays]))

    def get_sequences(self, idx: IndexLike, offsets: Sequence[int] | np.ndarray | Mapping[str, Any], *,
                      pad: str | Mapping[str, str] = "edge") -> tuple[TrajectoryData, Any]:
        """Windows of frames around anchor rows of the view, as
        :meth:`TrajectoryReplayBuffer.get_sequences <trajstore.TrajectoryReplayBuffer.get_sequences>`
        (one list of offsets, or per-field offsets): frame ``t`` of anchor ``b`` is view row
        ``idx[b] + offsets[t]``, valid when it exists and belongs to the anchor's episode.

        Returns
        -------
        data : TrajectoryData
            ``step_data`` leaves (B, T, ...), ``episode_data`` (B, ...) or None.
        valid_mask : (B, T) bool, or per field a dict key -> (B, len(offsets[key])) bool
        """
        p = self.parent
        if isinstance(offsets, Mapping):
            return p.output.field_windows(_fw.get_field_windows(self._rows, p.step_space, idx, offsets, pad))
        return p.output.windows(_seq.get_sequences(self._rows, idx, offsets, pad))  # type: ignore[arg-type]

    def sample_sequences(self, batch_size: int, seq_len: int | None = None, *,
                         offsets: Mapping[str, Any] | None = None, rng: np.random.Generator | int | None = None,
                         pad: str | Mapping[str, str] = "edge", within_episode: bool = False, allow_pad: bool = False
                         ) -> tuple[TrajectoryData, Any]:
        """Windows drawn uniformly from the view's rows, as
        :meth:`TrajectoryReplayBuffer.sample_sequences <trajstore.TrajectoryReplayBuffer.sample_sequences>`.

        Returns
        -------
        data : TrajectoryData
            ``step_data`` leaves (B, T, ...), ``episode_data`` (B, ...) or None.
        valid_mask : (B, T) bool, or per field a dict of (B, T_key) bool
        """
        p = self.parent
        _fw.seq_len_or_offsets(seq_len, offsets)
        g, within = as_generator(rng, p.default_rng), within_episode and not allow_pad
        if offsets is not None:
            return p.output.field_windows(_fw.sample_field_windows(self._rows, p.step_space, batch_size, offsets, g, pad,
                                                             within))
        return p.output.windows(_seq.sample_sequences(self._rows, batch_size, cast(int, seq_len), g,
                                                pad, within))  # type: ignore[arg-type]

    def episodes(self) -> dict[str, np.ndarray]:
        """The selected episodes with steps present, as
        :meth:`TrajectoryReplayBuffer.episodes <trajstore.TrajectoryReplayBuffer.episodes>`
        (``start``: view row of the first step)."""
        return _seq.episode_table(self._rows)

    def dask_leaves(self, leaves: Sequence[int]) -> list[Any]:
        """One dask array per step leaf in ``leaves``: the selected steps committed now.

        Made of the parent's arrays indexed by the selected rows: a view numbers its rows in this
        process only (counting the selected steps a ring evicted since it was made), while dask
        tasks reopen the store and would number them afresh (a view that had seen 8 of its steps
        evicted read rows 8 further on); a store's absolute rows mean the same rows everywhere.
        """
        from trajstore.sampling.dask_arrays import dask_arrays

        parent = self._rows.parent
        arrays = dask_arrays(parent, leaves)  # syncs the parent: the arrays hold its committed rows now
        lo, hi = self._rows.committed
        rows = parent.absolute_rows(self._rows.to_parent(np.arange(hi - lo, dtype=np.int64))) - parent.committed[0]
        return [a[rows] for a in arrays]

    def get_episode(self, episode_id: int) -> TrajectoryData:
        """Every step of selected episode ``episode_id`` (UnknownEpisodeError when it has none here)."""
        return read_episode(self, self._rows, episode_id)

    def __repr__(self) -> str:
        return f"EpisodeView({short_ids(self.episode_ids)}, len={len(self)}) of {self.parent!r}"


class EpisodeEditing:
    """Episode-level selection and deletion, mixed into ``TrajectoryReplayBuffer``."""

    def select_episodes(self, ids: Any) -> EpisodeView:
        """A read-only view of the steps of episodes ``ids`` (nothing is copied).

        Parameters
        ----------
        ids : int or (K,) int array
            Episode ids; each must have steps in the buffer now (duplicates count once).

        Returns
        -------
        EpisodeView
            Indexable, samplable and sequence-samplable over the selected steps only.

        Raises
        ------
        BadArgumentError
            ``ids`` are not integers.
        UnknownEpisodeError
            An id has no steps in the buffer (never recorded, evicted or removed); the message
            names the first few.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        sel = _as_ids(ids)
        _check_known(buf, sel)
        return EpisodeView(buf, sel)

    def filter_episodes(self, fn: Callable[[dict[str, np.ndarray]], Any]) -> EpisodeView:
        """A read-only view of the episodes for which ``fn`` holds.

        Parameters
        ----------
        fn : callable
            Receives :func:`episode_columns` (``episode_id``, ``start``, ``length``, ``live``,
            ``has_data`` and every episode-data leaf, one (E, ...) numpy array each) and returns an
            (E,) bool mask, e.g. ``lambda ep: ep["return"] > 100``.

        Returns
        -------
        EpisodeView
            The episodes whose mask entry is True (possibly none: an empty view).

        Raises
        ------
        BadValueError
            ``fn`` returned something that is not an (E,) bool mask.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        cols = episode_columns(buf)
        mask = np.asarray(fn(cols))
        n = len(cols["episode_id"])
        if mask.dtype != bool or mask.shape != (n,):
            raise BadValueError(f"filter_episodes: the function must return a ({n},) bool mask, one entry per "
                                f"episode; got {mask.dtype} {mask.shape}")
        return EpisodeView(buf, cols["episode_id"][mask])

    def remove_episodes(self, ids: Any) -> None:
        """Delete every step of episodes ``ids`` and their episode data, in one crash-atomic rewrite.

        Later steps move up (as ``remove_at``); a crash leaves every episode either whole or gone
        together with the others of the call (the store is "before" or "after").  Removing the
        episode being recorded starts a fresh one.

        Parameters
        ----------
        ids : int or (K,) int array
            Episode ids, each with steps or episode data in the buffer (duplicates count once).

        Raises
        ------
        BadArgumentError
            ``ids`` are not integers.
        UnknownEpisodeError
            An id has neither steps nor episode data; nothing is changed.
        ReadOnlyError
            The buffer is open read-only.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        sel = _as_ids(ids)
        buf.sync_reads()
        with buf.writing():  # multiprocessing: under the writers' lock, on their latest commit
            _remove(buf, sel)


def _remove(buf: TrajectoryReplayBuffer, sel: np.ndarray) -> None:
    """The body of ``remove_episodes`` (inside a write operation)."""
    et = buf.layout.episode_table
    first, lengths, run_ids = buf.row_source().runs()
    ep_rows = buf.episode_index.lookup(sel) if et is not None else np.full(len(sel), -1, np.int64)
    _check_known(buf, sel, extra=ep_rows >= 0)
    mine = np.isin(run_ids, sel)
    n = lengths[mine]
    rows = (np.repeat(first[mine] - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(int(n.sum()))
            if n.size else np.zeros(0, np.int64)).astype(np.int64)
    gone_ep = np.unique(ep_rows[ep_rows >= 0])
    if rows.size == 0 and gone_ep.size == 0:
        return

    def fresh_episode() -> None:
        if buf.current_episode_id in sel:  # its id is gone: later steps start a fresh episode
            buf.id_counter.new_episode()

    remove_rows(buf, rows, gone_ep, fresh_episode)


def _check_known(buf: TrajectoryReplayBuffer, sel: np.ndarray, extra: np.ndarray | None = None) -> None:
    """UnknownEpisodeError unless every id of ``sel`` has steps (or ``extra`` says it is known)."""
    _first, _lengths, run_ids = buf.row_source().runs() if len(buf) else (None, None, np.zeros(0, np.int64))
    known = np.isin(sel, run_ids)
    if extra is not None:
        known |= extra
    if not known.all():
        bad = sel[~known]
        raise UnknownEpisodeError(f"episode id(s) {short_ids(bad)} have no steps in {buf.cache_path or 'the buffer'}; "
                                  f"expected ids of recorded episodes (see buffer.episodes()['episode_id'])")
