"""``DummyVecRolloutBuffer``: a RolloutBuffer facade over one sub-buffer per env.

The facade receives PPO's / A2C's calls for ``n_envs`` envs and hands env ``i`` its own slice
of every argument, so each env's stream lives in its own sub-store (``cache_path/env_{i}``).
Unlike the experimental class of the same name in sb3-extra-buffers (which broadcasts every
call to every buffer and cannot be built by PPO), it splits, merges ``get`` into SB3's
env-major minibatches, and is a plain class with explicit methods (picklable).

Bit-identical to SB3's ``RolloutBuffer(n_envs)`` under one seed: GAE runs per env column
(every column of SB3's vectorised loop is independent), ``get`` draws one
``np.random.permutation(T * n_envs)`` and maps flat index ``j`` to env ``j // T``, step ``j % T``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Generator, Sequence

import gymnasium
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, RolloutBuffer
from stable_baselines3.common.type_aliases import (
    DictRolloutBufferSamples,
    RolloutBufferSamples,
)
from stable_baselines3.common.vec_env import VecNormalize

from trajstore._optional import to_numpy
from trajstore.core.ring import distinct
from trajstore.errors import BadArgumentError, BadOptionError, SpaceMismatchError
from trajstore.sb3 import _root
from trajstore.sb3._base import concat, take
from trajstore.sb3._layout import ObsLayout
from trajstore.sb3.rollout import (
    FLAT,
    ZarrDictRolloutBuffer,
    ZarrRolloutBuffer,
    ZarrRolloutMixin,
)

__all__ = ["DummyVecRolloutBuffer"]

#: Per-step arrays the sub-buffers share with the facade (column views, see ``_bind``).
SHARED = ("actions", "rewards", "episode_starts", "values", "log_probs", "advantages", "returns")

KIND = "DummyVecRolloutBuffer"
_OPTIONS = ("gamma", "gae_lambda", "buffer_class", "buffer_kwargs", "cache_path", "storage_options", "max_workers")


def _prepare(sub: Any) -> None:
    """Run a sub-buffer's first-``get`` preparation without drawing from ``np.random``."""
    if getattr(sub, "generator_ready", False):
        return
    if hasattr(sub, "_prepare_get"):
        sub._prepare_get()
        return
    if isinstance(sub.observations, dict):  # SB3's (Dict)RolloutBuffer: its get() preparation
        for key, obs in sub.observations.items():
            sub.observations[key] = sub.swap_and_flatten(obs)
    else:
        sub.observations = sub.swap_and_flatten(sub.observations)
    for name in FLAT:
        sub.__dict__[name] = sub.swap_and_flatten(sub.__dict__[name])
    sub.generator_ready = True


def _sub_obs(sub: Any, layout: ObsLayout, steps: np.ndarray) -> dict[str | None, np.ndarray]:
    """Observations ``{key: (B, ...)}`` of steps ``steps`` of a prepared one-env sub-buffer."""
    if isinstance(sub, ZarrRolloutMixin):
        return take(sub._flat_obs, steps) if sub._flat_obs is not None else sub._gather("obs", steps, None)
    return take(layout.unwrap(sub.observations), steps)


