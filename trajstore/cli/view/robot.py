"""The robot metadata ``trajstore view`` shows (docs/robot.md): each episode's task in the episode
table, the task dictionary and frame rate in the overview, the stored statistics aggregated over the
episodes they are current for, and the time axis of an episode's plots.

Everything here reads the store's own files through the layers below (``trajstore.robot.json`` and
``trajstore.stats`` through :mod:`trajstore.storage.robot_files`, aggregates through
:meth:`TrajectoryReplayBuffer.stats`); nothing is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from trajstore.buffers.robot import TIME_FIELD
from trajstore.maintenance.robot_meta import check_task_strings
from trajstore.maintenance.summary import STEPS
from trajstore.maintenance.where import where_fields
from trajstore.storage.location import Location
from trajstore.storage.robot_files import RobotInfo, load_robot, load_stats

if TYPE_CHECKING:
    from trajstore.buffers.trajectory import TrajectoryReplayBuffer

__all__ = ["MAX_STAT_CHANNELS", "MAX_TASKS_SHOWN", "STAT_KEYS", "TIME_PATH", "check_where_tasks", "stats_answer",
           "task_dictionary", "time_axis"]

#: Tasks of the dictionary listed in the overview (the rest are counted).
MAX_TASKS_SHOWN = 200
#: Channels of one field shown in the statistics table (the rest are counted): as many as a plot
#: draws lines (a (16, 16) frame that is no image has 256 channels of its own).
MAX_STAT_CHANNELS = 16
#: The statistics shown per channel, in this order (``count`` is per field).
STAT_KEYS = ("mean", "std", "min", "max", "q01", "q10", "q50", "q90", "q99")
#: Array path of the step field holding each step's time in seconds.
TIME_PATH = f"{STEPS}/{TIME_FIELD}"


def task_dictionary(info: RobotInfo, episode_ids: np.ndarray) -> dict[str, Any]:
    """The overview's task dictionary: ``tasks`` (the first :data:`MAX_TASKS_SHOWN`, each
    ``{"index", "task", "episodes"}``: how many of ``episode_ids`` have it) and ``more`` (tasks
    not listed)."""
    counts = np.zeros(len(info.tasks), np.int64)
    present = set(np.asarray(episode_ids).tolist())
    for e, t in info.episode_tasks.items():
        if e in present:
            counts[t] += 1
    shown = [{"index": k, "task": t, "episodes": int(counts[k])} for k, t in enumerate(info.tasks[:MAX_TASKS_SHOWN])]
    return {"tasks": shown, "more": max(0, len(info.tasks) - MAX_TASKS_SHOWN)}


def check_where_tasks(buf: TrajectoryReplayBuffer | None, where: str) -> None:
    """A ``where`` comparing ``task`` with strings that are no task of the store raises
    UnknownTaskError, as ``trajstore filter --where`` does (a typo would match nothing silently)."""
    if buf is not None and where.strip() and buf.tasks and "task" in where_fields(where):
        check_task_strings(buf, where)


def time_axis(loc: Location, series: dict[str, list[list[Any]]], steps: np.ndarray) -> dict[str, Any]:
    """The time of the steps sent (``steps``: step numbers in the episode): ``source`` ("timestamp":
    the step field, "fps": step / the declared frame rate, None: no time) and ``time`` (seconds,
    one per step sent; None where a timestamp is not a number)."""
    ts = series.get(TIME_PATH)
    if ts is not None and len(ts) == 1:
        return {"source": "timestamp", "time": ts[0]}
    fps = load_robot(loc).fps
    if fps is None:
        return {"source": None, "time": None}
    return {"source": "fps", "fps": fps, "time": (np.asarray(steps, np.float64) / fps).tolist()}


def stats_answer(buf: TrajectoryReplayBuffer, cache: dict[str, Any]) -> dict[str, Any]:
    """The stored statistics aggregated over every episode they are current for (same commit epoch,
    same length: read from the file, no rows read).

    Parameters
    ----------
    buf : TrajectoryReplayBuffer
        The store, open read-only.
    cache : dict
        Kept between calls: the last answer, under the stored episodes it aggregates.

    Returns
    -------
    dict
        ``stored`` (whether the store has a stats file), ``episodes`` (aggregated), ``of`` (episodes
        in the store), ``fields``: a list of ``{"field", "count", "shape", "channels", "more"}``
        with ``channels`` a list of per-channel lists of :data:`STAT_KEYS` values.
    """
    stored = load_stats(buf.store.loc)
    table = buf.episodes()
    of = int(len(table["episode_id"]))
    if stored is None:
        return {"stored": False, "episodes": 0, "of": of, "fields": []}
    now = dict(zip(table["episode_id"].tolist(), table["length"].tolist()))
    current = stored.epoch == buf.row_source().record.epoch
    ids = np.array([e for e, n in zip(stored.episode_ids.tolist(), stored.lengths.tolist())
                    if current and now.get(e) == n], np.int64)
    key = (stored.epoch, ids.tobytes(), tuple(stored.fields))
    if cache.get("key") == key:
        return {**cache["answer"], "of": of}
    fields: list[dict[str, Any]] = []
    if ids.size:
        names = [n for n, _ in stored.fields]
        for name, s in buf.stats(episodes=ids, fields=names).items():
            flat = np.stack([np.asarray(s[k], np.float64).ravel() for k in STAT_KEYS], 1)
            fields.append({"field": name, "count": int(s["count"]), "shape": list(np.shape(s["mean"])),
                           "channels": flat[:MAX_STAT_CHANNELS].tolist(), "more": max(0, len(flat) - MAX_STAT_CHANNELS)})
    answer = {"stored": True, "episodes": int(ids.size), "of": of, "fields": fields}
    cache.update(key=key, answer=answer)
    return answer
