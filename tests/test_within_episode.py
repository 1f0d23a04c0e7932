"""SequenceDataset on ReplayBuffer stores: episodes end after rows flagged terminated / truncated /
done, exactly as ``trajstore episodes`` splits them (issue 13: it used to treat the store as one
episode and silently mix episodes)."""

from __future__ import annotations

import json
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch")

from trajstore import ReplayBuffer, TrajectoryReplayBuffer, errors  # noqa: E402
from trajstore.demo import record_demo  # noqa: E402
from trajstore.torch import SequenceDataset  # noqa: E402


def cli_episodes(path: str) -> list[tuple[int, int]]:
    """``(start, length)`` of every episode ``trajstore episodes --json`` lists."""
    r = subprocess.run([sys.executable, "-m", "trajstore", "episodes", path, "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    eps = [(e["start"], e["length"]) for e in out["episodes"]]
    assert out["episodes_total"] == len(eps)
    return eps


def episode_of_rows(eps: list[tuple[int, int]], n: int) -> np.ndarray:
    ep = np.full(n, -1)
    for k, (s, length) in enumerate(eps):
        ep[s : s + length] = k
    assert (ep >= 0).all()
    return ep


def check_windows(ds: SequenceDataset, done: np.ndarray, ep: np.ndarray, within: bool) -> None:
    """Every item: a frame is valid iff its row exists and no earlier frame of the window ends an
    episode; valid frames lie in the anchor's CLI episode; within_episode windows are all valid
    and are exactly the windows inside one episode."""
    n, T = len(done), ds.seq_len
    batch = ds.read_batch(np.arange(len(ds)))
    mask = np.asarray(batch[ds.mask_key])
    for i, a in enumerate(ds.anchors.tolist()):
        rows = a + np.arange(T)
        inside = rows < n
        before = np.concatenate([[False], done[np.minimum(rows, n - 1)][:-1]])
        expect = inside & ~np.logical_or.accumulate(before)
        np.testing.assert_array_equal(mask[i], expect, err_msg=f"anchor {a}")
        assert (ep[rows[expect]] == ep[a]).all()
    if within:
        assert mask.all()
        inside_one = [a for a in range(0, n - T + 1, ds.stride) if len(set(ep[a : a + T].tolist())) == 1]
        assert ds.anchors.tolist() == inside_one


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    """What ``trajstore demo`` writes: 5 real CartPole episodes with terminated/truncated fields."""
    return record_demo(str(tmp_path_factory.mktemp("demo") / "cartpole"), episodes=5)


def _demo_flags(path: str) -> np.ndarray:
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        d = rb[:]
    return (d["terminated"].reshape(-1) | d["truncated"].reshape(-1)).astype(bool)


@pytest.mark.parametrize("seq_len,stride", [(1, 1), (4, 1), (8, 3), (16, 1)])
def test_demo_store_windows_stay_in_episodes(demo, seq_len, stride):
    eps = cli_episodes(demo)
    assert len(eps) == 5
    done = _demo_flags(demo)
    n = len(done)
    ep = episode_of_rows(eps, n)
    for within in (True, False):
        ds = SequenceDataset(demo, seq_len, ["obs", "terminated", "truncated"], within_episode=within,
                             stride=stride, output="numpy")
        check_windows(ds, done, ep, within)
        if within:
            batch = ds.read_batch(np.arange(len(ds)))
            flags = (batch["terminated"] | batch["truncated"]).reshape(len(ds), seq_len)
            assert not flags[:, :-1].any()  # no window crosses a done boundary
            if seq_len == 1:
                assert len(set(ep[ds.anchors].tolist())) == len(eps)  # every CLI episode is there


def test_demo_sequence_data_matches_rows(demo):
    """Frames hold the rows they name; padded frames repeat the episode's last step (edge) or are
    zero, never the next episode's first step."""
    with ReplayBuffer.load_from(demo, read_only=True) as rb:
        obs = rb[:]["obs"]
    done = _demo_flags(demo)
    last = int(np.flatnonzero(done)[0])  # the first episode's last row
    T = 6
    for pad in ("edge", "zero"):
        ds = SequenceDataset(demo, T, ["obs"], pad=pad, output="numpy")
        item = ds[last - 2]
        np.testing.assert_array_equal(item["mask"], [1, 1, 1, 0, 0, 0])
        np.testing.assert_array_equal(item["obs"][:3], obs[last - 2 : last + 1])
        np.testing.assert_array_equal(item["obs"][3:], np.repeat(obs[last : last + 1], 3, 0) if pad == "edge"
                                      else np.zeros((3, obs.shape[1]), obs.dtype))


def _fill_done(rb: ReplayBuffer, lengths: list[int], field: str = "done") -> np.ndarray:
    """Episodes of the given lengths (the last one left open when its length is negative)."""
    flags = []
    for k, n in enumerate(lengths):
        d = np.zeros(abs(n), np.int64)
        if n > 0:
            d[-1] = 1
        flags.append(d)
    done = np.concatenate(flags)
    rb.extend({"x": np.arange(len(done), dtype=np.float32), field: done})
    return done.astype(bool)


@pytest.mark.parametrize("field", ["done", "dones", "timeouts", "terminal"])
def test_hand_built_store(tmp_path, field):
    """A store with one done-like field (any name the CLI knows), an open last episode."""
    space = gym.spaces.Dict({"x": gym.spaces.Box(-np.inf, np.inf, (), np.float32), field: gym.spaces.Discrete(2)})
    path = str(tmp_path / "rb")
    lengths = [1, 5, 2, 9, 1, 1, 7, -4]
    with ReplayBuffer.create(space, cache_path=path) as rb:
        done = _fill_done(rb, lengths, field)
    eps = cli_episodes(path)
    assert [n for _s, n in eps] == [abs(n) for n in lengths]
    ep = episode_of_rows(eps, len(done))
    for T in (1, 2, 3, 5):
        for within in (True, False):
            ds = SequenceDataset(path, T, ["x"], within_episode=within, output="numpy")
            check_windows(ds, done, ep, within)
            if within:
                x = np.asarray(ds.read_batch(np.arange(len(ds)))["x"])
                assert (ep[x.astype(int)] == ep[x[:, :1].astype(int)]).all()
    assert len(SequenceDataset(path, 1, ["x"], within_episode=True)) == len(done)
    assert len(SequenceDataset(path, 9, ["x"], within_episode=True)) == 1  # only the 9-step episode


def test_ring_with_an_episode_cut_by_eviction(tmp_path):
    """Eviction cut the first episode: its remaining rows are still a (partial) episode, as the CLI says."""
    space = gym.spaces.Dict({"x": gym.spaces.Box(-np.inf, np.inf, (), np.float32),
                             "terminated": gym.spaces.MultiBinary(1), "truncated": gym.spaces.MultiBinary(1)})
    path = str(tmp_path / "ring")
    lengths = [7, 13, 4, 20, 9, 11, -3]  # 67 rows into a ring of 50: 7 + 10 rows evicted
    ends = np.cumsum(np.abs(lengths)) - 1
    n_all = int(ends[-1]) + 1
    term = np.zeros(n_all, np.int8)
    trunc = np.zeros(n_all, np.int8)
    term[ends[:-1:2]] = 1
    trunc[ends[1:-1:2]] = 1  # alternate the two flags: either one ends an episode
    with ReplayBuffer.create(space, cache_path=path, capacity=50, chunk_rows=8) as rb:
        for lo in range(0, n_all, 9):
            hi = min(lo + 9, n_all)
            rb.extend({"x": np.arange(lo, hi, dtype=np.float32), "terminated": term[lo:hi, None],
                       "truncated": trunc[lo:hi, None]})
        assert len(rb) == 50 and rb.offset != 0
    done = (term | trunc)[-50:].astype(bool)
    eps = cli_episodes(path)
    assert [n for _s, n in eps] == [3, 4, 20, 9, 11, 3]
    ep = episode_of_rows(eps, 50)
    for T in (1, 3, 4, 10):
        for within in (True, False):
            check_windows(SequenceDataset(path, T, ["x"], within_episode=within, output="numpy"), done, ep, within)
    assert len(SequenceDataset(path, 4, within_episode=True)) == 0 + 1 + 17 + 6 + 8 + 0


def test_no_done_field_refuses_within_episode(tmp_path):
    space = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (2,), np.float32), "reward": gym.spaces.Box(-1, 1, ())})
    path = str(tmp_path / "plain")
    with ReplayBuffer.create(space, cache_path=path) as rb:
        rb.extend({"obs": np.zeros((10, 2), np.float32), "reward": np.zeros(10, np.float32)})
    with pytest.raises(errors.NoEpisodesError) as ei:
        SequenceDataset(path, 3, within_episode=True)
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert path in msg
    for needed in ("terminated", "truncated", "done", "'obs', 'reward'", "TrajectoryReplayBuffer", "within_episode=False"):
        assert needed in msg
    # A ReplayBuffer without episode boundaries is one long episode when within_episode=False.
    ds = SequenceDataset(path, 3, output="numpy")
    assert len(ds) == 10 and np.asarray(ds.read_batch(np.arange(8))["mask"]).all()
    # A non-vector done-like leaf is not a done flag (the CLI's rule: scalar leaves only).
    wide = str(tmp_path / "wide")
    with ReplayBuffer.create(gym.spaces.Dict({"done": gym.spaces.MultiBinary(2)}), cache_path=wide) as rb:
        rb.extend({"done": np.zeros((4, 2), np.int8)})
    with pytest.raises(errors.NoEpisodesError):
        SequenceDataset(wide, 2, within_episode=True)


