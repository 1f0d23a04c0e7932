"""trajstore.recording: real gymnasium envs (CartPole-v1, Pendulum-v1) written into real stores."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from trajstore import TrajectoryReplayBuffer
from trajstore.metadata import env_description, get_dataset_info
from trajstore.recording import EPISODE_SPACE, RecordEpisodes, RecordVectorEpisodes, step_space


class _StepInfo(gym.Wrapper):
    """Adds ``info["step"]`` (1, 2, ... within an episode), up to step ``until`` (exclusive)."""

    def __init__(self, env: gym.Env, until: int | None = None) -> None:
        super().__init__(env)
        self.until = until

    def reset(self, **kw):
        self.t = 0
        return self.env.reset(**kw)

    def step(self, a):
        o, r, te, tr, i = self.env.step(a)
        self.t += 1
        keep = self.until is None or self.t < self.until
        return o, r, te, tr, ({**i, "step": self.t} if keep else dict(i))


def _episodes(buf: TrajectoryReplayBuffer) -> list[tuple[int, dict, dict]]:
    """(episode id, step data, episode data) of every episode, in row order."""
    out = []
    for eid in buf.episodes()["episode_id"].tolist():
        item = buf.get_episode(eid)
        ep = {k: v[0] for k, v in item["episode_data"].items()}
        out.append((eid, item["step_data"], ep))
    return out


def _replay(env_id: str, seed: int, steps: dict) -> None:
    """Replay recorded actions in a freshly seeded env: same observations and rewards."""
    env = gym.make(env_id)
    obs, _ = env.reset(seed=seed)
    n = len(steps["reward"])
    for t in range(n):
        np.testing.assert_array_equal(steps["obs"][t], obs)
        obs, reward, term, trunc, _ = env.step(steps["action"][t])
        assert steps["reward"][t] == reward
        assert bool(steps["terminated"][t]) == term and bool(steps["truncated"][t]) == trunc
        if "next_obs" in steps:
            np.testing.assert_array_equal(steps["next_obs"][t], obs)
    env.close()


@pytest.mark.parametrize("env_id,episodes", [("CartPole-v1", 4), ("Pendulum-v1", 2)])
def test_record_env_and_replay(tmp_path, env_id, episodes):
    path = str(tmp_path / "rec")
    env = RecordEpisodes(gym.make(env_id), cache_path=path, record_next_obs=True,
                         dataset_info={"name": f"{env_id} random", **env_description(gym.make(env_id))})
    env.action_space.seed(5)
    lengths = []
    for ep in range(episodes):
        env.reset(seed=100 + ep)
        n, done = 0, False
        while not done:
            _o, _r, term, trunc, _i = env.step(env.action_space.sample())
            n, done = n + 1, term or trunc
        lengths.append(n)
    env.close()

    buf = TrajectoryReplayBuffer.load_from(path, read_only=True)
    assert len(buf) == sum(lengths)
    eps = _episodes(buf)
    assert [len(s["reward"]) for _e, s, _d in eps] == lengths
    for k, (_eid, steps, data) in enumerate(eps):
        assert data["seed"] == 100 + k and data["length"] == lengths[k]
        assert data["return"] == pytest.approx(float(np.sum(steps["reward"])))
        assert bool(steps["terminated"][-1] or steps["truncated"][-1])
        assert not (steps["terminated"][:-1] | steps["truncated"][:-1]).any()
        _replay(env_id, 100 + k, steps)
    if env_id == "Pendulum-v1":
        assert lengths == [200, 200] and steps["action"].shape == (200, 1)
    info = get_dataset_info(path)
    assert info["env_id"] == env_id and info["name"] == f"{env_id} random"
    assert info["env_spec"]["id"] == env_id and "gymnasium" in info["library_versions"]
    buf.close()


def test_record_info_keys_partial_episode_and_existing_buffer(tmp_path):
    path = str(tmp_path / "rec")
    env = gym.make("CartPole-v1")
    space = step_space(env.observation_space, env.action_space,
                       info_spaces={"step": gym.spaces.Box(0, 10**6, (), np.int64)})
    buf = TrajectoryReplayBuffer.create(space, episode_data_instance_space=EPISODE_SPACE, cache_path=path)

    rec = RecordEpisodes(_StepInfo(env), buf, info_keys={"step": space["info"]["step"]})
    rec.reset(seed=1)
    for _ in range(3):
        rec.step(0)
    rec.reset()  # a reset in the middle of an episode ends it; no seed -> -1
    for _ in range(2):
        rec.step(1)
    rec.close()  # unfinished episode: kept, with its length so far
    eps = _episodes(buf)
    assert [len(s["reward"]) for _e, s, _d in eps] == [3, 2]
    np.testing.assert_array_equal(eps[0][1]["info"]["step"], [1, 2, 3])
    assert eps[0][2]["seed"] == 1 and eps[1][2]["seed"] == -1 and eps[1][2]["length"] == 2
    assert not eps[0][1]["terminated"].any()
    buf.close()


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_record_vector_env_episodes_separate(tmp_path, mode):
    path = str(tmp_path / f"vec_{mode.value}")
    venv = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": mode})
    rec = RecordVectorEpisodes(venv, cache_path=path, record_next_obs=True)
    rec.action_space.seed(3)
    rec.reset(seed=10)
    for _ in range(150):
        rec.step(rec.action_space.sample())
    rec.close()

    buf = TrajectoryReplayBuffer.load_from(path, read_only=True)
    eps = _episodes(buf)
    ids = buf.get_at_with_metadata(np.arange(len(buf)))[1]["episode_ids"]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    assert len(starts) == len(eps) == len(np.unique(ids))  # every episode is one contiguous block
    finished = 0
    for _eid, steps, data in eps:
        n = len(steps["reward"])
        assert data["length"] == n and data["return"] == pytest.approx(float(steps["reward"].sum()))
        # within an episode the chain obs -> next_obs is unbroken: nothing of another sub-env got in
        np.testing.assert_array_equal(steps["obs"][1:], steps["next_obs"][:-1])
        done = steps["terminated"] | steps["truncated"]
        assert not done[:-1].any()
        finished += bool(done[-1])
    assert finished >= 3
    seeded = [(int(d["seed"]), s) for _e, s, d in eps if d["seed"] >= 0]
    assert sorted(sd for sd, _s in seeded) == [10, 11, 12]  # each sub-env's first episode
    for sd, steps in seeded:
        _replay("CartPole-v1", sd, steps)
    # the total: every step of every sub-env, minus NEXT_STEP's reset steps
    assert len(buf) <= 3 * 150
    if mode == AutoresetMode.SAME_STEP:
        assert len(buf) == 3 * 150
    buf.close()


def test_record_vector_env_disabled_autoreset(tmp_path):
    venv = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": AutoresetMode.DISABLED})
    rec = RecordVectorEpisodes(venv, cache_path=str(tmp_path / "dis"), record_next_obs=True)
    rec.reset(seed=0)
    ended = 0
    for _ in range(120):
        _o, _r, term, trunc, _i = rec.step(np.array([0, 1]))  # constant actions end episodes fast
        done = term | trunc
        if done.any():
            ended += int(done.sum())
            rec.reset(options={"reset_mask": done})
    rec.close()
    buf = TrajectoryReplayBuffer.load_from(str(tmp_path / "dis"), read_only=True)
    eps = _episodes(buf)
    complete = [s for _e, s, _d in eps if s["terminated"][-1] or s["truncated"][-1]]
    assert len(complete) == ended >= 4
    for _e, steps, _d in eps:
        np.testing.assert_array_equal(steps["obs"][1:], steps["next_obs"][:-1])
    assert len(buf) == 2 * 120
    buf.close()


def test_an_info_key_missing_after_the_first_step_is_refused_and_nothing_of_that_step_is_written(tmp_path):
    """A recorded info key that a later step's info lacks raises UnknownFieldError (a KeyError)
    naming the key, before that step's row is written; the steps before it stay recorded."""
    from trajstore.errors import BadArgumentError, UnknownFieldError

    with pytest.raises(BadArgumentError, match="pass cache_path="):  # a path where the buffer goes
        RecordEpisodes(gym.make("CartPole-v1"), str(tmp_path / "rec"))
    rec = RecordEpisodes(_StepInfo(gym.make("CartPole-v1"), until=3), cache_path=str(tmp_path / "rec"), info_keys=["step"])
    rec.reset(seed=0)
    rec.step(0)
    rec.step(0)
    with pytest.raises(UnknownFieldError, match=r"info keys \['step'\] missing from this step's info") as ei:
        rec.step(0)
    assert isinstance(ei.value, KeyError)
    assert len(rec.buffer) == 2
    np.testing.assert_array_equal(rec.buffer[:]["step_data"]["info"]["step"], [1, 2])
    rec.close()


