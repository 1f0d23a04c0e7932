"""Record a few episodes of a real gymnasium environment into a new store (``trajstore demo``)."""

from __future__ import annotations

import os

import gymnasium
import numpy as np

from trajstore.buffers.replay import ReplayBuffer

__all__ = ["record_demo", "transition_space"]


def transition_space(env: gymnasium.Env) -> gymnasium.spaces.Dict:
    """Space of one transition of ``env``: obs, action, reward, next_obs, terminated, truncated."""
    return gymnasium.spaces.Dict({
        "obs": env.observation_space,
        "action": env.action_space,
        "reward": gymnasium.spaces.Box(-np.inf, np.inf, (), np.float32),
        "next_obs": env.observation_space,
        "terminated": gymnasium.spaces.MultiBinary(1),
        "truncated": gymnasium.spaces.MultiBinary(1),
    })


def record_demo(path: str | os.PathLike[str], *, env_id: str = "CartPole-v1", episodes: int = 5, seed: int = 0,
                overwrite: bool = False) -> str:
    """Run a random policy for ``episodes`` episodes and store every transition at ``path``.

    The writer is closed (committed) before returning; the store can then be reopened with
    ``ReplayBuffer.load_from(path, read_only=True)``.  Returns the store path.
    """
    env = gymnasium.make(env_id)
    env.action_space.seed(seed)
    with ReplayBuffer.create(transition_space(env), cache_path=path, overwrite=overwrite) as rb:
        for ep in range(episodes):
            obs, _info = env.reset(seed=seed + ep)
            done = False
            while not done:
                action = env.action_space.sample()
                next_obs, reward, terminated, truncated, _info = env.step(action)
                rb.append({"obs": obs, "action": action, "reward": np.float32(reward), "next_obs": next_obs,
                           "terminated": np.array([terminated], np.int8), "truncated": np.array([truncated], np.int8)})
                obs, done = next_obs, terminated or truncated
        out = rb.cache_path
    env.close()
    return str(out)
