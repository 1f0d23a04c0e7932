"""ZarrRolloutBuffer and DummyVecRolloutBuffer against stable-baselines3's RolloutBuffer.

Every buffer gets the same rollouts; advantages, returns and every minibatch of ``get`` (under
one ``np.random`` seed, partial last batch and ``get(None)`` included) must equal SB3's bit for
bit.  Then the facade's own contract (splitting, ``full``, validation, threads, pickling,
close), and ``keep_history``.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import gymnasium as gym  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.errors import SpaceMismatchError, UnsupportedSpaceError  # noqa: E402
from trajstore.sb3 import DummyVecRolloutBuffer, ZarrDictRolloutBuffer, ZarrRolloutBuffer  # noqa: E402

T = 12  # steps per rollout
GAMMA, LAMBDA = 0.98, 0.9

OBS = {
    "float": (spaces.Box(-np.inf, np.inf, (3,), np.float32), spaces.Discrete(3)),
    "image": (spaces.Box(0, 255, (10, 10, 3), np.uint8), spaces.Box(-1, 1, (2,), np.float32)),
    "discrete": (spaces.Discrete(5), spaces.MultiDiscrete([2, 3])),
    "dict": (spaces.Dict({"img": spaces.Box(0, 255, (6, 6, 1), np.uint8), "vec": spaces.Box(-1, 1, (4,), np.float32),
                          "d": spaces.Discrete(4)}), spaces.Box(-1, 1, (1,), np.float32)),
}


def value(space: gym.Space, n: int, rng: np.random.Generator) -> Any:
    if isinstance(space, spaces.Dict):
        return {k: value(s, n, rng) for k, s in space.spaces.items()}
    if isinstance(space, spaces.Discrete):
        return rng.integers(0, space.n, size=n).astype(space.dtype)
    if isinstance(space, spaces.MultiDiscrete):
        return rng.integers(0, space.nvec, size=(n, *space.shape)).astype(space.dtype)
    if space.dtype == np.uint8:
        return rng.integers(0, 256, size=(n, *space.shape)).astype(np.uint8)
    return rng.standard_normal((n, *space.shape)).astype(space.dtype)


def rollout(bufs: list[Any], obs_space: gym.Space, act_space: gym.Space, n: int, seed: int,
            starts: np.ndarray | None = None, before_step: Callable[[int, list[Any]], list[Any]] | None = None
            ) -> list[Any]:
    """reset, T adds (as PPO's collect_rollouts passes them), compute_returns_and_advantage;
    ``before_step(t, bufs)`` may hand back other buffers to go on with.  Returns the buffers."""
    rng = np.random.default_rng(seed)
    for b in bufs:
        b.reset()
    for t in range(T):
        if before_step is not None:
            bufs = before_step(t, bufs)
        action = value(act_space, n, rng)
        if isinstance(act_space, spaces.Discrete):
            action = action.reshape(-1, 1)  # as collect_rollouts does
        es = (rng.random(n) < 0.25).astype(np.float32) if starts is None else starts[t]
        args = (value(obs_space, n, rng), action, rng.standard_normal(n).astype(np.float32), es,
                th.tensor(rng.standard_normal((n, 1)).astype(np.float32)),
                th.tensor(rng.standard_normal(n).astype(np.float32)))
        for b in bufs:
            b.add(*args)
    last_values = th.tensor(rng.standard_normal((n, 1)).astype(np.float32))
    dones = rng.random(n) < 0.4
    for b in bufs:
        b.compute_returns_and_advantage(last_values=last_values, dones=dones)
    return bufs


def assert_batches_equal(got: list[Any], want: list[Any], where: str) -> None:
    assert len(got) == len(want), f"{where}: {len(got)} minibatches, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert type(g).__name__ == type(w).__name__
        for field in w._fields:
            a, b = getattr(g, field), getattr(w, field)
            pairs = [(a[k], b[k], k) for k in b] if isinstance(b, dict) else [(a, b, "")]
            for x, y, k in pairs:
                assert x.dtype == y.dtype and x.shape == y.shape, f"{where} batch {i} {field}{k}"
                assert th.equal(x, y), f"{where} batch {i} {field}{k}: values differ"


def same_gets(ours: Any, ref: Any, where: str, seed: int) -> None:
    for epoch, batch_size in enumerate((5, 5, None)):  # 12*n not a multiple of 5: partial last batch
        np.random.seed(seed + epoch)
        want = list(ref.get(batch_size))
        np.random.seed(seed + epoch)
        got = list(ours.get(batch_size))
        assert_batches_equal(got, want, f"{where} epoch {epoch}")


def ref_buffer(obs_space: gym.Space, act_space: gym.Space, n: int) -> RolloutBuffer:
    cls = DictRolloutBuffer if isinstance(obs_space, spaces.Dict) else RolloutBuffer
    return cls(T, obs_space, act_space, "cpu", gae_lambda=LAMBDA, gamma=GAMMA, n_envs=n)


BUILDERS: dict[str, Callable[..., Any]] = {
    "zarr": lambda o, a, n, p: (ZarrDictRolloutBuffer if isinstance(o, spaces.Dict) else ZarrRolloutBuffer)(
        T, o, a, "cpu", gae_lambda=LAMBDA, gamma=GAMMA, n_envs=n, cache_path=p),
    "zarr-read-per-batch": lambda o, a, n, p: (ZarrDictRolloutBuffer if isinstance(o, spaces.Dict) else ZarrRolloutBuffer)(
        T, o, a, "cpu", gae_lambda=LAMBDA, gamma=GAMMA, n_envs=n, load_obs_on_get=False),
    "dummyvec": lambda o, a, n, p: DummyVecRolloutBuffer(T, o, a, "cpu", n_envs=n, gamma=GAMMA, gae_lambda=LAMBDA,
                                                         cache_path=p),
    "dummyvec-threads": lambda o, a, n, p: DummyVecRolloutBuffer(T, o, a, "cpu", n_envs=n, gamma=GAMMA,
                                                                 gae_lambda=LAMBDA, use_threads=True),
    "dummyvec-read-per-batch": lambda o, a, n, p: DummyVecRolloutBuffer(
        T, o, a, "cpu", n_envs=n, gamma=GAMMA, gae_lambda=LAMBDA, use_threads=True,
        buffer_kwargs=dict(load_obs_on_get=False)),
    "dummyvec-sb3-subs": lambda o, a, n, p: DummyVecRolloutBuffer(
        T, o, a, "cpu", n_envs=n, gamma=GAMMA, gae_lambda=LAMBDA, use_threads=True,
        buffer_class=DictRolloutBuffer if isinstance(o, spaces.Dict) else RolloutBuffer),
}


@pytest.mark.parametrize("impl", list(BUILDERS))
@pytest.mark.parametrize("n_envs", [1, 4])
@pytest.mark.parametrize("kind", list(OBS))
def test_rollouts_equal_sb3(tmp_path: Path, kind: str, n_envs: int, impl: str) -> None:
    obs_space, act_space = OBS[kind]
    ref = ref_buffer(obs_space, act_space, n_envs)
    ours = BUILDERS[impl](obs_space, act_space, n_envs, tmp_path / "buf")
    try:
        for r in range(2):
            rollout([ref, ours], obs_space, act_space, n_envs, seed=r)
            assert ours.full and ours.size() == ref.size() == T
            for name in ("advantages", "returns", "values"):
                a, b = getattr(ours, name), getattr(ref, name)
                assert a.shape == b.shape == (T, n_envs) and a.dtype == b.dtype, name
                assert np.array_equal(a, b), f"{name} differ"
            same_gets(ours, ref, f"{kind}/{impl}/rollout {r}", seed=10 * r)
            for name in ("values", "returns", "advantages"):  # flattened env-major by get, as SB3's
                assert np.array_equal(getattr(ours, name), getattr(ref, name)), name
    finally:
        if hasattr(ours, "close"):
            ours.close()


def test_rollout_observation_view(tmp_path: Path) -> None:
    obs_space, act_space = OBS["image"]
    ref = ref_buffer(obs_space, act_space, 3)
    with ZarrRolloutBuffer(T, obs_space, act_space, "cpu", gae_lambda=LAMBDA, gamma=GAMMA, n_envs=3) as ours:
        rollout([ref, ours], obs_space, act_space, 3, seed=5)
        np.testing.assert_array_equal(np.asarray(ours.observations), ref.observations)
        np.testing.assert_array_equal(ours.observations[3:7, 2], ref.observations[3:7, 2])
        with pytest.raises(UnsupportedSpaceError, match="ZarrDictRolloutBuffer"):
            ZarrRolloutBuffer(T, OBS["dict"][0], act_space)
        with pytest.raises(UnsupportedSpaceError, match="Dict observation space"):
            ZarrDictRolloutBuffer(T, obs_space, act_space)


# --------------------------------------------------------------------------------------- the facade


def test_facade_splits_per_env(tmp_path: Path) -> None:
    obs_space, act_space = OBS["float"]
    with DummyVecRolloutBuffer(T, obs_space, act_space, "cpu", n_envs=3, gamma=GAMMA, gae_lambda=LAMBDA,
                               cache_path=tmp_path / "f") as f:
        assert f.n_envs == 3 and f.gae_lambda == LAMBDA and f.gamma == GAMMA  # not misrouted
        subs = f.buffers
        assert [s.n_envs for s in subs] == [1, 1, 1] and all(isinstance(s, ZarrRolloutBuffer) for s in subs)
        assert [s.cache_path for s in subs] == [str(tmp_path / "f" / f"env_{i}") for i in range(3)]
        assert json.loads((tmp_path / "f" / "sb3.json").read_text())["kind"] == "DummyVecRolloutBuffer"
        ref = ref_buffer(obs_space, act_space, 3)
        rollout([ref, f], obs_space, act_space, 3, seed=1)
        for i, s in enumerate(subs):  # env i holds column i, and got last_values[i] / dones[i]
            np.testing.assert_array_equal(np.asarray(s.observations)[:, 0], ref.observations[:, i])
            np.testing.assert_array_equal(s.rewards[:, 0], ref.rewards[:, i])
            np.testing.assert_array_equal(s.advantages[:, 0], ref.advantages[:, i])
        np.testing.assert_array_equal(f.rewards, ref.rewards)
        np.testing.assert_array_equal(f.episode_starts, ref.episode_starts)
    assert all(s.closed for s in subs)


def test_facade_full_and_size() -> None:
    obs_space, act_space = OBS["float"]
    assert DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=0, buffers=[]).full is False
    with DummyVecRolloutBuffer(4, obs_space, act_space, "cpu", n_envs=2) as f:
        assert not f.full and f.size() == 0
        rng = np.random.default_rng(0)
        for t in range(4):
            f.add(value(obs_space, 2, rng), np.zeros((2, 1)), np.zeros(2, np.float32), np.zeros(2, np.float32),
                  th.zeros(2, 1), th.zeros(2))
            assert f.full == (t == 3) and f.pos == t + 1
        f.buffers[0].reset()
        assert not f.full  # every sub-buffer must be full
        f.full = True  # set by hand: every sub-buffer, as SB3 code expects to read it back
        assert f.full and all(sub.full for sub in f.buffers)
        f.full = False
        assert not f.full and not any(sub.full for sub in f.buffers)


def test_facade_validation() -> None:
    obs_space, act_space = OBS["float"]
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['keep_history'\]"):
        DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=2, keep_history=True)
    good = [RolloutBuffer(T, obs_space, act_space, gamma=GAMMA, gae_lambda=LAMBDA) for _ in range(2)]
    with pytest.raises(ValueError, match="expected one per env"):
        DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=3, buffers=good, gamma=GAMMA, gae_lambda=LAMBDA)
    with pytest.raises(ValueError, match=r"buffers\[1\].n_envs is 2; expected 1"):
        DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=2, gamma=GAMMA, gae_lambda=LAMBDA,
                              buffers=[good[0], RolloutBuffer(T, obs_space, act_space, n_envs=2)])
    with pytest.raises(ValueError, match=r"buffers\[0\].gamma is 0.99; expected 0.98"):
        DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=1, gamma=GAMMA, gae_lambda=LAMBDA,
                              buffers=[RolloutBuffer(T, obs_space, act_space, gae_lambda=LAMBDA)])
    with pytest.raises(SpaceMismatchError, match=r"buffers\[0\].observation_space"):
        DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=1, gamma=GAMMA, gae_lambda=LAMBDA, buffers=[
            RolloutBuffer(T, spaces.Box(-1, 1, (4,), np.float32), act_space, gamma=GAMMA, gae_lambda=LAMBDA)])
    f = DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=2, buffers=good, gamma=GAMMA, gae_lambda=LAMBDA)
    assert f.buffers == good


def test_facade_reopen_validates(tmp_path: Path) -> None:
    obs_space, act_space = OBS["float"]
    DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=2, cache_path=tmp_path / "f").close()
    with pytest.raises(SpaceMismatchError, match="n_envs=2; got n_envs=3"):
        DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=3, cache_path=tmp_path / "f")
    DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=3, cache_path=tmp_path / "f",
                          buffer_kwargs=dict(overwrite=True, keep_history=True)).close()
    assert sorted(os.listdir(tmp_path / "f")) == ["env_0", "env_1", "env_2", "sb3.json"]
    assert sorted(os.listdir(tmp_path / "f" / "env_2")) == ["history", "rollout", "sb3.json"]
    DummyVecRolloutBuffer(T, obs_space, act_space, n_envs=1, cache_path=tmp_path / "f",
                          buffer_kwargs=dict(overwrite=True)).close()
    assert sorted(os.listdir(tmp_path / "f")) == ["env_0", "sb3.json"]
    assert sorted(os.listdir(tmp_path / "f" / "env_0")) == ["rollout", "sb3.json"]


@pytest.mark.parametrize("where", ["temporary", "folder"])
def test_facade_pickles(tmp_path: Path, where: str) -> None:
    obs_space, act_space = OBS["image"]
    ref = ref_buffer(obs_space, act_space, 2)
    kw = {} if where == "temporary" else dict(cache_path=tmp_path / "f")
    f = DummyVecRolloutBuffer(T, obs_space, act_space, "cpu", n_envs=2, use_threads=True, gamma=GAMMA,
                              gae_lambda=LAMBDA, **kw)
    rollout([ref, f], obs_space, act_space, 2, seed=3)
    folders = [s.cache_path for s in f.buffers]
    g = pickle.loads(pickle.dumps(f))
    assert g.use_threads and g.n_envs == 2
    assert (g.buffers[0] is f.buffers[0]) == (where == "folder")  # in-process handles find the open buffer
    same_gets(g, ref, "unpickled facade", seed=4)
    f.close()
    g.close()
    if where == "temporary":
        assert not any(os.path.exists(p) for p in folders + [s.cache_path for s in g.buffers])


def test_facade_pickled_mid_rollout() -> None:
    """A copy pickled halfway through a rollout goes on adding (its sub-buffers share its arrays
    again) and gives SB3's batches; the original is untouched by the copy's adds."""
    obs_space, act_space = OBS["float"]
    ref = ref_buffer(obs_space, act_space, 3)
    f = DummyVecRolloutBuffer(T, obs_space, act_space, "cpu", n_envs=3, gamma=GAMMA, gae_lambda=LAMBDA)
    copies: list[Any] = []

    def swap(t: int, bufs: list[Any]) -> list[Any]:
        if t == T // 2:
            copies.append(pickle.loads(pickle.dumps(bufs[1])))
            return [bufs[0], copies[0]]
        return bufs

    _, g = rollout([ref, f], obs_space, act_space, 3, seed=5, before_step=swap)
    assert g.full and not f.full and f.pos == T // 2
    for i, sub in enumerate(g.buffers):
        assert np.shares_memory(sub.actions, g.actions) and sub.pos == T
        np.testing.assert_array_equal(sub.advantages[:, 0], ref.advantages[:, i])
    same_gets(g, ref, "facade pickled mid-rollout", seed=6)
    f.close()
    g.close()


# ------------------------------------------------------------------------------------------- history


def test_keep_history(tmp_path: Path) -> None:
    obs_space, act_space = OBS["discrete"]
    n = 2
    starts = np.zeros((3, T, n), np.float32)
    starts[0, 0] = 1  # PPO's first step
    starts[0, 5, 0] = starts[1, 3, 0] = 1  # env 0: episodes [0,5), [5, T+3), [T+3, ...)
    starts[2, 0, 1] = 1  # env 1: an episode ends exactly at a rollout boundary
    p = tmp_path / "z"
    z = ZarrRolloutBuffer(T, obs_space, act_space, "cpu", gae_lambda=LAMBDA, gamma=GAMMA, n_envs=n, cache_path=p,
                          keep_history=True, resume=True)
    ref = ref_buffer(obs_space, act_space, n)
    kept: list[dict[str, np.ndarray]] = []
    for r in range(3):
        rollout([ref, z], obs_space, act_space, n, seed=r, starts=starts[r])
        kept.append({"obs": ref.observations.copy(), "actions": ref.actions.copy(), "returns": ref.returns.copy(),
                     "advantages": ref.advantages.copy(), "rewards": ref.rewards.copy()})
    assert [tb.cache_path for tb in z.history] == [str(p / "history" / f"env_{e}") for e in range(n)]
    z.close()
    for e in range(n):
        tb = TrajectoryReplayBuffer.load_from(p / "history" / f"env_{e}", read_only=True)
        steps = tb[:]["step_data"]
        assert len(tb) == 3 * T
        for name, field in (("obs", "obs"), ("actions", "action"), ("returns", "return"), ("advantages", "advantage"),
                            ("rewards", "reward")):
            np.testing.assert_array_equal(steps[field], np.concatenate([k[name][:, e] for k in kept]), err_msg=field)
        np.testing.assert_array_equal(steps["rollout"], np.repeat(np.arange(3), T))
        ep = tb.episodes()
        want_starts = np.flatnonzero(starts[:, :, e].reshape(-1))
        np.testing.assert_array_equal(ep["start"], want_starts)
        np.testing.assert_array_equal(ep["length"], np.diff(np.append(want_starts, 3 * T)))
        tb.close()
    # reopening appends: the next rollout starts a new episode and gets the next rollout index
    z = ZarrRolloutBuffer(T, obs_space, act_space, "cpu", gae_lambda=LAMBDA, gamma=GAMMA, n_envs=n, cache_path=p,
                          keep_history=True, resume=True)
    first = np.zeros((T, n), np.float32)
    first[0] = 1
    rollout([z], obs_space, act_space, n, seed=9, starts=first)
    for tb in z.history:
        assert len(tb) == 4 * T and int(tb[-1]["step_data"]["rollout"]) == 3
        assert tb.episodes()["start"][-1] == 3 * T
    z.close()


def test_dummyvec_history_per_env(tmp_path: Path) -> None:
    obs_space, act_space = OBS["dict"]
    f = DummyVecRolloutBuffer(T, obs_space, act_space, "cpu", n_envs=2, cache_path=tmp_path / "f",
                              buffer_kwargs=dict(keep_history=True))
    ref = ref_buffer(obs_space, act_space, 2)
    rollout([ref, f], obs_space, act_space, 2, seed=2)
    f.close()
    for e in range(2):
        with TrajectoryReplayBuffer.load_from(tmp_path / "f" / f"env_{e}" / "history", read_only=True) as tb:
            obs = tb[:]["step_data"]["obs"]
            for k in ("img", "vec", "d"):
                np.testing.assert_array_equal(obs[k], ref.observations[k][:, e])


def test_sb3_allocation_is_never_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SB3's RolloutBuffer.__init__ / reset (dense observation arrays) are never called."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("SB3's RolloutBuffer.__init__ or reset called")

    for cls in (RolloutBuffer, DictRolloutBuffer):
        monkeypatch.setattr(cls, "__init__", refuse)
        monkeypatch.setattr(cls, "reset", refuse)
    obs_space, act_space = OBS["image"]
    with DummyVecRolloutBuffer(4096, obs_space, act_space, n_envs=2, gamma=GAMMA, gae_lambda=LAMBDA,
                               cache_path=tmp_path / "f") as f:
        f.reset()
        assert f.buffers[0].observations.shape == (4096, 1, 10, 10, 3)
    with ZarrDictRolloutBuffer(16, OBS["dict"][0], act_space, n_envs=3) as z:
        z.reset()


@pytest.mark.parametrize("impl", ["zarr", "dummyvec", "dummyvec-sb3-subs"])
def test_staged_steps_and_positions_set_by_hand_equal_sb3(tmp_path: Path, impl: str) -> None:
    """A rollout of 256 steps stages its observations in blocks (the store's ring step: 8 rows), so
    an ``add`` finds rows still staged; with ``pos`` set back (the step overwrites a held row) and
    forward (zero rows in between) by hand mid-block (on the facade, its sub-buffers move with
    it), every observation is where SB3 puts it."""
    steps = 256
    obs_space, act_space = OBS["image"]
    ref = RolloutBuffer(steps, obs_space, act_space, "cpu", gae_lambda=LAMBDA, gamma=GAMMA, n_envs=2)
    if impl == "zarr":
        ours: Any = ZarrRolloutBuffer(steps, obs_space, act_space, "cpu", gae_lambda=LAMBDA, gamma=GAMMA, n_envs=2,
                                      cache_path=tmp_path / "buf")
    elif impl == "dummyvec":
        ours = DummyVecRolloutBuffer(steps, obs_space, act_space, "cpu", n_envs=2, gamma=GAMMA, gae_lambda=LAMBDA,
                                     cache_path=tmp_path / "buf")
    else:  # SB3's own one-env buffers under the facade
        ours = DummyVecRolloutBuffer(steps, obs_space, act_space, "cpu", n_envs=2, gamma=GAMMA, gae_lambda=LAMBDA,
                                     buffer_class=RolloutBuffer)
    rng = np.random.default_rng(3)
    try:
        for b in (ref, ours):
            b.reset()
        t = 0
        while not ref.full:
            moves = {21: -5, 83: -5, 140: 6}  # 21: back inside a staged block
            for b in (ref, ours):
                b.pos += moves.get(t, 0)
            args = (value(obs_space, 2, rng), value(act_space, 2, rng), rng.standard_normal(2).astype(np.float32),
                    np.zeros(2, np.float32), th.zeros((2, 1)), th.zeros(2))
            for b in (ref, ours):
                b.add(*args)
            t += 1
        assert ours.full and ours.pos == ref.pos
        if impl == "zarr":
            assert np.array_equal(np.asarray(ours.observations[:]), ref.observations)
        else:
            for e, sub in enumerate(ours.buffers):
                assert np.array_equal(np.asarray(sub.observations[:])[:, 0], ref.observations[:, e]), f"env {e}"
    finally:
        ours.close()
