"""Prioritized experience replay for stable-baselines3: ``ZarrPrioritizedReplayBuffer``,
``ZarrPrioritizedDictReplayBuffer`` and ``PrioritizedDQN``.

The buffers are :class:`~trajstore.sb3.replay.ZarrReplayBuffer` /
:class:`~trajstore.sb3.replay.ZarrDictReplayBuffer` (same folder layout, same constructor plus
``alpha``, ``beta``, ``eps``, ``beta_final``) whose ``sample`` draws positions with a
:class:`~trajstore.sampling.PrioritizedSampler` over the buffer's trajstore store (``_rb``,
folder ``transitions/``).  The priorities persist in that store's sidecar
(``transitions/trajstore.priorities``), so ``save_replay_buffer`` / ``load_replay_buffer``,
``DQN.load`` and a reopen after a crash sample with the stored priorities.

Rows and positions
------------------
The sampler returns the store's *logical* rows ``0 .. size() - 1``, oldest first.  Logical row
``i`` is SB3 position ``(offset + i) % buffer_size``, where ``offset`` is the position of the
oldest row (0 until the ring wraps, ``pos`` once full, and anything after reopening a buffer
killed while full: see ``ZarrReplayBuffer._offset``).  A row holds the transitions of every env at
that position, so with ``n_envs > 1`` the priority belongs to the position: the env of each
sampled transition is drawn uniformly (``np.random``, as SB3 does), which keeps the importance
weights exact for the distribution sampled, and an update sets the position's priority.

Every stored row is a valid transition, also with ``optimize_memory_usage`` (the newest row's next
observation is kept apart, as in ``ZarrReplayBuffer``), so unlike SB3's uniform sampling no
position is skipped.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

import numpy as np
import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3 import DQN
from stable_baselines3.common.vec_env import VecNormalize

from trajstore.core.store import in_zarr_loop
from trajstore.errors import BadOptionError
from trajstore.sampling.prioritized import PrioritizedSampler
from trajstore.sb3.replay import ZarrDictReplayBuffer, ZarrReplayBuffer, ZarrReplayMixin

__all__ = ["PrioritizedReplayBufferSamples", "ZarrPrioritizedReplayBuffer", "ZarrPrioritizedDictReplayBuffer",
           "PrioritizedDQN"]


class PrioritizedReplayBufferSamples(NamedTuple):
    """A prioritized batch: SB3's ``ReplayBufferSamples`` fields, then ``weights`` and ``indices``.

    Attributes
    ----------
    observations, next_observations : torch.Tensor or dict of torch.Tensor
        (B, *obs_shape) in the observation space's dtype (a dict of those for Dict spaces).
    actions : torch.Tensor
        (B, action_dim); Discrete actions int64.
    dones, rewards : torch.Tensor
        (B, 1) float32; ``dones`` is ``done * (1 - timeout)``.
    discounts : None
        Always None (1-step returns), as SB3's ``ReplayBuffer`` gives.
    weights : torch.Tensor
        (B, 1) float32 importance weights ``(N * P(i)) ** -beta / max over the batch``, in (0, 1].
    indices : numpy.ndarray
        (B,) int64 logical rows to pass to ``update_priorities``.
    """

    observations: Any
    actions: th.Tensor
    next_observations: Any
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    indices: np.ndarray


class _IndexRows:
    """What the sampler sees of the store: its rows, sidecar location and commits, but no reads.

    ``get_at`` returns None instead of the rows: the buffer gathers only the sampled env's
    observations itself (a row holds every env's), so nothing is read twice.
    """

    def __init__(self, rb: Any) -> None:
        self._rb = rb
        self.read_only = rb.read_only
        self.cache_path = rb.cache_path
        self.storage_options = rb.storage_options

    def row_source(self) -> Any:
        return self._rb.row_source()

    def get_at(self, idx: np.ndarray) -> None:
        return None

    def flush(self, fsync: bool | None = None) -> None:
        self._rb.flush(fsync)


class _PrioritizedMixin(ZarrReplayMixin):
    """Prioritized sampling on top of the Zarr replay classes (mixed in before them)."""

    _sampler: PrioritizedSampler

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: Any = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        beta_final: float | None = None,
        cache_path: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        resume: bool | None = None,
        **storage_kwargs: Any,
    ) -> None:
        if beta_final is not None and (isinstance(beta_final, bool) or not isinstance(beta_final, (int, float))
                                       or not 0 <= beta_final):
            raise BadOptionError(f"{type(self).__name__}: beta_final must be None or a float >= 0; got {beta_final!r}")
        super().__init__(buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
                         handle_timeout_termination, cache_path=cache_path, storage_options=storage_options,
                         overwrite=overwrite, resume=resume, **storage_kwargs)
        try:
            self._sampler = PrioritizedSampler(_IndexRows(self._rb), alpha=alpha, beta=beta, eps=eps)
        except BaseException:
            self._release()
            raise
        self.beta_initial = float(beta)
        self.beta_final = None if beta_final is None else float(beta_final)
        self._gen: np.random.Generator | None = None

    def _check_algorithm(self, algo: Any | None) -> None:
        """Refuse a model whose training never calls :meth:`update_priorities` (SAC, TD3, DQN...):
        every priority would stay equal and it would train on uniform samples without a word."""
        if algo is not None and not getattr(algo, "updates_priorities", False):
            raise BadOptionError(
                f"{type(self).__name__} needs an algorithm that updates priorities; {type(algo).__name__}'s train() "
                "never calls update_priorities, so it would sample uniformly.  Use trajstore.sb3.PrioritizedDQN, "
                f"or subclass {type(algo).__name__} so that train() passes each batch's indices and |TD error| to "
                "replay_buffer.update_priorities (and weights its loss by batch.weights), and set the class "
                "attribute updates_priorities = True")

    # -- parameters ----------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        """Priority exponent: ``P(i)`` is proportional to ``(priority_i + eps) ** alpha``."""
        return self._sampler.alpha

    @property
    def eps(self) -> float:
        """Added to every priority before the exponent."""
        return self._sampler.eps

    @property
    def beta(self) -> float:
        """Importance-sampling exponent of the next :meth:`sample` (may be set)."""
        return self._sampler.beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._sampler.beta = float(value)

    @property
    def sampler(self) -> PrioritizedSampler:
        """The :class:`~trajstore.sampling.PrioritizedSampler` over the store (its logical rows)."""
        return self._sampler

    def anneal_beta(self, progress: float) -> float:
        """Set ``beta`` linearly from its initial value (``progress`` 0) to ``beta_final``
        (``progress`` 1); nothing changes when ``beta_final`` is None.

        Parameters
        ----------
        progress : float
            Fraction of training done, clipped to [0, 1] (``PrioritizedDQN`` passes
            ``1 - _current_progress_remaining`` before every ``train``).

        Returns
        -------
        float
            ``beta`` now.
        """
        if self.beta_final is not None:
            p = min(1.0, max(0.0, float(progress)))
            self._sampler.beta = (1.0 - p) * self.beta_initial + p * self.beta_final
        return self._sampler.beta

    # -- sampling ------------------------------------------------------------------------------
    def positions_of(self, indices: Any) -> np.ndarray:
        """SB3 positions of logical rows ``indices`` (as :meth:`sample` returns them).

        Parameters
        ----------
        indices : array-like of int
            (B,) logical rows ``0 .. size() - 1``, oldest first.

        Returns
        -------
        numpy.ndarray
            (B,) int64 positions into ``actions``, ``rewards``, ``dones``, ``observations``...
        """
        return (self._offset + np.asarray(indices, dtype=np.int64)) % self.buffer_size

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> PrioritizedReplayBufferSamples:
        """``batch_size`` transitions drawn with probability ``P(i)``, with importance weights.

        Rows are drawn by the sampler's own generator (seeded from ``np.random`` at the first
        call, so a run seeded with ``set_random_seed`` is reproducible); the env of each row is
        drawn with ``np.random`` as SB3 does.

        Parameters
        ----------
        batch_size : int
            Transitions to draw (with replacement), > 0.
        env : VecNormalize, optional
            Normalizes observations and rewards, as in SB3.

        Returns
        -------
        PrioritizedReplayBufferSamples
            SB3's fields (see ``ZarrReplayBuffer.sample``), ``weights`` (B, 1) float32 tensor
            and ``indices`` (B,) int64 logical rows for :meth:`update_priorities`.

        Raises
        ------
        EmptyBufferError
            The buffer holds no transition.
        """
        self._check_open()
        if self._gen is None:
            self._gen = np.random.default_rng(np.random.randint(0, 2**31 - 1))
        _, indices, weights = self._sampler.sample(batch_size, rng=self._gen)
        base = self._get_samples(self.positions_of(indices), env=env)
        w = self._tensor(np.asarray(weights, np.float32).reshape(-1, 1))
        obs, actions, next_obs, dones, rewards = base[:5]
        return PrioritizedReplayBufferSamples(obs, actions, next_obs, dones, rewards, None, w, indices)

    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set the priorities of the rows of the last :meth:`sample` (e.g. ``|TD error|``).

        Parameters
        ----------
        indices : array-like of int
            (B,) the ``indices`` of the last sample (numpy, list or torch).
        priorities : array-like of float
            (B,) finite values >= 0 (numpy or torch, any float dtype); ``eps`` is added when
            sampling.

        Raises
        ------
        BadValueError
            A priority is negative, NaN, infinite or beyond float32's range, or their number
            differs from the indices'.
        IndexOutOfRangeError
            An index outside the rows the sample saw.
        """
        self._check_open()
        if isinstance(priorities, th.Tensor):
            priorities = priorities.detach().cpu().numpy()
        self._sampler.update_priorities(indices, np.asarray(priorities).reshape(-1))

    def priorities(self) -> np.ndarray:
        """Priorities of every position now (as given to :meth:`update_priorities`, before ``eps``).

        Returns
        -------
        numpy.ndarray
            (buffer_size,) float32; 0 at positions holding no transition.
        """
        self._check_open()
        out = np.zeros(self.buffer_size, np.float32)
        n = len(self._sampler)
        if n:
            out[self.positions_of(np.arange(n))] = self._sampler.priorities(np.arange(n))
        return out

    # -- committing ----------------------------------------------------------------------------
    def flush(self, fsync: bool = False) -> None:
        """Commit the transitions (see ``ZarrReplayBuffer.flush``), then the priorities."""
        super().flush(fsync)
        if fsync or self._sampler.changed():  # (at exit, after the sampler's own exit flush: no IO)
            self._sampler.flush(fsync)

    def _release(self, strict: bool = False) -> None:
        sampler = self.__dict__.get("_sampler")
        if sampler is not None:
            try:
                sampler.close()  # writes the priorities (the stores are still open)
            except Exception:
                if strict:
                    raise
        super()._release(strict)

    def __del__(self) -> None:
        if sys.is_finalizing() or in_zarr_loop():
            # Exiting (the exit hooks commit), or collected in zarr's IO thread, where a commit
            # would wait on this very loop: the stores and the sampler release without writing.
            return
        super().__del__()

    def reset(self) -> None:
        """Empty the buffer; every priority goes with its row."""
        super().reset()
        self._sampler.max_priority = 1.0

    # -- pickling ------------------------------------------------------------------------------
    def _ctor_kwargs(self) -> dict[str, Any]:
        return dict(super()._ctor_kwargs(), alpha=self.alpha, beta=self.beta, eps=self.eps,
                    beta_final=self.beta_final)

    def _snapshot(self) -> dict[str, Any]:
        snap = super()._snapshot()
        n = len(self._sampler)
        snap["priorities"] = self._sampler.priorities(np.arange(n)) if n else None
        snap["max_priority"] = self._sampler.max_priority
        snap["beta_initial"] = self.beta_initial
        return snap

    def _restore(self, snap: dict[str, Any]) -> None:
        super()._restore(snap)
        self._sampler.max_priority = float(snap["max_priority"])
        if snap["priorities"] is not None:
            self._sampler.update_priorities(np.arange(len(snap["priorities"])), snap["priorities"])
        self.beta_initial = float(snap["beta_initial"])


