"""End to end: SB3 algorithms trained with trajstore buffers end with the same policy parameters
(``torch.equal``) as with SB3's default buffers (CPU, fixed seed); and a SAC run continues from
its ``cache_path`` after the process ended cleanly or was killed with SIGKILL.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import torch as th  # noqa: E402
from stable_baselines3 import A2C, DDPG, DQN, PPO, SAC, TD3  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402

from trajstore.sb3 import DummyVecRolloutBuffer, ZarrReplayBuffer, ZarrRolloutBuffer  # noqa: E402


def small_net() -> dict[str, Any]:
    """Fresh policy_kwargs for every model (SB3 adds keys to the dict it is given)."""
    return dict(net_arch=[16, 16])


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(n)


def assert_same_parameters(a: Any, b: Any) -> None:
    sa, sb = a.policy.state_dict(), b.policy.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert th.equal(sa[k], sb[k]), f"parameter {k} differs"


def close_buffer(model: Any) -> None:
    buf = getattr(model, "replay_buffer", None) or getattr(model, "rollout_buffer", None)
    if hasattr(buf, "close"):
        buf.close()


# ------------------------------------------------------------------------------- same parameters


@pytest.mark.slow
def test_sac_pendulum_same_parameters(tmp_path: Path) -> None:
    def train(**kw: Any) -> SAC:
        env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
        model = SAC("MlpPolicy", env, buffer_size=240, learning_starts=100, batch_size=32, seed=0, device="cpu",
                    policy_kwargs=small_net(), **kw)
        return model.learn(400)

    ref = train()
    ours = train(replay_buffer_class=ZarrReplayBuffer, replay_buffer_kwargs=dict(cache_path=tmp_path / "rb"))
    assert ours.replay_buffer.full and ours.replay_buffer.pos == ref.replay_buffer.pos  # the ring wrapped
    assert_same_parameters(ours, ref)
    close_buffer(ours)


@pytest.mark.parametrize("algo", [TD3, DDPG])
def test_td3_ddpg_same_parameters(tmp_path: Path, algo: type) -> None:
    def train(**kw: Any) -> Any:
        env = make_vec_env("Pendulum-v1", n_envs=1, seed=1)
        return algo("MlpPolicy", env, buffer_size=150, learning_starts=50, batch_size=16, seed=1, device="cpu",
                    policy_kwargs=small_net(), **kw).learn(200)

    ours = train(replay_buffer_class=ZarrReplayBuffer, replay_buffer_kwargs=dict(cache_path=tmp_path / "rb"))
    assert_same_parameters(ours, train())
    close_buffer(ours)


@pytest.mark.filterwarnings("ignore:The last trajectory in the replay buffer will be truncated")
def test_dqn_optimize_memory_same_parameters(tmp_path: Path) -> None:
    """optimize_memory_usage, and the ``dones[pos] = True`` that a second ``learn`` writes."""
    def train(buffer_class: Any = None, **buffer_kwargs: Any) -> DQN:
        env = make_vec_env("CartPole-v1", n_envs=2, seed=2)
        model = DQN("MlpPolicy", env, buffer_size=200, learning_starts=60, batch_size=16, train_freq=4,
                    target_update_interval=50, optimize_memory_usage=True, seed=2, device="cpu",
                    policy_kwargs=small_net(), replay_buffer_class=buffer_class,
                    replay_buffer_kwargs=dict(handle_timeout_termination=False, **buffer_kwargs))
        model.learn(300)
        return model.learn(200)

    ref = train()
    ours = train(ZarrReplayBuffer, cache_path=tmp_path / "rb")
    np.testing.assert_array_equal(ours.replay_buffer.dones, ref.replay_buffer.dones)
    assert_same_parameters(ours, ref)
    close_buffer(ours)


@pytest.mark.parametrize("setup", ["dummyvec-threads", "dummyvec-history", "zarr-history"])
def test_ppo_cartpole_same_parameters(tmp_path: Path, setup: str) -> None:
    def train(**kw: Any) -> PPO:
        env = make_vec_env("CartPole-v1", n_envs=4, seed=0)
        model = PPO("MlpPolicy", env, n_steps=32, batch_size=64, n_epochs=2, seed=0, device="cpu",
                    policy_kwargs=small_net(), **kw)
        return model.learn(32 * 4 * 3)

    kwargs = {
        "dummyvec-threads": dict(rollout_buffer_class=DummyVecRolloutBuffer,
                                 rollout_buffer_kwargs=dict(use_threads=True, cache_path=tmp_path / "p")),
        "dummyvec-history": dict(rollout_buffer_class=DummyVecRolloutBuffer,
                                 rollout_buffer_kwargs=dict(buffer_kwargs=dict(keep_history=True))),
        "zarr-history": dict(rollout_buffer_class=ZarrRolloutBuffer,
                             rollout_buffer_kwargs=dict(keep_history=True, cache_path=tmp_path / "z")),
    }[setup]
    ours = train(**kwargs)
    assert_same_parameters(ours, train())
    buf = ours.rollout_buffer
    if setup.endswith("history"):  # every step of the 3 rollouts is in the history
        hist = buf.history if isinstance(buf, ZarrRolloutBuffer) else [h for s in buf.buffers for h in s.history]
        assert sum(len(h) for h in hist) == 32 * 4 * 3
    close_buffer(ours)


def test_a2c_cartpole_same_parameters(tmp_path: Path) -> None:
    def train(**kw: Any) -> A2C:
        env = make_vec_env("CartPole-v1", n_envs=3, seed=3)
        return A2C("MlpPolicy", env, n_steps=8, seed=3, device="cpu", policy_kwargs=small_net(), **kw).learn(240)

    ours = train(rollout_buffer_class=DummyVecRolloutBuffer, rollout_buffer_kwargs=dict(cache_path=tmp_path / "a"))
    assert_same_parameters(ours, train())
    close_buffer(ours)


# ------------------------------------------------------------------------------------------- resume

CHILD = textwrap.dedent("""
    import hashlib, json, os, sys
    import numpy as np, torch as th
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from trajstore.sb3 import ZarrReplayBuffer
    th.set_num_threads(1)
    mode, work = sys.argv[1], sys.argv[2]

    def digest(rb, n):
        h = hashlib.sha1()
        for a in (np.asarray(rb.observations)[:n], np.asarray(rb.next_observations)[:n], rb.actions[:n],
                  rb.rewards[:n], rb.dones[:n], rb.timeouts[:n]):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    class Marker(BaseCallback):
        def _on_step(self):
            if self.num_timesteps == 150:
                self.model.save(os.path.join(work, "model"))
                rb = self.model.replay_buffer
                rb.flush()
                with open(os.path.join(work, "marker.tmp"), "w") as f:
                    json.dump({"n": rb.size(), "digest": digest(rb, rb.size())}, f)
                os.replace(os.path.join(work, "marker.tmp"), os.path.join(work, "marker.json"))
            return True

    env = make_vec_env("Pendulum-v1", n_envs=1, seed=0)
    model = SAC("MlpPolicy", env, buffer_size=100_000, learning_starts=50, batch_size=32, seed=0, device="cpu",
                policy_kwargs=dict(net_arch=[16, 16]), replay_buffer_class=ZarrReplayBuffer,
                replay_buffer_kwargs=dict(cache_path=os.path.join(work, "buffer"), commit_interval=0.1,
                                          resume=True))
    if mode == "clean":
        model.learn(150)
        model.save(os.path.join(work, "model"))
        model.save_replay_buffer(os.path.join(work, "buffer.pkl"))
        rb = model.replay_buffer
        print(json.dumps({"n": rb.size(), "digest": digest(rb, rb.size())}))
        # no close(): the process just ends
    else:
        model.learn(10**7, callback=Marker())  # killed long before it ends
