"""``ZarrRolloutBuffer`` / ``ZarrDictRolloutBuffer``: SB3's rollout buffers with observations on disk.

Layout of ``cache_path``::

    sb3.json         spaces, n_envs, n_steps (buffer_size)
    rollout/         trajstore ReplayBuffer of ``buffer_size`` rows, leaves obs.{env}[.{key}]:
                     the observations of the rollout being collected (cleared by ``reset``)
    history/         keep_history=True: TrajectoryReplayBuffer of every finished rollout
                     (``history/env_{i}`` per env when n_envs > 1), episodes split at episode_starts

The small per-step arrays (actions, rewards, episode_starts, values, log_probs, advantages,
returns) stay in RAM with SB3's shapes and dtypes; ``compute_returns_and_advantage`` is SB3's
own code, and ``get`` draws the same ``np.random.permutation`` as SB3, so minibatches are
bit-identical to SB3's under one seed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Generator, cast

import gymnasium
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.buffers import (
    BaseBuffer,
    DictRolloutBuffer,
    RolloutBuffer,
)
from stable_baselines3.common.type_aliases import (
    DictRolloutBufferSamples,
    RolloutBufferSamples,
)
from stable_baselines3.common.vec_env import VecNormalize

from trajstore._optional import to_numpy
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import UnsupportedSpaceError
from trajstore.sb3._base import PositionView, ZarrBufferMixin, concat, take
from trajstore.sb3._layout import ObsLayout, scalar_box, storage_box
from trajstore.sb3._root import announce_resume, space_config

__all__ = ["ZarrRolloutBuffer", "ZarrDictRolloutBuffer", "RolloutArrays"]

#: Per-step RAM arrays, in the order SB3's ``get`` flattens them.
FLAT = ("actions", "values", "log_probs", "advantages", "returns")
#: History step fields (besides "obs") and the RAM array each one comes from.
HISTORY_FIELDS = {"action": "actions", "reward": "rewards", "episode_start": "episode_starts", "value": "values",
                  "log_prob": "log_probs", "advantage": "advantages", "return": "returns"}

#: What a rollout minibatch is made of, as numpy: (observations (B, ...) or dict, actions (B,
#: action_dim) float32, old_values, old_log_prob, advantages, returns (B,) float32).
RolloutArrays = tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _slice(value: Any, s: slice) -> Any:
    return {k: _slice(v, s) for k, v in value.items()} if isinstance(value, dict) else value[s]


class ZarrRolloutMixin(ZarrBufferMixin):
    """Everything of the two rollout classes; they differ only in the observation space they take."""

    _main = "rollout"
    actions: np.ndarray
    rewards: np.ndarray
    returns: np.ndarray
    episode_starts: np.ndarray
    values: np.ndarray
    log_probs: np.ndarray
    advantages: np.ndarray

    if TYPE_CHECKING:  # SB3's BaseBuffer: the concrete classes derive from it after this mixin
        @staticmethod
        def swap_and_flatten(arr: np.ndarray) -> np.ndarray: ...

    def __init__(
        self,
        buffer_size: int,
        observation_space: gymnasium.Space,
        action_space: gymnasium.Space,
        device: Any = "auto",
        gae_lambda: float = 1,
        gamma: float = 0.99,
        n_envs: int = 1,
        *,
        cache_path: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        resume: bool | None = None,
        keep_history: bool = False,
        history_capacity: int | None = None,
        load_obs_on_get: bool = True,
        **storage_kwargs: Any,
    ) -> None:
        BaseBuffer.__init__(cast(BaseBuffer, self), buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self._check_space(observation_space)
        self.gae_lambda = gae_lambda
        self.gamma = gamma
        self.generator_ready = False
        self.keep_history = keep_history
        self.history_capacity = history_capacity
        self.load_obs_on_get = load_obs_on_get
        self._layout = ObsLayout(observation_space, n_envs)
        self._env_obs: list[dict] | None = None  # per-env observations read for the history
        self._flat_obs: dict | None = None  # env-major observations of the prepared rollout
        self._written = True  # rows in the rollout store since the last clear (unknown: True)
        config = {**space_config(observation_space, action_space), "n_envs": self.n_envs, "buffer_size": buffer_size}
        created = self._init_root(cache_path, storage_options, overwrite, config, ["rollout", "history"], storage_kwargs,
                                  resume)
        try:
            obs_space = spaces.Dict(self._layout.leaves("obs"))
            self._rb = self._open_replay("rollout", obs_space, buffer_size, created)
            self.history: list[TrajectoryReplayBuffer] = [
                self._open_trajectory(self._history_name(e), self._history_space(), history_capacity, created)
                for e in range(self.n_envs)] if keep_history else []
            self._rollouts = max([self._last_rollout(tb) + 1 for tb in self.history], default=0)
            if created:
                self._finish_create()
            self.reset()
        except BaseException:
            self._release()
            raise
        steps = sum(len(tb) for tb in self.history)
        if not created and steps:  # only the history carries an earlier run's data into this one
            announce_resume(resume, type(self).__name__, self._root.path,
                            f"{self._rollouts:,} rollouts ({steps:,} steps) in its history")

    @staticmethod
    def _check_space(observation_space: gymnasium.Space) -> None:
        if isinstance(observation_space, spaces.Dict):
            raise UnsupportedSpaceError("ZarrRolloutBuffer takes Box, Discrete, MultiDiscrete or MultiBinary "
                                        "observations; got a Dict space: use ZarrDictRolloutBuffer")

    # -- history --------------------------------------------------------------------------------
    def _history_name(self, env: int) -> str:
        return "history" if self.n_envs == 1 else f"history/env_{env}"

    def _history_space(self) -> spaces.Dict:
        """One step of the history stream: obs, action (action_dim,), float32 scalars, rollout index."""
        fields: list[tuple[str, gymnasium.Space]] = [("obs", self._layout.env_space()),
                                                     ("action", storage_box((self.action_dim,), self.action_space.dtype))]
        fields += [(name, scalar_box(np.float32)) for name in list(HISTORY_FIELDS)[1:]]
        return spaces.Dict(fields + [("rollout", scalar_box(np.int64))])

    @staticmethod
    def _last_rollout(tb: TrajectoryReplayBuffer) -> int:
        n = len(tb)
        return int(tb.get_column(["step_data", "rollout"])[n - 1]) if n else -1

    def _record_history(self) -> None:
        """Append the finished rollout to every env's history stream, one episode per
        ``episode_starts`` segment; an episode that runs on from the last rollout keeps its id."""
        steps = self.buffer_size
        self._env_obs = [self._read_env("obs", e, 0, steps) for e in range(self.n_envs)]
        for e, tb in enumerate(self.history):
            data = {"obs": self._layout.wrap(self._env_obs[e])}
            data.update({name: getattr(self, attr)[:, e] for name, attr in HISTORY_FIELDS.items()})
            data["rollout"] = np.full(steps, self._rollouts, np.int64)
            starts = np.flatnonzero(self.episode_starts[:, e] != 0)
            cuts = [0, *starts[starts > 0].tolist(), steps]
            if self.episode_starts[0, e] != 0 and len(tb):
                tb.mark_episode_end()
            for i, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
                if i:
                    tb.mark_episode_end()
                tb.extend(_slice(data, slice(lo, hi)))
            tb.flush()
        self._rollouts += 1

    # -- SB3 API ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new rollout: zeroed RAM arrays (SB3's), the stored observations cleared."""
        self._check_open()
        steps, n = self.buffer_size, self.n_envs
        self.actions = np.zeros((steps, n, self.action_dim), dtype=self.action_space.dtype)
        for name in ("rewards", "returns", "episode_starts", "values", "log_probs", "advantages"):
            setattr(self, name, np.zeros((steps, n), dtype=np.float32))
        self.generator_ready = False
        self._env_obs = self._flat_obs = None
        if self._written:
            self._rb.clear()
            self._written = False
        BaseBuffer.reset(cast(BaseBuffer, self))

    def add(self, obs: Any, action: np.ndarray, reward: np.ndarray, episode_start: np.ndarray, value: Any,
            log_prob: Any) -> None:
        """Add one step of every env (SB3's signature and semantics).

        Parameters
        ----------
        obs : ndarray (n_envs, *obs_shape), or dict of those
        action : ndarray, reshaped to (n_envs, action_dim)
        reward, episode_start : ndarray (n_envs,)
        value : Tensor (n_envs, 1) ; log_prob : Tensor (n_envs,)
        """
        self._check_open()
        if len(log_prob.shape) == 0:
            log_prob = log_prob.reshape(-1, 1)
        action = np.asarray(action).reshape((self.n_envs, self.action_dim))
        self._add_arrays(self._layout.batch(obs), action, reward, episode_start, to_numpy(value).flatten(),
                         to_numpy(log_prob))

    def _add_arrays(self, obs: dict[str | None, np.ndarray], action: np.ndarray, reward: np.ndarray,
                    episode_start: np.ndarray, value: np.ndarray, log_prob: np.ndarray) -> None:
        """``add`` of normalised numpy arguments: obs ``{key: (n_envs, *shape)}``, action
        (n_envs, action_dim), reward / episode_start / value / log_prob (n_envs,)."""
        p = self.pos
        self.actions[p] = np.array(action)  # an IndexError once full, as SB3's
        self.rewards[p] = np.array(reward)
        self.episode_starts[p] = np.array(episode_start)
        self.values[p] = value
        self.log_probs[p] = log_prob
        self._add_obs(obs)

    def _add_obs(self, obs: dict[str | None, np.ndarray]) -> None:
        """Store one step's observations ``{key: (n_envs, *shape)}`` and advance ``pos``; the
        per-step RAM arrays of this step are the caller's to write.  At a ``pos`` set by hand the
        step goes where SB3 puts it: over the row held there, or after rows of zeros."""
        values = self._layout.row_values(obs)  # leaves in the order of layout.leaves("obs")
        held = self._held()
        if self.pos < held:
            names = [name for name, _ in self._layout.leaves("obs")]
            self._rb.set_at(np.array([self.pos]), {name: v[None] for name, v in zip(names, values)})
        else:
            if self.pos > held:
                self._rb.extend({name: np.zeros((self.pos - held, *box.shape), box.dtype)
                                 for name, box in self._layout.leaves("obs")})
            self._rb.append_leaves(values)
        self._written = True
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True

    def _held(self) -> int:
        """Rows the rollout store holds, counting rows still staged (``len`` would hand them to the
        store first: one table write per step and env, which made PPO with 8 envs 1.14x SB3's time;
        staged, they go a block at a time)."""
        st = self._rb.row_stager()
        if st is None or not st.pending:
            return len(self._rb)
        return self._rb.rows_table.count + st.n  # (a rollout never laps its ring: reset() clears it)

    def compute_returns_and_advantage(self, last_values: Any, dones: np.ndarray) -> None:
        """SB3's GAE(lambda) (its own code); then, with ``keep_history``, the rollout is recorded."""
        super().compute_returns_and_advantage(last_values, dones)  # type: ignore[misc]
        if self.keep_history:
            self._record_history()

    def get(self, batch_size: int | None = None) -> Generator[Any, None, None]:
        """Minibatches of one ``np.random.permutation(buffer_size * n_envs)``, as SB3's ``get``."""
        assert self.full, ""
        indices = np.random.permutation(self.buffer_size * self.n_envs)
        if not self.generator_ready:
            self._prepare_get()
        if batch_size is None:
            batch_size = self.buffer_size * self.n_envs
        start_idx = 0
        while start_idx < self.buffer_size * self.n_envs:
            yield self._get_samples(indices[start_idx : start_idx + batch_size])
            start_idx += batch_size

    def _prepare_get(self) -> None:
        """SB3's first-``get`` step: flatten the RAM arrays env-major; read the observations
        (one sequential read per env) when ``load_obs_on_get``."""
        for name in FLAT:
            self.__dict__[name] = self.swap_and_flatten(self.__dict__[name])
        if self.load_obs_on_get:
            steps = self.buffer_size
            self._flat_obs = concat(self._env_obs or [self._read_env("obs", e, 0, steps) for e in range(self.n_envs)])
        self.generator_ready = True

    def _sample_arrays(self, batch_inds: np.ndarray) -> RolloutArrays:
        """Numpy content of the minibatch at env-major flat indices ``batch_inds`` (prepared buffer)."""
        if self._flat_obs is not None:
            obs = take(self._flat_obs, batch_inds)
        else:
            env, step = np.divmod(batch_inds, self.buffer_size)
            obs = self._gather("obs", step, env)
        return (self._layout.wrap(obs), self.actions[batch_inds].astype(np.float32, copy=False),
                self.values[batch_inds].flatten(), self.log_probs[batch_inds].flatten(),
                self.advantages[batch_inds].flatten(), self.returns[batch_inds].flatten())

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> Any:
        """Rollout(Dict)BufferSamples: obs (B, ...) in the obs dtype, actions (B, action_dim)
        float32, old_values / old_log_prob / advantages / returns (B,) float32."""
        return self._samples(self._sample_arrays(batch_inds))

    def _samples(self, arrays: RolloutArrays) -> Any:
        """Tensors of fresh minibatch arrays (see :meth:`_tensor`)."""
        obs, rest = arrays[0], [self._tensor(a) for a in arrays[1:]]
        if self._layout.is_dict:
            return DictRolloutBufferSamples({k: self._tensor(v) for k, v in obs.items()}, *rest)
        return RolloutBufferSamples(self._tensor(obs), *rest)

    # -- stored observations ---------------------------------------------------------------------
    @property
    def observations(self) -> PositionView | dict[str, PositionView]:
        """Read-only (buffer_size, n_envs, *obs_shape) view of this rollout's observations."""
        return self._views("obs")

    def _logical_of(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return positions, positions < len(self._rb)

    # -- pickling ----------------------------------------------------------------------------------
    def _ctor_kwargs(self) -> dict[str, Any]:
        return dict(gae_lambda=self.gae_lambda, gamma=self.gamma, keep_history=self.keep_history,
                    history_capacity=self.history_capacity, load_obs_on_get=self.load_obs_on_get)

    @classmethod
    def _sizes_from_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return dict(buffer_size=cfg["buffer_size"], n_envs=cfg["n_envs"])

    def _snapshot(self) -> dict[str, Any]:
        names = ("actions", "rewards", "returns", "episode_starts", "values", "log_probs", "advantages")
        return {"arrays": {n: getattr(self, n).copy() for n in names}, "pos": self.pos, "full": self.full,
                "generator_ready": self.generator_ready, "rollouts": self._rollouts,
                "obs": [self._read_env("obs", e, 0, self.pos) for e in range(self.n_envs)] if self.pos else None}

    def _restore(self, snap: dict[str, Any]) -> None:
        if snap["obs"] is not None:
            lay = self._layout
            self._rb.extend({lay.leaf("obs", e, k): part[k] for e, part in enumerate(snap["obs"]) for k in lay.keys})
            self._written = True
        self.__dict__.update(snap["arrays"])
        self.pos, self.full, self._rollouts = snap["pos"], snap["full"], snap["rollouts"]
        self.generator_ready = snap["generator_ready"]
        if self.generator_ready and self.load_obs_on_get:
            self._flat_obs = concat([self._read_env("obs", e, 0, self.pos) for e in range(self.n_envs)])


# (observations: a read-only view here, an array in SB3's class)
class ZarrRolloutBuffer(ZarrRolloutMixin, RolloutBuffer):  # type: ignore[misc]
    """SB3's ``RolloutBuffer`` with the rollout's observations in a trajstore store.

    Same constructor as SB3's (``buffer_size`` is ``n_steps``), plus keyword-only arguments.
    ``compute_returns_and_advantage`` is SB3's own; ``get`` yields the same minibatches as SB3
    under one seed.  After the first ``get`` the RAM arrays are flattened env-major, as in SB3.

    Parameters
    ----------
    buffer_size, observation_space, action_space, device, gae_lambda, gamma, n_envs
        As in ``stable_baselines3.common.buffers.RolloutBuffer``.
    cache_path : str or path-like, optional
        Folder or fsspec URL; ``None``: a temporary folder deleted by :meth:`close`.  An
        existing buffer there is reopened (spaces, n_envs and buffer_size must match; the
        current rollout restarts, the history is kept).
    storage_options : dict, optional
        fsspec options for URLs.
    overwrite : bool
        Replace an existing buffer (and its history) at ``cache_path``.
    resume : bool or None
        What to do with an existing buffer at ``cache_path``: ``True`` reopens it (its history
        grows on), ``False`` refuses it (``StoreExistsError``), ``None`` (default) reopens it,
        with a ``ResumedBufferWarning`` when its history holds steps of an earlier run.
    keep_history : bool
        Also append every finished rollout (at ``compute_returns_and_advantage``) to
        :attr:`history`: one :class:`trajstore.TrajectoryReplayBuffer` per env whose steps hold
        obs, action, reward, episode_start, value, log_prob, advantage, return and the rollout
        index, with a new episode id at every ``episode_starts``.  PPO's experience becomes an
        offline dataset (``TrajectoryReplayBuffer.load_from(cache_path + "/history")``).
    history_capacity : int, optional
        Steps kept per env in the history (a ring); ``None``: unbounded.
    load_obs_on_get : bool
        True: the first ``get`` reads the rollout's observations with one sequential read per
        env (as SB3's first ``get`` copies them); False: every minibatch reads its rows.
    **storage_kwargs
        trajstore storage options (``chunk_rows``, ``compressor``, ``fsync``, ``commit_interval``).
    """

    KIND = "ZarrRolloutBuffer"


class ZarrDictRolloutBuffer(ZarrRolloutMixin, DictRolloutBuffer):  # type: ignore[misc]  # (as ZarrRolloutBuffer)
    """SB3's ``DictRolloutBuffer`` with every observation key in a trajstore store.

    Same arguments as :class:`ZarrRolloutBuffer`; the observation space must be a Dict.
    Minibatches are ``DictRolloutBufferSamples``.
    """

    KIND = "ZarrDictRolloutBuffer"

    @staticmethod
    def _check_space(observation_space: gymnasium.Space) -> None:
        if not isinstance(observation_space, spaces.Dict):
            raise UnsupportedSpaceError(f"ZarrDictRolloutBuffer needs a Dict observation space; got {observation_space}: "
                                        "use ZarrRolloutBuffer")
