"""The cases of stable-baselines3's own buffer tests (tests/test_buffers.py, test_her.py,
test_n_step_replay.py of DLR-RM/stable-baselines3), run on the Zarr classes with a real
``cache_path`` each, plus what a user resuming or prioritizing a run must not be surprised by.

- ``full`` set by hand on a new buffer samples zeros (SB3's buffers are preallocated zeros);
- ``copy.deepcopy(buffer)`` is an independent buffer (a temporary folder of its own), so an old
  copy compared after more adds still holds the old data (SB3's HER truncation test);
- n-step returns stop at terminations, truncations and the newest position as SB3's do;
- an unknown keyword raises the ``TypeError`` SB3's callers match on;
- a relative ``cache_path`` is recorded resolved, so ``SAC.load`` from another working directory
  reopens the same buffer; a trained model that gets a new, empty buffer says so;
- a prioritized buffer is refused to an algorithm that never updates priorities.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import gymnasium as gym  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import A2C, SAC  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.envs import BitFlippingEnv  # noqa: E402
from stable_baselines3.common.vec_env import VecNormalize  # noqa: E402

from trajstore.errors import BadOptionError  # noqa: E402
from trajstore.sb3 import (  # noqa: E402
    NewBufferWarning,
    PrioritizedDQN,
    ResumedBufferWarning,
    ZarrDictReplayBuffer,
    ZarrDictRolloutBuffer,
    ZarrHerReplayBuffer,
    ZarrNStepReplayBuffer,
    ZarrPrioritizedReplayBuffer,
    ZarrReplayBuffer,
    ZarrRolloutBuffer,
)

OBS_DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64, np.float16,
              np.float32, np.float64]
ACTION_SPACES = [spaces.Discrete(10), spaces.Box(-1.0, 1.0, dtype=np.float32), spaces.Box(-1.0, 1.0, dtype=np.float64)]


@pytest.fixture
def paths(tmp_path: Path) -> Any:
    """Fresh folders under tmp_path, one per call."""
    count = iter(range(1000))
    return lambda: str(tmp_path / f"buf{next(count)}")


# -- SB3's test_buffers.py ----------------------------------------------------------------------------
@pytest.mark.parametrize("obs_dtype", OBS_DTYPES)
@pytest.mark.parametrize("use_dict", [False, True])
@pytest.mark.parametrize("action_space", ACTION_SPACES, ids=["discrete", "box32", "box64"])
def test_full_set_by_hand_samples_zeros_in_every_dtype(paths: Any, obs_dtype: Any, use_dict: bool,
                                                       action_space: spaces.Space) -> None:
    obs_space = spaces.Box(0, 100, dtype=obs_dtype)
    params: dict[str, Any] = dict(buffer_size=1, action_space=action_space)
    replay_action = ReplayBuffer._maybe_cast_dtype(action_space.dtype)
    if use_dict:
        params["observation_space"] = spaces.Dict({"obs": obs_space, "obs_2": spaces.Box(0, 100, dtype=np.uint8)})
        rollout, replay = ZarrDictRolloutBuffer(**params, cache_path=paths()), ZarrDictReplayBuffer(**params, cache_path=paths())
        for buf in (rollout, replay):
            assert buf.observations["obs"].dtype == obs_dtype and buf.observations["obs_2"].dtype == np.uint8
    else:
        params["observation_space"] = obs_space
        rollout, replay = ZarrRolloutBuffer(**params, cache_path=paths()), ZarrReplayBuffer(**params, cache_path=paths())
        assert rollout.observations.dtype == obs_dtype and replay.observations.dtype == obs_dtype
    assert rollout.actions.dtype == action_space.dtype
    assert replay.actions.dtype == replay_action
    rollout.full = True
    replay.full = True
    got_rollout = next(rollout.get(batch_size=64))
    got_replay = replay.sample(batch_size=64)
    assert got_rollout.actions.numpy().dtype == np.float32
    assert got_replay.actions.numpy().dtype == replay_action
    for batch in (got_rollout, got_replay):
        obs = batch.observations
        for key, value in (obs.items() if use_dict else [("obs", obs)]):
            assert value.numpy().dtype == (np.uint8 if key == "obs_2" else obs_dtype)
            assert not value.numpy().any()  # positions never written hold zeros, as SB3's arrays do
    rollout.close()
    replay.close()


def test_full_set_by_hand_mixes_stored_rows_and_zeros(paths: Any) -> None:
    space = spaces.Box(0, 100, (2,), np.float32)
    buf = ZarrReplayBuffer(8, space, spaces.Box(-1, 1, (1,), np.float32), cache_path=paths())
    for i in range(3):
        buf.add(np.full((1, 2), i + 1, np.float32), np.full((1, 2), i + 2, np.float32), np.zeros((1, 1)), np.ones(1),
                np.zeros(1), [{}])
    buf.full = True
    np.random.seed(0)
    batch = buf.sample(200)
    obs, rewards = batch.observations.numpy()[:, 0], batch.rewards.numpy()[:, 0]
    assert set(np.unique(obs).tolist()) == {0.0, 1.0, 2.0, 3.0}  # 3 stored positions, 5 of zeros
    assert np.array_equal(rewards == 1, obs > 0)
    assert np.array_equal(np.asarray(buf.observations)[:, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0])
    buf.close()


class _DummyEnv(gym.Env):
    """SB3's test env: observations 1..5 cycling, reward equal to the observation."""

    def __init__(self, use_dict: bool = False) -> None:
        self.use_dict = use_dict
        space = spaces.Box(1, 5, (1,))
        self.action_space = spaces.Box(1, 5, shape=(10, 7)) if use_dict else spaces.Box(1, 5, (1,))
        keys = ("observation", "achieved_goal", "desired_goal")
        self.observation_space = spaces.Dict({k: space for k in keys}) if use_dict else space
        self._t = 0

    def _obs(self) -> Any:
        value = np.array([self._t % 5 + 1.0], np.float32)
        return {k: value for k in self.observation_space.spaces} if self.use_dict else value  # type: ignore[attr-defined]

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        self._t = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self._t += 1
        return self._obs(), float(self._t % 5 + 1), False, self._t >= 100, {}


