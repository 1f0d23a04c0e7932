"""How stable-baselines3 observations are laid out in a trajstore store.

SB3 keeps observations in arrays of shape ``(buffer_size, n_envs, *obs_shape)`` (one per key
for Dict spaces).  Here every env gets its own leaf per key, named ``"{prefix}.{env}"`` (Box,
Discrete, MultiDiscrete, MultiBinary spaces) or ``"{prefix}.{env}.{key}"`` (Dict spaces), so a
sample reads only the rows of the env it drew.  Each leaf is a ``Box`` with SB3's stored shape
and dtype (``get_obs_shape``: a Discrete observation is stored as shape ``(1,)``), so values
come back exactly as SB3's own buffers return them.

The same layout serves the replay buffers (prefixes ``obs`` and ``next_obs``), the rollout
buffers (``obs``) and the history stream of a rollout buffer (one env, key ``obs``).
"""

from __future__ import annotations

from typing import Any, Mapping, cast

import gymnasium
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.preprocessing import get_obs_shape

from trajstore.errors import BadValueError, UnsupportedSpaceError

__all__ = ["ObsLayout", "storage_box", "scalar_box"]

#: Obs value for one batch: ``{key: array}`` with key ``None`` for a non-Dict space.
PerKey = dict[str | None, np.ndarray]


