"""ZarrReplayBuffer / ZarrDictReplayBuffer against stable-baselines3's own buffers as the oracle.

Both buffers get the same transitions; under one ``np.random`` seed every ``sample`` must be
bit-identical (every field, dtype and shape), before and after the ring wraps, for n_envs 1 and
4, with optimize_memory_usage on and off, with timeouts and with VecNormalize, for image, float,
Discrete, MultiDiscrete, MultiBinary and Dict observations.  Then: reopening, validation,
pickling as a handle, temporary folders, persistence of RAM edits, and a store reopened after
its writer died while the ring was full.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import gymnasium as gym  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize  # noqa: E402

from trajstore import ReplayBuffer as StoreBuffer  # noqa: E402
from trajstore.errors import (  # noqa: E402
    NotATrajstoreError,
    ReadOnlyError,
    SpaceMismatchError,
    StoreExistsError,
    UnsupportedSpaceError,
)
from trajstore.sb3 import ZarrDictReplayBuffer, ZarrReplayBuffer, ZarrRolloutBuffer  # noqa: E402

# ---------------------------------------------------------------------------------------------- data

OBS = {
    "image": spaces.Box(0, 255, (84, 84, 4), np.uint8),
    "float": spaces.Box(-np.inf, np.inf, (5,), np.float32),
    "float64": spaces.Box(-3.0, 3.0, (2, 3), np.float64),
    "discrete": spaces.Discrete(7),
    "multidiscrete": spaces.MultiDiscrete([3, 4]),
    "multibinary": spaces.MultiBinary(6),
}
ACT = {
    "image": spaces.Discrete(4),
    "float": spaces.Box(-1, 1, (2,), np.float32),
    "float64": spaces.Box(-1, 1, (3,), np.float64),  # stored as float32, as SB3 casts it
    "discrete": spaces.MultiDiscrete([3, 4]),
    "multidiscrete": spaces.MultiBinary(3),
    "multibinary": spaces.Discrete(2),
}
DICT_OBS = spaces.Dict({
    "img": spaces.Box(0, 255, (8, 8, 3), np.uint8),
    "vec": spaces.Box(-np.inf, np.inf, (4,), np.float32),
    "d": spaces.Discrete(3),
})


def value(space: gym.Space, n: int, rng: np.random.Generator) -> Any:
    """A batch of ``n`` values as a VecEnv gives them (Discrete: shape (n,))."""
    if isinstance(space, spaces.Dict):
        return {k: value(s, n, rng) for k, s in space.spaces.items()}
    if isinstance(space, spaces.Discrete):
        return rng.integers(0, space.n, size=n).astype(space.dtype)
    if isinstance(space, spaces.MultiDiscrete):
        return rng.integers(0, space.nvec, size=(n, *space.shape)).astype(space.dtype)
    if isinstance(space, spaces.MultiBinary):
        return rng.integers(0, 2, size=(n, *space.shape)).astype(space.dtype)
    if space.dtype == np.uint8:
        return rng.integers(0, 256, size=(n, *space.shape)).astype(np.uint8)
    return rng.standard_normal((n, *space.shape)).astype(space.dtype)


def transition(obs_space: gym.Space, act_space: gym.Space, n: int, rng: np.random.Generator) -> tuple:
    """``(obs, next_obs, action, reward, done, infos)`` of one ``add`` call with ``n`` envs."""
    infos = [{"TimeLimit.truncated": bool(rng.random() < 0.3)} if rng.random() < 0.5 else {} for _ in range(n)]
    return (value(obs_space, n, rng), value(obs_space, n, rng), value(act_space, n, rng),
            rng.standard_normal(n).astype(np.float32), rng.random(n) < 0.2, infos)


def assert_samples_equal(got: Any, want: Any, where: str = "") -> None:
    """Every field of two sample tuples: same type, torch dtype, shape and values."""
    assert type(got).__name__ == type(want).__name__, where
    for field in want._fields:
        g, w = getattr(got, field), getattr(want, field)
        if w is None:
            assert g is None, f"{where} {field}"
        elif isinstance(w, dict):
            assert list(g) == list(w), f"{where} {field} keys"
            for k in w:
                assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, f"{where} {field}[{k}]"
                assert th.equal(g[k], w[k]), f"{where} {field}[{k}] values"
        else:
            assert g.dtype == w.dtype, f"{where} {field}: dtype {g.dtype} != {w.dtype}"
            assert g.shape == w.shape, f"{where} {field}: shape {tuple(g.shape)} != {tuple(w.shape)}"
            assert th.equal(g, w), f"{where} {field}: values differ"


def same_sample(ours: Any, ref: Any, seed: int, batch: int = 32, env: Any = None, where: str = "") -> None:
    np.random.seed(seed)
    want = ref.sample(batch, env=env)
    np.random.seed(seed)
    got = ours.sample(batch, env=env)
    assert_samples_equal(got, want, where)


def assert_arrays_like_sb3(ours: Any, ref: Any) -> None:
    """The RAM arrays and the stored observations equal SB3's arrays."""
    for name in ("actions", "rewards", "dones", "timeouts"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    names = ["observations"] + ([] if ref.optimize_memory_usage else ["next_observations"])
    for name in names:
        want = getattr(ref, name)
        got = getattr(ours, name)
        for k in (want if isinstance(want, dict) else [None]):
            w, g = (want[k], got[k]) if k is not None else (want, got)
            assert g.shape == w.shape and g.dtype == w.dtype, (name, k)
            assert np.array_equal(np.asarray(g), w), (name, k)


# ------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("optimize", [False, True], ids=["plain", "optimize"])
@pytest.mark.parametrize("n_envs", [1, 4])
@pytest.mark.parametrize("kind", list(OBS))
def test_sample_equals_sb3(tmp_path: Path, kind: str, n_envs: int, optimize: bool) -> None:
    obs_space, act_space = OBS[kind], ACT[kind]
    per_env = 24
    kw = dict(n_envs=n_envs, optimize_memory_usage=optimize, handle_timeout_termination=not optimize)
    ref = ReplayBuffer(per_env * n_envs, obs_space, act_space, "cpu", **kw)
    with ZarrReplayBuffer(per_env * n_envs, obs_space, act_space, "cpu", cache_path=tmp_path / "rb", **kw) as ours:
        assert (ours.buffer_size, ours.obs_shape, ours.action_dim) == (ref.buffer_size, ref.obs_shape, ref.action_dim)
        rng = np.random.default_rng(0)
        for t in range(per_env + 17):  # wraps once
            tr = transition(obs_space, act_space, n_envs, rng)
            ref.add(*tr)
            ours.add(*tr)
            assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size()), t
            if t in (2, 11, per_env - 1, per_env, per_env + 1, per_env + 16):
                same_sample(ours, ref, seed=t, where=f"{kind} n_envs={n_envs} step {t}")
        assert_arrays_like_sb3(ours, ref)


