"""Robot-learning metadata of a ``TrajectoryReplayBuffer`` (mixed into it; issue 32, docs/robot.md):
time (``fps`` or a ``timestamp`` step field) and windows in seconds, the task dictionary with each
episode's task, and stored statistics per episode aggregated over any episodes.

The files are :mod:`trajstore.storage.robot_files`'; the work is the sampling layer's
(:mod:`trajstore.sampling.time_windows`, :mod:`trajstore.sampling.field_stats`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from trajstore.buffers.base import as_generator
from trajstore.core.ring import IndexLike, normalize_index
from trajstore.errors import (
    BadArgumentError,
    BadOptionError,
    ReadOnlyError,
    UnknownEpisodeError,
    UnknownFieldError,
    UnknownTaskError,
)
from trajstore.sampling import field_stats as _fs
from trajstore.sampling import time_windows as _tw
from trajstore.sampling.source import EpisodeSource, read_consistent
from trajstore.storage.keys import ROBOT_KEY, STATS_KEY
from trajstore.storage.robot_files import (
    MAX_TASK_CHARS,
    MAX_TASKS,
    RobotInfo,
    load_robot,
    load_stats,
    robot_bytes,
    stats_bytes,
)

if TYPE_CHECKING:
    from trajstore.buffers.trajectory import TrajectoryReplayBuffer

__all__ = ["RobotData", "TIME_FIELD"]

#: The step field holding each step's time in seconds (float64, shape ()).
TIME_FIELD = "timestamp"
_ON_MISSING = ("pad", "raise")


def _check_task(task: Any) -> str:
    if not isinstance(task, str) or not task or len(task) > MAX_TASK_CHARS or not task.isprintable():
        raise BadArgumentError(f"a task is a non-empty printable string of at most {MAX_TASK_CHARS} characters; "
                               f"got {task!r:.80}")
    return task


class RobotData:
    """Time, tasks and statistics, mixed into ``TrajectoryReplayBuffer``."""

    # -- the robot file -----------------------------------------------------------------------
    def robot_info(self) -> RobotInfo:
        """The store's ``trajstore.robot.json`` (fps, tasks, episode tasks), read now."""
        return load_robot(cast("TrajectoryReplayBuffer", self).store.loc)

    def put_robot_info(self, info: RobotInfo) -> None:
        """Replace the store's robot metadata with ``info`` (checked first; one atomic put)."""
        buf = cast("TrajectoryReplayBuffer", self)
        if buf.read_only:
            raise ReadOnlyError(f"{buf.cache_path!r} is open read-only: edit its robot metadata through a writer")
        data = robot_bytes(info)  # checked before any byte is written
        buf.store.loc.put(ROBOT_KEY, data)

    @property
    def fps(self) -> float | None:
        """Frames per second the store declares (None: not declared)."""
        return self.robot_info().fps

    def set_fps(self, fps: float | None) -> None:
        """Declare the step rows' frame rate (None removes it)."""
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < 1e9):
            raise BadOptionError(f"fps must be a number in (0, 1e9) or None; got {fps!r}")
        info = self.robot_info()
        info.fps = None if fps is None else float(fps)
        self.put_robot_info(info)

    # -- tasks --------------------------------------------------------------------------------
    @property
    def tasks(self) -> list[str]:
        """The task dictionary: task index ``k`` is ``tasks[k]``."""
        return self.robot_info().tasks

    def episode_tasks(self) -> dict[int, str]:
        """``{episode id: task}`` of every episode with steps in the store that has a task."""
        info = self.robot_info()
        present = set(cast("TrajectoryReplayBuffer", self).episodes()["episode_id"].tolist())
        return {e: info.tasks[t] for e, t in sorted(info.episode_tasks.items()) if e in present}

    def assign_task(self, episodes: int | Iterable[int], task: str | int, *, new: bool = True) -> int:
        """Give episodes a task (a string, added to the dictionary unless ``new=False``, or a task
        index); returns its task index.  The whole file is replaced at once (crash safe).

        Raises
        ------
        UnknownTaskError
            ``task`` is an index or (with ``new=False``) a string the dictionary does not hold.
        UnknownEpisodeError
            An episode without steps in the store.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        info = self.robot_info()
        if isinstance(task, (int, np.integer)) and not isinstance(task, bool):
            if not 0 <= int(task) < len(info.tasks):
                raise UnknownTaskError(f"no task index {task}; the tasks are {dict(enumerate(info.tasks))}")
            k = int(task)
        else:
            name = _check_task(task)
            if name not in info.tasks and not new:
                raise UnknownTaskError(f"no task {name!r}; the tasks are {info.tasks}")
            if name not in info.tasks:
                if len(info.tasks) >= MAX_TASKS:
                    raise BadOptionError(f"a store holds at most {MAX_TASKS} tasks")
                info.tasks.append(name)
            k = info.tasks.index(name)
        ids = np.atleast_1d(np.asarray(list(episodes) if not isinstance(episodes, (int, np.integer)) else episodes))
        if ids.size == 0:
            ids = ids.astype(np.int64)
        if ids.dtype.kind not in "iu":
            raise BadArgumentError(f"episodes must be episode ids (ints); got {ids.dtype}")
        known = set(buf.episodes()["episode_id"].tolist())
        missing = sorted(set(ids.tolist()) - known)
        if missing:
            raise UnknownEpisodeError(f"episodes {missing[:10]} have no steps in {buf.cache_path!r}")
        info.episode_tasks.update({int(e): k for e in ids.tolist()})
        # Episodes no longer in the store (removed, or evicted by a ring) leave the file.
        info.episode_tasks = {e: t for e, t in info.episode_tasks.items() if e in known}
        self.put_robot_info(info)
        return k

    def rename_task(self, old: str, new: str) -> None:
        """Rename a task of the dictionary (every episode with it follows; crash safe).

        Raises
        ------
        UnknownTaskError
            ``old`` is not a task of the store.
        BadOptionError
            ``new`` is already another task.
        """
        info = self.robot_info()
        if old not in info.tasks:
            raise UnknownTaskError(f"no task {old!r}; the tasks are {info.tasks}")
        new = _check_task(new)
        if new != old and new in info.tasks:
            raise BadOptionError(f"task {new!r} exists already; assign its episodes instead of renaming")
        info.tasks[info.tasks.index(old)] = new
        self.put_robot_info(info)

    def episodes_with_task(self, task: str) -> np.ndarray:
        """(E,) int64 ids of the episodes with steps whose task is ``task``, in id order (for
        ``select_episodes``, ``remove_episodes``, ``stats(episodes=...)``).

        Raises
        ------
        UnknownTaskError
            ``task`` is not in the dictionary.
        """
        info = self.robot_info()
        if task not in info.tasks:
            raise UnknownTaskError(f"no task {task!r}; the tasks are {info.tasks}")
        k = info.tasks.index(task)
        present = set(cast("TrajectoryReplayBuffer", self).episodes()["episode_id"].tolist())
        return np.array(sorted(e for e, t in info.episode_tasks.items() if t == k and e in present), np.int64)

    def task_names(self, task_indices: Any) -> np.ndarray:
        """Task strings of task indices (a per-step ``task_index`` field's values), same shape, object dtype.

        Raises
        ------
        UnknownTaskError
            An index outside the dictionary.
        """
        tasks = self.tasks
        k = np.asarray(task_indices)
        if k.dtype.kind not in "iu" or (k.size and (k.min() < 0 or k.max() >= len(tasks))):
            raise UnknownTaskError(f"task indices must be ints in [0, {len(tasks)}); got {k.dtype} values "
                                   f"{k.ravel()[:5].tolist()}...; the tasks are {dict(enumerate(tasks))}")
        return np.array(tasks + [""], dtype=object)[k]

    def task_column(self, episode_ids: np.ndarray) -> np.ndarray:
        """(E,) object array of the task of each episode id (``""`` where it has none)."""
        return self.robot_info().task_of(episode_ids)

    # -- time ---------------------------------------------------------------------------------
    def _clock(self) -> _tw.Clock:
        buf = cast("TrajectoryReplayBuffer", self)
        src = buf.row_source()
        for leaf, lf in zip(src.step_leaves, buf.layout.step_plan.leaves):
            if lf.name == TIME_FIELD:
                return _tw.Clock(leaf, None)
        fps = self.fps
        if fps is None:
            raise BadOptionError(f"{buf.cache_path!r} has no time: give it a {TIME_FIELD!r} step field or declare "
                                 "its frame rate with set_fps(...)")
        return _tw.Clock(None, fps)

    def _leaves_of(self, key: str) -> list[tuple[str, int]]:
        """``[(leaf name, source leaf)]`` of a step field or Dict node named ``key``."""
        buf = cast("TrajectoryReplayBuffer", self)
        src = buf.row_source()
        got = [(lf.name, leaf) for leaf, lf in zip(src.step_leaves, buf.layout.step_plan.leaves)
               if lf.name == key or lf.name.startswith(key + "/") or key == ""]
        if not got:
            raise UnknownFieldError(f"no step field {key!r}; the fields are {[lf.name for lf in buf.layout.step_plan.leaves]}")
        return got

    def _check_timestamps(self, arrays: list[np.ndarray], ids: np.ndarray) -> None:
        """Refuse (before anything is written) timestamps that go back within an episode, also
        against the last step of an episode that continues.  The last time written is remembered
        (with the row count and epoch it holds for), so appends do not read it back."""
        buf = cast("TrajectoryReplayBuffer", self)
        at = self.__dict__.get("_time_leaf")
        if at is None:
            names = [lf.name for lf in buf.layout.step_plan.leaves]
            at = self.__dict__["_time_leaf"] = names.index(TIME_FIELD) if TIME_FIELD in names else -1
        if at < 0 or not len(ids):
            return
        ts = np.asarray(arrays[at], np.float64).reshape(len(ids))
        n, epoch = len(buf), buf.store.committed.epoch
        for eid in np.unique(ids).tolist():
            mine = ts[ids == eid]
            last = self._last_time(eid, n, epoch)
            _tw.check_increasing(mine if last is None else np.concatenate([[last], mine]),
                                 f"extend of episode {eid} in {buf.cache_path!r}")
        self.__dict__["_time_tail"] = (n + len(ids), epoch, int(ids[-1]), float(ts[-1]))

    def _last_time(self, eid: int, n: int, epoch: int) -> float | None:
        """Time of the last row when it belongs to episode ``eid`` (episodes are written in runs:
        only the last row's episode can continue), else None."""
        tail = self.__dict__.get("_time_tail")
        if tail is not None and tail[:2] == (n, epoch):
            return tail[3] if tail[2] == eid else None
        buf = cast("TrajectoryReplayBuffer", self)
        if not n or int(buf.row_source().step_ids(np.array([n - 1]))[0]) != eid:
            return None
        return float(np.asarray(buf.get_at(n - 1)["step_data"][TIME_FIELD]))

    def get_time_windows(self, idx: IndexLike, delta_timestamps: Mapping[str, Sequence[float]], *,
                         tolerance_s: float = 1e-4, mode: str = "nearest", on_missing: str = "pad",
                         streams: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Frames at times relative to anchor rows, as LeRobot's ``delta_timestamps``.

        For anchor row ``idx[b]`` at time ``t`` of its episode, frame ``k`` of field ``key`` is the
        episode's step at ``t + delta_timestamps[key][k]`` (``mode``: nearest, or latest at or
        before); a frame with no step within ``tolerance_s`` is padded: it holds the nearest step of
        the episode and ``<key>_is_pad`` is True there (``on_missing="raise"``: an error instead).

        ``streams`` maps names to other TrajectoryReplayBuffers with the same episode ids and clock
        (fields at other rates); ``"<stream>/<field>"`` keys read them at the same query times.

        Returns
        -------
        dict
            Per step leaf read, ``name -> (B, T, *leaf.shape)``; per key ``key + "_is_pad" -> (B, T)``
            bool.  This buffer's backend.

        Raises
        ------
        BadOptionError
            ``tolerance_s`` negative, a bad ``mode`` / ``on_missing``, no time in a store, or (with
            ``on_missing="raise"``) a frame out of tolerance.
        UnknownFieldError, TimeOrderError
            A key naming no field; timestamps that go back within an episode.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        tol = _tw.check_tolerance(tolerance_s, mode)
        if on_missing not in _ON_MISSING:
            raise BadOptionError(f"on_missing must be one of {_ON_MISSING}; got {on_missing!r}")
        deltas = _tw.check_deltas(delta_timestamps)
        plan = self._time_plan(deltas, dict(streams or {}))
        anchors = np.atleast_1d(np.asarray(normalize_index(idx, len(buf)), np.int64))
        src = buf.row_source()
        eids, t0 = read_consistent(src, lambda: _tw.anchor_times(src, self._clock(), anchors))
        out: dict[str, Any] = {}
        for key, (owner, leaves) in plan.items():
            times = t0[:, None] + deltas[key][None, :]
            osrc: EpisodeSource = owner.row_source()
            clock = owner._clock()

            def read(osrc: EpisodeSource = osrc, clock: _tw.Clock = clock, times: np.ndarray = times,
                     leaves: list[tuple[str, int]] = leaves) -> tuple[list[np.ndarray], np.ndarray]:
                rows, pad = _tw.rows_at_times(osrc, clock, eids, times, mode, tol)
                return _tw.read_at(osrc, rows, [leaf for _, leaf in leaves]), pad

            arrays, pad = read_consistent(osrc, read)
            if on_missing == "raise" and pad.any():
                b, k = (int(v[0]) for v in np.nonzero(pad))
                raise BadOptionError(f"{key!r}: no step of episode {int(eids[b])} within {tol} s of "
                                     f"t={times[b, k]:.6f} s (anchor {int(anchors[b])}, delta "
                                     f"{deltas[key][k]}); pass on_missing='pad' to mask it")
            prefix = key.split("/", 1)[0] + "/" if owner is not self else ""
            for (name, _), a in zip(leaves, arrays):
                out[prefix + name] = buf.output.backend.out(a)
            out[key + "_is_pad"] = buf.output.backend.out(pad)
        return out

    def _time_plan(self, deltas: Mapping[str, np.ndarray], streams: dict[str, Any]
                   ) -> dict[str, tuple[Any, list[tuple[str, int]]]]:
        """Each key's owner (this buffer or a stream) and its leaves."""
        plan: dict[str, tuple[Any, list[tuple[str, int]]]] = {}
        for key in deltas:
            head, _, rest = key.partition("/")
            if head in streams and rest:
                plan[key] = (streams[head], streams[head]._leaves_of(rest))
            else:
                plan[key] = (self, self._leaves_of(key))
        return plan

    def sample_time_windows(self, batch_size: int, delta_timestamps: Mapping[str, Sequence[float]], *,
                            rng: np.random.Generator | int | None = None, **kwargs: Any) -> dict[str, Any]:
        """:meth:`get_time_windows` around ``batch_size`` uniformly drawn anchor rows."""
        buf = cast("TrajectoryReplayBuffer", self)
        g = as_generator(rng, buf.default_rng)
        return self.get_time_windows(g.integers(0, len(buf), size=int(batch_size)), delta_timestamps, **kwargs)

    # -- statistics ---------------------------------------------------------------------------
    def _stat_fields(self, names: Sequence[str] | None) -> list[_fs.StatField]:
        buf = cast("TrajectoryReplayBuffer", self)
        src = buf.row_source()
        every = [_fs.StatField(lf.name or "value", leaf, tuple(lf.shape), np.dtype(lf.dtype))
                 for leaf, lf in zip(src.step_leaves, buf.layout.step_plan.leaves)]
        if names is None:
            return every
        known = {f.name: f for f in every}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UnknownFieldError(f"no step fields {unknown}; the fields are {list(known)}")
        return [known[n] for n in names]

    def stats(self, episodes: Iterable[int] | None = None, *, fields: Sequence[str] | None = None,
              exact: bool = False) -> dict[str, dict[str, Any]]:
        """Statistics of step fields over ``episodes`` (default: every episode with steps).

        Returns ``{field: {"count", "mean", "std", "min", "max", "q01", "q10", "q50", "q90", "q99"}}``
        (numpy; ``count`` the steps; the others of the field's per-channel shape, e.g. ``(1, 1, 3)``
        for an (H, W, 3) image).  Stored per-episode statistics are used where they are current
        (same commit epoch, same episode length); the others are computed from the rows.  Across
        several episodes quantiles are merged within a rank error of 0.01 unless ``exact=True``
        (which reads every row of the episodes); see :mod:`trajstore.sampling.field_stats`.

        Raises
        ------
        UnknownEpisodeError, UnknownFieldError, DamagedStoreError
            An episode without steps; a field the store lacks; a damaged stats file.
        """
        buf = cast("TrajectoryReplayBuffer", self)
        flds = self._stat_fields(fields)
        table = buf.episodes()
        ids = table["episode_id"] if episodes is None else np.unique(np.asarray(list(episodes), np.int64))
        missing = np.setdiff1d(ids, table["episode_id"])
        if missing.size:
            raise UnknownEpisodeError(f"episodes {missing[:10].tolist()} have no steps in {buf.cache_path!r}")
        if not ids.size:
            raise UnknownEpisodeError(f"{buf.cache_path!r} has no episodes to compute statistics of")
        steps = int(table["length"][np.isin(table["episode_id"], ids)].sum())
        src = buf.row_source()
        if exact:
            whole = _fs.group_stats(src, flds, ids, src.record.epoch)
            return _fs.summarize(whole, np.array([0]), flds, steps)
        per = self._episode_stats(ids, flds, table)
        return _fs.summarize(per, np.arange(len(ids)), flds, steps)

    def _episode_stats(self, ids: np.ndarray, flds: list[_fs.StatField], table: dict[str, np.ndarray]) -> Any:
        """Per-episode statistics of ``ids`` in that order: stored where current, else computed."""
        buf = cast("TrajectoryReplayBuffer", self)
        src = buf.row_source()
        stored = load_stats(buf.store.loc)
        lengths = dict(zip(table["episode_id"].tolist(), table["length"].tolist()))
        have: dict[int, np.ndarray] = {}
        if stored is not None and stored.epoch == src.record.epoch:
            cols = _fs.columns_of(stored, flds)
            if cols is not None:
                for k, (e, n) in enumerate(zip(stored.episode_ids.tolist(), stored.lengths.tolist())):
                    if lengths.get(e) == n:
                        have[e] = stored.values[k][cols]
        todo = np.array([e for e in ids.tolist() if e not in have], np.int64)
        fresh = _fs.episode_stats(src, flds, todo, src.record.epoch)
        have.update(zip(todo.tolist(), fresh.values))
        return dataclasses.replace(fresh, episode_ids=ids, lengths=np.array([lengths[e] for e in ids.tolist()], np.int64),
                                   values=np.stack([have[e] for e in ids.tolist()]))

    def close(self, *, save_stats: bool = False) -> None:
        """Commit and release the store (``StoredBuffer.close``); ``save_stats=True`` first stores
        every episode's statistics (:meth:`save_stats`; a writer only)."""
        buf = cast("TrajectoryReplayBuffer", self)
        if save_stats and not buf.closed:
            self.save_stats()
        super().close()  # type: ignore[misc]

    def save_stats(self) -> int:
        """Compute (or keep, where current) every episode's statistics of every step field and store
        them in ``trajstore.stats`` (replaced whole: crash safe).  Returns the episodes stored."""
        buf = cast("TrajectoryReplayBuffer", self)
        if buf.read_only:
            raise ReadOnlyError(f"{buf.cache_path!r} is open read-only: save statistics through a writer")
        buf.flush()
        flds = self._stat_fields(None)
        table = buf.episodes()
        per = self._episode_stats(table["episode_id"], flds, table)
        buf.store.loc.put(STATS_KEY, stats_bytes(per))
        return len(per.episode_ids)