def test_in_memory_buffer_source():
    space = gym.spaces.Dict({"x": gym.spaces.Box(-np.inf, np.inf, (), np.float32), "done": gym.spaces.Discrete(2)})
    rb = ReplayBuffer.create(space)
    done = _fill_done(rb, [3, 2, 4])
    ds = SequenceDataset(rb, 3, within_episode=True, output="numpy")
    assert ds.anchors.tolist() == [0, 5, 6]
    np.testing.assert_array_equal(ds.read_batch([0, 1, 2])["x"], [[0, 1, 2], [5, 6, 7], [6, 7, 8]])
    assert done.sum() == 3
    with pytest.raises(errors.NoEpisodesError, match="in-memory buffer"):
        SequenceDataset(ReplayBuffer.create(gym.spaces.Dict({"x": gym.spaces.Discrete(3)})), 2, within_episode=True)


def test_trajectory_store_unchanged(tmp_path):
    """Trajectory stores keep using their episode ids (a stray ``done`` step field is ignored)."""
    space = gym.spaces.Dict({"x": gym.spaces.Box(-np.inf, np.inf, (), np.float32), "done": gym.spaces.Discrete(2)})
    path = str(tmp_path / "traj")
    with TrajectoryReplayBuffer.create(space, cache_path=path) as b:
        for k, n in enumerate([4, 3]):
            b.extend({"x": np.arange(n, dtype=np.float32) + 10 * k, "done": np.ones(n, np.int64)})
            b.mark_episode_end()
    ds = SequenceDataset(path, 3, within_episode=True, output="numpy")
    assert ds.anchors.tolist() == [0, 1, 4]
    assert [n for _s, n in cli_episodes(path)] == [4, 3]


