"""ZarrHerReplayBuffer against stable-baselines3's own HerReplayBuffer as the oracle.

Both buffers get the same transitions (episodes of many lengths, some longer than the ring,
1 and 2 envs, rings that wrap several times); after every ``add`` the episode bookkeeping
(``ep_start``, ``ep_length``, ``_current_ep_start``) must equal SB3's, and under one
``np.random`` seed every ``sample`` must be bit-identical, for the goal strategies future, final
and episode, with ``copy_info_dict``.  A reopened buffer must rebuild the same bookkeeping from
the store and continue as SB3's.  Then: pickling through save/load_replay_buffer, refused
arguments, and a short SAC + HER run on SB3's BitFlippingEnv that ends with the same parameters
as with SB3's HerReplayBuffer.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import gymnasium as gym  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import SAC, HerReplayBuffer  # noqa: E402
from stable_baselines3.common.envs import BitFlippingEnv  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv  # noqa: E402

from trajstore.errors import BadOptionError, UnsupportedSpaceError  # noqa: E402
from trajstore.sb3.her import ZarrHerReplayBuffer  # noqa: E402


class GoalEnv(gym.Env):
    """A goal env whose reward is continuous in the goals and reads the info dicts."""

    observation_space = spaces.Dict({
        "observation": spaces.Box(-5, 5, (3,), np.float32),
        "achieved_goal": spaces.Box(-5, 5, (2,), np.float32),
        "desired_goal": spaces.Box(-5, 5, (2,), np.float32),
    })
    action_space = spaces.Box(-1, 1, (2,), np.float32)

    def compute_reward(self, achieved_goal: np.ndarray, desired_goal: np.ndarray, infos: Any) -> np.ndarray:
        bonus = np.array([info.get("bonus", 0.0) for info in infos]) if len(infos) else 0.0
        return -np.linalg.norm(achieved_goal - desired_goal, axis=-1) + bonus


SPACE = GoalEnv.observation_space


def transition(n: int, rng: np.random.Generator, p_done: float) -> tuple:
    """One ``add`` call of ``n`` envs; dones end episodes (some as timeouts)."""
    def obs() -> dict[str, np.ndarray]:
        return {k: rng.standard_normal((n, *s.shape)).astype(np.float32) for k, s in SPACE.spaces.items()}

    done = rng.random(n) < p_done
    infos = [{"bonus": float(rng.random()), "TimeLimit.truncated": bool(d and rng.random() < 0.3)} for d in done]
    return obs(), obs(), rng.uniform(-1, 1, (n, 2)).astype(np.float32), rng.standard_normal(n).astype(np.float32), \
        done, infos


def assert_samples_equal(got: Any, want: Any, where: str = "") -> None:
    """Every field of two sample tuples: same type, torch dtype, shape and values."""
    assert type(got).__name__ == type(want).__name__, where
    for field in want._fields:
        g, w = getattr(got, field), getattr(want, field)
        if w is None:
            assert g is None, f"{where} {field}"
            continue
        for k in (w if isinstance(w, dict) else [None]):
            gk, wk = (g[k], w[k]) if k is not None else (g, w)
            assert gk.dtype == wk.dtype and gk.shape == wk.shape, f"{where} {field}[{k}]"
            assert th.equal(gk, wk), f"{where} {field}[{k}]: values differ"


def same_samples(ours: Any, ref: Any, seed: int, calls: int = 4, batch: int = 40, where: str = "") -> None:
    np.random.seed(seed)
    want = [ref.sample(batch) for _ in range(calls)]
    np.random.seed(seed)
    got = [ours.sample(batch) for _ in range(calls)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert_samples_equal(g, w, f"{where} call {i}")


def same_bookkeeping(ours: Any, ref: Any, where: str = "") -> None:
    assert (ours.pos, ours.full) == (ref.pos, ref.full), where
    np.testing.assert_array_equal(ours._current_ep_start, ref._current_ep_start, err_msg=f"{where} current")
    np.testing.assert_array_equal(ours.ep_length, ref.ep_length, err_msg=f"{where} ep_length")
    # ep_start matters where an episode can be sampled (SB3 keeps stale values elsewhere)
    valid = ref.ep_length > 0
    np.testing.assert_array_equal(ours.ep_start[valid], ref.ep_start[valid], err_msg=f"{where} ep_start")


def vec_env(n: int) -> DummyVecEnv:
    return DummyVecEnv([GoalEnv for _ in range(n)])


def pair(tmp_path: Path, n_envs: int, size: int, **kw: Any) -> tuple[HerReplayBuffer, ZarrHerReplayBuffer]:
    env = vec_env(n_envs)
    ref = HerReplayBuffer(size * n_envs, SPACE, GoalEnv.action_space, env, "cpu", n_envs=n_envs, **kw)
    ours = ZarrHerReplayBuffer(size * n_envs, SPACE, GoalEnv.action_space, env, "cpu", n_envs=n_envs,
                               cache_path=tmp_path / "rb", **kw)
    return ref, ours


# ------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
@pytest.mark.parametrize("n_envs", [1, 2])
def test_sample_equals_sb3(tmp_path: Path, strategy: str, n_envs: int) -> None:
    ref, ours = pair(tmp_path, n_envs, 16, goal_selection_strategy=strategy, n_sampled_goal=3, copy_info_dict=True)
    with ours:
        rng = np.random.default_rng(n_envs)
        for t in range(60):  # wraps three times; some episodes are longer than the ring
            tr = transition(n_envs, rng, p_done=0.02 if 20 <= t < 40 else 0.25)
            ref.add(*tr)
            ours.add(*tr)
            same_bookkeeping(ours, ref, f"step {t}")
            if t in (5, 15, 16, 31, 47, 59) and (ref.ep_length > 0).any():
                same_samples(ours, ref, seed=t, where=f"{strategy} n_envs={n_envs} step {t}")


@pytest.mark.parametrize("n_envs", [1, 2])
def test_reopen_rebuilds_episode_bookkeeping(tmp_path: Path, n_envs: int) -> None:
    """Closed and reopened at many points (empty, partial episodes, long episodes, after wraps):
    the reopened buffer's bookkeeping is SB3's, and it samples and continues as SB3's."""
    ref, ours = pair(tmp_path, n_envs, 12, goal_selection_strategy="future")
    kw = dict(env=ref.env, device="cpu", resume=True)
    rng = np.random.default_rng(10 + n_envs)
    ours.close()
    for t in range(90):
        if t % 7 == 0:  # reopen now and then
            ours = ZarrHerReplayBuffer.open(tmp_path / "rb", **kw)
            same_bookkeeping(ours, ref, f"reopened before step {t}")
        tr = transition(n_envs, rng, p_done=0.03 if 30 <= t < 55 else 0.3)
        ref.add(*tr)
        ours.add(*tr)
        if t % 7 == 6:
            same_bookkeeping(ours, ref, f"step {t}")
            if (ref.ep_length > 0).any():
                same_samples(ours, ref, seed=t, calls=2, where=f"step {t}")
            ours.close()
    ours.close()


