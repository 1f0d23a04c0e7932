"""Record a few episodes of a real gymnasium environment into a new store (``trajstore demo``)."""

from __future__ import annotations

import os

import gymnasium

from trajstore.buffers.replay import ReplayBuffer
from trajstore.recording import step_space

__all__ = ["record_demo", "transition_space"]


def transition_space(env: gymnasium.Env) -> gymnasium.spaces.Dict:
    """Space of one transition of ``env``: the recorders' step space with ``next_obs``.

    ``obs``, ``action``, ``next_obs`` (the env's spaces), ``reward`` (float64, shape ()) and
    ``terminated`` / ``truncated`` (bool, shape ()): the same fields and dtypes as
    :func:`trajstore.recording.step_space`, so a demo store and a recorded one read alike.
    """
    return step_space(env.observation_space, env.action_space, next_obs=True)


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
                rb.append({"obs": obs, "action": action, "reward": float(reward), "next_obs": next_obs,
                           "terminated": bool(terminated), "truncated": bool(truncated)})
                obs, done = next_obs, terminated or truncated
        out = rb.cache_path
    env.close()
    return str(out)
