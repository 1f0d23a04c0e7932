"""``ZarrHerReplayBuffer``: SB3's ``HerReplayBuffer`` (hindsight experience replay) on disk.

Layout of ``cache_path``: as :class:`~trajstore.sb3.replay.ZarrDictReplayBuffer` (``sb3.json`` +
``transitions/``), every row with one more leaf, ``ep_start`` (n_envs,) int64: SB3's
``ep_start[pos]``, the position where the episode of that transition began in each env.  It is
written once, with the row.  The rest of HER's bookkeeping is rebuilt from the stored rows when
the buffer is reopened:

- ``ep_length[p, e]`` is the length L of the finished episode holding position p when that
  episode is still whole in the ring (its first row, at ``ep_start``, holds the transition
  written L - 1 steps before its done row), else 0, which is what SB3's ``add`` leaves there;
- ``_current_ep_start[e]`` is ``pos`` when the newest row of env e ended an episode, else that
  row's ``ep_start``.

Sampling runs SB3's own ``HerReplayBuffer.sample`` (goal selection, ``compute_reward`` through
the env) over read-only views of the stored observations, so under one ``np.random`` seed the
batches are SB3's, bit for bit.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import gymnasium
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.type_aliases import DictReplayBufferSamples
from stable_baselines3.common.vec_env import VecEnv, VecNormalize
from stable_baselines3.her.goal_selection_strategy import GoalSelectionStrategy
from stable_baselines3.her.her_replay_buffer import HerReplayBuffer

from trajstore.errors import BadOptionError, UnsupportedSpaceError
from trajstore.sampling.source import check_batch_size
from trajstore.sb3._layout import storage_box
from trajstore.sb3.replay import ZarrReplayMixin

__all__ = ["ZarrHerReplayBuffer"]

GOAL_KEYS = ("achieved_goal", "desired_goal")


class _RowsWithEpisodeStart:
    """The ``transitions`` store as the replay mixin uses it, appending to every row the
    ``ep_start`` of its position (the last leaf of :meth:`ZarrHerReplayBuffer._row_space`).

    Everything else is the store's own: attributes are looked up on it.
    """

    def __init__(self, rb: Any, owner: "ZarrHerReplayBuffer") -> None:
        self._rb, self._owner = rb, owner

    def append_leaves(self, arrays: Sequence[np.ndarray]) -> None:
        """Append one row: ``arrays`` (the mixin's leaves) followed by ``ep_start[pos]`` (n_envs,) int64."""
        owner = self._owner
        self._rb.append_leaves([*arrays, owner.ep_start[owner.pos]])

    def __len__(self) -> int:
        return len(self._rb)

    def __getitem__(self, idx: Any) -> Any:
        return self._rb[idx]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rb, name)