def test_pickle_and_load_replay_buffer(tmp_path: Path) -> None:
    ref, ours = pair(tmp_path, 1, 20)
    rng = np.random.default_rng(3)
    for _ in range(27):
        tr = transition(1, rng, p_done=0.2)
        ref.add(*tr)
        ours.add(*tr)
    data = pickle.dumps(ours)  # what save_replay_buffer writes: a pointer
    assert len(data) < 4096
    assert pickle.loads(data) is ours  # the live buffer holds the folder
    ours.close()
    back = pickle.loads(data)  # reopens the folder, without an env (SB3's HER unpickles without one too)
    assert isinstance(back, ZarrHerReplayBuffer) and back.env is None and back is not ours
    back.set_env(ref.env)
    back.set_env(ref.env)  # the same env again: accepted (load_replay_buffer on the buffer SAC.load reopened)
    with pytest.raises(ValueError, match="already initialized"):
        back.set_env(vec_env(1))
    same_bookkeeping(back, ref)
    same_samples(back, ref, seed=4)
    with pytest.warns(UserWarning, match="truncated"):
        ref.truncate_last_trajectory()
    with pytest.warns(UserWarning, match="truncated"):
        back.truncate_last_trajectory()
    same_bookkeeping(back, ref, "truncated")
    back.close()
    with ZarrHerReplayBuffer.open(tmp_path / "rb", env=ref.env, device="cpu") as again:  # the truncation was stored
        same_bookkeeping(again, ref, "truncated, reopened")
        same_samples(again, ref, seed=5)