@pytest.mark.parametrize("cls", [ZarrReplayBuffer, ZarrDictReplayBuffer])
def test_replay_buffer_normalization(paths: Any, cls: Any) -> None:
    env = VecNormalize(make_vec_env(lambda: _DummyEnv(cls is ZarrDictReplayBuffer)))
    buf = cls(100, env.observation_space, env.action_space, device="cpu", cache_path=paths())
    env.reset()
    obs = env.get_original_obs()
    for _ in range(100):
        _, _, done, info = env.step(env.action_space.sample())
        next_obs = env.get_original_obs()
        buf.add(obs, next_obs, env.action_space.sample(), env.get_original_reward(), done, info)
        obs = next_obs
    sample = buf.sample(50, env)
    for observations in (sample.observations, sample.next_observations):
        for value in (observations.values() if isinstance(observations, dict) else [observations]):
            assert th.allclose(value.mean(0), th.zeros(1), atol=1)
    assert np.allclose(sample.rewards.mean(0), np.zeros(1), atol=1)
    buf.close()


@pytest.mark.parametrize("cls", [ZarrDictReplayBuffer, ZarrDictRolloutBuffer, ZarrReplayBuffer, ZarrRolloutBuffer])
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_device_buffer(paths: Any, cls: Any, device: str) -> None:
    use_dict = cls in (ZarrDictReplayBuffer, ZarrDictRolloutBuffer)
    rollout = cls in (ZarrRolloutBuffer, ZarrDictRolloutBuffer)
    env = make_vec_env(lambda: _DummyEnv(use_dict))
    buf = cls(100, env.observation_space, env.action_space, device=device, cache_path=paths())
    obs = env.reset()
    for _ in range(100):
        action = env.action_space.sample()
        next_obs, reward, done, info = env.step(action)
        if rollout:
            buf.add(obs, action, reward, np.zeros(1), th.zeros(1), th.ones(1))
        else:
            buf.add(obs, next_obs, action, reward, done, info)
        obs = next_obs
    batches = list(buf.get(50)) if rollout else [buf.sample(50)]
    want = th.device("cuda" if device == "auto" and th.cuda.is_available() else "cpu").type
    for batch in batches:
        for value in batch:
            for t in (value.values() if isinstance(value, dict) else [value]):
                assert t is None or t.device.type == want
    buf.close()