@pytest.mark.parametrize("n_envs", [1, 4])
def test_dict_sample_equals_sb3(tmp_path: Path, n_envs: int) -> None:
    act_space = spaces.Box(-1, 1, (2,), np.float32)
    ref = DictReplayBuffer(10 * n_envs, DICT_OBS, act_space, "cpu", n_envs=n_envs)
    with ZarrDictReplayBuffer(10 * n_envs, DICT_OBS, act_space, "cpu", n_envs=n_envs, cache_path=tmp_path / "rb") as ours:
        rng = np.random.default_rng(1)
        for t in range(23):
            tr = transition(DICT_OBS, act_space, n_envs, rng)
            ref.add(*tr)
            ours.add(*tr)
            if t >= 1:
                same_sample(ours, ref, seed=t, batch=16, where=f"dict step {t}")
        assert_arrays_like_sb3(ours, ref)


def test_vecnormalize_samples_equal_sb3(tmp_path: Path) -> None:
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("Pendulum-v1")]), norm_obs=True, norm_reward=True)
    rng = np.random.default_rng(2)
    venv.obs_rms.mean = rng.standard_normal(3)
    venv.obs_rms.var = rng.random(3) + 0.5
    venv.ret_rms.var = np.array(2.5)
    obs_space, act_space = venv.observation_space, venv.action_space
    ref = ReplayBuffer(32, obs_space, act_space, "cpu", n_envs=2)
    with ZarrReplayBuffer(32, obs_space, act_space, "cpu", n_envs=2, cache_path=tmp_path / "rb") as ours:
        for t in range(25):
            tr = transition(obs_space, act_space, 2, rng)
            ref.add(*tr)
            ours.add(*tr)
            if t % 6 == 5:
                same_sample(ours, ref, seed=t, env=venv, where=f"VecNormalize step {t}")