def test_reopen_after_the_writer_died(tmp_path: Path) -> None:
    """A process adds transitions and dies (``os._exit``: no close, no flush); the reopened
    buffer has SB3's bookkeeping for every committed transition and continues as SB3's."""
    child = textwrap.dedent(f"""
        import os, sys
        import numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_sb3_her import GoalEnv, SPACE, transition, vec_env
        from trajstore.sb3.her import ZarrHerReplayBuffer
        rb = ZarrHerReplayBuffer(24, SPACE, GoalEnv.action_space, vec_env(2), "cpu", n_envs=2,
                                 cache_path={str(tmp_path / "rb")!r}, commit_interval=0)
        rng = np.random.default_rng(21)
        for t in range(40):
            rb.add(*transition(2, rng, p_done=0.03 if 10 <= t < 25 else 0.3))
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    env = vec_env(2)
    ref = HerReplayBuffer(24, SPACE, GoalEnv.action_space, env, "cpu", n_envs=2)
    rng = np.random.default_rng(21)
    for t in range(40):
        ref.add(*transition(2, rng, p_done=0.03 if 10 <= t < 25 else 0.3))
    with ZarrHerReplayBuffer.open(tmp_path / "rb", env=env, device="cpu") as ours:
        assert ours.full  # the ring wrapped in the child
        same_bookkeeping(ours, ref, "reopened")
        same_samples(ours, ref, seed=8)
        for t in range(15):
            tr = transition(2, rng, p_done=0.3)
            ref.add(*tr)
            ours.add(*tr)
        same_bookkeeping(ours, ref, "continued")
        same_samples(ours, ref, seed=9)


def test_temporary_buffer_pickles_its_data() -> None:
    env = vec_env(1)
    ref = HerReplayBuffer(30, SPACE, GoalEnv.action_space, env, "cpu", goal_selection_strategy="episode")
    with ZarrHerReplayBuffer(30, SPACE, GoalEnv.action_space, env, "cpu", goal_selection_strategy="episode") as rb:
        rng = np.random.default_rng(6)
        for _ in range(37):
            tr = transition(1, rng, p_done=0.2)
            ref.add(*tr)
            rb.add(*tr)
        with pickle.loads(pickle.dumps(rb)) as back:
            assert back.cache_path != rb.cache_path and back.env is None
            back.set_env(env)
            same_bookkeeping(back, ref)
            same_samples(back, ref, seed=7)


def test_reset_forgets_the_episodes(tmp_path: Path) -> None:
    ref, ours = pair(tmp_path, 2, 10)
    rng = np.random.default_rng(12)
    for _ in range(14):
        ours.add(*transition(2, rng, p_done=0.3))
    assert (ours.ep_length > 0).any()
    ours.reset()
    assert ours.size() == 0 and not (ours.ep_length > 0).any() and not ours._current_ep_start.any()
    with pytest.raises(RuntimeError, match="before the end of the first episode"):
        ours.sample(4)
    for _ in range(7):  # it fills again as a new SB3 buffer does
        tr = transition(2, rng, p_done=0.3)
        ref.add(*tr)
        ours.add(*tr)
    same_bookkeeping(ours, ref)
    ours.close()
    with ZarrHerReplayBuffer.open(tmp_path / "rb", env=ref.env, device="cpu") as again:
        same_bookkeeping(again, ref, "reopened")
        same_samples(again, ref, seed=13)


def test_refused_arguments(tmp_path: Path) -> None:
    env, act = vec_env(1), GoalEnv.action_space
    with pytest.raises(UnsupportedSpaceError, match="achieved_goal"):
        ZarrHerReplayBuffer(10, spaces.Dict({"observation": SPACE["observation"]}), act, env)
    with pytest.raises(UnsupportedSpaceError, match="achieved_goal"):
        ZarrHerReplayBuffer(10, SPACE["observation"], act, env)
    with pytest.raises(BadOptionError, match="one of \\['episode', 'final', 'future'\\]; got 'random'"):
        ZarrHerReplayBuffer(10, SPACE, act, env, goal_selection_strategy="random")
    with pytest.raises(BadOptionError, match="optimize_memory_usage"):
        ZarrHerReplayBuffer(10, SPACE, act, env, optimize_memory_usage=True, handle_timeout_termination=False)
    with ZarrHerReplayBuffer(10, SPACE, act, env, cache_path=tmp_path / "rb") as rb:
        with pytest.raises(RuntimeError, match="before the end of the first episode"):
            rb.sample(4)


# ------------------------------------------------------------------------------------ training


@pytest.mark.filterwarnings("ignore:The last trajectory in the replay buffer will be truncated")
def test_sac_her_bitflipping_same_parameters(tmp_path: Path) -> None:
    """SAC + HER on BitFlippingEnv; then the buffers are saved and loaded (SB3's pickle, our
    pointer that reopens the store) and training continues: same parameters throughout."""
    n = th.get_num_threads()
    th.set_num_threads(1)
    try:
        def train(buffer_class: type, **kw: Any) -> SAC:
            env = BitFlippingEnv(n_bits=4, continuous=True, max_steps=6)
            model = SAC("MultiInputPolicy", env, buffer_size=150, learning_starts=40, batch_size=32, seed=5,
                        device="cpu", policy_kwargs=dict(net_arch=[16, 16]), replay_buffer_class=buffer_class,
                        replay_buffer_kwargs=dict(n_sampled_goal=2, goal_selection_strategy="future", **kw))
            return model.learn(200)

        def same(a: SAC, b: SAC) -> None:
            sa, sb = a.policy.state_dict(), b.policy.state_dict()
            assert list(sa) == list(sb)
            for k in sa:
                assert th.equal(sa[k], sb[k]), f"parameter {k} differs"

        ref = train(HerReplayBuffer)
        ours = train(ZarrHerReplayBuffer, cache_path=tmp_path / "rb")
        assert ours.replay_buffer.full  # the ring wrapped
        same(ours, ref)
        ref.save_replay_buffer(tmp_path / "ref.pkl")
        ours.save_replay_buffer(tmp_path / "ours.pkl")
        ours.replay_buffer.close()  # as if the process ended
        ref.load_replay_buffer(tmp_path / "ref.pkl")
        ours.load_replay_buffer(tmp_path / "ours.pkl")  # reopens the store; truncates the last episode as SB3's
        same_bookkeeping(ours.replay_buffer, ref.replay_buffer)
        for model in (ref, ours):  # the global RNGs moved on with the other run: the same seed for both
            model.set_random_seed(7)
            model.learn(80, reset_num_timesteps=False)
        same(ours, ref)
        ours.replay_buffer.close()
    finally:
        th.set_num_threads(n)