class DummyVecRolloutBuffer(RolloutBuffer):
    """A RolloutBuffer facade that forwards the rollout API to one sub-buffer per env.

    Parameters
    ----------
    buffer_size : int
        Steps per rollout (``n_steps``) of every env.
    observation_space, action_space : gymnasium.Space
    device : str or torch.device
        Device of the minibatch tensors (and of the sub-buffers it builds).
    n_envs : int
        Number of envs; one sub-buffer each.
    use_threads : bool
        Run per-env work (``add``, ``reset``, ``compute_returns_and_advantage``, minibatch
        reads) in a thread pool; results are assembled by env index, bit-identical to
        ``use_threads=False``.
    buffers : sequence of RolloutBuffer, optional
        Ready sub-buffers, one per env, each with ``n_envs == 1``, this ``buffer_size``,
        ``gamma``, ``gae_lambda`` and these spaces.  They are pickled with the facade, and PPO
        saves ``rollout_buffer_kwargs`` in its zip: prefer ``buffer_class`` / ``buffer_kwargs``.
    **kwargs
        ``gamma`` (0.99), ``gae_lambda`` (1): as in RolloutBuffer (PPO/A2C pass them).
        ``buffer_class``: class of the sub-buffers built when ``buffers`` is None
        (default :class:`ZarrRolloutBuffer`, :class:`ZarrDictRolloutBuffer` for Dict spaces).
        ``buffer_kwargs``: extra keyword arguments of every sub-buffer (e.g. ``keep_history``).
        ``cache_path``: sub-buffer ``i`` gets ``cache_path/env_{i}`` (None: each its own
        temporary folder).  ``buffer_kwargs["resume"]`` decides for the whole facade what an
        existing buffer at ``cache_path`` does (as in :class:`ZarrRolloutBuffer`: one warning, not
        one per env).  ``storage_options``: fsspec options for URLs.
        ``max_workers``: threads (default ``min(n_envs, os.cpu_count())``).

    Attributes
    ----------
    actions : ndarray (buffer_size, n_envs, action_dim)
    rewards, episode_starts, log_probs : ndarray (buffer_size, n_envs) float32
        Written by ``add`` for all envs at once; column ``i`` is a view that sub-buffer ``i``
        holds as its own array (until pickling, which rebinds them, or ``get``).
    values, returns, advantages : ndarray (buffer_size, n_envs) float32
        Gathered from the sub-buffers by ``compute_returns_and_advantage``.  The first ``get``
        flattens these and ``actions``, ``log_probs`` env-major to (buffer_size * n_envs, ...),
        as SB3's own ``get``.
    buffers : list
        The sub-buffers, env order.

    Examples
    --------
    >>> PPO("MlpPolicy", vec_env, rollout_buffer_class=DummyVecRolloutBuffer,
    ...     rollout_buffer_kwargs=dict(cache_path="runs/ppo", use_threads=True))  # doctest: +SKIP
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: gymnasium.Space,
        action_space: gymnasium.Space,
        device: Any = "auto",
        n_envs: int = 1,
        use_threads: bool = False,
        buffers: Sequence[RolloutBuffer] | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(_OPTIONS))
        if unknown:
            raise BadArgumentError(f"DummyVecRolloutBuffer got unexpected keyword(s) {unknown}; it takes {list(_OPTIONS)} "
                            "(options of the sub-buffers go in buffer_kwargs=)")
        self._buffers: list[Any] = []
        self._executor: ThreadPoolExecutor | None = None
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.gamma = kwargs.get("gamma", 0.99)
        self.gae_lambda = kwargs.get("gae_lambda", 1)
        self.use_threads = use_threads
        self.max_workers = kwargs.get("max_workers") or min(n_envs, os.cpu_count() or 1)
        self.cache_path = kwargs.get("cache_path")
        self.generator_ready = False
        if buffers is not None:
            self._buffers = self._check_buffers(list(buffers))
        else:
            self._buffers = self._build(kwargs.get("buffer_class"), dict(kwargs.get("buffer_kwargs") or {}),
                                        kwargs.get("storage_options"))
        self._ours = bool(self._buffers) and all(isinstance(b, ZarrRolloutMixin) for b in self._buffers)
        self._layout = ObsLayout(observation_space, n_envs)
        self.reset()

    # -- construction -------------------------------------------------------------------------------
    def _build(self, buffer_class: type | None, buffer_kwargs: dict[str, Any],
               storage_options: dict[str, Any] | None) -> list[Any]:
        if buffer_class is None:
            buffer_class = ZarrDictRolloutBuffer if isinstance(self.observation_space, spaces.Dict) else ZarrRolloutBuffer
        root, created = None, False
        parts = [f"env_{i}" for i in range(self.n_envs)]
        if self.cache_path is not None:
            root = _root.StoreRoot(self.cache_path, storage_options)
            config = {**_root.space_config(self.observation_space, self.action_space), "n_envs": self.n_envs,
                      "buffer_size": self.buffer_size}
            resume = buffer_kwargs.pop("resume", None)
            created = root.prepare(KIND, config, parts, bool(buffer_kwargs.get("overwrite", False)), resume)
            buffer_kwargs["resume"] = True  # decided (and announced below) for the whole facade
            if storage_options is not None:
                buffer_kwargs.setdefault("storage_options", storage_options)
        subs: list[Any] = []
        try:
            for i in range(self.n_envs):
                extra = {} if root is None else {"cache_path": root.sub(parts[i])}
                subs.append(buffer_class(self.buffer_size, self.observation_space, self.action_space, device=self.device,
                                         gae_lambda=self.gae_lambda, gamma=self.gamma, n_envs=1,
                                         **extra, **buffer_kwargs))
        except BaseException:
            for sub in subs:
                if hasattr(sub, "close"):
                    sub.close()
            raise
        if root is not None and created:  # sub-stores of a replaced facade with more envs go
            root.drop_parts([n for n in root.names() if n.startswith("env_")], keep=set(parts))
            root.write_config({"kind": KIND, **config})
        steps = sum(len(tb) for sub in subs for tb in getattr(sub, "history", []))
        if root is not None and not created and steps:
            _root.announce_resume(resume, KIND, root.path, f"{steps:,} steps in the history of its {len(subs)} envs")
        return subs

    def _check_buffers(self, buffers: list[Any]) -> list[Any]:
        if len(buffers) != self.n_envs:
            raise BadOptionError(f"buffers has {len(buffers)} sub-buffers; expected one per env (n_envs={self.n_envs})")
        for i, sub in enumerate(buffers):
            for name in ("n_envs", "buffer_size", "gamma", "gae_lambda"):
                want = 1 if name == "n_envs" else getattr(self, name)
                if getattr(sub, name, None) != want:
                    raise BadOptionError(f"buffers[{i}].{name} is {getattr(sub, name, None)!r}; expected {want!r}")
            for name in ("observation_space", "action_space"):
                if getattr(sub, name) != getattr(self, name):
                    raise SpaceMismatchError(f"buffers[{i}].{name} is {getattr(sub, name)}; expected {getattr(self, name)}")
        return buffers

    # -- per-env execution -----------------------------------------------------------------------
    def _each(self, fn: Callable[[int, Any], Any], envs: Sequence[int] | None = None) -> list[Any]:
        """``[fn(i, buffers[i]) for i in envs]``, in a thread pool when ``use_threads``; results in
        env order, the first failure (in env order) re-raised after all calls finished."""
        envs = range(self.n_envs) if envs is None else envs
        if not self.use_threads or len(envs) < 2:
            return [fn(i, self._buffers[i]) for i in envs]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="trajstore-sb3")
        futures = [self._executor.submit(fn, i, self._buffers[i]) for i in envs]
        wait(futures)
        return [f.result() for f in futures]

    # -- state ------------------------------------------------------------------------------------
    @property
    def buffers(self) -> list[Any]:
        return list(self._buffers)

    @property
    def full(self) -> bool:
        """True when every sub-buffer is full (False when there are none)."""
        return bool(self._buffers) and all(sub.full for sub in self._buffers)

    @full.setter
    def full(self, value: bool) -> None:
        """Set every sub-buffer's ``full`` (SB3 code assigns ``buffer.full`` by hand, as
        ``BaseBuffer.__init__`` and ``reset`` do), so the facade reads back what was set."""
        for sub in self.__dict__.get("_buffers", ()):
            sub.full = value

    @property
    def pos(self) -> int:
        """The next step each env's ``add`` writes (the same for every env)."""
        return int(self.__dict__.get("_pos", 0))

    @pos.setter
    def pos(self, value: int) -> None:
        """Move the facade and every sub-buffer to step ``value``: code that sets an SB3 buffer's
        ``pos`` by hand (to overwrite or skip steps) gets every env's next ``add`` at that step,
        observations included, as in SB3's ``RolloutBuffer(n_envs)``."""
        self.__dict__["_pos"] = value
        for sub in self.__dict__.get("_buffers", ()):
            sub.pos = value

    def size(self) -> int:
        """Steps stored per env, as SB3's ``BaseBuffer.size``: ``buffer_size`` once every
        sub-buffer is full, else the facade's ``pos``."""
        return self.buffer_size if self.full else self.pos

    def _stack(self, name: str) -> np.ndarray:
        return np.concatenate([getattr(sub, name) for sub in self._buffers], axis=1)

    def _bind(self) -> None:
        """Make every sub-buffer's per-step arrays column views of the facade's (buffer_size,
        n_envs, ...) arrays, so ``add`` writes all envs in one assignment per array."""
        for i, sub in enumerate(self._buffers):
            for name in SHARED:
                setattr(sub, name, self.__dict__[name][:, i : i + 1])

    # -- rollout API --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Reset every sub-buffer; facade pos 0, per-step arrays zeroed, of shape (buffer_size,
        n_envs, ...) and the sub-buffers' dtypes, shared with the sub-buffers as column views."""
        self._each(lambda i, sub: sub.reset())
        for name in SHARED:
            if self._buffers:
                like = getattr(self._buffers[0], name)
                tail, dtype = like.shape[2:], like.dtype
            else:  # n_envs=0: no sub-buffer to take dtypes from; SB3's
                tail, dtype = ((self.action_dim,) if name == "actions" else ()), np.dtype(np.float32)
            self.__dict__[name] = np.zeros((self.buffer_size, self.n_envs, *tail), dtype)
        self._bind()
        self._flat_obs: dict[str | None, np.ndarray] | None = None  # the joined rollout of the first get
        self.generator_ready = False
        self.pos = 0

    def add(self, obs: Any, action: np.ndarray, reward: np.ndarray, episode_start: np.ndarray, value: Any,
            log_prob: Any) -> None:
        """Add one step of every env; env ``i`` gets row ``i`` of every argument.

        Parameters
        ----------
        obs : ndarray (n_envs, *obs_shape) or dict of those
        action : ndarray, reshaped to (n_envs, action_dim)
        reward, episode_start : ndarray (n_envs,)
        value : Tensor (n_envs, 1) ; log_prob : Tensor (n_envs,)
        """
        n, p = self.n_envs, self.pos
        if len(log_prob.shape) == 0:
            log_prob = log_prob.reshape(-1)
        action = action.reshape((n, self.action_dim))
        # SB3's conversions, for all envs at once (the sub-buffers' arrays are views of these).
        self.actions[p] = np.array(action)  # an IndexError once full, as SB3's
        self.rewards[p] = np.array(reward)
        self.episode_starts[p] = np.array(episode_start)
        self.values[p] = to_numpy(value).flatten()
        self.log_probs[p] = to_numpy(log_prob).reshape(n)
        if self._ours:  # trajstore sub-buffers: each stores its env's observations
            o = self._layout.batch(obs)
            self._each(lambda i, sub: sub._add_obs({k: a[i : i + 1] for k, a in o.items()}))
        else:  # any other one-env RolloutBuffer gets the whole step (it rewrites the same values)
            if isinstance(self.observation_space, spaces.Discrete):
                obs = obs.reshape((n, *self.obs_shape))

            def one(i: int, sub: Any) -> None:
                sl = slice(i, i + 1)
                o = {k: v[sl] for k, v in obs.items()} if isinstance(obs, dict) else obs[sl]
                sub.add(o, action[sl], reward[sl], episode_start[sl], value[sl], log_prob[sl])

            self._each(one)
        self.pos += 1

    def compute_returns_and_advantage(self, last_values: Any, dones: np.ndarray) -> None:
        """GAE(lambda) per env (env ``i`` gets ``last_values[i]`` and ``dones[i]``); then the facade's
        values, returns, advantages (buffer_size, n_envs) are gathered from the sub-buffers."""
        self._each(lambda i, sub: sub.compute_returns_and_advantage(last_values[i : i + 1], dones[i : i + 1]))
        for name in ("values", "returns", "advantages"):
            setattr(self, name, self._stack(name))

    def get(self, batch_size: int | None = None) -> Generator[Any, None, None]:
        """Minibatches of one ``np.random.permutation(buffer_size * n_envs)`` over the env-major
        order of SB3 (flat index ``j``: env ``j // buffer_size``, step ``j % buffer_size``)."""
        assert self.full, ""
        total = self.buffer_size * self.n_envs
        indices = np.random.permutation(total)
        if not self.generator_ready:
            self._prepare_get()
        if batch_size is None:
            batch_size = total
        start_idx = 0
        while start_idx < total:
            yield self._get_samples(indices[start_idx : start_idx + batch_size])
            start_idx += batch_size

    def _prepare_get(self) -> None:
        """The first ``get``: prepare every sub-buffer, then join their rollouts env-major (SB3's
        ``swap_and_flatten`` order), so a minibatch is one fancy index per array as in SB3.

        Observations are joined only when every sub-buffer holds its rollout's in RAM; a
        trajstore sub-buffer then hands its copy over (its own ``get`` reads the store again).
        With ``load_obs_on_get=False`` sub-buffers, minibatch observations are gathered per env.
        """
        self._each(lambda i, sub: _prepare(sub))
        for name in FLAT:
            self.__dict__[name] = self.swap_and_flatten(self.__dict__[name])
        ours = [isinstance(sub, ZarrRolloutMixin) for sub in self._buffers]
        if all(not o or sub._flat_obs is not None for o, sub in zip(ours, self._buffers)):
            self._flat_obs = concat([sub._flat_obs if o else self._layout.unwrap(sub.observations)
                                     for o, sub in zip(ours, self._buffers)])
            for o, sub in zip(ours, self._buffers):
                if o:
                    sub._flat_obs = None
        self.generator_ready = True

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> Any:
        """The minibatch at env-major flat indices ``batch_inds`` (B,): obs (B, ...) in the obs
        dtype, actions (B, action_dim) float32, old_values / old_log_prob / advantages / returns (B,)."""
        batch_inds = np.asarray(batch_inds)
        obs = self._layout.wrap(take(self._flat_obs, batch_inds) if self._flat_obs is not None
                                else self._gather_obs(batch_inds))
        # Fancy indexing made fresh copies: tensors share their memory (values as SB3's to_torch).
        rest = [self.to_torch(a, copy=False) for a in (
            self.actions[batch_inds].astype(np.float32, copy=False), self.values[batch_inds].flatten(),
            self.log_probs[batch_inds].flatten(), self.advantages[batch_inds].flatten(),
            self.returns[batch_inds].flatten())]
        if isinstance(obs, dict):
            return DictRolloutBufferSamples({k: self.to_torch(v, copy=False) for k, v in obs.items()}, *rest)
        return RolloutBufferSamples(self.to_torch(obs, copy=False), *rest)

    def _gather_obs(self, batch_inds: np.ndarray) -> dict[str | None, np.ndarray]:
        """Observations at env-major flat indices, read from each env's sub-buffer (in the thread
        pool with ``use_threads``) and scattered into batch order."""
        env_of, step = np.divmod(batch_inds, self.buffer_size)
        envs = distinct(env_of).tolist()
        sels = {e: np.flatnonzero(env_of == e) for e in envs}
        parts = dict(zip(envs, self._each(lambda i, sub: _sub_obs(sub, self._layout, step[sels[i]]), envs)))
        out: dict[str | None, np.ndarray] = {}
        for k, first in parts[envs[0]].items():
            out[k] = np.empty((len(batch_inds), *first.shape[1:]), first.dtype)
            for e in envs:
                out[k][sels[e]] = parts[e][k]
        return out

    # -- lifetime ---------------------------------------------------------------------------------
    def flush(self) -> None:
        """Commit every sub-buffer that has a store."""
        for sub in self._buffers:
            if hasattr(sub, "flush"):
                sub.flush()

    def close(self) -> None:
        """Close every sub-buffer (temporary sub-stores are deleted) and stop the threads."""
        executor, self._executor = getattr(self, "_executor", None), None
        if executor is not None:
            executor.shutdown(wait=True)
        for sub in getattr(self, "_buffers", []):
            if hasattr(sub, "close"):
                sub.close()

    def __enter__(self) -> "DummyVecRolloutBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_executor"] = None  # rebuilt on demand
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "pos" in state:  # pickled before ``pos`` became a property
            state["_pos"] = state.pop("pos")
        self.__dict__.update(state)
        if not self.generator_ready:  # pickling copied the shared arrays apart: share them again
            self._bind()
