"""``ZarrNStepReplayBuffer``: SB3's ``NStepReplayBuffer`` with observations on disk.

The rows are stored exactly as :class:`~trajstore.sb3.replay.ZarrReplayBuffer` stores them (same
folder layout: ``sb3.json`` + ``transitions/``); the n-step return is computed at sampling time
from the RAM arrays ``rewards``, ``dones``, ``timeouts`` with SB3's own arithmetic, so under one
``np.random`` seed the batches (``rewards`` = n-step returns, ``discounts`` = gamma ** steps,
``next_observations`` of the last step, ``dones``) are bit-identical to SB3's.

``n_steps`` and ``gamma`` shape sampling only: they are not recorded in ``sb3.json``, so a
buffer can be reopened with other values.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from trajstore.errors import BadOptionError, MissingDependencyError, UnsupportedSpaceError
from trajstore.sb3.replay import ZarrReplayMixin

try:
    from stable_baselines3.common.buffers import NStepReplayBuffer
except ImportError:  # pragma: no cover - stable-baselines3 before 2.7
    import stable_baselines3

    raise MissingDependencyError(f"trajstore.sb3.nstep needs stable-baselines3 >= 2.7 (NStepReplayBuffer); "
                                 f"found {stable_baselines3.__version__}: pip install -U stable-baselines3") from None

__all__ = ["ZarrNStepReplayBuffer"]


class ZarrNStepReplayBuffer(ZarrReplayMixin, NStepReplayBuffer):  # type: ignore[misc]  # (as ZarrReplayBuffer)
    """SB3's ``NStepReplayBuffer`` (n-step returns) with observations in a trajstore store.

    Same constructor as SB3's ``NStepReplayBuffer`` plus the keyword-only storage arguments of
    :class:`~trajstore.sb3.replay.ZarrReplayBuffer`.  ``sample`` returns
    ``ReplayBufferSamples`` whose ``rewards`` (B, 1) float32 are the discounted sums of up to
    ``n_steps`` rewards (stopping at the first done or timeout, and at the newest transition),
    ``discounts`` (B, 1) float32 are ``gamma ** k`` for the k steps summed, ``next_observations``
    (B, *obs_shape) are those of the last step summed and ``dones`` (B, 1) float32 its
    ``done * (1 - timeout)``: what SB3's DQN, SAC, TD3 use as n-step targets.

    Parameters
    ----------
    buffer_size, observation_space, action_space, device, n_envs, handle_timeout_termination
        As in ``stable_baselines3.common.buffers.NStepReplayBuffer``.
    optimize_memory_usage : bool
        Not supported (as in SB3): True raises ``BadOptionError``.
    n_steps : int
        Number of rewards summed per sample (>= 1).
    gamma : float
        Discount factor of the sum.
    cache_path, storage_options, overwrite, resume, **storage_kwargs
        As in :class:`~trajstore.sb3.replay.ZarrReplayBuffer`.

    Raises
    ------
    BadOptionError
        ``optimize_memory_usage=True`` or ``n_steps < 1``.
    UnsupportedSpaceError
        A Dict observation space (SB3 has no n-step Dict buffer).

    Examples
    --------
    >>> model = DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=ZarrNStepReplayBuffer,
    ...             replay_buffer_kwargs=dict(n_steps=3, gamma=0.99, cache_path="runs/dqn"))  # doctest: +SKIP
    """

    KIND = "ZarrNStepReplayBuffer"

    def __init__(
        self,
        buffer_size: int,
        observation_space: gymnasium.Space,
        action_space: gymnasium.Space,
        device: Any = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        n_steps: int = 3,
        gamma: float = 0.99,
        cache_path: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        resume: bool | None = None,
        **storage_kwargs: Any,
    ) -> None:
        if optimize_memory_usage:
            raise BadOptionError("ZarrNStepReplayBuffer does not support optimize_memory_usage=True (SB3's "
                                 "NStepReplayBuffer does not either); got optimize_memory_usage=True")
        if int(n_steps) != n_steps or n_steps < 1:
            raise BadOptionError(f"n_steps must be an integer >= 1; got {n_steps!r}")
        self.n_steps = int(n_steps)
        self.gamma = gamma
        super().__init__(buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
                         handle_timeout_termination, cache_path=cache_path, storage_options=storage_options,
                         overwrite=overwrite, resume=resume, **storage_kwargs)

    @staticmethod
    def _check_space(observation_space: gymnasium.Space, optimize_memory_usage: bool) -> None:
        if isinstance(observation_space, spaces.Dict):
            raise UnsupportedSpaceError(f"ZarrNStepReplayBuffer takes Box, Discrete, MultiDiscrete or MultiBinary "
                                        f"observations (SB3 has no n-step Dict buffer); got {observation_space}")

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """n-step transitions starting at positions ``batch_inds`` (B,), each from an env drawn here.

        SB3's ``NStepReplayBuffer._get_samples``, reading observations from the store and never
        writing to ``timeouts`` (SB3 marks the newest position truncated for the duration of the
        call; here the mark is applied to the gathered values).
        """
        env_indices = np.random.randint(0, self.n_envs, size=batch_inds.shape)
        size, n = self.buffer_size, self.n_steps
        last_valid = (self.pos - 1) % size
        # The newest position ends every window (its successor is older data, or nothing).
        last_row = np.logical_or(self.timeouts[last_valid], np.logical_not(self.dones[last_valid])).astype(np.float32)

        def timeouts_at(rows: np.ndarray, envs: np.ndarray) -> np.ndarray:
            return np.where(rows == last_valid, last_row[envs], self.timeouts[rows, envs])

        indices = (batch_inds[:, None] + np.arange(n).reshape(1, -1)) % size  # (B, n_steps)
        rewards_seq = self._normalize_reward(self.rewards[indices, env_indices[:, None]], env)
        dones_seq = self.dones[indices, env_indices[:, None]]
        truncated_seq = timeouts_at(indices, env_indices[:, None])
        done_or_truncated = np.logical_or(dones_seq, truncated_seq)
        done_idx = done_or_truncated.argmax(axis=1)
        done_idx = np.where(done_or_truncated.any(axis=1), done_idx, n - 1)
        mask = np.arange(n).reshape(1, -1) <= done_idx[:, None]
        target_q_discounts = self.gamma ** mask.sum(axis=1, keepdims=True).astype(np.float32)
        discounts = self.gamma ** np.arange(n, dtype=np.float32).reshape(1, -1)
        n_step_returns = (rewards_seq * discounts * mask).sum(axis=1, keepdims=True)

        last_indices = (batch_inds + done_idx) % size
        lay = self._layout
        logical, _ = self._logical_of(last_indices)
        next_obs = self._normalize_obs(lay.wrap(self._gather("next_obs", logical, env_indices)), env)
        next_dones = self.dones[last_indices, env_indices][:, None].astype(np.float32)
        next_timeouts = timeouts_at(last_indices, env_indices)[:, None].astype(np.float32)
        final_dones = next_dones * (1.0 - next_timeouts)

        logical, _ = self._logical_of(batch_inds)
        obs = self._normalize_obs(lay.wrap(self._gather("obs", logical, env_indices)), env)
        actions = self.actions[batch_inds, env_indices]
        t = self._tensor  # every array here is a fresh private one (see ZarrReplayBuffer._get_samples)
        assert isinstance(obs, np.ndarray) and isinstance(next_obs, np.ndarray)  # not a Dict space (_check_space)
        return ReplayBufferSamples(observations=t(obs), actions=t(actions), next_observations=t(next_obs),
                                   dones=t(final_dones), rewards=t(n_step_returns), discounts=t(target_q_discounts))

    def _ctor_kwargs(self) -> dict[str, Any]:
        return dict(super()._ctor_kwargs(), n_steps=self.n_steps, gamma=self.gamma)