class ZarrHerReplayBuffer(ZarrReplayMixin, HerReplayBuffer):  # type: ignore[misc]  # (as ZarrReplayBuffer)
    """SB3's ``HerReplayBuffer`` with observations and episode bookkeeping in a trajstore store.

    Same constructor as SB3's ``HerReplayBuffer`` plus the keyword-only storage arguments of
    :class:`~trajstore.sb3.replay.ZarrReplayBuffer`.  ``sample`` is SB3's: ``DictReplayBufferSamples``
    of which the first ``batch_size - int(her_ratio * batch_size)`` are real transitions and the
    rest have a desired goal drawn by ``goal_selection_strategy`` and a reward from the env's
    ``compute_reward``.  ``ep_start``, ``ep_length`` (buffer_size, n_envs) int64 and
    ``_current_ep_start`` (n_envs,) int64 are RAM arrays kept by SB3's own rules and restored
    from the store on reopen (see the module docstring), so a reopened buffer (``SAC.load``,
    ``load_replay_buffer``, :meth:`open`) samples and continues exactly as the buffer that was
    closed.

    Parameters
    ----------
    buffer_size, observation_space, action_space, device, n_envs, handle_timeout_termination
        As in ``stable_baselines3.HerReplayBuffer``; ``observation_space`` is a Dict with keys
        ``achieved_goal`` and ``desired_goal``.
    env : VecEnv, optional
        The training env (its ``compute_reward`` gives the virtual rewards).  SB3's algorithms
        pass it; a buffer reopened from a pickle gets it from ``load_replay_buffer`` (``set_env``).
    optimize_memory_usage : bool
        Not supported (as in SB3's DictReplayBuffer): True raises ``BadOptionError``.
    n_sampled_goal, goal_selection_strategy, copy_info_dict
        As in SB3 (``"future"``, ``"final"``, ``"episode"`` or a ``GoalSelectionStrategy``).
        With ``copy_info_dict`` the infos are kept in RAM only: a reopened buffer passes ``{}``
        for the transitions of the earlier process.
    cache_path, storage_options, overwrite, resume, **storage_kwargs
        As in :class:`~trajstore.sb3.replay.ZarrReplayBuffer`.

    Raises
    ------
    UnsupportedSpaceError
        The observation space is not a Dict with ``achieved_goal`` and ``desired_goal``.
    BadOptionError
        ``optimize_memory_usage=True``.

    Examples
    --------
    >>> model = SAC("MultiInputPolicy", env, replay_buffer_class=ZarrHerReplayBuffer,
    ...             replay_buffer_kwargs=dict(n_sampled_goal=4, cache_path="runs/her"))  # doctest: +SKIP
    """

    KIND = "ZarrHerReplayBuffer"

    def __init__(
        self,
        buffer_size: int,
        observation_space: gymnasium.Space,
        action_space: gymnasium.Space,
        env: VecEnv | None = None,
        device: Any = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        n_sampled_goal: int = 4,
        goal_selection_strategy: GoalSelectionStrategy | str = "future",
        copy_info_dict: bool = False,
        *,
        cache_path: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        resume: bool | None = None,
        **storage_kwargs: Any,
    ) -> None:
        if optimize_memory_usage:
            raise BadOptionError("ZarrHerReplayBuffer does not support optimize_memory_usage=True (SB3's "
                                 "HerReplayBuffer does not either); got optimize_memory_usage=True")
        if isinstance(goal_selection_strategy, str):
            names = {s.name.lower(): s for s in GoalSelectionStrategy}
            if goal_selection_strategy.lower() not in names:
                raise BadOptionError(f"goal_selection_strategy must be one of {sorted(names)}; "
                                     f"got {goal_selection_strategy!r}")
            goal_selection_strategy = names[goal_selection_strategy.lower()]
        if not isinstance(goal_selection_strategy, GoalSelectionStrategy):
            raise BadOptionError(f"goal_selection_strategy must be a GoalSelectionStrategy or one of 'future', "
                                 f"'final', 'episode'; got {goal_selection_strategy!r}")
        self.env = env
        self.copy_info_dict = copy_info_dict
        self.goal_selection_strategy = goal_selection_strategy
        self.n_sampled_goal = n_sampled_goal
        self.her_ratio = 1 - (1.0 / (self.n_sampled_goal + 1))
        size = max(buffer_size // n_envs, 1)  # the per-env capacity, as the mixin computes it
        self.infos = np.array([[{} for _ in range(n_envs)] for _ in range(size)])
        self.ep_start = np.zeros((size, n_envs), dtype=np.int64)
        self.ep_length = np.zeros((size, n_envs), dtype=np.int64)
        self._current_ep_start = np.zeros(n_envs, dtype=np.int64)
        super().__init__(buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
                         handle_timeout_termination, cache_path=cache_path, storage_options=storage_options,
                         overwrite=overwrite, resume=resume, **storage_kwargs)
        self._rb = _RowsWithEpisodeStart(self._rb, self)  # type: ignore[assignment]  # the store, plus ep_start

    # -- layout ---------------------------------------------------------------------------------
    @staticmethod
    def _check_space(observation_space: gymnasium.Space, optimize_memory_usage: bool) -> None:
        if not isinstance(observation_space, spaces.Dict) or any(k not in observation_space.spaces for k in GOAL_KEYS):
            raise UnsupportedSpaceError(f"ZarrHerReplayBuffer needs a Dict observation space with keys {GOAL_KEYS} "
                                        f"(a goal env's); got {observation_space}")

    def _row_space(self) -> spaces.Dict:
        leaves = list(super()._row_space().spaces.items())
        return spaces.Dict(leaves + [("ep_start", storage_box((self.n_envs,), np.int64))])

    def _small(self) -> dict[str, np.ndarray]:
        return {**super()._small(), "ep_start": self.ep_start}

    # -- SB3 API ----------------------------------------------------------------------------------
    def add(self, obs: Any, next_obs: Any, action: np.ndarray, reward: np.ndarray, done: np.ndarray,
            infos: list[dict[str, Any]]) -> None:
        """Add one transition of every env: SB3's ``HerReplayBuffer.add``, the row into the store.

        Parameters
        ----------
        obs, next_obs : dict of ndarray (n_envs, *shape)
        action : ndarray
            Reshaped to (n_envs, action_dim).
        reward, done : ndarray (n_envs,)
            A done ends the episode of its env: its transitions become sampleable.
        infos : list of dict
            ``info["TimeLimit.truncated"]`` sets the timeout flag (``handle_timeout_termination``).
        """
        self._check_open()
        # SB3 2.9's HerReplayBuffer.add: an episode about to be overwritten leaves the distribution.
        for env_idx in range(self.n_envs):
            episode_start = self.ep_start[self.pos, env_idx]
            episode_length = self.ep_length[self.pos, env_idx]
            if episode_length > 0:
                episode_end = episode_start + episode_length
                episode_indices = np.arange(self.pos, episode_end) % self.buffer_size
                self.ep_length[episode_indices, env_idx] = 0
        self.ep_start[self.pos] = self._current_ep_start.copy()
        if self.copy_info_dict:
            self.infos[self.pos] = infos
        ZarrReplayMixin.add(self, obs, next_obs, action, reward, done, infos)  # the row, with ep_start[pos]
        for env_idx in range(self.n_envs):
            if done[env_idx]:
                self._compute_episode_length(env_idx)

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> DictReplayBufferSamples:  # type: ignore[override]
        """SB3's ``HerReplayBuffer.sample`` (same ``np.random`` draws) over the stored observations.

        Returns
        -------
        DictReplayBufferSamples
            observations, next_observations {key: (B, *shape)} in each key's dtype; actions
            (B, action_dim); dones, rewards (B, 1) float32.  Virtual transitions (the last
            ``int(her_ratio * B)``) carry a new desired goal and the env's ``compute_reward``.

        Raises
        ------
        RuntimeError
            No episode has ended yet (SB3's message).
        BadOptionError
            ``batch_size`` is not an int >= 0 (a ``ValueError``).
        """
        self._check_open()
        check_batch_size(batch_size, "sample")
        return HerReplayBuffer.sample(self, batch_size, env)

    def set_env(self, env: VecEnv) -> None:
        """Set the env whose ``compute_reward`` gives virtual rewards.

        As SB3's, but giving the env the buffer already has is accepted: ``load_replay_buffer``
        sets it on the very buffer ``SAC.load`` reopened in this process.

        Raises
        ------
        ValueError
            The buffer already has another env (SB3's message).
        """
        if self.env is not None and self.env is not env:
            raise ValueError("Trying to set env of already initialized environment.")
        self.env = env

    def reset(self) -> None:
        """Empty the buffer, episode bookkeeping included (SB3 keeps its old episodes sampleable)."""
        super().reset()
        self.ep_length[:] = 0
        self._current_ep_start[:] = 0

    # -- reopening ----------------------------------------------------------------------------------
    def _load_state(self, read_pending: bool = True) -> None:
        """Rebuild pos, full, the RAM arrays and HER's episode bookkeeping from the stored rows."""
        super()._load_state(read_pending)
        size, count = self.buffer_size, self._count
        self.ep_length[:] = 0
        if not count:
            self._current_ep_start[:] = 0
            return
        phys = (self._offset + np.arange(count)) % size  # positions, oldest row first
        step_at = np.full(size, -1, np.int64)
        step_at[phys] = self._column("step")[:]
        newest = (self.pos - 1) % size
        self._current_ep_start[:] = np.where(self.dones[newest] != 0, self.pos, self.ep_start[newest])
        for e in range(self.n_envs):
            for p in phys[self.dones[phys, e] != 0].tolist():  # each held row that ended an episode
                start = int(self.ep_start[p, e])
                end = (p + 1) % size
                if end < start:
                    end += size
                length = end - start
                # Whole in the ring: its first row holds the transition written length - 1 steps earlier.
                if length > 0 and step_at[start] >= 0 and step_at[p] - step_at[start] == length - 1:
                    self.ep_length[np.arange(start, end) % size, e] = length

    # -- pickling ----------------------------------------------------------------------------------
    def _after_copy(self, dup: Any) -> None:
        dup.env = self.env

    def _ctor_kwargs(self) -> dict[str, Any]:
        return dict(super()._ctor_kwargs(), n_sampled_goal=self.n_sampled_goal,
                    goal_selection_strategy=self.goal_selection_strategy.name.lower(),
                    copy_info_dict=self.copy_info_dict)
