"""What an SB3 buffer does with a ``cache_path`` that already holds a buffer (issue 13).

``resume=None`` (default) reopens it with a ``ResumedBufferWarning`` naming what was found;
``resume=True`` reopens it silently; ``resume=False`` refuses (``StoreExistsError``) and leaves
it untouched; ``overwrite=True`` starts empty.  A fresh or temporary buffer never warns.  Checked
on the replay buffers, the rollout buffer with history, the DummyVec facade (one warning for all
envs), and through real SAC runs: a rerun script warns, ``SAC.load`` with ``resume=True`` does not.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import gymnasium as gym  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import SAC  # noqa: E402

from trajstore.errors import StoreExistsError  # noqa: E402
from trajstore.sb3 import (  # noqa: E402
    DummyVecRolloutBuffer,
    ResumedBufferWarning,
    ZarrDictReplayBuffer,
    ZarrReplayBuffer,
    ZarrRolloutBuffer,
)

OBS = spaces.Box(-1, 1, (3,), np.float32)
ACT = spaces.Box(-1, 1, (2,), np.float32)


def fill_replay(path: Path, n: int, n_envs: int = 1) -> None:
    rb = ZarrReplayBuffer(100, OBS, ACT, "cpu", n_envs=n_envs, cache_path=path)
    for i in range(n):
        obs = np.full((n_envs, 3), i / 100, np.float32)
        rb.add(obs, obs, np.zeros((n_envs, 2), np.float32), np.ones(n_envs), np.zeros(n_envs), [{}] * n_envs)
    rb.close()


def resumed(make: Any) -> tuple[Any, list[str]]:
    """``make()`` and the messages of the ResumedBufferWarnings it gave (other warnings, e.g. a
    ResourceWarning of an earlier test's garbage, are not this test's business)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = make()
    return out, [str(w.message) for w in caught if issubclass(w.category, ResumedBufferWarning)]


def test_fresh_and_temporary_buffers_do_not_warn(tmp_path: Path) -> None:
    for kw in (dict(cache_path=tmp_path / "new"), dict(cache_path=None), dict(cache_path=tmp_path / "r", resume=False)):
        rb, msgs = resumed(lambda: ZarrReplayBuffer(100, OBS, ACT, "cpu", **kw))
        assert msgs == [] and rb.size() == 0
        rb.close()


def test_an_empty_buffer_reopens_without_warning(tmp_path: Path) -> None:
    fill_replay(tmp_path / "rb", 0)  # carries nothing of an earlier run
    rb, msgs = resumed(lambda: ZarrReplayBuffer(100, OBS, ACT, "cpu", cache_path=tmp_path / "rb"))
    assert msgs == [] and rb.size() == 0
    rb.close()
    with pytest.raises(StoreExistsError):  # resume=False refuses any existing buffer, empty or not
        ZarrReplayBuffer(100, OBS, ACT, "cpu", cache_path=tmp_path / "rb", resume=False)


def test_default_reopens_with_a_warning_naming_the_rows(tmp_path: Path) -> None:
    fill_replay(tmp_path / "rb", 7, n_envs=2)
    rb, msgs = resumed(lambda: ZarrReplayBuffer(100, OBS, ACT, "cpu", n_envs=2, cache_path=tmp_path / "rb"))
    assert rb.size() == 7
    assert len(msgs) == 1
    assert str(tmp_path / "rb") in msgs[0] and "14 transitions (7 positions x 2 envs)" in msgs[0]
    assert "resume=True" in msgs[0] and "overwrite=True" in msgs[0]
    rb.close()


def test_resume_true_is_silent_and_keeps_every_row(tmp_path: Path) -> None:
    fill_replay(tmp_path / "rb", 5)
    rb, msgs = resumed(lambda: ZarrReplayBuffer(100, OBS, ACT, "cpu", cache_path=tmp_path / "rb", resume=True))
    assert msgs == [] and rb.size() == 5
    np.testing.assert_array_equal(rb.observations[:5, 0, 0], np.arange(5, dtype=np.float32) / 100)
    rb.close()
    rb, msgs = resumed(lambda: ZarrReplayBuffer.open(tmp_path / "rb"))  # an explicit reopen
    assert msgs == [] and rb.size() == 5
    rb.close()


def test_resume_false_refuses_and_touches_nothing(tmp_path: Path) -> None:
    fill_replay(tmp_path / "rb", 5)
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "rb").rglob("*"))
    with pytest.raises(StoreExistsError, match=r"rb: holds a ZarrReplayBuffer .*resume=True.*overwrite=True"):
        ZarrReplayBuffer(100, OBS, ACT, "cpu", cache_path=tmp_path / "rb", resume=False)
    after = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "rb").rglob("*"))
    assert before == after
    rb, msgs = resumed(lambda: ZarrReplayBuffer(100, OBS, ACT, "cpu", cache_path=tmp_path / "rb", resume=True))
    assert rb.size() == 5
    rb.close()


def test_overwrite_starts_empty_without_warning(tmp_path: Path) -> None:
    fill_replay(tmp_path / "rb", 5)
    for resume in (None, False):
        rb, msgs = resumed(lambda: ZarrReplayBuffer(100, OBS, ACT, "cpu", cache_path=tmp_path / "rb",
                                                     overwrite=True, resume=resume))
        assert msgs == [] and rb.size() == 0
        rb.close()