def test_constructor_like_sb3(tmp_path: Path) -> None:
    obs, act = OBS["float"], ACT["float"]
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        ZarrReplayBuffer(10, obs, act, optimize_memory_usage=True, handle_timeout_termination=True)
    with pytest.raises(UnsupportedSpaceError, match="ZarrDictReplayBuffer"):
        ZarrReplayBuffer(10, DICT_OBS, act)
    with pytest.raises(UnsupportedSpaceError, match="Dict observation space"):
        ZarrDictReplayBuffer(10, obs, act)
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        ZarrDictReplayBuffer(10, DICT_OBS, act, optimize_memory_usage=True, handle_timeout_termination=False)
    with ZarrReplayBuffer(7, obs, act, "cpu", n_envs=3) as rb:
        assert rb.buffer_size == 2 and rb.n_envs == 3 and rb.device.type == "cpu"
        assert isinstance(rb, ReplayBuffer) and rb.temporary
    with ZarrReplayBuffer(2, obs, act, n_envs=4, optimize_memory_usage=True, handle_timeout_termination=False) as rb:
        assert rb.buffer_size == 1 and not hasattr(rb, "next_observations")


def test_observation_views(tmp_path: Path) -> None:
    obs_space, act_space = OBS["float"], ACT["float"]
    ref = ReplayBuffer(20, obs_space, act_space, "cpu", n_envs=2)
    with ZarrReplayBuffer(20, obs_space, act_space, "cpu", n_envs=2, cache_path=tmp_path / "rb") as ours:
        rng = np.random.default_rng(3)
        for _ in range(7):
            tr = transition(obs_space, act_space, 2, rng)
            ref.add(*tr)
            ours.add(*tr)
        view = ours.observations
        assert view.shape == ref.observations.shape and view.dtype == ref.observations.dtype and len(view) == 10
        inds, envs = np.array([0, 6, 3, 3]), np.array([1, 0, 1, 0])
        for idx in (4, -1, slice(2, 9), inds, (inds, envs), (slice(None), 1), (5, 0), np.arange(10) < 3, ...):
            np.testing.assert_array_equal(view[idx], ref.observations[idx], err_msg=str(idx))
            np.testing.assert_array_equal(ours.next_observations[idx], ref.next_observations[idx])
        with pytest.raises(IndexError):
            view[10]
        with pytest.raises(ReadOnlyError):
            view[0] = 1


# ------------------------------------------------------------------------------------ persistence