def storage_box(shape: tuple[int, ...], dtype: Any) -> spaces.Box:
    """A Box of ``shape``/``dtype`` whose bounds span the dtype (trajstore does not check bounds)."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return spaces.Box(-np.inf, np.inf, shape, dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return spaces.Box(info.min, info.max, shape, dt)
    if dt.kind == "b":
        return spaces.Box(0, 1, shape, dt)
    raise UnsupportedSpaceError(f"observations of dtype {dt} cannot be stored; expected a bool, integer or float dtype")


def scalar_box(dtype: Any) -> spaces.Box:
    """A shape-() Box of ``dtype`` (one number per row)."""
    return storage_box((), dtype)


class ObsLayout:
    """Storage of the observations of ``n_envs`` envs of one SB3 observation space.

    Parameters
    ----------
    observation_space : gymnasium.Space
        Box, Discrete, MultiDiscrete, MultiBinary, or a Dict of those (as SB3 accepts).
    n_envs : int
        Number of envs whose observations arrive together, shape ``(n_envs, *obs_shape)``.

    Attributes
    ----------
    keys : list of str or None
        Dict keys in the space's order, or ``[None]`` for a non-Dict space.
    shape, dtype : dict
        SB3's stored shape (``get_obs_shape``) and dtype of every key.
    """

    def __init__(self, observation_space: gymnasium.Space, n_envs: int) -> None:
        self.space = observation_space
        self.n_envs = int(n_envs)
        self.is_dict = isinstance(observation_space, spaces.Dict)
        subs = list(cast(spaces.Dict, observation_space).spaces.items()) if self.is_dict else [(None, observation_space)]
        try:
            shapes: Any = get_obs_shape(observation_space)  # {key: shape} for a Dict space, else a shape
        except NotImplementedError as e:
            raise UnsupportedSpaceError(f"stable-baselines3 cannot store observations of {observation_space}: {e}") from None
        self.keys: list[str | None] = [k for k, _ in subs]
        self.shape: dict[str | None, tuple[int, ...]] = {
            k: tuple(int(d) for d in (shapes[k] if self.is_dict else shapes)) for k in self.keys
        }
        self.dtype: dict[str | None, np.dtype] = {k: np.dtype(s.dtype) for k, s in subs}
        self.discrete = {k: isinstance(s, spaces.Discrete) for k, s in subs}
        for k, s in subs:
            if isinstance(s, spaces.Dict):
                raise UnsupportedSpaceError(f"nested Dict observation at key {k!r}: stable-baselines3 buffers "
                                            "support one level of Dict")
        # What an add's observation already is in the common case (one array, right shape and
        # dtype), so :meth:`batch` can pass it through without the checks (a per-step saving).
        self._as_is = None if self.is_dict else ((self.n_envs, *self.shape[None]), self.dtype[None])

    # -- storage -----------------------------------------------------------------------------
    def leaf(self, prefix: str, env: int, key: str | None) -> str:
        """Name of the stored leaf of ``key`` of env ``env`` (e.g. ``"obs.0"``, ``"obs.3.image"``)."""
        return f"{prefix}.{env}" if key is None else f"{prefix}.{env}.{key}"

    def leaves(self, prefix: str) -> list[tuple[str, spaces.Box]]:
        """``(leaf name, Box)`` of every env and key, env-major."""
        return [(self.leaf(prefix, e, k), storage_box(self.shape[k], self.dtype[k]))
                for e in range(self.n_envs) for k in self.keys]

    def env_space(self) -> gymnasium.Space:
        """Space of one env's stored observation: a Box, or a Dict of Boxes (SB3 shapes)."""
        if not self.is_dict:
            return storage_box(self.shape[None], self.dtype[None])
        return spaces.Dict([(k, storage_box(self.shape[k], self.dtype[k])) for k in self.keys])  # type: ignore[misc]

    # -- input --------------------------------------------------------------------------------
    def batch(self, obs: Any, n: int | None = None) -> PerKey:
        """SB3's normalisation of one ``add`` call's observations.

        Parameters
        ----------
        obs : ndarray (n, *obs_shape), or dict of those
            Discrete observations may come as ``(n,)``.  Values are cast to the stored dtype the
            way numpy assignment into SB3's arrays casts them.
        n : int, optional
            Leading dimension (default ``n_envs``).

        Returns
        -------
        dict
            ``{key: ndarray (n, *shape[key]) of dtype[key]}`` (views where no cast is needed).

        Raises
        ------
        BadValueError
            A shape that does not broadcast to ``(n, *obs_shape)``, or a missing Dict key.
        """
        if n is None and type(obs) is np.ndarray and self._as_is == (obs.shape, obs.dtype):
            return {None: obs}
        n = self.n_envs if n is None else n
        if self.is_dict:
            if not isinstance(obs, Mapping):
                raise BadValueError(f"expected a dict of observations with keys {self.keys}; got {type(obs).__name__}")
            missing = [k for k in self.keys if k not in obs]
            if missing:
                raise BadValueError(f"observation dict lacks keys {missing}; expected keys {self.keys}")
        out: PerKey = {}
        for k in self.keys:
            a = np.asarray(obs[k] if self.is_dict else obs)
            want = (n, *self.shape[k])
            if self.discrete[k] and a.size == n:
                a = a.reshape(want)
            if a.shape != want:
                try:
                    a = np.broadcast_to(a, want)
                except ValueError:
                    where = f"observation {k!r}" if k is not None else "observation"
                    raise BadValueError(f"{where} has shape {a.shape}; expected {want}") from None
            out[k] = a if a.dtype == self.dtype[k] else a.astype(self.dtype[k])
        return out

    def row_values(self, per_key: PerKey) -> list[np.ndarray]:
        """Env ``e``'s observation ``per_key[key][e]`` for every env and key, in the order of
        :meth:`leaves` (a row's observation leaves)."""
        if not self.is_dict:
            return list(per_key[None])  # its rows
        return [per_key[k][e] for e in range(self.n_envs) for k in self.keys]

    # -- output -------------------------------------------------------------------------------
    def empty(self, n: int) -> PerKey:
        """Uninitialised ``{key: (n, *shape)}`` arrays to scatter reads into."""
        return {k: np.empty((n, *self.shape[k]), self.dtype[k]) for k in self.keys}

    def zeros(self, n: int) -> PerKey:
        """Zeroed ``{key: (n, *shape[key]) of dtype[key]}`` arrays."""
        return {k: np.zeros((n, *self.shape[k]), self.dtype[k]) for k in self.keys}

    def wrap(self, per_key: PerKey) -> np.ndarray | dict[str, np.ndarray]:
        """The SB3 form: the array itself for a non-Dict space, else ``{key: array}``."""
        return dict(per_key) if self.is_dict else per_key[None]  # type: ignore[arg-type]

    def unwrap(self, value: Any) -> PerKey:
        """Inverse of :meth:`wrap`."""
        return {k: value[k] for k in self.keys} if self.is_dict else {None: value}
