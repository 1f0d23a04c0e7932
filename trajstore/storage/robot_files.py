"""The two robot metadata files of a trajectory store, parsed as hostile input (docs/format.md
"Robot metadata"): ``trajstore.robot.json`` (frame rate, task dictionary, each episode's task) and
``trajstore.stats`` (per-episode statistics of every step field).

Both are replaced whole by the writer (temp file + rename, :meth:`Location.put`), so a reader sees
the old file or the new one.  Reading checks every count, type and size before anything is
allocated from it; anything else is a :class:`~trajstore.errors.DamagedStoreError` naming the
file and the problem.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from trajstore.errors import DamagedStoreError
from trajstore.storage.keys import ROBOT_KEY, STATS_KEY
from trajstore.storage.location import Location
from trajstore.storage.schema import load_json

__all__ = ["MAX_TASKS", "MAX_TASK_CHARS", "QUANTILE_GRID", "RobotInfo", "StatsTable", "load_robot", "load_stats",
           "robot_bytes", "robot_summary", "stats_bytes"]

#: At most this many distinct tasks, each at most this many characters.
MAX_TASKS = 1 << 16
MAX_TASK_CHARS = 4096
#: Largest robot file (bytes) and largest stats header.
MAX_ROBOT_BYTES = 16 << 20
MAX_STATS_HEADER = 1 << 20
#: Per-episode quantiles kept: every percentile, 0 (min) to 100 (max).
QUANTILE_GRID = 101
#: Per channel: count, mean, m2 (sum of squared deviations), min, max, then the quantile grid.
STAT_WIDTH = 5 + QUANTILE_GRID
_MAGIC = b"TSSTATS\x01"
_BIG = 1 << 62


@dataclass
class RobotInfo:
    """What ``trajstore.robot.json`` holds.

    Attributes
    ----------
    fps : float or None
        Frames per second of the step rows (None: not declared).
    tasks : list of str
        The task dictionary: task index ``k`` is ``tasks[k]`` (LeRobot's ``task_index``).
    episode_tasks : dict of int to int
        Episode id -> task index (episodes not listed have no task).
    """

    fps: float | None = None
    tasks: list[str] = field(default_factory=list)
    episode_tasks: dict[int, int] = field(default_factory=dict)

    def task_of(self, episode_ids: np.ndarray) -> np.ndarray:
        """(E,) object array: the task string of each episode id, ``""`` where it has none."""
        return np.array([self.tasks[self.episode_tasks[e]] if e in self.episode_tasks else ""
                         for e in np.asarray(episode_ids).tolist()], dtype=object)


def robot_bytes(info: RobotInfo) -> bytes:
    """The file's bytes (checked as a reader checks them, so a writer never stores what it would refuse)."""
    raw = json.dumps({"version": 1, "fps": info.fps, "tasks": info.tasks,
                      "episode_tasks": sorted([e, t] for e, t in info.episode_tasks.items())}).encode("utf-8")
    _parse_robot(raw, "(being written)")
    return raw


def load_robot(loc: Location) -> RobotInfo:
    """The store's robot metadata (empty when it has no file).

    Raises
    ------
    DamagedStoreError
        The file is not what this module writes (the message names the problem).
    """
    raw = loc.get(ROBOT_KEY, limit=MAX_ROBOT_BYTES)
    return RobotInfo() if raw is None else _parse_robot(raw, str(loc.url))


def robot_summary(loc: Location, epoch: int) -> dict[str, Any]:
    """What ``trajstore info`` says of the two files (both read and checked; a damaged one raises).

    Parameters
    ----------
    loc : Location
        The store's location.
    epoch : int
        The commit record's epoch now: stored statistics of another epoch are stale.

    Returns
    -------
    dict
        ``fps`` (None: not declared), ``tasks`` (how many in the dictionary), ``episodes_with_task``
        (entries of the file: episodes a ring evicted since the last edit included) and ``stats``:
        None when no statistics are stored, else ``episodes`` (stored), ``fields`` (their names)
        and ``current`` (computed under this epoch: no rows rewritten or removed since).

    Raises
    ------
    DamagedStoreError
        Either file is not what this module writes.
    """
    info = load_robot(loc)
    st = load_stats(loc)
    stats = None if st is None else {"episodes": int(len(st.episode_ids)), "fields": [n for n, _ in st.fields],
                                     "current": st.epoch == epoch}
    return {"fps": info.fps, "tasks": len(info.tasks), "episodes_with_task": len(info.episode_tasks), "stats": stats}


def _bad(where: str, what: str) -> DamagedStoreError:
    return DamagedStoreError(f"{where}: {ROBOT_KEY} {what}")


def _parse_robot(raw: bytes, where: str) -> RobotInfo:
    obj = load_json(raw, where, ROBOT_KEY, strict_numbers=True)
    if not isinstance(obj, dict) or obj.get("version") != 1 or set(obj) != {"version", "fps", "tasks", "episode_tasks"}:
        raise _bad(where, "is not an object with version 1, fps, tasks and episode_tasks")
    fps = _robot_fps(obj["fps"], where)
    tasks = _robot_tasks(obj["tasks"], where)
    return RobotInfo(fps, tasks, _robot_episode_tasks(obj["episode_tasks"], len(tasks), where))


def _robot_fps(fps: Any, where: str) -> float | None:
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < 1e9
                            or not math.isfinite(fps)):
        raise _bad(where, f"fps is {fps!r}; expected null or a number in (0, 1e9)")
    return None if fps is None else float(fps)


