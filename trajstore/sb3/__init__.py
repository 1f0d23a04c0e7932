"""stable-baselines3 integration: disk-backed replay and rollout buffers.

- :class:`ZarrReplayBuffer`, :class:`ZarrDictReplayBuffer`: SB3's replay buffers (SAC, TD3,
  DDPG, DQN) with observations in a trajstore store under ``cache_path``; reopened (not
  truncated) when the same ``cache_path`` is used again, e.g. by ``SAC.load`` (``resume=True``
  says that is wanted; without it a :class:`ResumedBufferWarning` names the data found).
- :class:`ZarrRolloutBuffer`, :class:`ZarrDictRolloutBuffer`: SB3's rollout buffers (PPO, A2C)
  with the rollout's observations on disk and an optional history of every rollout.
- :class:`DummyVecRolloutBuffer`: a rollout facade that gives every env its own sub-buffer.
- :class:`ZarrNStepReplayBuffer`, :class:`ZarrHerReplayBuffer`: SB3's ``NStepReplayBuffer`` and
  ``HerReplayBuffer`` on disk (HER's episode bookkeeping survives a restart).
- :class:`ZarrPrioritizedReplayBuffer` (:class:`ZarrPrioritizedDictReplayBuffer`) and
  :class:`PrioritizedDQN`: prioritized replay with the priorities kept in the store.

Under one ``np.random`` seed they return the same batches as SB3's own buffers, bit for bit.
See docs/sb3.md.
"""

from __future__ import annotations

from trajstore._optional import missing

try:
    import stable_baselines3  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    raise missing("stable_baselines3", "trajstore.sb3") from None

from trajstore.sb3._root import NewBufferWarning, ResumedBufferWarning  # noqa: E402
from trajstore.sb3.dummy_vec import DummyVecRolloutBuffer  # noqa: E402
from trajstore.sb3.her import ZarrHerReplayBuffer  # noqa: E402
from trajstore.sb3.nstep import ZarrNStepReplayBuffer  # noqa: E402
from trajstore.sb3.prioritized import (  # noqa: E402
    PrioritizedDQN,
    PrioritizedReplayBufferSamples,
    ZarrPrioritizedDictReplayBuffer,
    ZarrPrioritizedReplayBuffer,
)
from trajstore.sb3.replay import ZarrDictReplayBuffer, ZarrReplayBuffer  # noqa: E402
from trajstore.sb3.rollout import ZarrDictRolloutBuffer, ZarrRolloutBuffer  # noqa: E402

__all__ = ["ZarrReplayBuffer", "ZarrDictReplayBuffer", "ZarrRolloutBuffer", "ZarrDictRolloutBuffer",
           "DummyVecRolloutBuffer", "ZarrNStepReplayBuffer", "ZarrHerReplayBuffer", "ZarrPrioritizedReplayBuffer",
           "ZarrPrioritizedDictReplayBuffer", "PrioritizedReplayBufferSamples", "PrioritizedDQN", "ResumedBufferWarning",
           "NewBufferWarning"]