def test_custom_rollout_buffer_kwargs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    A2C("MlpPolicy", "Pendulum-v1", rollout_buffer_class=ZarrRolloutBuffer, rollout_buffer_kwargs=dict(cache_path="ok"))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'wrong_keyword'"):
        A2C("MlpPolicy", "Pendulum-v1", rollout_buffer_class=ZarrRolloutBuffer,
            rollout_buffer_kwargs=dict(cache_path="bad", wrong_keyword=1))
    with pytest.raises(TypeError, match=r"got multiple values for keyword argument 'gamma'"):
        A2C("MlpPolicy", "Pendulum-v1", rollout_buffer_class=ZarrRolloutBuffer, rollout_buffer_kwargs=dict(gamma=1))
    with pytest.raises(TypeError, match=r"needs a Dict observation space"):  # SB3: an AssertionError
        A2C("MlpPolicy", "Pendulum-v1", rollout_buffer_class=ZarrDictRolloutBuffer,
            rollout_buffer_kwargs=dict(cache_path="dict"))
    assert sorted(os.listdir(tmp_path)) == ["ok"]  # refused before anything was written


# -- SB3's test_her.py: deepcopy and truncate_last_trajectory -------------------------------------
def _step_her(venv: Any, buf: Any, observations: Any, n: int, n_bits: int) -> Any:
    for _ in range(n):
        actions = np.random.rand(venv.num_envs, n_bits)
        next_observations, rewards, dones, infos = venv.step(actions)
        buf.add(observations, next_observations, actions, rewards, dones, infos)
        observations = next_observations
    return observations


def _her_arrays(buf: Any, part: Any = slice(None)) -> list[np.ndarray]:
    keys = ("observation", "desired_goal", "achieved_goal")
    return ([np.asarray(buf.observations[k])[part] for k in keys] + [np.asarray(buf.next_observations[k])[part] for k in keys]
            + [buf.actions[part], buf.rewards[part]])