class ZarrPrioritizedReplayBuffer(_PrioritizedMixin, ZarrReplayBuffer):  # type: ignore[misc]  # (as ZarrReplayBuffer)
    """:class:`~trajstore.sb3.replay.ZarrReplayBuffer` with prioritized sampling (Schaul et al. 2016).

    ``sample`` draws transitions with probability ``P(i) = (p_i + eps) ** alpha / sum`` and
    returns :class:`PrioritizedReplayBufferSamples` (SB3's fields plus ``weights`` and
    ``indices``); :meth:`update_priorities` sets new priorities.  New transitions enter with the
    largest priority seen so far.  Priorities are stored with the buffer
    (``<cache_path>/transitions/trajstore.priorities``): every ``flush`` (automatically at least
    every second while priorities are updated), ``close``, ``save_replay_buffer`` and the process's
    exit write them, and a reopened buffer samples with them.

    Parameters
    ----------
    buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage, handle_timeout_termination
        As in ``stable_baselines3.common.buffers.ReplayBuffer``.
    alpha : float
        Priority exponent (0: uniform).
    beta : float
        Importance-sampling exponent (0: every weight 1); the attribute may be changed.
    eps : float
        Added to every priority, so a transition of priority 0 is still drawn now and then.
    beta_final : float, optional
        When given, :meth:`anneal_beta` (called by ``PrioritizedDQN`` before every training
        round) moves ``beta`` linearly from ``beta`` to ``beta_final`` over the training.
    cache_path, storage_options, overwrite, resume, **storage_kwargs
        As in :class:`~trajstore.sb3.replay.ZarrReplayBuffer` (``cache_path=None``: a
        temporary folder deleted by ``close``).

    Examples
    --------
    >>> model = PrioritizedDQN("MlpPolicy", "CartPole-v1",
    ...                        replay_buffer_kwargs=dict(cache_path="runs/per", alpha=0.6))  # doctest: +SKIP
    """

    KIND = "ZarrPrioritizedReplayBuffer"