def test_demo_and_recorder_store_the_same_fields_with_the_same_dtypes(tmp_path) -> None:
    """Issue 36.6: ``trajstore demo`` and ``RecordEpisodes`` write reward as float64 and the flags as
    scalar bools (recording.REWARD_DTYPE / FLAG_DTYPE), so both reach numpy and torch alike."""
    from trajstore import ReplayBuffer
    from trajstore.demo import record_demo
    from trajstore.recording import FLAG_DTYPE, REWARD_DTYPE

    demo = record_demo(str(tmp_path / "demo"), episodes=2)
    env = RecordEpisodes(gym.make("CartPole-v1"), cache_path=str(tmp_path / "rec"), record_next_obs=True)
    env.reset(seed=0)
    done = False
    while not done:
        _o, _r, te, tr, _i = env.step(env.action_space.sample())
        done = te or tr
    env.close()
    with ReplayBuffer.load_from(demo, read_only=True, backend="torch") as rb, \
            TrajectoryReplayBuffer.load_from(str(tmp_path / "rec"), read_only=True, backend="torch") as tb:
        a, b = rb[:4], tb[:4]["step_data"]
        assert sorted(a) == sorted(b) == ["action", "next_obs", "obs", "reward", "terminated", "truncated"]
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape[1:] == b[k].shape[1:], k
        import torch

        assert a["reward"].dtype == torch.float64 and REWARD_DTYPE == np.float64
        assert a["terminated"].dtype == torch.bool and a["terminated"].shape == (4,) and FLAG_DTYPE == np.bool_
