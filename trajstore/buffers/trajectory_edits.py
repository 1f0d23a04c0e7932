"""Rewrites, removals and bulk copies of a ``TrajectoryReplayBuffer`` (mixed into it): ``set_at``,
``remove_at``, ``clear``, episode data set by id, and ``extend_from``.  Every rewrite is one
crash-atomic :meth:`Store.rewrite <trajstore.core.store.Store.rewrite>` (steps and episode rows
together); appends are :mod:`trajstore.buffers.trajectory`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import numpy as np

from trajstore.buffers.replay import copy_steps
from trajstore.buffers.trajectory_layout import MAX_EPISODE_ID, check_episode_ids, set_episode_rows
from trajstore.buffers.views import BatchBase
from trajstore.core.ring import IndexLike, normalize_index
from trajstore.errors import BadValueError, SpaceMismatchError
from trajstore.storage.fields.base import Field

if TYPE_CHECKING:
    from trajstore.buffers.trajectory import TrajectoryReplayBuffer

__all__ = ["TrajectoryEdits", "check_episode_ids", "remove_rows", "MAX_EPISODE_ID"]


def remove_rows(buf: TrajectoryReplayBuffer, rows: np.ndarray, ep_rows: np.ndarray,
                then: Callable[[], None] | None = None) -> None:
    """Delete logical step rows ``rows`` and episode-data rows ``ep_rows`` (each sorted and
    distinct, int64) in one crash-atomic rewrite (inside a write operation); ``then`` runs with
    the bookkeeping of the new commit (``remove_episodes`` starts a fresh episode there)."""
    t, et = buf.rows_table, buf.layout.episode_table

    def changes() -> Iterator[tuple[Field, int, np.ndarray]]:
        yield from t.rewrite_plan_remove(rows)
        if et is not None and ep_rows.size:
            yield from et.rewrite_plan_remove(ep_rows)

    def shrink() -> None:
        t.state.end -= int(rows.size)
        if et is not None:
            et.state.end -= int(ep_rows.size)
        buf.episode_index.forget()
        if then is not None:
            then()

    buf.store.rewrite(changes(), shrink)


class TrajectoryEdits:
    """Rewrites, removals and bulk copies, mixed into ``TrajectoryReplayBuffer``."""

    def set_episode_data_at(self, episode_id: int, value: Any) -> None:
        """Set the data of episode ``episode_id`` (overwritten in place if it already has some)."""
        buf = cast("TrajectoryReplayBuffer", self)
        plan = buf.layout.episode_plan
        if plan is None:
            raise SpaceMismatchError("this buffer has no episode_data space")
        arrays, _ = plan.to_arrays(value, batched=False)
        ids = check_episode_ids(np.array([episode_id]))
        with buf.writing():
            buf.id_counter.claim(ids)  # fresh ids must never collide with it
            buf.episode_index.set_row(int(ids[0]), arrays)

    def set_current_episode_data(self, value: Any) -> None:
        """Set the data of the episode being recorded (``current_episode_id``)."""
        buf = cast("TrajectoryReplayBuffer", self)
        buf.set_episode_data_at(buf.current_episode_id, value)

    def set_at(self, idx: IndexLike, value: Any) -> None:
        """Overwrite step rows ``idx`` (bare step data or ``{"step_data", "episode_ids"?,
        "episode_data"?}``, as ``extend`` takes; the last row of each episode sets its data);
        crash-atomic."""
        buf = cast("TrajectoryReplayBuffer", self)
        buf.sync_reads()
        i = normalize_index(idx, buf.rows_table.count)
        single = isinstance(i, int)
        if isinstance(value, dict) and "step_data" in value and "episode_data" in value:
            value = {k: v for k, v in value.items() if k != "episode_data"} if value["episode_data"] is None else value
        arrays, n, ids, ep = buf.layout.split(value, batched=not single)
        rows = np.atleast_1d(np.asarray(i, dtype=np.int64))
        if not single and n != len(rows):
            raise BadValueError(f"set_at got {n} rows for {len(rows)} indices")
        lay = buf.layout
        fields = list(range(len(arrays))) + ([lay.id_field] if ids is not None else [])
        data = arrays + ([ids] if ids is not None else [])
        with buf.store.write_op():
            if ids is not None:
                buf.id_counter.claim(ids)
            buf.store.rewrite(lay.steps.rewrite_plan_set(rows, data, fields), buf.episode_index.forget)
            if ep is not None:
                set_episode_rows(buf.episode_index, np.atleast_1d(lay.step_ids(rows)), ep)

    def remove_at(self, idx: IndexLike) -> None:
        """Delete steps ``idx`` (later steps move up); episodes left without steps lose their
        episode data.  One crash-atomic rewrite covers both."""
        buf = cast("TrajectoryReplayBuffer", self)
        buf.sync_reads()
        rows = np.unique(np.atleast_1d(np.asarray(normalize_index(idx, buf.rows_table.count), dtype=np.int64)))
        if rows.size == 0:
            return
        t, et = buf.rows_table, buf.layout.episode_table
        ids = t.read_contiguous(0, t.count, [buf.layout.id_field])[0]
        keep = np.ones(len(ids), bool)
        keep[rows] = False
        gone = np.setdiff1d(np.unique(ids[rows]), np.unique(ids[keep]))
        ep_rows = buf.episode_index.lookup(gone) if et is not None and gone.size else np.zeros(0, np.int64)
        with buf.store.write_op():
            remove_rows(buf, rows, np.unique(ep_rows[ep_rows >= 0]))

    def extend_from(self, other: BatchBase, chunk_size: int | None = None, tqdm: bool | None = None) -> None:
        """Append every step of ``other``.

        From a trajectory buffer, episode boundaries and episode data are kept; its episodes get
        fresh ids here.  From any other batch whose space equals ``step_space`` (a ReplayBuffer,
        a view), the steps join the current episode.

        ``chunk_size`` steps are copied at a time; ``None`` (default) sizes steps by bytes, about
        8 MiB of step data each.  ``tqdm``: ``True``/``False`` force the progress bar on/off;
        ``None`` (default) shows it on a terminal for copies of at least 64 MiB, when tqdm is
        installed.  Steps and episode data are checked against this buffer's spaces a step at a
        time, like ``extend``: a refused row stops the copy, with the steps before it appended.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        src = cast("TrajectoryReplayBuffer", other) if isinstance(other, TrajectoryEdits) else None
        src_space = src.step_space if src is not None else other.single_space
        if src_space != buf.step_space:
            raise SpaceMismatchError(f"extend_from: step spaces differ: {src_space} vs {buf.step_space}")
        lay, n = buf.layout, len(other)
        fresh: dict[int, int] = {}
        step, bar = copy_steps(n, buf.rows_table.row_bytes, chunk_size, tqdm)
        try:
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                if src is not None:
                    # Equal step spaces: src's step fields come in this buffer's leaf order, its ids last.
                    *step_arrays, src_ids = src.rows_table.read_contiguous(
                        lo, hi, list(range(len(lay.step_plan.leaves))) + [src.layout.id_field])
                    lay.step_plan.check(step_arrays, first_row=lo)
                    uniq, inverse = np.unique(src_ids, return_inverse=True)
                    for eid in uniq.tolist():
                        if eid not in fresh:
                            fresh[eid] = buf.id_counter.fresh()
                    ids = np.array([fresh[e] for e in uniq.tolist()], np.int64)[inverse.reshape(-1)]
                    buf.extend_leaves(step_arrays, hi - lo, ids, None)
                else:
                    arrays = other.leaf_arrays(slice(lo, hi))
                    lay.step_plan.check(arrays, first_row=lo)
                    buf.extend_leaves(arrays, hi - lo, None, None)
                bar.update(hi - lo)
        finally:
            bar.close()
        if not fresh:
            return
        with buf.store.write_op():
            if src is not None and lay.episode_plan is not None and src.episode_space == buf.episode_space:
                _copy_episode_data(src, buf, fresh)
            buf.id_counter.new_episode()


def _copy_episode_data(src: TrajectoryReplayBuffer, buf: TrajectoryReplayBuffer, fresh: dict[int, int]) -> None:
    """The episode data of ``src``'s episodes ``fresh`` (src id -> id here) that still have steps
    in ``buf`` (a small ring may have dropped some), checked against ``buf``'s episode space."""
    ids = np.array(list(fresh), np.int64)
    rows = src.episode_index.lookup(ids)
    last, start = buf.episode_index.last_rows(), buf.rows_table.state.start
    alive = np.array([last.get(fresh[e], -1) >= start for e in ids.tolist()], bool)
    have = (rows >= 0) & alive
    et, plan = src.layout.episode_table, buf.layout.episode_plan
    if not have.any() or et is None or plan is None:
        return
    data = et.gather(rows[have], list(range(len(plan.leaves))))
    plan.check(data)
    for k, eid in enumerate(ids[have].tolist()):
        buf.episode_index.set_row(fresh[eid], [a[k : k + 1] for a in data])