@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("n_steps", [4, 5])
@pytest.mark.parametrize("handle_timeout_termination", [False, True])
def test_truncate_last_trajectory_against_a_deep_copy(paths: Any, n_envs: int, n_steps: int,
                                                      handle_timeout_termination: bool) -> None:
    n_bits = 4
    venv = make_vec_env(lambda: BitFlippingEnv(n_bits=n_bits, continuous=True), n_envs)
    buf = ZarrHerReplayBuffer(int(1e4), venv.observation_space, venv.action_space, env=venv, n_envs=n_envs,
                              n_sampled_goal=2, goal_selection_strategy="future",
                              handle_timeout_termination=handle_timeout_termination, cache_path=paths())
    observations = _step_her(venv, buf, venv.reset(), n_steps, n_bits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # copying says nothing (SB3's test counts warnings)
        old = copy.deepcopy(buf)
    assert old is not buf and old.temporary and old.cache_path != buf.cache_path
    pos = buf.pos
    not_finished = np.where(buf._current_ep_start != pos)[0]
    unfinished = bool((old.dones[pos - 1] == 0).any())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf.truncate_last_trajectory()
    assert len(caught) == int(unfinished)
    if unfinished:
        assert "The last trajectory in the replay buffer will be truncated" in str(caught[0].message)
    assert (buf._current_ep_start == pos).all()
    assert (buf.dones[pos - 1] == 1).all()
    if handle_timeout_termination:
        assert (buf.timeouts[pos - 1, not_finished] == 1).all()
    assert (buf.ep_length[pos - 1] != 0).all()
    for a, b in zip(_her_arrays(old), _her_arrays(buf)):
        assert np.allclose(a, b)
    assert np.allclose(old.dones[: pos - 1], buf.dones[: pos - 1]) and np.allclose(old.dones[pos:], buf.dones[pos:])

    _step_her(venv, buf, observations, 10, n_bits)
    end = buf.pos
    for a, b in zip(_her_arrays(old, slice(None, pos)), _her_arrays(buf, slice(None, pos))):
        assert np.allclose(a, b)  # the copy keeps the old rows ...
    for a, b in zip(_her_arrays(old, slice(pos, end)), _her_arrays(buf, slice(pos, end))):
        assert not np.allclose(a, b)  # ... and never sees the new ones
    for a, b in zip(_her_arrays(old, slice(end, None)), _her_arrays(buf, slice(end, None))):
        assert np.allclose(a, b)
    assert not np.allclose(old.dones[pos - 1: end], buf.dones[pos - 1: end])
    folder = old.cache_path
    old.close()
    assert not os.path.exists(folder)  # the copy's temporary folder goes with it
    buf.close()


def test_deep_copy_of_a_sac_her_buffer_then_save_and_load(tmp_path: Path) -> None:
    env = make_vec_env(lambda: BitFlippingEnv(n_bits=4, continuous=True), 2)
    model = SAC("MultiInputPolicy", env, replay_buffer_class=ZarrHerReplayBuffer,
                replay_buffer_kwargs=dict(n_sampled_goal=2, goal_selection_strategy="future",
                                          cache_path=str(tmp_path / "her")),
                gradient_steps=2, train_freq=4, buffer_size=int(2e4), policy_kwargs=dict(net_arch=[16]),
                learning_starts=40, seed=0)
    model.learn(60)
    old = copy.deepcopy(model.replay_buffer)
    model.save_replay_buffer(tmp_path / "rb.pkl")
    del model.replay_buffer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_replay_buffer(tmp_path / "rb.pkl", truncate_last_traj=False)
    new = model.replay_buffer
    pos = new.pos
    assert new is not old and pos == old.pos
    for a, b in zip(_her_arrays(old, slice(None, pos)), _her_arrays(new, slice(None, pos))):
        assert np.array_equal(a, b)
    assert np.array_equal(old.dones[: pos - 1], new.dones[: pos - 1])
    model.learn(40, reset_num_timesteps=False)
    old.close()
    new.close()


def test_deep_copy_keeps_ram_edits_and_full(paths: Any) -> None:
    buf = ZarrReplayBuffer(4, spaces.Box(0, 9, (2,), np.float32), spaces.Discrete(3), cache_path=paths())
    for i in range(2):
        buf.add(np.full((1, 2), i, np.float32), np.full((1, 2), i + 1, np.float32), np.array([1]), np.ones(1),
                np.zeros(1), [{}])
    buf.dones[1] = 1.0  # an edit not yet in the store, as SB3's _setup_learn makes
    buf.full = True
    dup = copy.deepcopy(buf)
    assert dup.full and dup.pos == buf.pos and dup.dones[1, 0] == 1.0
    assert np.array_equal(np.asarray(dup.next_observations), np.asarray(buf.next_observations))
    dup.add(np.full((1, 2), 7, np.float32), np.full((1, 2), 8, np.float32), np.array([2]), np.ones(1), np.zeros(1), [{}])
    assert np.asarray(buf.observations)[2, 0, 0] == 0 and np.asarray(dup.observations)[2, 0, 0] == 7
    dup.close()
    buf.close()


# -- SB3's test_n_step_replay.py ------------------------------------------------------------------
def _nstep(path: str, n_steps: int = 3, gamma: float = 0.99) -> ZarrNStepReplayBuffer:
    return ZarrNStepReplayBuffer(10, spaces.Box(0, 1, (4,), np.float32), spaces.Box(0, 1, (2,), np.float32),
                                 device="cpu", n_steps=n_steps, gamma=gamma, cache_path=path)


def _fill(buf: Any, length: int, done_at: int | None = None, truncated_at: int | None = None) -> None:
    for i in range(length):
        buf.add(np.full((1, 4), i, np.float32), np.full((1, 4), i + 1, np.float32), np.zeros((1, 2), np.float32),
                np.array([1.0]), np.array([1.0 if i == done_at else 0.0]), [{"TimeLimit.truncated": i == truncated_at}])


def _expected_return(gamma: float, n_steps: int, stop_idx: int | None = None) -> float:
    total = 0.0
    for step in reversed(range(n_steps)):
        total = 1.0 + gamma * (step != stop_idx) * total
    return total


@pytest.mark.parametrize("done_at", [1, 2])
@pytest.mark.parametrize("n_steps", [3, 5])
@pytest.mark.parametrize("base_idx", [0, 2])
def test_nstep_early_termination(paths: Any, done_at: int, n_steps: int, base_idx: int) -> None:
    buf = _nstep(paths(), n_steps, 0.98)
    _fill(buf, 10, done_at=done_at)
    batch = buf._get_samples(np.array([base_idx]))
    np.testing.assert_allclose(batch.rewards.item(), _expected_return(0.98, n_steps, done_at - base_idx), rtol=1e-6)
    assert batch.dones.item() == float(base_idx <= done_at)
    buf.close()


@pytest.mark.parametrize("truncated_at", [1, 2])
@pytest.mark.parametrize("n_steps", [2, 5])
@pytest.mark.parametrize("base_idx", [0, 1])
def test_nstep_early_truncation(paths: Any, truncated_at: int, n_steps: int, base_idx: int) -> None:
    buf = _nstep(paths(), n_steps)
    _fill(buf, 10, truncated_at=truncated_at)
    batch = buf._get_samples(np.array([base_idx]))
    np.testing.assert_allclose(batch.rewards.item(), _expected_return(0.99, n_steps, truncated_at - base_idx),
                               rtol=1e-6)
    assert batch.dones.item() == 0.0
    buf.close()


@pytest.mark.parametrize("n_steps", [3, 5])
def test_nstep_no_terminations_and_the_newest_position(paths: Any, n_steps: int) -> None:
    gamma = 0.99
    buf = _nstep(paths(), n_steps)
    _fill(buf, 10)
    batch = buf._get_samples(np.array([3]))
    np.testing.assert_allclose(batch.discounts.item(), gamma**n_steps)
    np.testing.assert_allclose(batch.rewards.item(), _expected_return(gamma, n_steps), rtol=1e-6)
    assert batch.dones.item() == 0.0
    _fill(buf, 2)  # the ring wraps: position pos - 1 ends every window
    batch = buf._get_samples(np.array([0]))
    np.testing.assert_allclose(batch.rewards.item(), _expected_return(gamma, n_steps, buf.pos - 1), rtol=1e-6)
    assert batch.dones.item() == 0.0
    np.testing.assert_allclose(batch.discounts.item(), gamma**2)
    buf.dones[buf.pos - 1, :] = True  # a real termination there: no temporary truncation
    batch = buf._get_samples(np.array([0]))
    np.testing.assert_allclose(batch.rewards.item(), _expected_return(gamma, n_steps, buf.pos - 1), rtol=1e-6)
    assert batch.dones.item() == 1.0
    buf.close()


def test_nstep_of_one_matches_the_plain_buffer(paths: Any) -> None:
    buf = _nstep(paths(), 1)
    ref = ZarrReplayBuffer(10, spaces.Box(0, 1, (4,), np.float32), spaces.Box(0, 1, (2,), np.float32), device="cpu",
                           cache_path=paths())
    _fill(buf, 10)
    _fill(ref, 10)
    got, want = buf._get_samples(np.array([3])), ref._get_samples(np.array([3]))
    np.testing.assert_allclose(got.rewards.item(), _expected_return(0.99, 1), rtol=1e-6)
    assert got.dones.item() == 0.0
    np.testing.assert_allclose(got.rewards.numpy(), want.rewards.numpy(), rtol=1e-6)
    buf.close()
    ref.close()


# -- resuming from another working directory ------------------------------------------------------
def test_sac_load_from_another_directory_reopens_the_saved_buffer(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    model = SAC("MlpPolicy", "Pendulum-v1", buffer_size=500, learning_starts=10, policy_kwargs=dict(net_arch=[16]),
                replay_buffer_class=ZarrReplayBuffer, replay_buffer_kwargs=dict(cache_path="runs/buf"))
    assert model.replay_buffer_kwargs["cache_path"] == str(first / "runs" / "buf")  # what the model saves
    model.learn(40)
    model.save("model.zip")
    model.replay_buffer.close()
    monkeypatch.chdir(second)
    with pytest.warns(ResumedBufferWarning, match=str(first / "runs" / "buf")):
        loaded = SAC.load(first / "model.zip", env=gym.make("Pendulum-v1"))
    assert loaded.replay_buffer.size() == 40
    loaded.learn(20, reset_num_timesteps=False)
    assert loaded.replay_buffer.size() == 60
    assert os.listdir(second) == []  # nothing was made in the new working directory
    loaded.replay_buffer.close()


def test_a_trained_model_given_a_new_empty_buffer_says_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = SAC("MlpPolicy", "Pendulum-v1", buffer_size=500, learning_starts=10, policy_kwargs=dict(net_arch=[16]),
                replay_buffer_class=ZarrReplayBuffer, replay_buffer_kwargs=dict(cache_path="runs/buf"))
    model.learn(20)
    model.save("model.zip")
    model.replay_buffer.close()
    # The model was saved by an older trajstore, with the relative path as given:
    custom = dict(replay_buffer_kwargs=dict(cache_path="runs/buf"))
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    with pytest.warns(NewBufferWarning, match=f"trained 20 timesteps but {other / 'runs' / 'buf'}"):
        loaded = SAC.load(tmp_path / "model.zip", env=gym.make("Pendulum-v1"), custom_objects=custom)
    assert loaded.replay_buffer.size() == 0
    loaded.replay_buffer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resume=False: a new buffer is what was asked for
        SAC.load(tmp_path / "model.zip", env=gym.make("Pendulum-v1"),
                 replay_buffer_kwargs=dict(cache_path="elsewhere", resume=False)).replay_buffer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model that has not trained yet gets a new buffer silently
        SAC("MlpPolicy", "Pendulum-v1", buffer_size=100, replay_buffer_class=ZarrReplayBuffer,
            replay_buffer_kwargs=dict(cache_path="fresh")).replay_buffer.close()


# -- prioritized replay needs an algorithm that updates priorities ---------------------------------
def test_prioritized_buffer_is_refused_to_sac(tmp_path: Path) -> None:
    with pytest.raises(BadOptionError, match=r"SAC's train\(\) never calls update_priorities.*PrioritizedDQN"):
        SAC("MlpPolicy", "Pendulum-v1", buffer_size=100, replay_buffer_class=ZarrPrioritizedReplayBuffer,
            replay_buffer_kwargs=dict(cache_path=str(tmp_path / "per")))
    assert not (tmp_path / "per").exists()
    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", buffer_size=100,
                           replay_buffer_kwargs=dict(cache_path=str(tmp_path / "dqn")))
    assert isinstance(model.replay_buffer, ZarrPrioritizedReplayBuffer)
    model.replay_buffer.close()
    # A buffer made by hand (no model setting it up) is the user's to drive.
    ZarrPrioritizedReplayBuffer(10, spaces.Box(0, 1, (2,)), spaces.Discrete(2), cache_path=str(tmp_path / "hand")).close()


# -- pos and full set by hand mean what they mean in SB3 ------------------------------------------
def _add_replay(buf: Any, i: int, n_envs: int) -> None:
    obs = np.full((n_envs, 2), i, np.float32) + np.arange(n_envs, dtype=np.float32)[:, None] / 10
    buf.add(obs, obs + 0.5, np.full((n_envs, 1), i % 3), np.full(n_envs, float(i)), np.zeros(n_envs),
            [{} for _ in range(n_envs)])


def _same_replay(ours: Any, sb3: Any) -> None:
    assert (ours.pos, ours.full) == (sb3.pos, sb3.full)
    assert np.array_equal(np.asarray(ours.observations), sb3.observations)
    assert np.array_equal(np.asarray(ours.next_observations), sb3.next_observations)
    assert np.array_equal(ours.rewards, sb3.rewards)
    np.random.seed(1)
    a = ours.sample(16)
    np.random.seed(1)
    b = sb3.sample(16)
    for x, y in zip(a, b):
        assert (x is None and y is None) or th.equal(x, y)


@pytest.mark.parametrize("n_envs", [1, 2])
def test_replay_pos_and_full_set_by_hand_follow_sb3(paths: Any, n_envs: int) -> None:
    obs_space, act_space = spaces.Box(0, 100, (2,), np.float32), spaces.Discrete(3)
    path = paths()
    ours = ZarrReplayBuffer(8 * n_envs, obs_space, act_space, n_envs=n_envs, cache_path=path)
    sb3 = ReplayBuffer(8 * n_envs, obs_space, act_space, n_envs=n_envs)
    for buf in (ours, sb3):
        for i in range(3):
            _add_replay(buf, i + 1, n_envs)
    steps = iter(range(4, 1000))
    for pos, full, adds in [(6, False, 1), (1, False, 2), (5, True, 1), (0, False, 9), (3, None, 2)]:
        i = next(steps)
        for buf in (ours, sb3):
            buf.pos = pos  # a jump forward leaves zeros between; backward rewrites stored rows
            if full is not None:
                buf.full = full
            for j in range(adds):
                _add_replay(buf, 10 * i + j, n_envs)
        _same_replay(ours, sb3)
    ours.close()
    reopened = ZarrReplayBuffer(8 * n_envs, obs_space, act_space, n_envs=n_envs, cache_path=path, resume=True)
    assert np.array_equal(np.asarray(reopened.observations), sb3.observations)  # rewrites and zeros were stored
    assert np.array_equal(reopened.rewards, sb3.rewards)
    reopened.close()


def test_rollout_pos_set_by_hand_follows_sb3(paths: Any) -> None:
    from stable_baselines3.common.buffers import RolloutBuffer

    obs_space, act_space = spaces.Box(0, 100, (2,), np.float32), spaces.Box(-1, 1, (1,), np.float32)
    ours = ZarrRolloutBuffer(6, obs_space, act_space, cache_path=paths())
    sb3 = RolloutBuffer(6, obs_space, act_space)
    for buf in (ours, sb3):
        for i, pos in enumerate([0, 1, 4, 2, 5]):  # 2 and 3 left as zeros, then 2 rewritten
            buf.pos = pos
            buf.add(np.full((1, 2), i + 1, np.float32), np.zeros((1, 1)), np.ones(1), np.zeros(1), th.zeros(1),
                    th.zeros(1))
        buf.compute_returns_and_advantage(th.zeros(1), np.zeros(1))
    assert ours.full and sb3.full
    assert np.array_equal(np.asarray(ours.observations), sb3.observations)
    np.random.seed(2)
    a = next(ours.get(4))
    np.random.seed(2)
    b = next(sb3.get(4))
    assert th.equal(a.observations, b.observations) and th.equal(a.returns, b.returns)
    ours.close()


EXIT_WITHOUT_CLOSING = """
import sys
import numpy as np
from trajstore.sb3 import PrioritizedDQN
model = PrioritizedDQN("MlpPolicy", "CartPole-v1", learning_starts=50, buffer_size=1000, train_freq=4, seed=0,
                       replay_buffer_kwargs=dict(cache_path=sys.argv[1]))
model.learn(200)
np.save(sys.argv[2], model.replay_buffer.priorities())
"""


def test_prioritized_dqn_exiting_without_closing_keeps_its_priorities(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-W", "always", "-c", EXIT_WITHOUT_CLOSING, str(tmp_path / "per"),
                          str(tmp_path / "want.npy")], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert "cannot schedule" not in out.stderr and "Warning" not in out.stderr, out.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buf = ZarrPrioritizedReplayBuffer.open(tmp_path / "per")
    assert np.array_equal(buf.priorities(), np.load(tmp_path / "want.npy"))
    assert len(np.unique(buf.priorities())) > 20  # |TD error|s, not the priority new rows enter with
    buf.close()