def _fill(bufs: list[Any], obs_space: gym.Space, act_space: gym.Space, n_envs: int, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tr = transition(obs_space, act_space, n_envs, rng)
        for b in bufs:
            b.add(*tr)


@pytest.mark.parametrize("optimize", [False, True], ids=["plain", "optimize"])
def test_reopen_keeps_every_transition(tmp_path: Path, optimize: bool) -> None:
    obs_space, act_space = OBS["image"], ACT["image"]
    kw = dict(n_envs=2, optimize_memory_usage=optimize, handle_timeout_termination=not optimize)
    ref = ReplayBuffer(40, obs_space, act_space, "cpu", **kw)
    rb = ZarrReplayBuffer(40, obs_space, act_space, "cpu", cache_path=tmp_path / "rb", **kw)
    _fill([ref, rb], obs_space, act_space, 2, 27, seed=4)  # wraps
    rb.close()
    rb = ZarrReplayBuffer(40, obs_space, act_space, "cpu", cache_path=tmp_path / "rb", resume=True, **kw)  # as SAC.load does
    assert (rb.pos, rb.full) == (ref.pos, ref.full)
    assert_arrays_like_sb3(rb, ref)
    same_sample(rb, ref, seed=5)
    _fill([ref, rb], obs_space, act_space, 2, 9, seed=6)  # and it continues
    same_sample(rb, ref, seed=7)
    rb.close()


def test_ram_edits_are_persisted(tmp_path: Path) -> None:
    """``_setup_learn`` writes ``replay_buffer.dones[pos] = True``; flush stores such edits."""
    obs_space, act_space = OBS["float"], ACT["float"]
    kw = dict(n_envs=2, optimize_memory_usage=True, handle_timeout_termination=False)
    with ZarrReplayBuffer(12, obs_space, act_space, cache_path=tmp_path / "rb", **kw) as rb:
        _fill([rb], obs_space, act_space, 2, 8, seed=8)  # wraps
        rb.dones[(rb.pos - 1) % rb.buffer_size] = True
        rb.rewards[0, 1] = 42.0
        dones, rewards = rb.dones.copy(), rb.rewards.copy()
    with ZarrReplayBuffer(12, obs_space, act_space, cache_path=tmp_path / "rb", resume=True, **kw) as rb:
        np.testing.assert_array_equal(rb.dones, dones)
        np.testing.assert_array_equal(rb.rewards, rewards)
    store = StoreBuffer.load_from(tmp_path / "rb" / "transitions", read_only=True)  # any trajstore reader
    assert len(store) == 6 and float(store.get_column(["reward"])[(0 - store.offset) % 6][1]) == 42.0
    store.close()


def test_setup_learn_edit_is_stored_by_next_add(tmp_path: Path) -> None:
    """The edit SB3 makes at the start of ``learn`` survives a crash once the next row is added."""
    obs_space, act_space = OBS["float"], ACT["float"]
    kw = dict(optimize_memory_usage=True, handle_timeout_termination=False, commit_interval=3600)
    rb = ZarrReplayBuffer(8, obs_space, act_space, cache_path=tmp_path / "a", **kw)

    def add(t: int) -> None:
        o = np.full((1, 5), t, np.float32)
        rb.add(o, o + 0.5, np.zeros((1, 2), np.float32), np.zeros(1, np.float32), np.zeros(1, bool), [{}])

    for t in range(11):
        add(t)
    edited = (rb.pos - 1) % rb.buffer_size
    rb.dones[edited] = True  # what _setup_learn does with optimize_memory_usage
    add(11)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the folder as a SIGKILL now leaves it
    rb.close()
    with StoreBuffer.load_from(tmp_path / "b" / "transitions", read_only=True) as stored:
        row = stored[(edited - stored.offset) % 8]
        assert int(row["step"]) == 10 and row["done"][0] == 1.0


def test_commits_every_commit_interval_while_adding(tmp_path: Path) -> None:
    """Transitions are committed at least every commit_interval even when nothing samples
    (e.g. before learning_starts), so a crash loses at most about that much."""
    obs_space, act_space = OBS["float"], ACT["float"]
    with ZarrReplayBuffer(100, obs_space, act_space, cache_path=tmp_path / "rb", commit_interval=0.05) as rb:
        _fill([rb], obs_space, act_space, 1, 3, seed=20)
        time.sleep(0.1)
        _fill([rb], obs_space, act_space, 1, 1, seed=21)
        with StoreBuffer.load_from(tmp_path / "rb" / "transitions", read_only=True) as reader:
            assert len(reader) == 4


def test_reopen_validates(tmp_path: Path) -> None:
    obs, act, p = OBS["float"], ACT["float"], tmp_path / "rb"
    ZarrReplayBuffer(20, obs, act, n_envs=2, cache_path=p).close()
    cfg = json.loads((p / "sb3.json").read_text())
    assert cfg["kind"] == "ZarrReplayBuffer" and cfg["n_envs"] == 2 and cfg["buffer_size"] == 10
    with pytest.raises(SpaceMismatchError, match="observation_space"):
        ZarrReplayBuffer(20, spaces.Box(-1, 1, (6,), np.float32), act, n_envs=2, cache_path=p)
    with pytest.raises(SpaceMismatchError, match="action_space"):
        ZarrReplayBuffer(20, obs, spaces.Discrete(3), n_envs=2, cache_path=p)
    with pytest.raises(SpaceMismatchError, match=r"n_envs=2; got n_envs=4"):
        ZarrReplayBuffer(20, obs, act, n_envs=4, cache_path=p)
    with pytest.raises(SpaceMismatchError, match=r"buffer_size=10; got buffer_size=15"):
        ZarrReplayBuffer(30, obs, act, n_envs=2, cache_path=p)
    with pytest.raises(SpaceMismatchError, match="optimize_memory_usage"):
        ZarrReplayBuffer(20, obs, act, n_envs=2, cache_path=p, optimize_memory_usage=True,
                         handle_timeout_termination=False)
    with pytest.raises(NotATrajstoreError, match="'ZarrReplayBuffer' buffer; expected 'ZarrRolloutBuffer'"):
        ZarrRolloutBuffer(20, obs, act, n_envs=2, cache_path=p)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(StoreExistsError, match="not empty"):
        ZarrReplayBuffer(20, obs, act, cache_path=foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    with ZarrReplayBuffer(20, obs, act, n_envs=4, cache_path=p, overwrite=True, optimize_memory_usage=True,
                          handle_timeout_termination=False) as rb:  # replaced
        _fill([rb], obs, act, 4, 3, seed=19)
        assert rb.size() == 3 and rb.buffer_size == 5
    assert sorted(os.listdir(p)) == ["pending", "sb3.json", "transitions"]
    with ZarrReplayBuffer(20, obs, act, n_envs=2, cache_path=p, overwrite=True) as rb:
        assert rb.size() == 0
    assert sorted(os.listdir(p)) == ["sb3.json", "transitions"]  # the parts of the old layout went


def test_pickle_is_a_handle(tmp_path: Path) -> None:
    obs_space, act_space = OBS["image"], ACT["image"]
    ref = ReplayBuffer(64, obs_space, act_space, "cpu")
    rb = ZarrReplayBuffer(64, obs_space, act_space, "cpu", cache_path=tmp_path / "rb", commit_interval=3600)
    _fill([ref, rb], obs_space, act_space, 1, 20, seed=9)
    blob = pickle.dumps(rb)  # what save_replay_buffer writes
    assert len(blob) < 8_000, len(blob)
    assert pickle.loads(blob) is rb  # this process holds the buffer: the same object
    snapshot = StoreBuffer.load_from(tmp_path / "rb" / "transitions", read_only=True)
    assert len(snapshot) == 20  # pickling committed every row
    snapshot.close()
    rb.close()
    again = pickle.loads(blob)
    assert again is not rb and again.pos == 20
    same_sample(again, ref, seed=10)
    again.close()


def test_temporary_folder(tmp_path: Path) -> None:
    obs_space, act_space = OBS["float"], ACT["float"]
    kw = dict(n_envs=2, optimize_memory_usage=True, handle_timeout_termination=False)
    ref = ReplayBuffer(16, obs_space, act_space, "cpu", **kw)
    rb = ZarrReplayBuffer(16, obs_space, act_space, "cpu", **kw)
    folder = rb.cache_path
    assert rb.temporary and os.path.isdir(folder)
    _fill([ref, rb], obs_space, act_space, 2, 13, seed=11)  # wraps
    copy = pickle.loads(pickle.dumps(rb))  # no folder to point to: the data travels
    assert copy.cache_path != folder and copy.temporary
    for buf in (rb, copy):
        same_sample(buf, ref, seed=12)
        assert_arrays_like_sb3(buf, ref)
    rb.close()
    copy.close()
    assert not os.path.exists(folder) and not os.path.exists(copy.cache_path)


def test_second_buffer_on_same_path_takes_over(tmp_path: Path) -> None:
    obs, act = OBS["float"], ACT["float"]
    first = ZarrReplayBuffer(10, obs, act, cache_path=tmp_path / "rb")
    _fill([first], obs, act, 1, 3, seed=13)
    with pytest.warns(UserWarning, match="was still open"):
        second = ZarrReplayBuffer(10, obs, act, cache_path=tmp_path / "rb", resume=True)
    assert first.closed and second.pos == 3
    with pytest.raises(ValueError, match="closed"):
        first.sample(2)
    second.close()


def test_memory_url(tmp_path: Path) -> None:
    """A fsspec URL works like a folder (zarr-python I/O)."""
    obs_space, act_space = OBS["discrete"], ACT["discrete"]
    url = f"memory://trajstore-sb3-tests/{tmp_path.name}"
    ref = ReplayBuffer(12, obs_space, act_space, "cpu", n_envs=2)
    with ZarrReplayBuffer(12, obs_space, act_space, "cpu", n_envs=2, cache_path=url) as rb:
        _fill([ref, rb], obs_space, act_space, 2, 9, seed=14)
        same_sample(rb, ref, seed=15)
    with ZarrReplayBuffer(12, obs_space, act_space, "cpu", n_envs=2, cache_path=url, resume=True) as rb:
        same_sample(rb, ref, seed=16)


def test_reopen_after_writer_died_while_full(tmp_path: Path) -> None:
    """A writer that dies while the ring is full may leave a commit that already evicted the
    oldest rows (before overwriting them; it also names the rows written since the last flush).
    The buffer reopens with the committed rows only,
    samples only those, and becomes full again as transitions arrive."""
    obs_space, act_space = OBS["float"], ACT["float"]
    live = ZarrReplayBuffer(64, obs_space, act_space, "cpu", n_envs=2, cache_path=tmp_path / "a", commit_interval=3600)

    def add(buf: Any, t: int) -> None:
        o = np.full((2, 5), t, np.float32)
        o[1] += 0.5
        buf.add(o, o + 1000, np.zeros((2, 2), np.float32), np.full(2, t, np.float32), np.zeros(2), [{}, {}])

    for t in range(40):
        add(live, t)
    live.flush()
    for t in range(40, 45):
        add(live, t)
    live.sample(1)  # the writer hands rows to the store: a ring eviction is committed first
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the folder as a SIGKILL at this instant leaves it
    live.close()
    rb = ZarrReplayBuffer(64, obs_space, act_space, "cpu", n_envs=2, cache_path=tmp_path / "b", resume=True)
    count = rb.size()
    assert count < rb.buffer_size and not rb.full and rb._offset != 0, "no partial ring to test"
    steps = np.asarray(rb.observations)[:, 0, 0]
    held = steps[(rb._offset + np.arange(count)) % rb.buffer_size]
    # The eviction record is a full commit: it also names the rows added since the flush (up to 45).
    end = int(held[-1]) + 1
    assert 40 <= end <= 45
    np.testing.assert_array_equal(held, np.arange(end - count, end))  # the newest committed rows, in order
    assert count >= rb.buffer_size - 2 * max(1, rb.buffer_size // 32)  # a ring stays (nearly) full
    s = rb.sample(500)
    seen = s.observations[:, 0].numpy()
    assert set(np.floor(seen).astype(int).tolist()) <= set(range(end - count, end))
    np.testing.assert_array_equal(s.next_observations[:, 0].numpy(), seen + 1000)
    np.testing.assert_array_equal(s.rewards[:, 0].numpy(), np.floor(seen))
    for t in range(100, 100 + rb.buffer_size - count):
        add(rb, t)
    assert rb.full and rb.size() == rb.buffer_size
    seen = np.floor(rb.sample(500).observations[:, 0].numpy()).astype(int)
    assert set(seen.tolist()) <= set(range(end - count, end)) | set(range(100, 100 + rb.buffer_size - count))
    rb.close()


def test_no_dense_allocation_and_no_sb3_init(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SB3's ReplayBuffer.__init__ (dense obs arrays, psutil check) is never run."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ReplayBuffer.__init__ called")

    monkeypatch.setattr(ReplayBuffer, "__init__", refuse)
    monkeypatch.setattr(DictReplayBuffer, "__init__", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SB3's "not enough memory" warning would fail here
        # SB3's default size with Atari frames: 56 GB of dense arrays in SB3 (and its memory warning)
        with ZarrReplayBuffer(10**6, OBS["image"], ACT["image"], cache_path=tmp_path / "big") as rb:
            assert rb.buffer_size == 10**6 and rb.observations.shape == (10**6, 1, 84, 84, 4)
            assert rb.actions.nbytes == 8 * 10**6  # the small fields are RAM arrays, as in SB3


def test_sample_batch_sizes_as_sb3(tmp_path):
    """sample(0) is an empty batch, as SB3's; a negative, fractional or bool batch size is a
    BadOptionError (a ValueError, where SB3 raises numpy's) before np.random is drawn from."""
    from trajstore.errors import BadOptionError

    obs_space, act_space = spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2)
    ref = ReplayBuffer(16, obs_space, act_space, "cpu")
    with ZarrReplayBuffer(16, obs_space, act_space, "cpu", cache_path=tmp_path / "rb") as ours:
        for buf in (ref, ours):
            for i in range(5):
                buf.add(np.full((1, 3), i, np.float32), np.zeros((1, 3), np.float32), np.array([[1]]), np.ones(1),
                        np.zeros(1), [{}])
        np.random.seed(0)
        want = ref.sample(0)
        np.random.seed(0)
        got = ours.sample(0)
        assert got.observations.shape == want.observations.shape == (0, 3)
        for bad in (-1, 2.5, True):
            state = np.random.get_state()[1].copy()
            with pytest.raises(BadOptionError, match="sample: batch_size must be an int >= 0") as e:
                ours.sample(bad)
            assert isinstance(e.value, ValueError) and (np.random.get_state()[1] == state).all()
        with pytest.raises(ValueError):
            ref.sample(-1)
