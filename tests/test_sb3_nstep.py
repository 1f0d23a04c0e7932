"""ZarrNStepReplayBuffer against stable-baselines3's own NStepReplayBuffer as the oracle.

Both buffers get the same transitions (episodes ending with terminations and with timeouts,
several envs, a ring that wraps); under one ``np.random`` seed every ``sample`` must be
bit-identical, field by field (n-step returns, discounts, last next observations, dones).  Then:
pickling through save/load_replay_buffer, reopening, the refused options, and a short DQN run
with n-step returns that ends with the same parameters as SB3's own n-step buffer.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import gymnasium as gym  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.buffers import NStepReplayBuffer  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize  # noqa: E402

from trajstore.errors import BadOptionError, SpaceMismatchError, UnsupportedSpaceError  # noqa: E402
from trajstore.sb3.nstep import ZarrNStepReplayBuffer  # noqa: E402

OBS = {
    "float": spaces.Box(-np.inf, np.inf, (5,), np.float32),
    "image": spaces.Box(0, 255, (6, 6, 3), np.uint8),
    "discrete": spaces.Discrete(7),
}
ACT = {
    "float": spaces.Box(-1, 1, (2,), np.float32),
    "image": spaces.Discrete(4),
    "discrete": spaces.MultiDiscrete([3, 4]),
}


def value(space: gym.Space, n: int, rng: np.random.Generator) -> Any:
    """A batch of ``n`` values as a VecEnv gives them (Discrete: shape (n,))."""
    if isinstance(space, spaces.Discrete):
        return rng.integers(0, space.n, size=n).astype(space.dtype)
    if isinstance(space, spaces.MultiDiscrete):
        return rng.integers(0, space.nvec, size=(n, *space.shape)).astype(space.dtype)
    if space.dtype == np.uint8:
        return rng.integers(0, 256, size=(n, *space.shape)).astype(np.uint8)
    return rng.standard_normal((n, *space.shape)).astype(space.dtype)


def transition(obs_space: gym.Space, act_space: gym.Space, n: int, rng: np.random.Generator) -> tuple:
    """One ``add`` call: episodes end with a termination (done) or a timeout (done + truncated)."""
    done = rng.random(n) < 0.2
    infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.5)} for d in done]
    return (value(obs_space, n, rng), value(obs_space, n, rng), value(act_space, n, rng),
            rng.standard_normal(n).astype(np.float32), done, infos)


def assert_samples_equal(got: Any, want: Any, where: str = "") -> None:
    """Every field of two sample tuples: same type, torch dtype, shape and values."""
    assert type(got).__name__ == type(want).__name__, where
    for field in want._fields:
        g, w = getattr(got, field), getattr(want, field)
        if w is None:
            assert g is None, f"{where} {field}"
            continue
        assert g.dtype == w.dtype, f"{where} {field}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{where} {field}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert th.equal(g, w), f"{where} {field}: values differ"


def same_samples(ours: Any, ref: Any, seed: int, calls: int = 5, batch: int = 32, env: Any = None,
                 where: str = "") -> None:
    """``calls`` consecutive samples after one seed: the draws stay in step."""
    np.random.seed(seed)
    want = [ref.sample(batch, env=env) for _ in range(calls)]
    np.random.seed(seed)
    got = [ours.sample(batch, env=env) for _ in range(calls)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert_samples_equal(g, w, f"{where} call {i}")
    assert want[0].discounts is not None


def fill(bufs: list[Any], obs_space: gym.Space, act_space: gym.Space, n_envs: int, steps: int,
         rng: np.random.Generator) -> None:
    for _ in range(steps):
        tr = transition(obs_space, act_space, n_envs, rng)
        for b in bufs:
            b.add(*tr)


# ------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("n_steps", [1, 3, 5])
@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("kind", list(OBS))
def test_sample_equals_sb3(tmp_path: Path, kind: str, n_envs: int, n_steps: int) -> None:
    obs_space, act_space = OBS[kind], ACT[kind]
    per_env = 20
    kw: dict[str, Any] = dict(n_envs=n_envs, n_steps=n_steps, gamma=0.9)
    ref = NStepReplayBuffer(per_env * n_envs, obs_space, act_space, "cpu", **kw)
    with ZarrNStepReplayBuffer(per_env * n_envs, obs_space, act_space, "cpu", cache_path=tmp_path / "rb", **kw) as ours:
        assert (ours.buffer_size, ours.n_steps, ours.gamma) == (ref.buffer_size, ref.n_steps, ref.gamma)
        rng = np.random.default_rng(n_envs * 10 + n_steps)
        for t in range(2 * per_env + 7):  # wraps twice
            tr = transition(obs_space, act_space, n_envs, rng)
            ref.add(*tr)
            ours.add(*tr)
            assert (ours.pos, ours.full) == (ref.pos, ref.full), t
            if t in (1, 6, per_env - 1, per_env, per_env + 3, 2 * per_env + 6):
                same_samples(ours, ref, seed=t, where=f"{kind} n_envs={n_envs} n_steps={n_steps} step {t}")
        for name in ("actions", "rewards", "dones", "timeouts"):  # sampling wrote nothing
            assert np.array_equal(getattr(ours, name), getattr(ref, name)), name


def test_windows_stop_at_episode_ends_and_at_the_newest_row(tmp_path: Path) -> None:
    """Hand-checked values: a window stops at a termination (done 1), at a timeout (done 0,
    bootstrapped) and at the newest transition; discounts are gamma ** (steps summed)."""
    obs_space, act_space = OBS["float"], ACT["float"]
    with ZarrNStepReplayBuffer(10, obs_space, act_space, "cpu", n_steps=3, gamma=0.5,
                               cache_path=tmp_path / "rb") as rb:
        obs = np.arange(7 * 5, dtype=np.float32).reshape(7, 1, 5)
        ends = {1: "done", 4: "timeout"}  # positions 0-1 | 2-4 | 5-6 (6: the newest)
        for p in range(7):
            done = np.array([p in ends])
            infos = [{"TimeLimit.truncated": ends.get(p) == "timeout"}]
            rb.add(obs[p], obs[p] + 100, np.zeros((1, 2), np.float32), np.array([p + 1.0], np.float32), done, infos)
        got = rb._get_samples(np.array([0, 1, 2, 3, 5, 6]))
        # rewards p+1: window at 0 -> 1 + .5*2 ; 1 -> 2 ; 2 -> 3 + .5*4 + .25*5 ; 3 -> 4 + .5*5 ; 5 -> 6 + .5*7 ; 6 -> 7
        np.testing.assert_array_equal(got.rewards.numpy()[:, 0], [2.0, 2.0, 6.25, 6.5, 9.5, 7.0])
        np.testing.assert_array_equal(got.discounts.numpy()[:, 0], [0.25, 0.5, 0.125, 0.25, 0.25, 0.5])
        np.testing.assert_array_equal(got.dones.numpy()[:, 0], [1, 1, 0, 0, 0, 0])  # a timeout bootstraps
        np.testing.assert_array_equal(got.next_observations.numpy()[:, 0], obs[[1, 1, 4, 4, 6, 6], 0, 0] + 100)
        np.testing.assert_array_equal(got.observations.numpy()[:, 0], obs[[0, 1, 2, 3, 5, 6], 0, 0])
        assert rb.timeouts[6, 0] == 0  # the newest row's mark is not written to the buffer


@pytest.mark.parametrize("handle_timeouts", [True, False])
def test_vecnormalize_and_timeouts_equal_sb3(tmp_path: Path, handle_timeouts: bool) -> None:
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("Pendulum-v1")]), norm_obs=True, norm_reward=True)
    rng = np.random.default_rng(2)
    venv.obs_rms.mean = rng.standard_normal(3)
    venv.obs_rms.var = rng.random(3) + 0.5
    venv.ret_rms.var = np.array(2.5)
    obs_space, act_space = venv.observation_space, venv.action_space
    kw: dict[str, Any] = dict(n_envs=2, n_steps=4, gamma=0.97, handle_timeout_termination=handle_timeouts)
    ref = NStepReplayBuffer(32, obs_space, act_space, "cpu", **kw)
    with ZarrNStepReplayBuffer(32, obs_space, act_space, "cpu", cache_path=tmp_path / "rb", **kw) as ours:
        for t in range(25):
            fill([ref, ours], obs_space, act_space, 2, 1, rng)
            if t % 6 == 5:
                same_samples(ours, ref, seed=t, env=venv, where=f"VecNormalize step {t}")


# ------------------------------------------------------------------------------------ persistence


def test_reopen_and_pickle_give_the_same_samples(tmp_path: Path) -> None:
    obs_space, act_space = OBS["image"], ACT["image"]
    kw: dict[str, Any] = dict(n_envs=2, n_steps=3, gamma=0.95)
    ref = NStepReplayBuffer(30, obs_space, act_space, "cpu", **kw)
    rb = ZarrNStepReplayBuffer(30, obs_space, act_space, "cpu", cache_path=tmp_path / "rb", **kw)
    rng = np.random.default_rng(4)
    fill([ref, rb], obs_space, act_space, 2, 21, rng)  # wraps
    data = pickle.dumps(rb)  # what save_replay_buffer writes
    assert len(data) < 4096
    rb.close()
    back = pickle.loads(data)  # no live buffer holds the folder: reopens it
    assert isinstance(back, ZarrNStepReplayBuffer) and (back.n_steps, back.gamma) == (3, 0.95)
    assert (back.pos, back.full) == (ref.pos, ref.full)
    same_samples(back, ref, seed=1)
    fill([ref, back], obs_space, act_space, 2, 4, rng)  # and it continues
    same_samples(back, ref, seed=2)
    back.close()
    # a reopen (as SAC.load does) may change n_steps and gamma: they shape sampling only
    ref5 = NStepReplayBuffer(30, obs_space, act_space, "cpu", n_envs=2, n_steps=5, gamma=0.8)
    for name in ("actions", "rewards", "dones", "timeouts"):
        getattr(ref5, name)[:] = getattr(ref, name)
    ref5.observations[:], ref5.next_observations[:] = ref.observations, ref.next_observations
    ref5.pos, ref5.full = ref.pos, ref.full
    with ZarrNStepReplayBuffer(30, obs_space, act_space, "cpu", n_envs=2, n_steps=5, gamma=0.8,
                               cache_path=tmp_path / "rb", resume=True) as again:
        same_samples(again, ref5, seed=3)
    with ZarrNStepReplayBuffer.open(tmp_path / "rb", device="cpu", n_steps=3, gamma=0.95) as opened:
        same_samples(opened, ref, seed=4)


def test_temporary_buffer_pickles_its_data() -> None:
    obs_space, act_space = OBS["float"], ACT["float"]
    ref = NStepReplayBuffer(12, obs_space, act_space, "cpu", n_steps=2, gamma=0.9)
    with ZarrNStepReplayBuffer(12, obs_space, act_space, "cpu", n_steps=2, gamma=0.9) as rb:
        fill([ref, rb], obs_space, act_space, 1, 15, np.random.default_rng(5))
        with pickle.loads(pickle.dumps(rb)) as back:
            assert back.cache_path != rb.cache_path and back.n_steps == 2
            same_samples(back, ref, seed=6)


def test_refused_options(tmp_path: Path) -> None:
    obs_space, act_space = OBS["float"], ACT["float"]
    with pytest.raises(BadOptionError, match="optimize_memory_usage"):
        ZarrNStepReplayBuffer(10, obs_space, act_space, optimize_memory_usage=True, handle_timeout_termination=False)
    with pytest.raises(BadOptionError, match="n_steps must be an integer >= 1; got 0"):
        ZarrNStepReplayBuffer(10, obs_space, act_space, n_steps=0)
    with pytest.raises(UnsupportedSpaceError, match="no n-step Dict buffer"):
        ZarrNStepReplayBuffer(10, spaces.Dict({"a": obs_space}), act_space)
    with ZarrNStepReplayBuffer(10, obs_space, act_space, cache_path=tmp_path / "rb"):
        pass
    with pytest.raises(SpaceMismatchError, match="buffer_size"):
        ZarrNStepReplayBuffer(12, obs_space, act_space, cache_path=tmp_path / "rb")


# ------------------------------------------------------------------------------------ training


def test_dqn_nstep_same_parameters(tmp_path: Path) -> None:
    """DQN(n_steps=3) uses SB3's NStepReplayBuffer; the same run with ours ends identical."""
    n = th.get_num_threads()
    th.set_num_threads(1)
    try:
        def train(**kw: Any) -> DQN:
            env = make_vec_env("CartPole-v1", n_envs=2, seed=3)
            model = DQN("MlpPolicy", env, buffer_size=150, learning_starts=50, batch_size=16, train_freq=2,
                        target_update_interval=40, seed=3, device="cpu", policy_kwargs=dict(net_arch=[16, 16]), **kw)
            return model.learn(300)

        ref = train(n_steps=3)
        assert type(ref.replay_buffer) is NStepReplayBuffer
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "n_steps is ignored" warning: nothing is ignored
            ours = train(replay_buffer_class=ZarrNStepReplayBuffer,
                         replay_buffer_kwargs=dict(n_steps=3, gamma=0.99, cache_path=tmp_path / "rb"))
        assert ours.replay_buffer.full and ours.replay_buffer.pos == ref.replay_buffer.pos  # the ring wrapped
        sa, sb = ours.policy.state_dict(), ref.policy.state_dict()
        assert list(sa) == list(sb)
        for k in sa:
            assert th.equal(sa[k], sb[k]), f"parameter {k} differs"
        ours.save_replay_buffer(tmp_path / "rb.pkl")
        assert (tmp_path / "rb.pkl").stat().st_size < 4096
        ours.load_replay_buffer(tmp_path / "rb.pkl")
        assert isinstance(ours.replay_buffer, ZarrNStepReplayBuffer) and ours.replay_buffer.n_steps == 3
        ours.replay_buffer.close()
    finally:
        th.set_num_threads(n)
