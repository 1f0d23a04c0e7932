"""Record gymnasium environments into a :class:`~trajstore.TrajectoryReplayBuffer`.

:class:`RecordEpisodes` wraps an ``Env``; :class:`RecordVectorEpisodes` wraps a ``VectorEnv``.
Every step becomes one row ``{"obs", "action", "reward", "terminated", "truncated",
"next_obs"?, "info/<key>"?}`` of step data; every episode gets one row of episode data
``{"seed", "return", "length"}`` (``seed`` is -1 when the episode's reset had no explicit seed).

With a vector env, each sub-env's steps are kept in RAM until its episode ends and then
written as one contiguous block with their own episode id, so episodes of different sub-envs
never interleave (sequence sampling within an episode works as for a single env).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import gymnasium
import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import (
    BadArgumentError,
    BadOptionError,
    UnknownFieldError,
    UnsupportedSpaceError,
)

__all__ = ["RecordEpisodes", "RecordVectorEpisodes", "step_space", "EPISODE_SPACE", "REWARD_DTYPE", "FLAG_DTYPE"]

EPISODE_SPACE = Dict({
    "seed": Box(-(2**62), 2**62, (), np.int64),
    "return": Box(-np.inf, np.inf, (), np.float64),
    "length": Box(0, 2**62, (), np.int64),
})


def _info_space(value: Any) -> Box:
    a = np.asarray(value)
    if a.dtype == np.bool_:
        return Box(0, 1, a.shape, np.bool_)  # type: ignore[arg-type]  # gymnasium annotates no bool dtype; Box takes it
    if a.dtype.kind in "iu":
        info = np.iinfo(a.dtype)
        return Box(info.min, info.max, a.shape, a.dtype)
    if a.dtype.kind == "f":
        return Box(-np.inf, np.inf, a.shape, a.dtype)
    raise UnsupportedSpaceError(f"info value of dtype {a.dtype} cannot be recorded (numbers and bools only)")


#: dtype of the ``reward`` step field of every recorded, imported and demo store: float64, so the
#: rewards of any source (float32 or float64) are kept exactly and episode returns sum exactly.
REWARD_DTYPE = np.dtype(np.float64)
#: dtype of the ``terminated`` / ``truncated`` step fields (shape ()): one bool per step.
FLAG_DTYPE = np.dtype(np.bool_)


def step_space(observation_space: gymnasium.Space, action_space: gymnasium.Space, *, next_obs: bool = False,
               info_spaces: Mapping[str, gymnasium.Space] | None = None) -> Dict:
    """The step space of one recorded step: what :class:`RecordEpisodes`, :class:`RecordVectorEpisodes`,
    ``trajstore demo`` and the importers of :mod:`trajstore.interop` write.

    Parameters
    ----------
    observation_space : gymnasium.Space
        Space of one observation (a single env's, not a vector env's batch); stored as ``obs``.
    action_space : gymnasium.Space
        Space of one action; stored as ``action``.
    next_obs : bool
        Also store ``next_obs`` (the observation after the step, ``observation_space``).
    info_spaces : mapping of str to gymnasium.Space, optional
        Info entries to store, as ``info/<key>`` (a nested Dict ``info``).

    Returns
    -------
    gymnasium.spaces.Dict
        ``obs``, ``action``, ``reward`` (shape (), :data:`REWARD_DTYPE` float64), ``terminated``
        and ``truncated`` (shape (), :data:`FLAG_DTYPE` bool), then ``next_obs`` and ``info``
        when asked for.  Create a buffer to pass to ``RecordEpisodes(env, buffer)`` with it and
        ``episode_data_instance_space=EPISODE_SPACE``.
    """
    parts: dict[str, gymnasium.Space] = {
        "obs": observation_space,
        "action": action_space,
        "reward": Box(-np.inf, np.inf, (), REWARD_DTYPE),
        "terminated": Box(0, 1, (), FLAG_DTYPE),
        "truncated": Box(0, 1, (), FLAG_DTYPE),
    }
    if next_obs:
        parts["next_obs"] = observation_space
    if info_spaces:
        parts["info"] = Dict(dict(info_spaces))
    return Dict(parts)


class _Recorder:
    """Buffer creation shared by both wrappers (created lazily at the first step when info
    spaces must be inferred from the first info dict)."""

    _single_obs_space: gymnasium.Space  # set by each wrapper's __init__
    _single_act_space: gymnasium.Space

    def _setup(self, buffer: TrajectoryReplayBuffer | None, cache_path: Any, record_next_obs: bool,
               info_keys: Sequence[str] | Mapping[str, gymnasium.Space] | None, create_kwargs: dict[str, Any],
               dataset_info: dict[str, Any] | None) -> None:
        if buffer is not None and cache_path is not None:
            raise BadOptionError("pass either buffer or cache_path, not both")
        if buffer is not None and not isinstance(buffer, TrajectoryReplayBuffer):
            hint = f"; to record into a new store at {buffer!r}, pass cache_path=" if isinstance(buffer, (str, os.PathLike)) else ""
            raise BadArgumentError(f"buffer must be a TrajectoryReplayBuffer or None; got {type(buffer).__name__}{hint}")
        self.record_next_obs = record_next_obs
        self.info_keys = list(info_keys or [])
        self._info_spaces = dict(info_keys) if isinstance(info_keys, Mapping) else None
        self._cache_path, self._create_kwargs, self._dataset_info = cache_path, create_kwargs, dataset_info
        self._own = buffer is None
        self.buffer: TrajectoryReplayBuffer | None = buffer
        if buffer is not None:
            if buffer.episode_space != EPISODE_SPACE:
                raise BadOptionError("the buffer must be created with episode_data_instance_space=recording.EPISODE_SPACE")
            self._start_fresh_episode()
        elif not self.info_keys or self._info_spaces is not None:
            self._create(self._info_spaces)

    def _create(self, info_spaces: Mapping[str, gymnasium.Space] | None) -> None:
        space = step_space(self._single_obs_space, self._single_act_space, next_obs=self.record_next_obs,
                           info_spaces=info_spaces)
        self.buffer = TrajectoryReplayBuffer.create(space, episode_data_instance_space=EPISODE_SPACE,
                                                    cache_path=self._cache_path, **self._create_kwargs)
        if self._dataset_info is not None and self.buffer.cache_path is not None:
            from trajstore.metadata import set_dataset_info

            set_dataset_info(self.buffer, **self._dataset_info)

    def _ensure_buffer(self, info: Mapping[str, Any], vector: bool) -> TrajectoryReplayBuffer:
        """The buffer (created from the first step's info), after checking that this step's info has
        every recorded key: a step without one raises before anything of it is written."""
        missing = [k for k in self.info_keys if k not in info]
        if missing and self.buffer is None:
            raise UnknownFieldError(f"info keys {missing} not in the first step's info; pass info_keys as a dict "
                                    "{key: space} to record keys that appear later")
        if missing:
            raise UnknownFieldError(f"info keys {missing} missing from this step's info (it has {sorted(info)}); "
                                    "every recorded step needs the info_keys: the step was not recorded")
        if self.buffer is None:
            self._create({k: _info_space(np.asarray(info[k])[0] if vector else info[k]) for k in self.info_keys})
        assert self.buffer is not None
        return self.buffer

    def _start_fresh_episode(self) -> None:
        """Make sure the buffer's current episode id has no steps yet (so ours is not shared)."""
        buf = self.buffer
        assert buf is not None
        if len(buf):
            buf.mark_episode_end()

    def _close_buffer(self) -> None:
        if self.buffer is not None:
            if self._own:
                self.buffer.close()
            else:
                self.buffer.flush()


class RecordEpisodes(gymnasium.Wrapper, _Recorder):
    """Write every step of ``env`` into a TrajectoryReplayBuffer.

    Parameters
    ----------
    env : gymnasium.Env
    buffer : TrajectoryReplayBuffer, optional
        Where to write (created with ``episode_data_instance_space=EPISODE_SPACE`` and the
        :func:`step_space` of this env); by default a new buffer at ``cache_path``.
    cache_path : str, optional
        Path of the new buffer (``None``: in memory).
    record_next_obs : bool
        Store ``next_obs`` in each step (else the next row's ``obs`` is the next observation,
        except after the last step of an episode).
    info_keys : list of str or dict {key: space}
        Info entries to record as ``info/<key>`` (spaces inferred from the first step's info
        when only names are given).
    dataset_info : dict, optional
        Dataset description stored with :func:`trajstore.metadata.set_dataset_info`.
    **create_kwargs
        Passed to ``TrajectoryReplayBuffer.create`` (``overwrite``, ``step_data_capacity``, ...).

    Episodes end (``mark_episode_end``) on ``terminated or truncated``; a ``reset`` in the middle
    of an episode ends it too.  ``close()`` closes the env and commits (and closes a buffer it
    created).
    """

    def __init__(self, env: gymnasium.Env, buffer: TrajectoryReplayBuffer | None = None, *,
                 cache_path: str | os.PathLike[str] | None = None, record_next_obs: bool = False,
                 info_keys: Sequence[str] | Mapping[str, gymnasium.Space] | None = None,
                 dataset_info: dict[str, Any] | None = None, **create_kwargs: Any) -> None:
        gymnasium.Wrapper.__init__(self, env)
        self._single_obs_space, self._single_act_space = env.observation_space, env.action_space
        self._obs: Any = None
        self._seed, self._return, self._length = -1, 0.0, 0
        self._setup(buffer, cache_path, record_next_obs, info_keys, create_kwargs, dataset_info)

    def _end_episode(self) -> None:
        if self._length and self.buffer is not None:
            self.buffer.set_current_episode_data({"seed": self._seed, "return": self._return, "length": self._length})
            self.buffer.mark_episode_end()
        self._return, self._length = 0.0, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset the env and start a new episode; an episode in progress ends here, with its data.

        Parameters
        ----------
        seed : int, optional
            Passed to the env, and recorded as the new episode's ``seed`` (-1 when None).
        options : dict, optional
            Passed to the env.

        Returns
        -------
        obs, info
            The env's, unchanged; ``obs`` becomes the first step's ``obs``.

        Raises
        ------
        ReadOnlyError, ClosedError
            The buffer cannot be written (an episode in progress must be ended).
        """
        self._end_episode()  # a reset in the middle of an episode ends it
        obs, info = self.env.reset(seed=seed, options=options)
        self._obs, self._seed = obs, -1 if seed is None else int(seed)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """Step the env and append the step as one row; ``terminated or truncated`` ends the
        episode (its data is written and the buffer moves to a new episode id).

        Parameters
        ----------
        action
            Passed to the env; recorded as the row's ``action``.

        Returns
        -------
        obs, reward, terminated, truncated, info
            The env's, unchanged.

        Raises
        ------
        gymnasium.error.ResetNeeded
            No ``reset`` since the last episode ended (or ever).
        UnknownFieldError
            An ``info_keys`` key is missing from this step's info (nothing of the step is recorded;
            on the first step with names-only ``info_keys`` its space cannot be inferred either).
        UnsupportedSpaceError
            First step: an ``info_keys`` value is neither a number nor a bool.
        BadValueError, SpaceMismatchError
            The row does not fit the step space (the env's step is already taken).
        ReadOnlyError, ClosedError
            The buffer cannot be written.
        """
        if self._obs is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        obs, reward, terminated, truncated, info = self.env.step(action)
        buf = self._ensure_buffer(info, vector=False)
        row: dict[str, Any] = {"obs": self._obs, "action": action, "reward": float(reward),
                               "terminated": bool(terminated), "truncated": bool(truncated)}
        if self.record_next_obs:
            row["next_obs"] = obs
        if self.info_keys:
            row["info"] = {k: info[k] for k in self.info_keys}
        buf.append(row)
        self._return += float(reward)
        self._length += 1
        self._obs = obs
        if terminated or truncated:
            self._end_episode()
            self._obs = None
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        """Commit; an unfinished episode keeps its steps and gets its data (its length so far)."""
        try:
            if self._length and self.buffer is not None:
                self.buffer.set_current_episode_data({"seed": self._seed, "return": self._return,
                                                      "length": self._length})
                self.buffer.mark_episode_end()
                self._length = 0
            self._close_buffer()
        finally:
            self.env.close()


class RecordVectorEpisodes(gymnasium.vector.VectorWrapper, _Recorder):
    """Write every step of every sub-env of a ``VectorEnv`` into a TrajectoryReplayBuffer.

    Parameters as :class:`RecordEpisodes`.  Each sub-env's episode gets its own id (taken from
    the buffer, so ids never collide) and is written as one contiguous block of rows when it
    ends (or at ``close``, as an unfinished episode).  Gymnasium 1.x autoreset modes:

    - ``NEXT_STEP`` (default): the step after an episode's last step only resets that sub-env;
      it is not recorded (its action is ignored by the env) and starts the next episode.
    - ``SAME_STEP``: the last step returns the next episode's first observation; the recorded
      ``next_obs`` of that step is ``info["final_obs"]``.
    - ``DISABLED``: a finished sub-env is not recorded until ``reset(options={"reset_mask": m}``
      (or a full reset) starts its next episode.
    """

    def __init__(self, env: gymnasium.vector.VectorEnv, buffer: TrajectoryReplayBuffer | None = None, *,
                 cache_path: str | os.PathLike[str] | None = None, record_next_obs: bool = False,
                 info_keys: Sequence[str] | Mapping[str, gymnasium.Space] | None = None,
                 dataset_info: dict[str, Any] | None = None, **create_kwargs: Any) -> None:
        gymnasium.vector.VectorWrapper.__init__(self, env)
        self._single_obs_space, self._single_act_space = env.single_observation_space, env.single_action_space
        mode = env.metadata.get("autoreset_mode", gymnasium.vector.AutoresetMode.NEXT_STEP)
        self.autoreset_mode = gymnasium.vector.AutoresetMode(mode)
        n = env.num_envs
        self._obs: Any = None
        self._active = np.zeros(n, bool)       # recording an episode
        self._pending_reset = np.zeros(n, bool)  # NEXT_STEP: the next step resets this sub-env
        self._rows: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self._seeds = np.full(n, -1, np.int64)
        self._returns = np.zeros(n)
        self._setup(buffer, cache_path, record_next_obs, info_keys, create_kwargs, dataset_info)

    # -- episode bookkeeping ------------------------------------------------------------------
    def _write_episode(self, i: int) -> None:
        rows = self._rows[i]
        if not rows or self.buffer is None:
            self._rows[i] = []
            return
        buf = self.buffer
        eid = buf.current_episode_id  # a fresh id: nothing is ever appended under the current id
        buf.mark_episode_end()
        batch = {k: _stack([r[k] for r in rows]) for k in rows[0]}
        buf.extend({"step_data": batch, "episode_ids": np.full(len(rows), eid, np.int64)})
        buf.set_episode_data_at(eid, {"seed": int(self._seeds[i]), "return": float(self._returns[i]),
                                      "length": len(rows)})
        self._rows[i] = []

    def _begin(self, i: int, seed: int) -> None:
        self._write_episode(i)
        self._active[i], self._seeds[i], self._returns[i] = True, seed, 0.0

    # -- VectorEnv API ----------------------------------------------------------------------------
    def reset(self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        """Reset the sub-envs (those of ``options["reset_mask"]``, else all) and start a new
        episode in each; their unfinished episodes are written first, as they stand.

        Parameters
        ----------
        seed : int or list of (int or None), optional
            Passed to the env.  Recorded per sub-env as its episode's ``seed``: ``seed + i`` for
            an int (as vector envs seed their sub-envs), the list's entry for a list, -1 for None.
        options : dict, optional
            Passed to the env; ``"reset_mask"`` (n_envs,) bool selects the sub-envs reset.

        Returns
        -------
        obs, info
            The env's, unchanged.

        Raises
        ------
        ReadOnlyError, ClosedError
            The buffer cannot be written (an unfinished episode must be written).
        """
        # VectorEnv.reset is annotated seed: int | None; vector envs also take one seed per env
        obs, info = self.env.reset(seed=seed, options=options)  # type: ignore[arg-type]
        n = self.num_envs
        mask = np.ones(n, bool)
        if options is not None and "reset_mask" in options:
            mask = np.asarray(options["reset_mask"], bool)
        if seed is None:
            seeds = [-1] * n
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + i for i in range(n)]
        else:
            seeds = [-1 if s is None else int(s) for s in seed]
        for i in np.flatnonzero(mask).tolist():
            self._begin(i, seeds[i])
            self._pending_reset[i] = False
        self._obs = obs if self._obs is None else _where(mask, obs, self._obs)
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every sub-env; keep each recorded step in RAM, and write a sub-env's episode as
        one block of rows when it ends (see the class docstring for which steps each autoreset
        mode records).

        Parameters
        ----------
        actions
            Batched actions, passed to the env; entry ``i`` is recorded as sub-env ``i``'s action.

        Returns
        -------
        obs, rewards, terminations, truncations, info
            The env's, unchanged (arrays of shape (n_envs, ...)).

        Raises
        ------
        gymnasium.error.ResetNeeded
            ``reset`` was never called.
        UnknownFieldError
            An ``info_keys`` key is missing from this step's info (nothing of the step is recorded;
            on the first step with names-only ``info_keys`` its space cannot be inferred either).
        UnsupportedSpaceError
            First step: an ``info_keys`` value is neither a number nor a bool.
        BadValueError, SpaceMismatchError
            An ended episode's rows do not fit the step space (the env's step is already taken).
        ReadOnlyError, ClosedError
            An episode ended and the buffer cannot be written.
        """
        if self._obs is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        obs, rewards, terms, truncs, info = self.env.step(actions)
        self._ensure_buffer(info, vector=True)
        done = np.logical_or(terms, truncs)
        if self.autoreset_mode == gymnasium.vector.AutoresetMode.NEXT_STEP:
            record = self._active & ~self._pending_reset
        else:
            record = self._active.copy()
        final_obs = info.get("final_obs") if self.autoreset_mode == gymnasium.vector.AutoresetMode.SAME_STEP else None
        for i in range(self.num_envs):
            if self.autoreset_mode == gymnasium.vector.AutoresetMode.NEXT_STEP and self._pending_reset[i]:
                self._pending_reset[i] = False
                self._begin(i, -1)  # this step was the sub-env's reset: its obs starts a new episode
                continue
            if not record[i]:
                continue
            nxt = final_obs[i] if final_obs is not None and done[i] else _index(obs, i)
            row = {"obs": _index(self._obs, i), "action": _index(actions, i), "reward": float(rewards[i]),
                   "terminated": bool(terms[i]), "truncated": bool(truncs[i])}
            if self.record_next_obs:
                row["next_obs"] = nxt
            if self.info_keys:
                row["info"] = {k: _index(info[k], i) for k in self.info_keys}
            self._rows[i].append(row)
            self._returns[i] += float(rewards[i])
            if done[i]:
                self._write_episode(i)
                self._active[i] = False
                if self.autoreset_mode == gymnasium.vector.AutoresetMode.NEXT_STEP:
                    self._pending_reset[i] = True
                elif self.autoreset_mode == gymnasium.vector.AutoresetMode.SAME_STEP:
                    self._begin(i, -1)  # obs already is the next episode's first observation
        self._obs = obs
        return obs, rewards, terms, truncs, info

    def close(self, **kwargs: Any) -> None:
        """Write unfinished episodes (their steps so far), commit, close the env."""
        try:
            for i in range(self.num_envs):
                self._write_episode(i)
            self._close_buffer()
        finally:
            self.env.close(**kwargs)


def _index(value: Any, i: int) -> Any:
    if isinstance(value, Mapping):
        return {k: _index(v, i) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_index(v, i) for v in value)
    return np.asarray(value)[i]


def _stack(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, Mapping):
        return {k: _stack([v[k] for v in values]) for k in first}
    if isinstance(first, tuple):
        return tuple(_stack([v[j] for v in values]) for j in range(len(first)))
    return np.stack([np.asarray(v) for v in values])


def _where(mask: np.ndarray, new: Any, old: Any) -> Any:
    if isinstance(new, Mapping):
        return {k: _where(mask, new[k], old[k]) for k in new}
    if isinstance(new, tuple):
        return tuple(_where(mask, a, b) for a, b in zip(new, old))
    a, b = np.asarray(new), np.asarray(old)
    m = mask.reshape((-1,) + (1,) * (a.ndim - 1))
    return np.where(m, a, b)