""")


def _run_child(work: Path, mode: str) -> subprocess.Popen:
    script = work / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen([sys.executable, str(script), mode, str(work)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _digest(rb: Any, n: int) -> str:
    h = hashlib.sha1()
    for a in (np.asarray(rb.observations)[:n], np.asarray(rb.next_observations)[:n], rb.actions[:n], rb.rewards[:n],
              rb.dones[:n], rb.timeouts[:n]):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _check_transitions(rb: Any, lo: int, hi: int) -> None:
    """Rows ``[lo, hi)`` of one run chain up: next_obs[i] == obs[i + 1] unless the episode ended
    (no half-written or missing row in between)."""
    obs, nxt = np.asarray(rb.observations)[lo:hi, 0], np.asarray(rb.next_observations)[lo:hi, 0]
    go_on = rb.dones[lo : hi - 1, 0] == 0
    np.testing.assert_array_equal(nxt[:-1][go_on], obs[1:][go_on])


def _load_and_continue(work: Path, expect_at_least: int, expect_digest: str, more: bool = False) -> None:
    env = make_vec_env("Pendulum-v1", n_envs=1, seed=5)
    model = SAC.load(work / "model", env=env, device="cpu")  # rebuilds the buffer from cache_path
    rb = model.replay_buffer
    assert isinstance(rb, ZarrReplayBuffer)
    n = rb.size()
    assert n >= expect_at_least, f"only {n} transitions; {expect_at_least} were committed"
    if more:  # rows committed automatically after the explicit flush survived the kill too
        assert n > expect_at_least, "no transition committed after the marker survived"
    assert _digest(rb, expect_at_least) == expect_digest
    _check_transitions(rb, 0, n)
    model.learn(60, reset_num_timesteps=False)  # starts with a fresh env reset, as SB3 does after load
    assert rb.size() == n + 60 and model.replay_buffer is rb
    _check_transitions(rb, n, n + 60)
    rb.close()


@pytest.mark.slow
def test_resume_in_a_new_process(tmp_path: Path) -> None:
    child = _run_child(tmp_path, "clean")
    out, err = child.communicate(timeout=240)
    assert child.returncode == 0, err
    saved = json.loads(out.strip().splitlines()[-1])
    assert saved["n"] == 150
    assert os.path.getsize(tmp_path / "buffer.pkl") < 4096  # a pointer, not the data
    env = make_vec_env("Pendulum-v1", n_envs=1, seed=5)
    model = SAC.load(tmp_path / "model", env=env, device="cpu")
    rebuilt = model.replay_buffer
    model.load_replay_buffer(tmp_path / "buffer.pkl")
    assert model.replay_buffer is rebuilt  # the pointer resolves to the buffer SAC.load reopened
    rebuilt.close()
    _load_and_continue(tmp_path, 150, saved["digest"])


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path: Path) -> None:
    child = _run_child(tmp_path, "kill")
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "marker.json").exists():
            assert child.poll() is None, child.communicate()[1]
            assert time.monotonic() < deadline, "the child never reached the marker"
            time.sleep(0.05)
        time.sleep(1.0)  # more rows get committed (commit_interval=0.1) while it keeps training
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
    marker = json.loads((tmp_path / "marker.json").read_text())
    _load_and_continue(tmp_path, marker["n"], marker["digest"], more=True)


# ------------------------------------------------------------------------------------------- bench


@pytest.mark.slow
def test_bench_sb3_quick(tmp_path: Path) -> None:
    """scripts/bench_sb3.py's section (small sizes; timings are printed, never asserted)."""
    from _bench import quick_section

    text = quick_section("sb3", tmp_path)
    assert "| SAC Pendulum-v1, 120 steps, learning_starts 60 (ZarrReplayBuffer) |" in text
    assert "| PPO CartPole-v1, 8 envs, n_steps 32, 768 steps (ZarrRolloutBuffer) |" in text
    assert "median of 1 `learn` runs per side" in text