def test_dict_replay_buffer_follows_the_same_rule(tmp_path: Path) -> None:
    obs = spaces.Dict({"v": OBS})
    rb = ZarrDictReplayBuffer(10, obs, ACT, "cpu", cache_path=tmp_path / "d")
    rb.add({"v": np.zeros((1, 3))}, {"v": np.zeros((1, 3))}, np.zeros((1, 2)), np.zeros(1), np.zeros(1), [{}])
    rb.close()
    rb, msgs = resumed(lambda: ZarrDictReplayBuffer(10, obs, ACT, "cpu", cache_path=tmp_path / "d"))
    assert len(msgs) == 1 and "1 transitions" in msgs[0] and "ZarrDictReplayBuffer" in msgs[0]
    rb.close()
    with pytest.raises(StoreExistsError):
        ZarrDictReplayBuffer(10, obs, ACT, "cpu", cache_path=tmp_path / "d", resume=False)


def rollout_once(buf: Any, n_envs: int) -> None:
    buf.reset()
    for t in range(4):
        buf.add(np.zeros((n_envs, 3), np.float32), np.zeros((n_envs, 2), np.float32), np.ones(n_envs, np.float32),
                np.full(n_envs, t == 0), th.zeros(n_envs), th.zeros(n_envs))
    buf.compute_returns_and_advantage(th.zeros(n_envs), np.zeros(n_envs))


def test_rollout_buffer_warns_only_when_its_history_carries_data(tmp_path: Path) -> None:
    plain = ZarrRolloutBuffer(4, OBS, ACT, "cpu", cache_path=tmp_path / "plain")
    rollout_once(plain, 1)
    plain.close()
    buf, msgs = resumed(lambda: ZarrRolloutBuffer(4, OBS, ACT, "cpu", cache_path=tmp_path / "plain"))
    assert msgs == []  # nothing of the earlier run is used: the rollout restarts
    buf.close()

    hist = ZarrRolloutBuffer(4, OBS, ACT, "cpu", cache_path=tmp_path / "hist", keep_history=True)
    rollout_once(hist, 1)
    rollout_once(hist, 1)
    hist.close()
    buf, msgs = resumed(lambda: ZarrRolloutBuffer(4, OBS, ACT, "cpu", cache_path=tmp_path / "hist", keep_history=True))
    assert len(msgs) == 1 and "2 rollouts (8 steps) in its history" in msgs[0]
    buf.close()
    with pytest.raises(StoreExistsError):
        ZarrRolloutBuffer(4, OBS, ACT, "cpu", cache_path=tmp_path / "hist", keep_history=True, resume=False)
    buf, msgs = resumed(lambda: ZarrRolloutBuffer(4, OBS, ACT, "cpu", cache_path=tmp_path / "hist",
                                                  keep_history=True, resume=True))
    assert msgs == [] and sum(len(tb) for tb in buf.history) == 8
    buf.close()


def test_facade_decides_once_for_all_envs(tmp_path: Path) -> None:
    kw = dict(n_envs=3, cache_path=tmp_path / "f", buffer_kwargs=dict(keep_history=True))
    f = DummyVecRolloutBuffer(4, OBS, ACT, "cpu", **kw)
    rollout_once(f, 3)
    f.close()
    f, msgs = resumed(lambda: DummyVecRolloutBuffer(4, OBS, ACT, "cpu", **kw))
    assert len(msgs) == 1 and "12 steps in the history of its 3 envs" in msgs[0]
    f.close()
    with pytest.raises(StoreExistsError):
        DummyVecRolloutBuffer(4, OBS, ACT, "cpu", n_envs=3, cache_path=tmp_path / "f",
                              buffer_kwargs=dict(keep_history=True, resume=False))
    f, msgs = resumed(lambda: DummyVecRolloutBuffer(4, OBS, ACT, "cpu", n_envs=3, cache_path=tmp_path / "f",
                                                    buffer_kwargs=dict(keep_history=True, resume=True)))
    assert msgs == []
    f.close()


def sac(path: Path, **kw: Any) -> SAC:
    return SAC("MlpPolicy", gym.make("Pendulum-v1"), seed=0, learning_starts=20, batch_size=16, device="cpu",
               replay_buffer_class=ZarrReplayBuffer, replay_buffer_kwargs=dict(cache_path=path, **kw))


def test_sac_rerun_warns_and_sac_load_with_resume_is_silent(tmp_path: Path) -> None:
    model, msgs = resumed(lambda: sac(tmp_path / "buf"))
    assert msgs == []
    model.learn(40)
    model.save(tmp_path / "model")
    model.replay_buffer.close()
    # the same script run again: a new model would train on the earlier run's 40 transitions
    model, msgs = resumed(lambda: sac(tmp_path / "buf"))
    assert len(msgs) == 1 and "40 transitions" in msgs[0]
    assert model.replay_buffer.size() == 40
    model.replay_buffer.close()
    with pytest.raises(StoreExistsError):
        sac(tmp_path / "buf", resume=False)
    # a run created with resume=True: SAC.load rebuilds the buffer with the saved kwargs, silently
    model = sac(tmp_path / "buf2", resume=True)
    model.learn(30)
    model.save(tmp_path / "model2")
    model.replay_buffer.close()
    model, msgs = resumed(lambda: SAC.load(tmp_path / "model2", env=gym.make("Pendulum-v1"), device="cpu"))
    assert msgs == [] and model.replay_buffer.size() == 30
    model.learn(10, reset_num_timesteps=False)
    assert model.replay_buffer.size() == 40
    model.replay_buffer.close()