def _robot_tasks(tasks: Any, where: str) -> list[str]:
    if not isinstance(tasks, list) or len(tasks) > MAX_TASKS:
        raise _bad(where, f"tasks must be a list of at most {MAX_TASKS} strings")
    for t in tasks:
        if not isinstance(t, str) or not t or len(t) > MAX_TASK_CHARS:
            raise _bad(where, f"holds task {t!r:.80}; expected non-empty strings of at most {MAX_TASK_CHARS} chars")
    if len(set(tasks)) != len(tasks):
        raise _bad(where, "lists a task twice")
    return list(tasks)


def _robot_episode_tasks(pairs: Any, n_tasks: int, where: str) -> dict[int, int]:
    if not isinstance(pairs, list):
        raise _bad(where, "episode_tasks must be a list of [episode id, task index] pairs")
    out: dict[int, int] = {}
    for p in pairs:
        if (not isinstance(p, list) or len(p) != 2 or not all(type(v) is int for v in p) or not 0 <= p[0] < _BIG
                or not 0 <= p[1] < n_tasks or p[0] in out):
            raise _bad(where, f"holds episode_tasks entry {p!r:.80}; expected distinct [episode id >= 0, task index "
                              f"< {n_tasks}] pairs")
        out[p[0]] = p[1]
    return out


@dataclass
class StatsTable:
    """What ``trajstore.stats`` holds: per-episode statistics of step fields.

    Attributes
    ----------
    epoch : int
        The commit record's epoch they were computed under (another epoch: stale).
    fields : list of (name, channels)
        Each field's name (step leaf path, ``"obs/image"``) and number of channels.
    episode_ids, lengths : (E,) int64
        The episodes and their step counts when computed.
    values : (E, sum of channels, STAT_WIDTH) float64
        Per episode and channel: count, mean, m2, min, max, then the 101 percentiles.
    """

    epoch: int
    fields: list[tuple[str, int]]
    episode_ids: np.ndarray
    lengths: np.ndarray
    values: np.ndarray


def stats_bytes(t: StatsTable) -> bytes:
    """The file's bytes: magic, u64 header length, JSON header, ids, lengths, values (little-endian)."""
    header = json.dumps({"epoch": t.epoch, "grid": QUANTILE_GRID, "episodes": len(t.episode_ids),
                         "fields": [[n, c] for n, c in t.fields]}).encode("utf-8")
    return b"".join([_MAGIC, struct.pack("<Q", len(header)), header, t.episode_ids.astype("<i8").tobytes(),
                     t.lengths.astype("<i8").tobytes(), t.values.astype("<f8").tobytes()])


