"""Robot metadata (docs/robot.md) through the whole-store episode edits of
:mod:`trajstore.maintenance.combine`: ``filter`` and ``split`` keep episode ids, so they keep the
kept episodes' tasks; ``combine`` gives fresh ids, so it merges the task dictionaries by string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadOptionError, UnknownTaskError
from trajstore.maintenance.where import where_strings
from trajstore.storage.robot_files import RobotInfo

__all__ = ["carry_robot_info", "check_task_strings", "merge_tasks", "robot_infos"]


def check_task_strings(buf: TrajectoryReplayBuffer, where: str) -> list[str]:
    """``["task"]``, the text column a ``where`` over ``task`` uses, once every string it compares
    with is a task of ``buf`` (UnknownTaskError otherwise: a typo would keep no episode silently)."""
    tasks = buf.tasks
    unknown = [t for t in where_strings(where) if t not in tasks]
    if unknown:
        raise UnknownTaskError(f"--where {where!r}: no task {unknown[0]!r} in {buf.cache_path!r}; the tasks are {tasks}")
    return ["task"]


def carry_robot_info(src: TrajectoryReplayBuffer, ids: np.ndarray, out: TrajectoryReplayBuffer) -> None:
    """The frame rate and the tasks of episodes ``ids`` of ``src`` into ``out`` (ids are kept; the
    dictionary is kept whole, so task indices stay the same)."""
    info = src.robot_info()
    if info.fps is None and not info.tasks:
        return
    keep = set(np.asarray(ids).tolist())
    info.episode_tasks = {e: t for e, t in info.episode_tasks.items() if e in keep}
    out.put_robot_info(info)


def robot_infos(bufs: Sequence[TrajectoryReplayBuffer], names: Sequence[Any]) -> list[RobotInfo]:
    """Each source's robot metadata; sources that declare different frame rates are refused."""
    infos = [b.robot_info() for b in bufs]
    rates = {i.fps for i in infos}
    if len(rates) > 1:
        raise BadOptionError(f"combine: the sources declare different frame rates "
                             f"{dict(zip(map(str, names), [i.fps for i in infos]))}; one store holds one rate "
                             "(docs/robot.md)")
    return infos


def merge_tasks(merged: RobotInfo, info: RobotInfo, src_ids: np.ndarray, fresh: np.ndarray) -> None:
    """The tasks of one source's episodes (``src_ids``, now ``fresh``) into ``merged``, by task string."""
    for eid, t in info.episode_tasks.items():
        at = int(np.searchsorted(src_ids, eid))
        if at < len(src_ids) and src_ids[at] == eid:
            name = info.tasks[t]
            if name not in merged.tasks:
                merged.tasks.append(name)
            merged.episode_tasks[int(fresh[at])] = merged.tasks.index(name)