def test_reader_of_a_live_ring(tmp_path):
    """A dataset reading a ring that a writer keeps filling: every batch's mask matches the done
    flags of the rows it returns (mask and data come from one commit record)."""
    space = gym.spaces.Dict({"x": gym.spaces.Box(-np.inf, np.inf, (), np.float64), "done": gym.spaces.Discrete(2)})
    path = str(tmp_path / "live")
    w = ReplayBuffer.create(space, cache_path=path, capacity=64, chunk_rows=8)

    def write(lo: int, hi: int) -> None:
        r = np.arange(lo, hi)
        w.extend({"x": r.astype(np.float64), "done": (r % 7 == 6).astype(np.int64)})
        w.flush()

    write(0, 64)
    T = 5
    ds = SequenceDataset(path, T, ["x", "done"], within_episode=False, output="numpy")
    for step in range(12):
        write(64 + 11 * step, 64 + 11 * (step + 1))
        batch = ds.read_batch(np.arange(len(ds)))
        x, d, mask = (np.asarray(batch[k]) for k in ("x", "done", "mask"))
        x0 = x[:, :1]
        assert (x0 >= 11 * (step + 1)).all()  # rows of the latest commit (the ring moved on)
        rows = x0 + np.arange(T)
        expect = ~np.logical_or.accumulate(np.concatenate([np.zeros((len(x), 1), bool), rows[:, :-1] % 7 == 6], 1), 1)
        expect &= rows <= x.max()
        np.testing.assert_array_equal(mask, expect)
        np.testing.assert_array_equal(x[mask], rows[mask])
        np.testing.assert_array_equal(d[mask], rows[mask] % 7 == 6)
    w.close()


def test_batch_sizes_zero_and_bad(tmp_path):
    """A batch of 0 is an empty batch on every sampler (within_episode included: its rejection loop
    raised a raw ValueError); a negative, fractional or bool batch size is a BadOptionError (numpy's
    ValueError before)."""
    space = gym.spaces.Dict({"obs": gym.spaces.Box(0, 1, (2,), np.float32)})
    tb = TrajectoryReplayBuffer.create(space, cache_path=tmp_path / "t")
    tb.extend({"obs": np.zeros((10, 2), np.float32)})
    rb = ReplayBuffer.create(space, cache_path=tmp_path / "r")
    rb.extend({"obs": np.zeros((10, 2), np.float32)})
    for within in (False, True):
        data, mask = tb.sample_sequences(0, 3, within_episode=within)
        assert data["step_data"]["obs"].shape == (0, 3, 2) and mask.shape == (0, 3)
        data, mask = tb.sample_sequences(0, offsets={"obs": [-1, 0]}, within_episode=within)
        assert data["step_data"]["obs"].shape == (0, 2, 2) and mask["obs"].shape == (0, 2)
    assert rb.sample(0)["obs"].shape == (0, 2) and tb.sample(0)["step_data"]["obs"].shape == (0, 2)
    for bad in (-1, 2.5, True, "4"):
        for call in (lambda: rb.sample(bad), lambda: tb.sample(bad), lambda: tb.sample_sequences(bad, 2),
                     lambda: tb.sample_sequences(bad, offsets={"obs": [0]}, within_episode=True)):
            with pytest.raises(errors.BadOptionError, match="batch_size must be an int >= 0"):
                call()
    tb.close()
    rb.close()
