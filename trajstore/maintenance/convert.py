"""Turn a replay store whose rows flag episode ends into a trajectory store (``trajstore convert``).

``trajstore demo``, stable-baselines3 buffers and any :class:`~trajstore.ReplayBuffer` with
``terminated``/``truncated`` (or ``done``) fields hold episodes without episode ids; the episode
tools (:func:`~trajstore.maintenance.combine.combine`, ``split``, ``filter_store``,
``TrajectoryReplayBuffer.load_from``) work on trajectory stores.  :func:`to_trajectory` writes
the same rows to a new trajectory store, with the episodes ``trajstore episodes`` lists (same
ids, same boundaries) as episode ids and each episode's ``return`` and ``length`` as episode data.
Like the other whole-store writers it streams a bounded block of rows at a time and is all or
nothing: the destination is built under a temporary name, verified, then renamed into place.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium
import numpy as np

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.core.progress import progress_bar
from trajstore.errors import BadArgumentError, NoEpisodesError
from trajstore.maintenance.staged import StagedFolders, check_free, local_path, verify_written
from trajstore.maintenance.summary import STEPS, episode_table, iter_blocks, open_store
from trajstore.spaces import ValuePlan, space_from_json

__all__ = ["to_trajectory", "CONVERTED_EPISODE_SPACE"]

#: Episode data of a converted store: the sum of the episode's rewards (0 without a reward field)
#: and its length in steps (the recorders' ``return`` and ``length``).
CONVERTED_EPISODE_SPACE = gymnasium.spaces.Dict({
    "return": gymnasium.spaces.Box(-np.inf, np.inf, (), np.float64),
    "length": gymnasium.spaces.Box(0, 2**62, (), np.int64),
})


def to_trajectory(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, reward_field: str | None = None,
                  storage_options: dict[str, Any] | None = None, tqdm: bool | None = None,
                  overwrite: bool = False) -> dict[str, Any]:
    """Write the replay store ``src`` as a trajectory store at ``dst``, its episodes as episode ids.

    Episodes are those of ``trajstore episodes SRC``: a row flagged by any ``terminated`` /
    ``truncated`` / ``done`` field (one element per row) ends its episode, episodes are numbered
    0, 1, ... in row order (a ring's first one may have lost its start), and steps after the last
    flagged row form the episode in progress, which stays the store's current episode (more steps
    appended to the converted store continue it).

    Parameters
    ----------
    src : path or URL
        A ReplayBuffer store (opened read-only).
    dst : path
        A local folder that does not exist yet (``overwrite=True`` replaces it).
    reward_field : str, optional
        Scalar step field summed into each episode's ``return`` (default: a field named
        ``reward``, ``rewards`` or ``rew``; none: returns are 0).
    storage_options : dict, optional
        fsspec options of ``src``.
    tqdm : bool or None
        Progress bar: True / False force it; None shows it on a terminal.
    overwrite : bool
        Replace an existing store at ``dst`` (only after the new one was written and verified).

    Returns
    -------
    dict
        ``source``, ``destination``, ``episodes`` (finished ones and the one in progress),
        ``in_progress`` (bool), ``steps``, ``reward_field`` (array path or None), ``verified``.

    Raises
    ------
    BadArgumentError
        ``src`` is already a trajectory store (nothing to convert).
    NoEpisodesError
        ``src`` has no done-like field of one element per row, so no episode boundaries.
    UnknownFieldError
        ``reward_field`` does not name one scalar step field.
    StoreExistsError
        ``dst`` exists and ``overwrite`` is False.
    """
    out_path = local_path(dst, "convert: dst")
    if "://" not in os.fspath(src) and os.path.abspath(os.fspath(src)) == out_path:
        raise BadArgumentError(f"convert: the destination {out_path!r} is the source")
    check_free(out_path, overwrite)
    store = open_store(src, storage_options)
    staged = StagedFolders()
    try:
        kind = store.attrs.get("kind")
        if kind != "ReplayBuffer":
            raise BadArgumentError(f"convert: {src} holds a {kind!r} store; expected a ReplayBuffer store (a "
                                   "trajectory store already has episode ids)")
        eps = episode_table(store, reward_field)  # NoEpisodesError without done-like fields
        if eps["source"] != "terminated/truncated flags":  # pragma: no cover - a ReplayBuffer has no ids
            raise NoEpisodesError(f"convert: {src} has no done-like fields")
        tmp = staged.new(out_path)
        _write_episodes(store, eps, tmp, f"convert into {os.path.basename(out_path)}", tqdm)
        verify_written(tmp)
        staged.commit(overwrite)
    except BaseException:
        staged.discard()
        raise
    finally:
        store.close()
    n_eps = len(eps["episode_id"])
    return {"source": os.fspath(src), "destination": out_path, "episodes": n_eps,
            "in_progress": bool(n_eps and eps["live"][-1]), "steps": int(store.tables[STEPS].count),
            "reward_field": eps["reward_field"], "verified": True}


def _write_episodes(store: Any, eps: dict[str, Any], tmp: str, label: str, tqdm: bool | None) -> None:
    """The rows of ``store`` into a new trajectory store at ``tmp``, with the episodes of
    ``eps`` (its ``episode_table``) as ids and their return and length as episode data;
    ``label`` names the progress bar."""
    steps = store.tables[STEPS]
    plan = ValuePlan(space_from_json(store.attrs["spaces"][STEPS]))
    starts, n_eps = np.asarray(eps["start"], np.int64), len(eps["episode_id"])
    returns = eps.get("return", np.zeros(n_eps))
    bar = progress_bar(steps.count, label, tqdm, unit="step")
    out = TrajectoryReplayBuffer.create(plan.space, episode_data_instance_space=CONVERTED_EPISODE_SPACE,
                                        cache_path=tmp)
    try:
        for lo, arrays in iter_blocks(steps, list(range(len(steps.fields)))):
            rows = np.arange(lo, lo + len(arrays[0]), dtype=np.int64)
            ids = np.searchsorted(starts, rows, side="right") - 1  # the episode each row is in
            out.extend({"step_data": plan.from_arrays(arrays), "episode_ids": ids})
            bar.update(len(rows))
        for eid in range(n_eps):
            out.set_episode_data_at(eid, {"return": np.float64(returns[eid]), "length": np.int64(eps["length"][eid])})
        # The episode in progress stays current; after a finished one a fresh id is (the extends
        # left the next fresh id past every id written).
        if n_eps and eps["live"][-1]:
            out.current_episode_id = n_eps - 1
        elif n_eps:
            out.mark_episode_end()
    finally:
        out.close()
        bar.close()
