"""Ray actors that record gymnasium envs into shards of one sharded dataset (issue 17).

Ray runs the actors; trajstore stores.  Each actor is a :class:`ShardWriter`: it creates its own
shard with :func:`~trajstore.shards.create_shard`, steps its env through
:class:`~trajstore.recording.RecordEpisodes` (one row per step, one episode-data row per
episode) and commits every ``flush_every`` steps.  A learner anywhere reads every shard as one
dataset with :func:`~trajstore.shards.open_sharded` while the actors write (no lock server: one
writer per shard, readers never lock).

``import trajstore`` never imports this module (nor Ray); ``import trajstore.ray`` needs the
``ray`` extra.  The caller starts Ray (``ray.init(...)``); see docs/scale.md.

Credentials.  Everything passed to a Ray actor (constructor arguments included) is pickled into
Ray's object store and control store, where it outlives the call and can show in logs and
dashboards.  So ``storage_options`` here carry only non-secret settings (``profile``,
``endpoint_url``, ``anon``, ``client_kwargs={"region_name": ...}``): keys that name a secret
(``key``, ``secret``, ``token``, ``password``, ``*access_key*``, ``credentials`` ...) are
refused with :class:`~trajstore.errors.BadOptionError` before any actor starts.  Credentials come
from the actor's own machine: an AWS profile (``{"profile": "name"}``, read there from
``~/.aws``), the node's environment (``AWS_ACCESS_KEY_ID`` ...), an instance role; or pass a
zero-argument callable as ``storage_options``, which is called inside the actor and may read
them there (it travels pickled: it must not hold secrets itself).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

import gymnasium
import numpy as np

from trajstore._optional import missing
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadArgumentError, BadOptionError
from trajstore.recording import EPISODE_SPACE, RecordEpisodes, step_space
from trajstore.shards import create_shard
from trajstore.shards.layout import check_shard_name
from trajstore.storage.credentials import check_storage_options

try:
    import ray
except ImportError as e:  # pragma: no cover - the ray extra is installed in the test env
    raise missing("ray", "trajstore.ray") from e

__all__ = ["COLD_STEPS", "ShardWriter", "ShardWriterActor", "start_actors", "run_actors", "check_storage_options"]

#: Steps after a shard is created that count as cold in an actor's step timings (as scripts' COLD).
COLD_STEPS = 200

StorageOptions = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None


def _random_policy(env: gymnasium.Env, seed: int | None) -> Callable[[Any], Any]:
    env.action_space.seed(seed)
    return lambda obs: env.action_space.sample()


class ShardWriter:
    """One actor's writer: an env recorded into a shard of its own (a plain class; Ray runs it as
    :data:`ShardWriterActor`, and it works without Ray too).

    Parameters
    ----------
    path : str
        The sharded dataset's root (local folder or fsspec URL), as for ``create_shard``.
    env_fn : callable
        ``env_fn() -> gymnasium.Env``, called in the actor (pickled by Ray: a module-level function
        or ``functools.partial(gymnasium.make, "CartPole-v1")``).
    policy_fn : callable, optional
        ``policy_fn(env) -> act`` with ``act(obs) -> action``, called once in the actor.  Default:
        uniform random actions (the action space seeded with ``seed``).
    shard : str, optional
        The shard's name; default a unique one (host, pid, random suffix).
    seed : int, optional
        Seeds the first reset (later resets continue the env's generator) and the default policy.
    record_next_obs : bool
        Store ``next_obs`` with each step (default True: transitions sample in one read).
    flush_every : int
        Commit after every this many steps (and at the end of each :meth:`collect`); a learner
        sees an actor's steps once they are committed.
    storage_options : dict, callable or None
        Non-secret fsspec settings, or a zero-argument callable returning the options, called in
        the actor (see the module docstring: credentials never travel pickled).
    **create_kwargs
        Passed to ``create_shard`` (``chunk_rows``, ``compressor``, ``commit_interval``...).
    """

    def __init__(self, path: str | os.PathLike[str], env_fn: Callable[[], gymnasium.Env], *,
                 policy_fn: Callable[[gymnasium.Env], Callable[[Any], Any]] | None = None, shard: str | None = None,
                 seed: int | None = None, record_next_obs: bool = True, flush_every: int = 1000,
                 storage_options: StorageOptions = None, **create_kwargs: Any) -> None:
        check_storage_options(storage_options)
        if not isinstance(flush_every, (int, np.integer)) or flush_every < 1:
            raise BadOptionError(f"flush_every must be an int >= 1; got {flush_every!r}")
        opts = storage_options() if callable(storage_options) else storage_options
        if opts is not None:
            create_kwargs["storage_options"] = dict(opts)
        env = env_fn()
        if not isinstance(env, gymnasium.Env):
            raise BadArgumentError(f"env_fn must return a gymnasium.Env; got {type(env).__name__}")
        space = step_space(env.observation_space, env.action_space, next_obs=record_next_obs)
        try:
            buf = create_shard(path, space, shard=shard, episode_data_instance_space=EPISODE_SPACE, **create_kwargs)
        except BaseException:
            env.close()
            raise
        assert isinstance(buf, TrajectoryReplayBuffer)  # kind="trajectory"
        self.shard = os.path.basename(str(buf.cache_path).rstrip("/"))
        self._buffer = buf
        self._env = RecordEpisodes(env, buf, record_next_obs=record_next_obs)
        self._act = policy_fn(env) if policy_fn is not None else _random_policy(env, seed)
        self._seed = seed
        self._flush_every = int(flush_every)
        self._obs: Any = None
        # what this actor has committed: steps per episode id, in order (the last may be unfinished)
        self._ids: list[int] = []
        self._lengths: list[int] = []
        self._committed = (0, 0)  # (episodes, rows) as of the last flush
        self._timing = np.zeros(2)  # seconds of the first COLD_STEPS steps, of the steps after them
        self._steps = 0

    def collect(self, steps: int) -> dict[str, Any]:
        """Step the env ``steps`` times, recording every step; commit every ``flush_every`` steps
        and at the end.

        Parameters
        ----------
        steps : int
            Env steps to take (episodes continue across calls).

        Returns
        -------
        dict
            :meth:`stats` after the final commit, plus ``"seconds"``: the whole call, final commit
            included.
        """
        if not isinstance(steps, (int, np.integer)) or steps < 0:
            raise BadOptionError(f"steps must be an int >= 0; got {steps!r}")
        buf = self._buffer
        start = time.perf_counter()
        for i in range(int(steps)):
            t = time.perf_counter()
            if self._obs is None:
                self._obs, _ = self._env.reset(seed=self._seed)
                self._seed = None  # later resets continue the env's generator
            eid = buf.current_episode_id
            if not self._ids or self._ids[-1] != eid:
                self._ids.append(eid)
                self._lengths.append(0)
            obs, _, terminated, truncated, _ = self._env.step(self._act(self._obs))
            self._lengths[-1] += 1
            self._steps += 1
            self._obs = None if terminated or truncated else obs
            if (i + 1) % self._flush_every == 0:
                self._flush()
            self._timing[int(self._steps > COLD_STEPS)] += time.perf_counter() - t
        self._flush()
        return {**self.stats(), "seconds": time.perf_counter() - start}

    def _flush(self) -> None:
        self._buffer.flush()
        self._committed = (len(self._ids), self._steps)

    def stats(self) -> dict[str, Any]:
        """What this actor has committed so far.

        Returns
        -------
        dict
            ``shard`` (str), ``rows`` (int, steps committed), ``episode_ids`` and ``lengths``
            ((E,) int64 each: the shard's own episode ids in row order and their committed steps;
            the last episode may still be running), ``pid`` (the actor's process), ``steps`` (taken,
            committed or not), ``cold_seconds`` and ``steady_seconds`` (time spent in the first
            :data:`COLD_STEPS` steps and in the steps after them: env step, policy and recording; a
            commit counts in the step that triggered it).
        """
        n, rows = self._committed
        return {"shard": self.shard, "rows": rows, "episode_ids": np.asarray(self._ids[:n], np.int64),
                "lengths": np.asarray(self._lengths[:n], np.int64), "pid": os.getpid(),
                "steps": self._steps, "cold_seconds": float(self._timing[0]),
                "steady_seconds": float(self._timing[1])}

    def close(self) -> dict[str, Any]:
        """Commit, end the running episode (its data records its steps so far), close the env.

        Returns
        -------
        dict
            :meth:`stats` after the final commit.
        """
        self._env.close()  # ends the episode and flushes; the buffer is the caller's: close it too
        self._buffer.close()
        self._committed = (len(self._ids), self._steps)
        return self.stats()


#: :class:`ShardWriter` as a Ray actor class (``ShardWriterActor.options(...).remote(path, env_fn, ...)``).
ShardWriterActor = ray.remote(ShardWriter)


def start_actors(path: str | os.PathLike[str], env_fn: Callable[[], gymnasium.Env], num_actors: int, *,
                 seed: int | None = 0, shards: list[str] | None = None, actor_options: dict[str, Any] | None = None,
                 storage_options: StorageOptions = None, **kwargs: Any) -> list[Any]:
    """Start ``num_actors`` :class:`ShardWriter` actors on the running Ray cluster.

    Parameters
    ----------
    path, env_fn, storage_options, **kwargs
        As for :class:`ShardWriter` (``policy_fn``, ``flush_every``, ``record_next_obs``, create
        options).  ``storage_options`` are checked here, before any actor starts.
    num_actors : int
        Actors to start, one shard each.
    seed : int or None
        Actor ``i`` gets ``seed + i`` (None: unseeded).
    shards : list of str, optional
        The shards' names (``num_actors`` of them); default unique names.
    actor_options : dict, optional
        Ray's ``.options(...)`` for each actor (``num_cpus``, ``resources``, ``runtime_env``...).

    Returns
    -------
    list of ray.actor.ActorHandle
        Call ``collect.remote(steps)``, ``stats.remote()``, ``close.remote()`` on them.

    Raises
    ------
    BadOptionError
        Secret ``storage_options``, a bad ``num_actors``, or ``shards`` that are not ``num_actors``
        distinct plain names: before any actor starts.
    """
    check_storage_options(storage_options)
    if not isinstance(num_actors, (int, np.integer)) or num_actors < 1:
        raise BadOptionError(f"num_actors must be an int >= 1; got {num_actors!r}")
    if shards is not None:  # checked here: an actor's own error would only surface at its first call
        if len(shards) != num_actors or len(set(shards)) != num_actors:
            raise BadOptionError(f"shards must name {num_actors} distinct shards (one per actor); got {shards!r}")
        for name in shards:
            check_shard_name(name, os.fspath(path))
    cls = ShardWriterActor.options(**(actor_options or {}))
    return [cls.remote(os.fspath(path), env_fn, shard=None if shards is None else shards[i],
                       seed=None if seed is None else seed + i, storage_options=storage_options, **kwargs)
            for i in range(num_actors)]


def run_actors(path: str | os.PathLike[str], env_fn: Callable[[], gymnasium.Env],
               policy_fn: Callable[[gymnasium.Env], Callable[[Any], Any]] | None = None, num_actors: int = 2,
               steps: int = 1000, **kwargs: Any) -> list[dict[str, Any]]:
    """Start ``num_actors`` actors, let each record ``steps`` env steps into its own shard, close them.

    Parameters
    ----------
    path, env_fn, policy_fn
        As for :class:`ShardWriter`.
    num_actors : int
        Actors (shards).
    steps : int
        Env steps per actor.
    **kwargs
        As for :func:`start_actors`.

    Returns
    -------
    list of dict
        Per actor, :meth:`ShardWriter.collect`'s result: ``shard``, ``rows``, ``episode_ids``,
        ``lengths``, ``pid``, ``steps``, ``cold_seconds``, ``steady_seconds``, ``seconds``.
    """
    actors = start_actors(path, env_fn, num_actors, policy_fn=policy_fn, **kwargs)
    try:
        ray.get([a.stats.remote() for a in actors])  # every actor created its shard
        refs = [a.collect.remote(steps) for a in actors]
        out = ray.get(refs)
        ray.get([a.close.remote() for a in actors])
        return out
    finally:
        for a in actors:
            ray.kill(a)