def load_stats(loc: Location) -> StatsTable | None:
    """The stored statistics, or None when the store has none.

    Raises
    ------
    DamagedStoreError
        A file of the wrong size, a header that is not this format's, counts that disagree with
        the size, negative or duplicate episode ids, counts that are not whole numbers, or
        quantiles out of order (the message names the file and the problem).
    """
    raw = loc.get(STATS_KEY)  # bounded by the store's whole-file limit (1 GiB)
    return None if raw is None else parse_stats(raw, str(loc.url))


def parse_stats(raw: bytes, where: str) -> StatsTable:
    """Parse and check the bytes of a stats file (see :func:`load_stats`)."""
    def bad(what: str) -> DamagedStoreError:
        return DamagedStoreError(f"{where}: {STATS_KEY} {what}; delete it or run `trajstore stats --save` again")

    if len(raw) < 16 or raw[:8] != _MAGIC:
        raise bad("does not start with this format's magic bytes")
    (hlen,) = struct.unpack("<Q", raw[8:16])
    if hlen > min(MAX_STATS_HEADER, len(raw) - 16):
        raise bad(f"claims a header of {hlen} bytes")
    head = _stats_header(load_json(raw[16:16 + hlen], where, STATS_KEY, strict_numbers=True), bad)
    fields = _stats_fields(head["fields"], bad)
    n, channels = head["episodes"], sum(c for _, c in fields)
    body = len(raw) - 16 - hlen
    if body != 16 * n + 8 * n * channels * STAT_WIDTH:
        raise bad(f"holds {body} bytes after its header; {n} episodes of {channels} channels need "
                  f"{16 * n + 8 * n * channels * STAT_WIDTH}")
    at = 16 + hlen
    ids = np.frombuffer(raw, "<i8", n, at).astype(np.int64)
    lengths = np.frombuffer(raw, "<i8", n, at + 8 * n).astype(np.int64)
    values = np.frombuffer(raw, "<f8", n * channels * STAT_WIDTH, at + 16 * n).reshape(n, channels, STAT_WIDTH).copy()
    _check_stats_values(ids, lengths, values, bad)
    return StatsTable(head["epoch"], fields, ids, lengths, values)


def _stats_header(head: Any, bad: Callable[[str], DamagedStoreError]) -> dict[str, Any]:
    if (not isinstance(head, dict) or set(head) != {"epoch", "grid", "episodes", "fields"}
            or head["grid"] != QUANTILE_GRID or type(head["epoch"]) is not int or type(head["episodes"]) is not int
            or not 0 <= head["episodes"] < _BIG or not 0 <= head["epoch"] < _BIG or not isinstance(head["fields"], list)):
        raise bad("has a header that is not {epoch, grid: 101, episodes, fields}")
    return head


def _stats_fields(listed: list[Any], bad: Callable[[str], DamagedStoreError]) -> list[tuple[str, int]]:
    fields: list[tuple[str, int]] = []
    for f in listed:
        if (not isinstance(f, list) or len(f) != 2 or not isinstance(f[0], str) or not f[0] or len(f[0]) > 1024
                or type(f[1]) is not int or not 1 <= f[1] <= 1 << 20):
            raise bad(f"names field {f!r:.80}; expected [name, channels >= 1]")
        fields.append((f[0], f[1]))
    return fields


def _check_stats_values(ids: np.ndarray, lengths: np.ndarray, values: np.ndarray,
                        bad: Callable[[str], DamagedStoreError]) -> None:
    if (ids < 0).any() or len(np.unique(ids)) != len(ids) or (lengths < 1).any():
        raise bad("lists negative or duplicate episode ids, or episodes without steps")
    count, grid = values[:, :, 0], values[:, :, 5:]
    if not np.all(np.isfinite(count)) or (count < 1).any() or (count != np.round(count)).any():
        raise bad("holds counts that are not whole numbers >= 1")
    finite = np.isfinite(grid)
    if (np.diff(grid, axis=-1)[finite[..., 1:] & finite[..., :-1]] < 0).any():
        raise bad("holds quantiles out of order")
