"""Rewrites, removals and bulk copies of a ``TrajectoryReplayBuffer`` (mixed into it): ``set_at``,
``remove_at``, ``clear``, episode data set by id, and ``extend_from``.  Every rewrite is one
crash-atomic :meth:`Store.rewrite <trajstore.core.store.Store.rewrite>` (steps and episode rows
together); appends are :mod:`trajstore.buffers.trajectory`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import numpy as np

from trajstore.buffers.replay import _copy_steps
from trajstore.buffers.views import BatchBase
from trajstore.core.ring import IndexLike, normalize_index
from trajstore.errors import BadValueError, SpaceMismatchError
from trajstore.storage.fields.base import Field
from trajstore.storage.schema import MAX_INT

if TYPE_CHECKING:
    from trajstore.buffers.trajectory import TrajectoryReplayBuffer

__all__ = ["TrajectoryEdits", "check_episode_ids", "remove_rows", "MAX_EPISODE_ID"]

#: Episode ids are int64 and the commit record holds ``next_episode_id`` (one past the largest),
#: which must stay below the bound of every integer in a commit record (schema.MAX_INT).
MAX_EPISODE_ID = MAX_INT - 1



def check_episode_ids(ids: Any) -> np.ndarray:
    """``ids`` as int64, checked to be episode ids: integers in ``[0, MAX_EPISODE_ID)``."""
    raw = np.asarray(ids)
    if raw.dtype.kind not in "iu" or raw.dtype.itemsize > 8:
        raise BadValueError(f"episode ids must be integers; got {raw.dtype}")
    if raw.size:
        lo, hi = int(raw.min()), int(raw.max())
        if lo < 0 or hi >= MAX_EPISODE_ID:
            raise BadValueError(f"episode ids must be in [0, {MAX_EPISODE_ID}); got {lo if lo < 0 else hi}")
    return raw.astype(np.int64)


def remove_rows(buf: TrajectoryReplayBuffer, rows: np.ndarray, ep_rows: np.ndarray,
                then: Callable[[], None] | None = None) -> None:
    """Delete logical step rows ``rows`` and episode-data rows ``ep_rows`` (each sorted and
    distinct, int64) in one crash-atomic rewrite (inside a write operation); ``then`` runs with
    the bookkeeping of the new commit (``remove_episodes`` starts a fresh episode there)."""
    t, et = buf._table, buf._ep_table

    def changes() -> Iterator[tuple[Field, int, np.ndarray]]:
        yield from t.rewrite_plan_remove(rows)
        if et is not None and ep_rows.size:
            yield from et.rewrite_plan_remove(ep_rows)

    def shrink() -> None:
        t.state.end -= int(rows.size)
        if et is not None:
            et.state.end -= int(ep_rows.size)
        buf._episodes.forget()
        if then is not None:
            then()

    buf._store.rewrite(changes(), shrink)


class TrajectoryEdits:
    """Rewrites, removals and bulk copies, mixed into ``TrajectoryReplayBuffer``."""

    def set_episode_data_at(self, episode_id: int, value: Any) -> None:
        """Set the data of episode ``episode_id`` (overwritten in place if it already has some)."""
        buf = cast("TrajectoryReplayBuffer", self)
        if buf._ep_plan is None:
            raise SpaceMismatchError("this buffer has no episode_data space")
        arrays, _ = buf._ep_plan.to_arrays(value, batched=False)
        eid = int(check_episode_ids(np.array([episode_id]))[0])
        with buf._store.write_op():
            buf._drain()
            buf._next_id = max(buf._next_id, eid + 1)  # fresh ids must never collide with it
            buf._episodes.set_row(eid, arrays)

    def set_current_episode_data(self, value: Any) -> None:
        """Set the data of the episode being recorded (``current_episode_id``)."""
        buf = cast("TrajectoryReplayBuffer", self)
        buf.set_episode_data_at(buf.current_episode_id, value)

    def set_at(self, idx: IndexLike, value: Any) -> None:
        """Overwrite step rows ``idx`` (bare step data or ``{"step_data", "episode_ids"?,
        "episode_data"?}``, as ``extend`` takes; the last row of each episode sets its data);
        crash-atomic."""
        buf = cast("TrajectoryReplayBuffer", self)
        buf._sync()
        i = normalize_index(idx, buf._table.count)
        single = isinstance(i, int)
        if isinstance(value, dict) and "step_data" in value and "episode_data" in value:
            value = {k: v for k, v in value.items() if k != "episode_data"} if value["episode_data"] is None else value
        arrays, n, ids, ep = buf._split(value, batched=not single)
        rows = np.atleast_1d(np.asarray(i, dtype=np.int64))
        if not single and n != len(rows):
            raise BadValueError(f"set_at got {n} rows for {len(rows)} indices")
        fields = list(range(len(arrays))) + ([buf._id_field] if ids is not None else [])
        data = arrays + ([ids] if ids is not None else [])
        with buf._store.write_op():
            if ids is not None:
                buf._claim_ids(ids)
            buf._store.rewrite(buf._table.rewrite_plan_set(rows, data, fields), buf._episodes.forget)
            if ep is not None:
                buf._set_episode_rows(np.atleast_1d(buf._step_ids(rows)), ep)

    def remove_at(self, idx: IndexLike) -> None:
        """Delete steps ``idx`` (later steps move up); episodes left without steps lose their
        episode data.  One crash-atomic rewrite covers both."""
        buf = cast("TrajectoryReplayBuffer", self)
        buf._sync()
        rows = np.unique(np.atleast_1d(np.asarray(normalize_index(idx, buf._table.count), dtype=np.int64)))
        if rows.size == 0:
            return
        t, et = buf._table, buf._ep_table
        ids = t.read_contiguous(0, t.count, [buf._id_field])[0]
        keep = np.ones(len(ids), bool)
        keep[rows] = False
        gone = np.setdiff1d(np.unique(ids[rows]), np.unique(ids[keep]))
        ep_rows = buf._episodes.lookup(gone) if et is not None and gone.size else np.zeros(0, np.int64)
        with buf._store.write_op():
            remove_rows(buf, rows, np.unique(ep_rows[ep_rows >= 0]))

    def clear(self) -> None:
        """Remove every step and episode; ids are never reused (a fresh episode starts)."""
        buf = cast("TrajectoryReplayBuffer", self)
        with buf._store.write_op():
            buf._stager.discard()
            for tab in (buf._table, buf._ep_table):
                if tab is not None:
                    tab.state.start = tab.state.end = 0
            buf._episodes.forget()
            buf._new_episode()
            head = buf._store.current_head()
            head.epoch += 1
            head.state = buf._state()
            buf._store.write_record(head)

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
        src_traj = isinstance(other, TrajectoryEdits)
        src_space = other.step_space if src_traj else other.single_space  # type: ignore[attr-defined]
        if src_space != buf.step_space:
            raise SpaceMismatchError(f"extend_from: step spaces differ: {src_space} vs {buf.step_space}")
        copy_episodes = src_traj and buf._ep_plan is not None and other.episode_space == buf.episode_space  # type: ignore[attr-defined]
        n = len(other)
        n_step = len(buf._step_plan.leaves)
        fresh: dict[int, int] = {}
        step, bar = _copy_steps(n, buf._table.row_bytes, chunk_size, tqdm)
        try:
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                if src_traj:
                    # Equal step spaces: other's step fields come in this buffer's leaf order, its ids last.
                    *step_arrays, src_ids = other._table.read_contiguous(  # type: ignore[attr-defined]
                        lo, hi, list(range(n_step)) + [other._id_field])  # type: ignore[attr-defined]
                    buf._step_plan.check(step_arrays, first_row=lo)
                    uniq, inverse = np.unique(src_ids, return_inverse=True)
                    for eid in uniq.tolist():
                        if eid not in fresh:
                            fresh[eid] = buf._next_id
                            buf._next_id += 1
                    ids = np.array([fresh[e] for e in uniq.tolist()], np.int64)[inverse.reshape(-1)]
                    buf._extend(step_arrays, hi - lo, ids, None)
                else:
                    arrays = other._read_slice(slice(lo, hi), other._all_leaves)
                    buf._step_plan.check(arrays, first_row=lo)
                    buf._extend(arrays, hi - lo, None, None)
                bar.update(hi - lo)
        finally:
            bar.close()
        if not fresh:
            return
        with buf._store.write_op():
            if copy_episodes:
                src = np.array(list(fresh), np.int64)
                rows = other._episodes.lookup(src)  # type: ignore[attr-defined]
                # Only episodes that still have steps here (a small ring may have dropped some).
                last, start = buf._episodes.last_rows(), buf._table.state.start
                alive = np.array([last.get(fresh[e], -1) >= start for e in src.tolist()], bool)
                have = (rows >= 0) & alive
                if have.any():
                    data = other._ep_table.gather(rows[have], list(range(len(other._ep_plan.leaves))))  # type: ignore[attr-defined]
                    buf._ep_plan.check(data)  # type: ignore[union-attr]
                    for k, eid in enumerate(src[have].tolist()):
                        buf._episodes.set_row(fresh[eid], [a[k : k + 1] for a in data])
            buf._new_episode()
