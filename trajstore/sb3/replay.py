"""``ZarrReplayBuffer`` / ``ZarrDictReplayBuffer``: SB3's replay buffers with observations on disk.

Layout of ``cache_path``::

    sb3.json                 spaces, n_envs, per-env capacity, optimize_memory_usage
    transitions/             trajstore ReplayBuffer, a ring of ``buffer_size`` rows; row p is
                             SB3 position p of every env: obs.{env}[.{key}], next_obs.{env}[.{key}]
                             (not with optimize_memory_usage), action (n_envs, action_dim),
                             reward / done / timeout (n_envs,) float32, step () int64
    pending/                 optimize_memory_usage only: the next observation of the last row

Sampling draws exactly what SB3 draws (``batch_inds`` in ``sample``, ``env_indices`` in
``_get_samples``), so under one ``np.random`` seed the batches are bit-identical to SB3's.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, cast

import gymnasium
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, DictReplayBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import (
    DictReplayBufferSamples,
    ReplayBufferSamples,
)
from stable_baselines3.common.vec_env import VecNormalize

from trajstore.buffers.replay import ReplayBuffer as StoreBuffer
from trajstore.core.stager import RowStager
from trajstore.errors import BadOptionError, UnsupportedSpaceError
from trajstore.sampling.source import check_batch_size
from trajstore.sb3._base import PositionView, ZarrBufferMixin
from trajstore.sb3._inplace import InPlaceRows
from trajstore.sb3._layout import ObsLayout, scalar_box, storage_box
from trajstore.sb3._root import announce_new, announce_resume, building_algorithm, record_path, space_config

__all__ = ["ZarrReplayBuffer", "ZarrDictReplayBuffer"]

SMALL = ("action", "reward", "done", "timeout")  # stored leaf -> RAM array (see _small)


class ZarrReplayMixin(ZarrBufferMixin):
    """Everything of the two replay classes; they differ only in the observation space they take."""

    _main = "transitions"
    actions: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    timeouts: np.ndarray

    if TYPE_CHECKING:  # SB3's ReplayBuffer / BaseBuffer: the concrete classes derive from them after this mixin
        @staticmethod
        def _maybe_cast_dtype(dtype: np.typing.DTypeLike | None) -> np.typing.DTypeLike | None: ...
        @staticmethod
        def _normalize_obs(obs: np.ndarray | dict[str, np.ndarray],
                           env: VecNormalize | None = None) -> np.ndarray | dict[str, np.ndarray]: ...
        @staticmethod
        def _normalize_reward(reward: np.ndarray, env: VecNormalize | None = None) -> np.ndarray: ...

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
        cache_path: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        resume: bool | None = None,
        **storage_kwargs: Any,
    ) -> None:
        BaseBuffer.__init__(cast(BaseBuffer, self), buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self._check_space(observation_space, optimize_memory_usage)
        if optimize_memory_usage and handle_timeout_termination:
            raise ValueError("ReplayBuffer does not support optimize_memory_usage = True "
                             "and handle_timeout_termination = True simultaneously.")
        self.optimize_memory_usage = optimize_memory_usage
        self.handle_timeout_termination = handle_timeout_termination
        self._layout = ObsLayout(observation_space, n_envs)
        size, n = self.buffer_size, self.n_envs
        self.actions = np.zeros((size, n, self.action_dim), dtype=self._maybe_cast_dtype(action_space.dtype))
        self.rewards = np.zeros((size, n), dtype=np.float32)
        self.dones = np.zeros((size, n), dtype=np.float32)
        self.timeouts = np.zeros((size, n), dtype=np.float32)
        self._count = 0  # rows held (== buffer_size when full)
        self._head = 0  # position of the store's next row: ``pos`` unless pos was set by hand
        self._steps = 0  # transitions ever added (the ``step`` of the next row)
        self._step = np.zeros((), np.int64)
        self._obs_slots = [(k, e) for e in range(n) for k in self._layout.keys]  # obs leaves, in order
        # (shape, dtype) an add's obs has when it can be staged as it is: one Box leaf, one env's
        # frame per row (lay.batch's as-is case); a shape no array has otherwise
        self._frame: tuple[tuple[int, ...], np.dtype | None] = ((-1,), None)
        if len(self._obs_slots) == 1 and not self._layout.is_dict:
            self._frame = ((n, *self._layout.shape[None]), self._layout.dtype[None])
        self._stage: RowStager | None = None
        self._in_place: InPlaceRows | None = None  # observations stored straight into their chunk files
        self._stage_chosen = False  # _stage is chosen at the first add (HER wraps the store after __init__)
        self._pending = self._layout.zeros(n)  # next obs of the last row (optimize_memory_usage)
        self._pending_saved = -1
        self._last_done = b""  # dones of the last stored row, as stored
        self._commit_interval = float(storage_kwargs.get("commit_interval", 1.0))
        # When the oldest add not yet committed by add's timer was made (None: none since)
        self._oldest_add: float | None = None
        config = {**space_config(observation_space, action_space), "n_envs": n, "buffer_size": size,
                  "optimize_memory_usage": bool(optimize_memory_usage)}
        algo = building_algorithm()
        self._check_algorithm(algo)
        created = self._init_root(cache_path, storage_options, overwrite, config, ["transitions", "pending"],
                                  storage_kwargs, resume)
        record_path(algo, cache_path, self._root)
        try:
            self._rb = self._open_replay("transitions", self._row_space(), size, created)
            if optimize_memory_usage:
                self._pending_rb = self._open_replay("pending", self._pending_space(), 1, created, required=False)
            if created:
                self._finish_create()
            else:
                self._load_state()
        except BaseException:
            self._release()
            raise
        if created and not overwrite and resume is not False:
            announce_new(algo, type(self).__name__, self._root)
        if not created and self._count:  # an empty buffer carries nothing of an earlier run
            held = f"{self._count * n:,} transitions" + (f" ({self._count:,} positions x {n} envs)" if n > 1 else "")
            announce_resume(resume, type(self).__name__, self._root.path, held)

    def _check_algorithm(self, algo: Any | None) -> None:
        """Hook: refuse an algorithm this buffer cannot serve (``algo``: the model being set up, if any)."""

    # -- layout ---------------------------------------------------------------------------------
    @staticmethod
    def _check_space(observation_space: gymnasium.Space, optimize_memory_usage: bool) -> None:
        if isinstance(observation_space, spaces.Dict):
            raise UnsupportedSpaceError("ZarrReplayBuffer takes Box, Discrete, MultiDiscrete or MultiBinary "
                                        "observations; got a Dict space: use ZarrDictReplayBuffer")

    def _row_space(self) -> spaces.Dict:
        lay, n = self._layout, self.n_envs
        leaves = lay.leaves("obs") + ([] if self.optimize_memory_usage else lay.leaves("next_obs"))
        leaves += [("action", storage_box((n, self.action_dim), self.actions.dtype))]
        leaves += [(name, storage_box((n,), np.float32)) for name in SMALL[1:]]
        leaves += [("step", scalar_box(np.int64))]
        return spaces.Dict(leaves)

    def _pending_space(self) -> spaces.Dict:
        return spaces.Dict(self._layout.leaves("obs") + [("step", scalar_box(np.int64))])

    def _small(self) -> dict[str, np.ndarray]:
        return {"action": self.actions, "reward": self.rewards, "done": self.dones, "timeout": self.timeouts}

    # -- positions ----------------------------------------------------------------------------------
    @property
    def _offset(self) -> int:
        """Position of the oldest row (0 until the ring wraps; ``pos`` once full)."""
        return (self._head - self._count) % self.buffer_size

    def _logical_of(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logical = (positions - self._offset) % self.buffer_size
        return logical, logical < self._count

    def _load_state(self, read_pending: bool = True) -> None:
        """Rebuild pos, full and the RAM arrays from the committed rows (reopen)."""
        rb, size = self._rb, self.buffer_size
        count, offset = len(rb), rb.offset
        self._count, self.full, self.pos = count, count == size, (offset + count) % size
        self._head = self.pos
        if count:
            phys = (offset + np.arange(count)) % size
            for name, arr in self._small().items():
                arr[phys] = self._column(name)[:]
            self._steps = int(self._column("step")[count - 1]) + 1
            self._last_done = self.dones[(self.pos - 1) % size].tobytes()
        if self.optimize_memory_usage and count and read_pending:
            pr = self._pending_rb
            if len(pr) and int(pr.get_column(["step"])[0]) == self._steps - 1:
                row = pr[0]
                for k in self._layout.keys:
                    self._pending[k][:] = np.stack([row[self._layout.leaf("obs", e, k)] for e in range(self.n_envs)])
                self._pending_saved = self._steps - 1
            else:
                # Killed after the last row was committed but before its next observation was:
                # end that transition (as SB3's _setup_learn does) so its unknown next obs is never used.
                self.dones[(self.pos - 1) % size] = True

    # -- SB3 API ----------------------------------------------------------------------------------
    def add(self, obs: Any, next_obs: Any, action: np.ndarray, reward: np.ndarray, done: np.ndarray,
            infos: list[dict[str, Any]]) -> None:
        """Add one transition of every env (SB3's signature and semantics).

        Parameters
        ----------
        obs, next_obs : ndarray (n_envs, *obs_shape), or dict of those
            Stored in the observation space's dtype (Discrete: shape (n_envs,) is accepted).
        action : ndarray
            Reshaped to (n_envs, action_dim).
        reward, done : ndarray (n_envs,)
        infos : list of dict
            ``info["TimeLimit.truncated"]`` sets the timeout flag (``handle_timeout_termination``).
        """
        self._check_open()
        p, size = self.pos, self.buffer_size
        rewrite = p != self._head and self._align_head()  # pos was set by hand
        if self._count and self.dones[p - 1].tobytes() != self._last_done:  # (p - 1 = -1: the last position)
            # SB3's _setup_learn ended the last stored transition (dones[pos - 1] = True): store it now
            self._persist_edits(np.array([(p - 1) % size]))
        st = None if rewrite else self._stage if self._stage_chosen else self._adopt_stager()
        o, no = self._checked_obs(st, obs, next_obs)  # checked before anything is written
        if st is not None:
            st.room()  # (a block left full by a failed drain, a full disk, is written first)
            if st.n == 0 and self._in_place is not None:
                self._in_place.begin()  # a new block: its observations go straight into their rows
        self.actions[p] = np.asarray(action).reshape((self.n_envs, self.action_dim))
        self.rewards[p] = reward  # assignment casts as SB3's np.array(...) then assignment does
        self.dones[p] = done
        if self.handle_timeout_termination:
            self.timeouts[p] = [info.get("TimeLimit.truncated", False) for info in infos]
        if st is not None:
            self._stage_obs(st, obs, next_obs, o, no)
        else:
            assert o is not None and no is not None
            self._write_row(p, o, no, rewrite)
        if self.optimize_memory_usage:
            for k in self._layout.keys:
                self._pending[k][:] = next_obs if no is None else no[k]
        self._advance(p, rewrite)
        if st is not None:
            st.added(commit_timer=False)  # this method's own timer below commits
        self._commit_on_timer()

    def _checked_obs(self, st: Any, obs: Any, next_obs: Any) -> tuple[Any, Any]:
        """``add``'s observations as the layout's batches ``(o, no)``, checked; ``(None, None)`` when
        staged and both are arrays of the one Box leaf's stored shape and dtype (nothing to
        convert or check: the fast path)."""
        shape, dtype = self._frame
        if (st is not None and type(obs) is np.ndarray and type(next_obs) is np.ndarray and obs.shape == shape
                and next_obs.shape == shape and obs.dtype is dtype and next_obs.dtype is dtype):
            return None, None
        return self._layout.batch(obs), self._layout.batch(next_obs)

    def _stage_obs(self, st: Any, obs: Any, next_obs: Any, o: Any, no: Any) -> None:
        """Stage the observations of ``add``'s row in ``st``'s next slot.

        Only the observations are staged (with _in_place: bufs view their rows in the chunk files);
        the other leaves come from the RAM arrays when the block is handed over (_fill_staged), so
        the row is counted before any hand-over (a hand-over that fails keeps it staged and counted)."""
        j, bufs = st.n, st.bufs
        if o is None:
            bufs[0][j] = obs[0]
            if not self.optimize_memory_usage:
                bufs[1][j] = next_obs[0]
            return
        for b, (k, e) in enumerate(self._obs_slots):
            bufs[b][j] = o[k][e]
        if not self.optimize_memory_usage:
            m = len(self._obs_slots)
            for b, (k, e) in enumerate(self._obs_slots):
                bufs[m + b][j] = no[k][e]

    def _write_row(self, p: int, o: Any, no: Any, rewrite: bool) -> None:
        """Write ``add``'s row at position ``p`` without a stager: rewritten in place (``rewrite``)
        or appended, leaf by leaf in the order of _row_space (obs, next_obs, action, reward, done,
        timeout, step)."""
        values = self._layout.row_values(o)
        if not self.optimize_memory_usage:
            values += self._layout.row_values(no)
        if rewrite:
            rows = self._rows_at(np.array([p]), [v[None] for v in values])
            self._stores[self._main].set_at(self._logical_of(np.array([p]))[0], rows)
        else:
            self._step[...] = self._steps
            values += [self.actions[p], self.rewards[p], self.dones[p], self.timeouts[p], self._step]
            self._rb.append_leaves(values)

    def _advance(self, p: int, rewrite: bool) -> None:
        """After ``add`` wrote position ``p``: the step count, ``full``, ``pos`` and (unless it
        rewrote a stored row) the row count, the store's head and the last ``done`` seen."""
        size = self.buffer_size
        if not rewrite:
            self._last_done = self.dones[p].tobytes()
        self._steps += 1
        if rewrite:
            self.full = self.full or p + 1 == size  # SB3: full once pos wraps
        elif self._count < size:
            self._count += 1
            self.full = self._count == size
        self.pos = p + 1 if p + 1 < size else 0
        if not rewrite:
            self._head = self.pos

    def _commit_on_timer(self) -> None:
        """Commit once ``commit_interval`` has passed since the oldest add not yet committed.

        trajstore stages single-row appends in RAM (up to 256 rows) and commits on its timer only
        when they are handed over; commit here so a crash loses at most commit_interval of adds.
        Timed from the oldest add since, not from the last commit: the first add after a pause
        (reopening, a long training step) commits nothing but itself otherwise."""
        now = time.monotonic()
        if self._oldest_add is None:
            self._oldest_add = now
        elif now - self._oldest_add >= self._commit_interval:
            self._rb.flush()
            self._oldest_add = None

    def _align_head(self) -> bool:
        """Prepare an ``add`` at a ``pos`` set by hand (SB3 writes there): True when ``pos`` holds a
        stored row, which the add rewrites in place; otherwise the positions from the store's next
        row up to ``pos`` get rows of zeros (as SB3's preallocated arrays hold there) and the add
        appends at ``pos``.

        Raises
        ------
        BadOptionError
            With ``optimize_memory_usage`` (the next observation of a row is the next row's).
        """
        if self.optimize_memory_usage:
            raise BadOptionError(f"{type(self).__name__}: pos was set by hand to {self.pos} (the next row goes to "
                                 f"{self._head}); not supported with optimize_memory_usage=True")
        p, size = self.pos, self.buffer_size
        store = self._stores[self._main]
        store.flush()  # staged rows are handed over at the positions they were added at
        if self._logical_of(np.array([p]))[1][0]:
            return True
        k = (p - self._head) % size  # empty positions only: the held ones end at _head - 1
        store.extend(self._rows_at((self._head + np.arange(k)) % size, None))
        self._steps += k
        self._count += k
        self._head = p
        self._last_done = self.dones[(p - 1) % size].tobytes()
        return False

    def _rows_at(self, positions: np.ndarray, obs_leaves: list[np.ndarray] | None) -> dict[str, np.ndarray]:
        """Store rows for SB3 ``positions`` (k,): the observation leaves given ((k, *leaf shape)
        each, in the order of ``_row_space``; None: zeros), the RAM fields at those positions and
        consecutive steps from the next one."""
        space, lay, k = self._row_space().spaces, self._layout, len(positions)
        names = [n for n, _ in lay.leaves("obs")] + ([] if self.optimize_memory_usage else
                                                       [n for n, _ in lay.leaves("next_obs")])
        boxes = [cast(spaces.Box, space[n]) for n in names]
        rows = {n: (np.zeros((k, *box.shape), box.dtype) if obs_leaves is None else obs_leaves[i])
                for i, (n, box) in enumerate(zip(names, boxes))}
        rows.update({name: arr[positions] for name, arr in self._small().items()})
        rows["step"] = self._steps + np.arange(k, dtype=np.int64)
        return rows

    def _adopt_stager(self) -> RowStager | None:
        """The row stager of the ``transitions`` store, when ``add`` may stage observations into it
        directly and leave the other leaves to :meth:`_fill_staged`; None where rows go through
        ``append_leaves`` (a wrapped store, e.g. HER's, which appends a leaf of its own, or a
        store that does not stage rows: multiprocessing, read-only)."""
        rb = self._rb
        st = rb.row_stager() if type(rb) is StoreBuffer else None
        n_obs = len(self._obs_slots) * (1 if self.optimize_memory_usage else 2)
        if st is None or len(st.bufs) != n_obs + len(SMALL) + 1:
            st = None
        else:
            st.fill = self._fill_staged
            self._in_place = InPlaceRows.of(st, range(n_obs))
        self._stage, self._stage_chosen = st, True
        return st

    def _fill_staged(self, bufs: list[np.ndarray], n: int) -> None:
        """Rows ``[0, n)`` of the staged leaves after the observations (action, reward, done,
        timeout: (n, n_envs, ...) from the RAM arrays; step: (n,) int64) for the last ``n`` adds."""
        at = (self._head - n + np.arange(n)) % self.buffer_size
        first = len(bufs) - len(SMALL) - 1
        for b, arr in zip(bufs[first:], self._small().values()):
            np.take(arr, at, axis=0, out=b[:n])
        bufs[-1][:n] = np.arange(self._steps - n, self._steps)

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> Any:
        """``batch_size`` transitions; draws ``np.random`` exactly as SB3's ``sample``.

        Returns
        -------
        ReplayBufferSamples (DictReplayBufferSamples for Dict observations)
            observations, next_observations (B, *obs_shape) in the obs dtype; actions (B,
            action_dim); dones = done * (1 - timeout) and rewards (B, 1) float32.

        Raises
        ------
        BadOptionError
            ``batch_size`` is not an int >= 0 (a ``ValueError``, as numpy's is in SB3's ``sample``).
        """
        self._check_open()
        check_batch_size(batch_size, "sample")  # before any draw: np.random's state is SB3's
        size = self.buffer_size
        if not self.full and self._count < size and self._offset != 0:
            # Only after reopening a store killed while full: rows offset .. offset+count-1.
            batch_inds = (self._offset + np.random.randint(0, self._count, size=batch_size)) % size
        elif not self.optimize_memory_usage:
            batch_inds = np.random.randint(0, size if self.full else self.pos, size=batch_size)
        elif self.full:  # never the row at pos: its next observation was overwritten
            batch_inds = (np.random.randint(1, size, size=batch_size) + self.pos) % size
        else:
            batch_inds = np.random.randint(0, self.pos, size=batch_size)
        return self._get_samples(batch_inds, env=env)

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> Any:
        """Transitions at positions ``batch_inds`` (B,), each from an env drawn here as SB3 does."""
        env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        lay = self._layout
        logical, _ = self._logical_of(batch_inds)
        obs = lay.wrap(self._gather("obs", logical, env_indices))
        if self.optimize_memory_usage:
            nxt = (batch_inds + 1) % self.buffer_size
            pending = nxt == self._head
            rows, _ = self._logical_of(np.where(pending, batch_inds, nxt))
            per_key = self._gather("obs", rows, env_indices)
            if pending.any():
                for k in lay.keys:
                    per_key[k][pending] = self._pending[k][env_indices[pending]]
            next_obs = lay.wrap(per_key)
        else:
            next_obs = lay.wrap(self._gather("next_obs", logical, env_indices))
        next_obs = self._normalize_obs(next_obs, env)
        obs = self._normalize_obs(obs, env)
        actions = self.actions[batch_inds, env_indices, :]
        dones = (self.dones[batch_inds, env_indices] * (1 - self.timeouts[batch_inds, env_indices])).reshape(-1, 1)
        rewards = self._normalize_reward(self.rewards[batch_inds, env_indices].reshape(-1, 1), env)
        # Every array here is a fresh private copy (gathered or computed), so tensors can share
        # its memory instead of copying it once more (SB3's to_torch copies; values are the same).
        t = self._tensor
        if lay.is_dict:
            return DictReplayBufferSamples(
                observations={k: t(v) for k, v in obs.items()},  # type: ignore[union-attr]
                actions=t(actions),
                next_observations={k: t(v) for k, v in next_obs.items()},  # type: ignore[union-attr]
                dones=t(dones),
                rewards=t(rewards),
            )
        return ReplayBufferSamples(*tuple(map(t, (obs, actions, next_obs, dones, rewards))))

    def reset(self) -> None:
        """Empty the buffer (the store is cleared at once)."""
        self._check_open()
        self._rb.clear()
        for arr in self._small().values():
            arr[:] = 0
        for k in self._layout.keys:
            self._pending[k][:] = 0
        self._count = self.pos = self._head = 0
        self.full = False

    def size(self) -> int:
        """Transitions stored per env (SB3's ``size()``: ``buffer_size`` once full)."""
        return self._count

    # -- stored observations ---------------------------------------------------------------------
    @property
    def observations(self) -> PositionView | dict[str, PositionView]:
        """Read-only (buffer_size, n_envs, *obs_shape) view of the stored observations."""
        return self._views("obs")

    @property
    def next_observations(self) -> PositionView | dict[str, PositionView]:
        """Read-only view of the next observations (absent with optimize_memory_usage, as in SB3)."""
        if self.optimize_memory_usage:
            raise AttributeError("with optimize_memory_usage, next observations live in `observations` (as in SB3)")
        return self._views("next_obs")

    def _patch_grid(self, prefix: str, key: str | None, positions: np.ndarray, out: np.ndarray) -> None:
        if self.optimize_memory_usage and prefix == "obs" and self._count:
            out[positions == self._head] = self._pending[key]

    # -- committing --------------------------------------------------------------------------------
    def _before_commit(self) -> None:
        """Write RAM edits of stored rows (SB3's ``dones[pos] = True``) and the pending obs."""
        self._persist_edits()
        if self.optimize_memory_usage and self._count and self._pending_saved != self._steps - 1:
            step = np.asarray(self._steps - 1, np.int64)  # leaves in the order of _pending_space
            self._pending_rb.append_leaves(self._layout.row_values(self._pending) + [step])
            self._pending_saved = self._steps - 1

    def _persist_edits(self, positions: np.ndarray | None = None) -> None:
        """Rewrite stored rows (all, or those at ``positions``) whose RAM fields were edited."""
        if not self._count:
            return
        if positions is None:
            logical = np.arange(self._count)
            phys = (self._offset + logical) % self.buffer_size
        else:
            phys = positions
            logical, _ = self._logical_of(positions)
        changed = np.zeros(len(logical), bool)
        rows_read = slice(None) if positions is None else logical
        for name, arr in self._small().items():
            stored, mine = self._column(name)[rows_read], arr[phys]
            changed |= (stored.view(np.uint8) != mine.view(np.uint8)).reshape(len(logical), -1).any(axis=1)
        if changed.any():
            rows = logical[changed]
            batch = self._rb[rows]
            for name, arr in self._small().items():
                batch[name] = arr[phys[changed]]
            self._rb.set_at(rows, batch)

    # -- pickling ----------------------------------------------------------------------------------
    def _ctor_kwargs(self) -> dict[str, Any]:
        return dict(optimize_memory_usage=self.optimize_memory_usage,
                    handle_timeout_termination=self.handle_timeout_termination)

    @classmethod
    def _sizes_from_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return dict(buffer_size=cfg["buffer_size"] * cfg["n_envs"], n_envs=cfg["n_envs"])

    @classmethod
    def _options_from_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The recorded ``optimize_memory_usage`` (a bool; anything else is left to the
        constructor's check against ``sb3.json``); with it, ``handle_timeout_termination=False``,
        the only value SB3 allows alongside it."""
        saved = cfg.get("optimize_memory_usage")
        if not isinstance(saved, bool):
            return {}
        return {"optimize_memory_usage": True, "handle_timeout_termination": False} if saved else \
            {"optimize_memory_usage": False}

    def _snapshot(self) -> dict[str, Any]:
        self.flush()
        return {"rows": self._rb[:] if self._count else None, "offset": self._offset, "steps": self._steps,
                "pending": {k: v.copy() for k, v in self._pending.items()}}

    def _restore(self, snap: dict[str, Any]) -> None:
        rows = snap["rows"]
        if rows is not None:
            offset = snap["offset"]
            if offset:  # full ring whose oldest row sits at `offset`: keep that position
                self._rb.extend({k: np.zeros((offset, *v.shape[1:]), v.dtype) for k, v in rows.items()})
            self._rb.extend(rows)
        self._load_state(read_pending=False)
        self._steps = snap["steps"]
        for k, v in snap["pending"].items():
            self._pending[k][:] = v


# (observations / next_observations: read-only views here, arrays in SB3's class)
class ZarrReplayBuffer(ZarrReplayMixin, ReplayBuffer):  # type: ignore[misc]
    """SB3's ``ReplayBuffer`` with observations and next observations in a trajstore store.

    Same constructor as SB3's, plus keyword-only storage arguments.  Capacity per env is
    ``max(buffer_size // n_envs, 1)``; ``optimize_memory_usage`` and
    ``handle_timeout_termination`` behave as in SB3.  ``actions`` (buffer_size, n_envs,
    action_dim), ``rewards``, ``dones``, ``timeouts`` (buffer_size, n_envs) float32 are RAM
    arrays (SB3's shapes and dtypes) stored with every row; in-place edits of stored rows are
    written at the next :meth:`flush` (the ``dones[pos - 1] = True`` of SB3's ``_setup_learn``
    already at the next ``add``).

    Parameters
    ----------
    buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage, handle_timeout_termination
        As in ``stable_baselines3.common.buffers.ReplayBuffer``.
    cache_path : str or path-like, optional
        Folder or fsspec URL of the buffer.  An existing buffer there is reopened (its spaces,
        n_envs, capacity and optimize_memory_usage must match) with every committed
        transition, so ``SAC.load`` continues where the saved run stopped (see ``resume``).
        ``None``: a temporary folder deleted by :meth:`close`.
    storage_options : dict, optional
        fsspec options for URLs.
    overwrite : bool
        Replace an existing buffer at ``cache_path`` instead of reopening it.
    resume : bool or None
        What to do with an existing buffer at ``cache_path``: ``True`` reopens it, ``False``
        refuses it (``StoreExistsError``), ``None`` (default) reopens it with a
        ``ResumedBufferWarning`` naming the transitions found, so a rerun script never trains a
        new model on an earlier run's data unawares.  Ignored when nothing is there yet.
    **storage_kwargs
        trajstore storage options: ``chunk_rows``, ``compressor`` (fixed at creation),
        ``fsync``, ``commit_interval`` (seconds between automatic commits, default 1).

    Examples
    --------
    >>> model = SAC("MlpPolicy", env, replay_buffer_class=ZarrReplayBuffer,
    ...             replay_buffer_kwargs=dict(cache_path="runs/sac_buffer"))  # doctest: +SKIP
    """

    KIND = "ZarrReplayBuffer"


class ZarrDictReplayBuffer(ZarrReplayMixin, DictReplayBuffer):  # type: ignore[misc]  # (as ZarrReplayBuffer)
    """SB3's ``DictReplayBuffer`` with every observation key in a trajstore store.

    Same arguments as :class:`ZarrReplayBuffer`; the observation space must be a Dict and
    ``optimize_memory_usage`` is not supported (as in SB3).  Samples are
    ``DictReplayBufferSamples``.
    """

    KIND = "ZarrDictReplayBuffer"

    @staticmethod
    def _check_space(observation_space: gymnasium.Space, optimize_memory_usage: bool) -> None:
        if not isinstance(observation_space, spaces.Dict):
            raise UnsupportedSpaceError(f"ZarrDictReplayBuffer needs a Dict observation space; got {observation_space}: "
                                        "use ZarrReplayBuffer")
        if optimize_memory_usage:
            raise ValueError("DictReplayBuffer does not support optimize_memory_usage")