class ZarrPrioritizedDictReplayBuffer(_PrioritizedMixin, ZarrDictReplayBuffer):  # type: ignore[misc]
    """:class:`ZarrPrioritizedReplayBuffer` for Dict observation spaces (no
    ``optimize_memory_usage``, as in SB3); observations are dicts of tensors."""

    KIND = "ZarrPrioritizedDictReplayBuffer"


class PrioritizedDQN(DQN):
    """SB3's ``DQN`` trained on prioritized replay.

    Every argument of ``stable_baselines3.DQN`` works as there.  ``replay_buffer_class``
    defaults to :class:`ZarrPrioritizedReplayBuffer` (:class:`ZarrPrioritizedDictReplayBuffer`
    for Dict observations); ``replay_buffer_kwargs`` take its arguments (``cache_path``: a
    folder that persists the buffer and its priorities; ``None``, the default, a temporary
    folder deleted when the buffer closes; ``alpha``, ``beta``, ``eps``, ``beta_final``).

    ``train`` is SB3's DQN ``train`` except for the loss and one call: the elementwise Huber
    (smooth L1) loss is multiplied by the importance weights before the mean, and the sampled
    transitions' priorities become ``|TD error|`` (the sampler adds ``eps``).  Before every
    training round ``beta`` is annealed towards ``beta_final`` when that is given.
    Gradient clipping, target updates and the logged keys are SB3's.

    ``updates_priorities = True`` is what the prioritized buffers check when a model sets them up:
    an algorithm whose ``train`` never calls ``update_priorities`` is refused (``BadOptionError``).
    """

    #: ``train`` calls ``replay_buffer.update_priorities`` (see ``_PrioritizedMixin._check_algorithm``).
    updates_priorities = True

    def _setup_model(self) -> None:
        if self.replay_buffer_class is None:
            dict_obs = isinstance(self.observation_space, spaces.Dict)
            self.replay_buffer_class = ZarrPrioritizedDictReplayBuffer if dict_obs else ZarrPrioritizedReplayBuffer
        elif not callable(getattr(self.replay_buffer_class, "update_priorities", None)):
            raise BadOptionError(f"PrioritizedDQN needs a prioritized replay buffer (ZarrPrioritizedReplayBuffer or "
                                 f"ZarrPrioritizedDictReplayBuffer, or a class with update_priorities); got "
                                 f"replay_buffer_class={self.replay_buffer_class.__name__}")
        super()._setup_model()

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """``gradient_steps`` updates on prioritized batches of ``batch_size`` (see the class)."""
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        buffer: Any = self.replay_buffer
        anneal = getattr(buffer, "anneal_beta", None)
        if anneal is not None:
            anneal(1.0 - self._current_progress_remaining)

        losses = []
        for _ in range(gradient_steps):
            replay_data = buffer.sample(batch_size, env=self._vec_normalize_env)
            discounts = replay_data.discounts if replay_data.discounts is not None else self.gamma

            with th.no_grad():
                next_q_values = self.q_net_target(replay_data.next_observations)
                next_q_values, _ = next_q_values.max(dim=1)
                next_q_values = next_q_values.reshape(-1, 1)
                target_q_values = replay_data.rewards + (1 - replay_data.dones) * discounts * next_q_values

            current_q_values = self.q_net(replay_data.observations)
            current_q_values = th.gather(current_q_values, dim=1, index=replay_data.actions.long())

            # Huber loss per transition, weighted by the importance weights (B, 1), then the mean.
            elementwise = F.smooth_l1_loss(current_q_values, target_q_values, reduction="none")
            loss = (replay_data.weights * elementwise).mean()
            losses.append(loss.item())
            td_errors = (current_q_values.detach() - target_q_values).abs().reshape(-1)
            buffer.update_priorities(replay_data.indices, td_errors)

            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()

        self._n_updates += gradient_steps

        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))
