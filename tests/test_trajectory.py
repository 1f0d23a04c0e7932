"""TrajectoryReplayBuffer (docs/design.md 1 "TrajectoryReplayBuffer", issue 3): the acceptance
cases of reference/unienv.md section 4 written against trajstore's intended semantics,
episode-data eviction in a ring, and bad input refused before any write (docs/design.md 3.5).

Sequences are in ``test_trajectory_sequences.py`` (which also holds acceptance case 9,
episode-aware frame stacking); crash, fork/spawn and lock tests in
``test_trajectory_processes.py``.  Real stores under ``tmp_path``, no mocks.
"""

from __future__ import annotations

import hashlib
import os

import gymnasium
import numpy as np
import pytest
import torch
import zarr
from gymnasium.spaces import Box, Dict, Discrete

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import BadValueError, ReadOnlyError, SpaceMismatchError

STEP = Dict({"obs": Box(-np.inf, np.inf, (3,), np.float32)})
EP_SPACES = {
    "box": Box(-np.inf, np.inf, (2,), np.float32),
    "dict": Dict({"goal": Box(-np.inf, np.inf, (2,), np.float32), "level": Discrete(7)}),
}


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def steps(vals) -> dict[str, np.ndarray]:
    """A batch of steps; row ``v`` has obs ``[v, v + 0.5, -v]``."""
    v = np.asarray(vals, np.float32).reshape(-1)
    return {"obs": np.stack([v, v + 0.5, -v], axis=1)}


def step(v) -> dict[str, np.ndarray]:
    return {"obs": steps([v])["obs"][0]}


def ep_value(kind: str, g: int):
    """Episode data number ``g`` of episode-space kind ``kind``."""
    if kind == "box":
        return np.array([g, -g], np.float32)
    return {"goal": np.array([g, 10 * g], np.float32), "level": np.int64(g % 7)}


def npy(x):
    """Nested torch/numpy -> nested numpy."""
    if isinstance(x, dict):
        return {k: npy(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(npy(v) for v in x)
    if isinstance(x, torch.Tensor):
        return x.cpu().numpy()
    return np.asarray(x)


def assert_kind(x, backend: str) -> None:
    """Every leaf of ``x`` is a numpy array or a torch tensor, as the backend says."""
    if isinstance(x, dict):
        for v in x.values():
            assert_kind(v, backend)
        return
    want = torch.Tensor if backend == "torch" else (np.ndarray, np.generic)  # np.int64 for a Discrete row
    assert isinstance(x, want), f"backend {backend!r} returned a {type(x).__name__}"


def assert_tree_equal(a, b) -> None:
    a, b = npy(a), npy(b)
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (a, b)
        for k in a:
            assert_tree_equal(a[k], b[k])
        return
    np.testing.assert_array_equal(a, b)


def stack(values):
    """A list of nested values -> one batched nested value."""
    if isinstance(values[0], dict):
        return {k: stack([v[k] for v in values]) for k in values[0]}
    return np.stack([np.asarray(v) for v in values])


def file_digest(root) -> dict[str, tuple[int, str]]:
    """path -> (size, sha1) of every file under ``root``; equal digests: no byte changed."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (os.path.getsize(p), hashlib.sha1(f.read()).hexdigest())
    return out


def ids_of(buf) -> np.ndarray:
    return npy(buf.get_at_with_metadata(np.arange(len(buf)))[1]["episode_ids"])


def two_episodes(buf, kind: str | None = None) -> None:
    """extend 2, (data g0), end, extend 3, (data g1), end."""
    buf.extend(steps([0, 1]))
    if kind:
        buf.set_current_episode_data(ep_value(kind, 100))
    buf.mark_episode_end()
    buf.extend(steps([10, 11, 12]))
    if kind:
        buf.set_current_episode_data(ep_value(kind, 101))
    buf.mark_episode_end()


# ----------------------------------------------------------------------------------------
# 1. episode id tagging
# ----------------------------------------------------------------------------------------
def test_episode_id_tagging(tmp_path):
    with TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s") as buf:
        assert buf.current_episode_id == 0
        two_episodes(buf)
        assert ids_of(buf).tolist() == [0, 0, 1, 1, 1]
        assert buf.current_episode_id == 2 and isinstance(buf.current_episode_id, int)
        data, meta = buf.get_at_with_metadata(3)
        assert int(meta["episode_ids"]) == 1 and np.asarray(meta["episode_ids"]).shape == ()
        assert meta["episode_ids"].dtype == np.int64

        # Explicit ids are stored as given and leave current_episode_id alone.
        buf.extend({"step_data": steps([20, 21, 22]), "episode_ids": np.array([7, 7, 9])})
        buf.append({"step_data": step(23), "episode_ids": 11})
        buf.extend({"step_data": steps([24]), "episode_ids": torch.tensor([7])})
        assert buf.current_episode_id == 2
        buf.extend(steps([30]))  # bare: the current episode
        assert ids_of(buf).tolist() == [0, 0, 1, 1, 1, 7, 7, 9, 11, 7, 2]
        np.testing.assert_array_equal(buf.get_at(np.arange(5, 11))["step_data"]["obs"][:, 0],
                                      [20, 21, 22, 23, 24, 30])
        # The next episode never collides with an id already stored.
        buf.mark_episode_end()
        assert buf.current_episode_id not in set(ids_of(buf).tolist())
        assert buf.current_episode_id > 2


# ----------------------------------------------------------------------------------------
# 2. episode data: int and array indices, numpy and torch, Box and Dict episode spaces
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["box", "dict"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_episode_data(tmp_path, backend, kind):
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES[kind], cache_path=tmp_path / "s",
                                        backend=backend)
    g0, g1 = ep_value(kind, 100), ep_value(kind, 101)
    two_episodes(buf, kind)
    # int in -> int out; arrays (numpy, torch) in -> arrays of the same kind out.
    assert buf.episode_id_to_episode_data_index(0) == 0 and buf.episode_id_to_episode_data_index(1) == 1
    assert int(buf.episode_id_to_episode_data_index(np.int64(1))) == 1
    got = buf.episode_id_to_episode_data_index(np.array([1, 0, 1]))
    assert isinstance(got, np.ndarray) and got.tolist() == [1, 0, 1]
    got = buf.episode_id_to_episode_data_index(torch.tensor([1, 0]))
    assert isinstance(got, torch.Tensor) and got.tolist() == [1, 0]

    expected = stack([g0, g0, g1, g1, g1])
    for idx in (np.arange(5), torch.arange(5), slice(None), [0, 1, 2, 3, 4]):
        ep = buf.get_at(idx)["episode_data"]
        assert_kind(ep, backend)
        assert_tree_equal(ep, expected)
    for i, g in ((0, g0), (1, g0), (2, g1), (4, g1), (-5, g0), (-1, g1)):
        out = buf.get_at(i)
        assert_kind(out["episode_data"], backend)
        assert_tree_equal(out["episode_data"], g)
    assert_tree_equal(buf[3]["step_data"]["obs"], steps([11])["obs"][0])

    # Overwriting a known id happens in place: same index, no new episode row.
    g0b = ep_value(kind, 105)
    buf.set_episode_data_at(0, g0b)
    assert buf.episode_id_to_episode_data_index(0) == 0 and buf.episode_id_to_episode_data_index(1) == 1
    assert_tree_equal(buf.get_at(np.arange(5))["episode_data"], stack([g0b, g0b, g1, g1, g1]))
    # Data of the current episode before its first step, then overwritten.
    buf.set_current_episode_data(ep_value(kind, 102))
    buf.set_current_episode_data(ep_value(kind, 103))
    assert buf.episode_id_to_episode_data_index(2) == 2
    buf.append(step(20))
    assert_tree_equal(buf[-1]["episode_data"], ep_value(kind, 103))
    # Unknown ids.
    for bad in (3, 99, -1, np.array([0, 99]), torch.tensor([99])):
        with pytest.raises(KeyError):
            buf.episode_id_to_episode_data_index(bad)
    # get_at_with_metadata returns ids in the backend.
    data, meta = buf.get_at_with_metadata(np.arange(6))
    assert_kind(meta["episode_ids"], backend)
    assert npy(meta["episode_ids"]).tolist() == [0, 0, 1, 1, 1, 2]
    buf.close()


def test_buffer_without_episode_space(tmp_path):
    with TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s") as buf:
        two_episodes(buf)
        assert buf.get_at(0)["episode_data"] is None and buf.get_at(np.arange(2))["episode_data"] is None
        with pytest.raises(SpaceMismatchError):
            buf.set_current_episode_data(np.zeros(2, np.float32))
        with pytest.raises(KeyError):
            buf.episode_id_to_episode_data_index(0)


# ----------------------------------------------------------------------------------------
# 3. ring
# ----------------------------------------------------------------------------------------
def test_ring_capacity_6(tmp_path):
    with pytest.raises(ValueError):
        TrajectoryReplayBuffer.create(STEP, step_data_capacity=6, step_episode_id_capacity=7, cache_path=tmp_path / "x")
    buf = TrajectoryReplayBuffer.create(STEP, step_data_capacity=6, step_episode_id_capacity=6,
                                        episode_data_instance_space=EP_SPACES["box"], cache_path=tmp_path / "s")
    two_episodes(buf, "box")  # ids [0,0,1,1,1], current 2
    assert len(buf) == 5 and buf.offset == 0
    buf.extend(steps([20, 21, 22, 23]))
    assert len(buf) == 6 and buf.offset == 3 and buf.full
    assert ids_of(buf).tolist() == [1, 1, 2, 2, 2, 2]
    np.testing.assert_array_equal(buf[:]["step_data"]["obs"][:, 0], [11, 12, 20, 21, 22, 23])
    # Episode 0 left the ring with its last step: its data is gone; episode 1 keeps its own.
    with pytest.raises(KeyError):
        buf.episode_id_to_episode_data_index(0)
    assert_tree_equal(buf.get_at(np.arange(2))["episode_data"], stack([ep_value("box", 101)] * 2))
    buf.close()
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as ro:
        assert len(ro) == 6 and ro.offset == 3 and ids_of(ro).tolist() == [1, 1, 2, 2, 2, 2]


# ----------------------------------------------------------------------------------------
# 4. round trip
# ----------------------------------------------------------------------------------------
def _fill_round_trip(buf, kind):
    two_episodes(buf, kind)
    buf.extend(steps([20]))  # an open episode (2) with data
    buf.set_current_episode_data(ep_value(kind, 102))


def _check_round_trip(ro, backend, kind):
    assert ro.read_only and len(ro) == 6 and ro.current_episode_id == 2
    assert ids_of(ro).tolist() == [0, 0, 1, 1, 1, 2]
    for eid in (0, 1, 2):
        idx = ro.episode_id_to_episode_data_index(eid)
        assert idx == eid and isinstance(idx, int)
    x = ro[:]
    assert_kind(x, backend)
    np.testing.assert_array_equal(npy(x["step_data"]["obs"]), steps([0, 1, 10, 11, 12, 20])["obs"])
    assert_tree_equal(x["episode_data"], stack([ep_value(kind, g) for g in (100, 100, 101, 101, 101, 102)]))
    ep = ro.episodes()
    assert npy(ep["episode_id"]).tolist() == [0, 1, 2] and npy(ep["length"]).tolist() == [2, 3, 1]


def _check_refuses_writes(ro, kind):
    path = ro.cache_path
    before = file_digest(path)
    writes = [
        lambda: ro.extend(steps([1])), lambda: ro.append(step(1)), lambda: ro.set_at(0, ro[0]),
        lambda: ro.remove_at(0), lambda: ro.mark_episode_end(), lambda: ro.clear(),
        lambda: ro.set_current_episode_data(ep_value(kind, 1)), lambda: ro.set_episode_data_at(0, ep_value(kind, 1)),
        lambda: ro.append_flattened(npy(ro.get_flattened_at(0))),
        lambda: ro.extend({"step_data": steps([1]), "episode_ids": np.array([0])}),
    ]
    for k, w in enumerate(writes):
        with pytest.raises(ReadOnlyError):
            w()
        assert len(ro) == 6, f"write {k} changed a read-only buffer"
    assert file_digest(path) == before, "a refused write on a read-only buffer changed the store's files"


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("how", ["close", "dumps_other_path"])
def test_round_trip(tmp_path, backend, how):
    kind = "dict"
    src = tmp_path / "s"
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES[kind], cache_path=src)
    _fill_round_trip(buf, kind)
    if how == "close":
        buf.close()
        path = src
    else:
        path = tmp_path / "copy"
        buf.dumps(path)
        buf.append(step(99))  # the original stays open and writable; the copy is not affected
        assert len(buf) == 7
    ro = TrajectoryReplayBuffer.load_from(path, read_only=True, backend=backend)
    try:
        _check_round_trip(ro, backend, kind)
        _check_refuses_writes(ro, kind)
    finally:
        ro.close()
    if how != "close":
        buf.close()
    # Any zarr reader sees the three sub-stores with plain arrays.
    g = zarr.open_group(str(path), mode="r")
    assert {"step_data", "step_episode_ids", "episode_data"} <= set(g.keys())
    np.testing.assert_array_equal(g["step_data/obs"][:6], steps([0, 1, 10, 11, 12, 20])["obs"])
    assert g["step_episode_ids"].dtype == np.int64
    np.testing.assert_array_equal(g["step_episode_ids"][:6], [0, 0, 1, 1, 1, 2])
    np.testing.assert_array_equal(g["episode_data/goal"][:3], [[100, 1000], [101, 1010], [102, 1020]])
    np.testing.assert_array_equal(g["episode_data/level"][:3], [100 % 7, 101 % 7, 102 % 7])
    # A writer reopen continues the ids.
    with TrajectoryReplayBuffer.load_from(path) as w:
        assert w.current_episode_id >= 2
        w.mark_episode_end()
        w.append(step(40))
        assert int(npy(w.get_at_with_metadata(-1)[1]["episode_ids"])) > 2


# ----------------------------------------------------------------------------------------
# 5. extend_from
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 8, 100])
def test_extend_from_replay_buffer(tmp_path, k):
    src = ReplayBuffer.create(STEP, cache_path=tmp_path / "src")
    src.extend(steps(np.arange(11) * 3))
    dst = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], cache_path=tmp_path / "d")
    dst.extend(steps([-1, -2]))
    cur = dst.current_episode_id
    dst.extend_from(src, chunk_size=k, tqdm=(k == 2))
    assert len(dst) == 13
    np.testing.assert_array_equal(dst[2:]["step_data"]["obs"], src[:]["obs"])
    assert set(ids_of(dst)[2:].tolist()) == {cur}, "steps from a plain buffer join the current episode"
    assert len(src) == 11
    src.close()
    dst.close()


def _make_traj_source(path, capacity):
    """Episodes of lengths 3, 1, 4, 2, 3 (the last one open); data for all but the second."""
    src = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], step_data_capacity=capacity,
                                        cache_path=path)
    v = 0
    for e, length in enumerate([3, 1, 4, 2, 3]):
        src.extend(steps(np.arange(v, v + length)))
        v += length
        if e != 1:
            src.set_current_episode_data(ep_value("box", 200 + e))
        if e < 4:
            src.mark_episode_end()
    return src


@pytest.mark.parametrize("src_capacity", [None, 8], ids=["unbounded", "ring8"])
@pytest.mark.parametrize("k", [1, 2, 8, 100])
def test_extend_from_trajectory_buffer(tmp_path, k, src_capacity):
    src = _make_traj_source(tmp_path / "src", src_capacity)
    n = len(src)
    src_ids = ids_of(src)
    src_x = src[:]
    src_data = {int(e): npy(src.get_episode(int(e))["episode_data"][0]) for e in np.unique(src_ids)
                if int(e) != 1}
    dst = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], cache_path=tmp_path / "d")
    dst.extend(steps([-1, -2]))
    dst.set_current_episode_data(ep_value("box", 999))
    before = dst.current_episode_id
    dst.extend_from(src, chunk_size=k, tqdm=(k == 8))
    assert len(dst) == 2 + n
    assert_tree_equal(dst[2:]["step_data"], src_x["step_data"])
    d_ids = ids_of(dst)
    new = d_ids[2:]
    # Episode boundaries kept: rows share a destination id exactly when they shared a source id.
    np.testing.assert_array_equal(new[:, None] == new[None, :], src_ids[:, None] == src_ids[None, :])
    # Fresh ids: none is the destination's existing episode, and later episodes never reuse one.
    assert before not in set(new.tolist())
    assert d_ids[:2].tolist() == [before, before]
    dst.mark_episode_end()
    assert dst.current_episode_id not in set(d_ids.tolist())
    # Episode data copied to the new ids (the source episode without data has none).
    mapping = {int(s): int(d) for s, d in zip(src_ids, new)}
    for s_eid, d_eid in mapping.items():
        if s_eid == 1:
            with pytest.raises(KeyError):
                dst.episode_id_to_episode_data_index(d_eid)
        else:
            assert_tree_equal(npy(dst.get_episode(d_eid)["episode_data"][0]), src_data[s_eid])
    assert_tree_equal(dst[0]["episode_data"], ep_value("box", 999))
    assert len(src) == n and ids_of(src).tolist() == src_ids.tolist()
    src.close()
    dst.close()


# ----------------------------------------------------------------------------------------
# 6. views
# ----------------------------------------------------------------------------------------
def test_views(tmp_path):
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], cache_path=tmp_path / "s")
    two_episodes(buf, "box")
    view = buf.get_slice(slice(1, 4))
    assert len(view) == 3
    assert_tree_equal(view[:], buf[1:4])
    assert_tree_equal(view[0], buf[1])
    buf.set_at(2, step(77))
    assert float(view[1]["step_data"]["obs"][0]) == 77.0, "a slice view is live"
    with pytest.raises(ReadOnlyError):
        view.extend(steps([5]))
    with pytest.raises(ReadOnlyError):
        view.append(step(5))
    buf.extend(steps([30]))
    assert len(view) == 3

    col = buf.get_column(["step_data", "obs"])
    assert len(col) == len(buf) == 6
    np.testing.assert_array_equal(col[:], buf[:]["step_data"]["obs"])
    np.testing.assert_array_equal(col[np.array([4, 0])], buf.get_at(np.array([4, 0]))["step_data"]["obs"])
    np.testing.assert_array_equal(col[2], buf.get_at(2)["step_data"]["obs"])
    assert col[2].shape == (3,)
    with pytest.raises(ReadOnlyError):
        col.set_at(0, np.zeros(3, np.float32))
    with pytest.raises(ReadOnlyError):
        col.extend(np.zeros((1, 3), np.float32))
    buf.extend(steps([31]))
    assert len(col) == 7 and float(col[-1][0]) == 31.0, "a column view is live"
    ep_col = buf.get_column(["episode_data"])
    np.testing.assert_array_equal(ep_col[:], buf[:]["episode_data"])
    buf.close()


# ----------------------------------------------------------------------------------------
# 7. flattened API
# ----------------------------------------------------------------------------------------
STEP2 = Dict({"obs": Box(-np.inf, np.inf, (3,), np.float32), "act": Discrete(4)})


@pytest.mark.parametrize("kind", ["box", "dict"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_flattened(tmp_path, backend, kind):
    path = tmp_path / "s"
    buf = TrajectoryReplayBuffer.create(STEP2, episode_data_instance_space=EP_SPACES[kind], cache_path=path,
                                        backend=backend)
    for e, length in enumerate([2, 3]):
        buf.extend({"obs": steps(np.arange(length) + 10 * e)["obs"], "act": np.arange(length) % 4})
        buf.set_current_episode_data(ep_value(kind, 100 + e))
        buf.mark_episode_end()
    space = buf.single_space
    rows = []
    for i in range(len(buf)):
        value = npy(buf.get_at(i))
        expected = gymnasium.spaces.flatten(space, {"step_data": value["step_data"], "episode_data": value["episode_data"]})
        got = buf.get_flattened_at(i)
        assert_kind(got, backend)
        got = npy(got)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
        rows.append(expected)
    np.testing.assert_array_equal(npy(buf.get_flattened_at(np.arange(len(buf)))), np.stack(rows))

    # append_flattened round trip (its episode part sets the current episode's data).
    rng = np.random.default_rng(0)
    value = {"step_data": {"obs": rng.normal(size=3).astype(np.float32), "act": np.int64(3)},
             "episode_data": ep_value(kind, 7)}
    flat = gymnasium.spaces.flatten(space, value)
    buf.append_flattened(flat)
    np.testing.assert_array_equal(npy(buf.get_flattened_at(-1)), flat)
    assert_tree_equal(buf[-1]["step_data"], value["step_data"])
    assert_tree_equal(buf[-1]["episode_data"], value["episode_data"])
    # set_flattened_at overwrites a row's step data and its episode's data.
    buf.set_flattened_at(0, flat)
    np.testing.assert_array_equal(npy(buf.get_flattened_at(0)), flat)
    assert_tree_equal(buf[1]["episode_data"], value["episode_data"])  # row 1: same episode as row 0
    # A wrong width is refused, before anything is written.
    buf.flush()
    before, n = file_digest(path), len(buf)
    for bad in (flat[:-1], np.concatenate([flat, [0]])):
        with pytest.raises(BadValueError):
            buf.append_flattened(bad)
    with pytest.raises(BadValueError):
        buf.extend_flattened(np.zeros((2, flat.size + 1), flat.dtype))
    assert len(buf) == n and file_digest(path) == before
    buf.close()


# ----------------------------------------------------------------------------------------
# 8. remove_at
# ----------------------------------------------------------------------------------------
def _three_episodes(buf):
    """ids [0,0,1,1,1,2,2]; obs 0,1 | 10,11,12 | 20,21; data 100, 101, 102."""
    for e, vals in enumerate([[0, 1], [10, 11, 12], [20, 21]]):
        buf.extend(steps(vals))
        buf.set_current_episode_data(ep_value("box", 100 + e))
        buf.mark_episode_end()


def test_remove_at(tmp_path):
    path = tmp_path / "s"
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], cache_path=path)
    _three_episodes(buf)
    buf.remove_at(np.array([0, 1, 3]))  # all of episode 0, one step of episode 1
    assert len(buf) == 4
    np.testing.assert_array_equal(buf[:]["step_data"]["obs"][:, 0], [10, 12, 20, 21])
    assert ids_of(buf).tolist() == [1, 1, 2, 2]
    with pytest.raises(KeyError):
        buf.episode_id_to_episode_data_index(0)
    assert_tree_equal(buf[:]["episode_data"], stack([ep_value("box", g) for g in (101, 101, 102, 102)]))
    assert_tree_equal(buf.get_episode(1)["episode_data"], stack([ep_value("box", 101)] * 2))
    ep = buf.episodes()
    assert npy(ep["episode_id"]).tolist() == [1, 2] and npy(ep["start"]).tolist() == [0, 2]
    # An episode in the middle of the episode table loses its data; the later one keeps its own.
    buf.extend(steps([30]))
    buf.set_current_episode_data(ep_value("box", 103))
    buf.remove_at(slice(0, 2))
    with pytest.raises(KeyError):
        buf.episode_id_to_episode_data_index(1)
    assert ids_of(buf).tolist() == [2, 2, 3]
    assert_tree_equal(buf[:]["episode_data"], stack([ep_value("box", g) for g in (102, 102, 103)]))
    buf.remove_at(-2)
    np.testing.assert_array_equal(buf[:]["step_data"]["obs"][:, 0], [20, 30])
    buf.close()
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        assert ids_of(ro).tolist() == [2, 3]
        assert_tree_equal(ro[:]["episode_data"], stack([ep_value("box", g) for g in (102, 103)]))
        with pytest.raises(KeyError):
            ro.episode_id_to_episode_data_index(0)


def test_remove_at_in_wrapped_ring(tmp_path):
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], step_data_capacity=6,
                                        cache_path=tmp_path / "s", chunk_rows=2)
    _three_episodes(buf)  # 7 steps into 6: offset 1, ids [0,1,1,1,2,2]
    assert buf.offset == 1 and ids_of(buf).tolist() == [0, 1, 1, 1, 2, 2]
    buf.remove_at([1, 2, 3])  # episode 1 entirely, across the wrap point
    assert ids_of(buf).tolist() == [0, 2, 2]
    np.testing.assert_array_equal(buf[:]["step_data"]["obs"][:, 0], [1, 20, 21])
    with pytest.raises(KeyError):
        buf.episode_id_to_episode_data_index(1)
    assert_tree_equal(buf[:]["episode_data"], stack([ep_value("box", g) for g in (100, 102, 102)]))
    buf.extend(steps([30, 31, 32, 33]))  # wraps again: episode 0's last step leaves
    assert ids_of(buf).tolist() == [2, 2, 3, 3, 3, 3]
    np.testing.assert_array_equal(buf[:]["step_data"]["obs"][:, 0], [20, 21, 30, 31, 32, 33])
    with pytest.raises(KeyError):
        buf.episode_id_to_episode_data_index(0)
    buf.close()


# ----------------------------------------------------------------------------------------
# episode eviction in a long run (docs/design.md: the episode store never fills with dead episodes)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ep_capacity", [4, 21])
def test_episode_eviction_long_run(tmp_path, ep_capacity):
    """Step ring 20, 50 episodes of random length 1..6, each with data (set before, during or
    after its steps).  With 21 episode rows (>= the most episodes 20 steps can hold, plus the
    current one) every step has its own episode's data; with 4, more episodes can be alive
    than rows exist, so only the newest four are guaranteed data, but no step ever shows
    another episode's data and no dead episode keeps data."""
    ep_space = Box(-np.inf, np.inf, (2,), np.float64)
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=ep_space, step_data_capacity=20,
                                        episode_data_capacity=ep_capacity, cache_path=tmp_path / "s", chunk_rows=4)
    rng = np.random.default_rng(3)
    v = 0

    def check(who):
        ids = ids_of(buf)
        x = buf[:]
        obs_eid = (x["step_data"]["obs"][:, 0] // 1000).astype(np.int64)
        assert np.array_equal(obs_eid, ids), f"{who}: step ids differ from the episodes their obs encode"
        in_ring = set(ids.tolist())
        for eid in range(buf.current_episode_id + 1):
            try:
                row = buf.episode_id_to_episode_data_index(eid)
            except KeyError:
                row = None
            if row is not None:
                assert eid in in_ring or eid == buf.current_episode_id, (
                    f"{who}: episode {eid} has no step in the ring but still has data")
            elif ep_capacity > 20:
                assert eid not in in_ring, f"{who}: episode {eid} has steps in the ring but lost its data"
        # Every step shows its own episode's data (zeros where its episode has none).
        ed = x["episode_data"]
        for i, eid in enumerate(ids.tolist()):
            assert ed[i].tolist() in ([eid, 1.0], [0.0, 0.0]), f"{who}: step {i} of episode {eid} shows {ed[i]}"
            if ed[i][1] == 0:
                with pytest.raises(KeyError):
                    buf.episode_id_to_episode_data_index(eid)
        newest = list(dict.fromkeys(ids.tolist()))[-min(ep_capacity, 4):]
        for eid in newest:
            if eid != buf.current_episode_id:
                buf.episode_id_to_episode_data_index(eid)  # the newest episodes have data

    for e in range(50):
        eid = buf.current_episode_id
        length = int(rng.integers(1, 7))
        when = int(rng.integers(0, length + 1))  # steps written before the data is set
        for k in range(length):
            if k == when:
                buf.set_current_episode_data(np.array([eid, 1.0]))
            buf.append(step(eid * 1000 + v))
            v += 1
        if when == length:
            buf.set_current_episode_data(np.array([eid, 1.0]))
        buf.mark_episode_end()
        check(f"after episode {e}")
    buf.close()
    buf = TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True)
    check("read-only reopen")
    buf.close()


def test_episode_data_set_out_of_order_is_evicted(tmp_path):
    """Data labelled after the fact (set_episode_data_at on finished episodes, newest first):
    an episode whose last step left the ring loses its data even when an older-inserted
    episode row is still alive, and dead rows never push out a live episode's data."""
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], step_data_capacity=6,
                                        episode_data_capacity=2, cache_path=tmp_path / "s")
    for e in range(3):
        buf.extend(steps([10 * e, 10 * e + 1]))
        buf.mark_episode_end()
    buf.set_episode_data_at(2, ep_value("box", 102))
    buf.set_episode_data_at(0, ep_value("box", 100))
    buf.extend(steps([30, 31]))  # episode 3: episode 0's steps leave the ring
    assert ids_of(buf).tolist() == [1, 1, 2, 2, 3, 3]
    with pytest.raises(KeyError):
        buf.episode_id_to_episode_data_index(0)
    buf.set_current_episode_data(ep_value("box", 103))
    # Two rows, two live episodes with data: both must have it.
    assert_tree_equal(buf[2]["episode_data"], ep_value("box", 102))
    assert_tree_equal(buf[4]["episode_data"], ep_value("box", 103))
    buf.close()


def test_extend_from_into_small_ring_keeps_only_live_episode_data(tmp_path):
    src = _make_traj_source(tmp_path / "src", None)  # 13 steps, episodes 3,1,4,2,3
    dst = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], step_data_capacity=4,
                                        cache_path=tmp_path / "d")
    dst.extend_from(src, chunk_size=5)
    ids = ids_of(dst)
    assert len(dst) == 4 and len(set(ids.tolist())) == 2  # last step of source episode 3, episode 4
    np.testing.assert_array_equal(dst[:]["step_data"]["obs"], src[-4:]["step_data"]["obs"])
    assert_tree_equal(dst[:]["episode_data"], stack([ep_value("box", g) for g in (203, 204, 204, 204)]))
    for eid in range(dst.current_episode_id + 1):
        if eid not in set(ids.tolist()):
            with pytest.raises(KeyError):
                dst.episode_id_to_episode_data_index(eid)  # episodes that never got a step in the ring
    src.close()
    dst.close()


def test_extend_with_episode_data_and_clear(tmp_path):
    path = tmp_path / "s"
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], cache_path=path)
    ed = np.array([[1, 1], [2, 2], [3, 3], [4, 4]], np.float32)
    buf.extend({"step_data": steps([0, 1, 2, 3]), "episode_ids": np.array([5, 5, 6, 5]), "episode_data": ed})
    # The last row of each episode wins.
    assert_tree_equal(buf[:]["episode_data"], stack([ed[3], ed[3], ed[2], ed[3]]))
    buf.extend({"step_data": steps([4]), "episode_data": ed[:1]})  # the current episode (0)
    assert_tree_equal(buf[-1]["episode_data"], ed[0])
    seen = set(ids_of(buf).tolist()) | {buf.current_episode_id}
    buf.clear()
    assert len(buf) == 0 and buf.current_episode_id not in seen, "clear must never reuse an episode id"
    for eid in seen:
        with pytest.raises(KeyError):
            buf.episode_id_to_episode_data_index(eid)
    buf.extend(steps([7]))
    buf.close()
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        assert len(ro) == 1 and int(ids_of(ro)[0]) not in seen


def test_writer_reopen_of_ring_keeps_evicting(tmp_path):
    path = tmp_path / "s"
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], step_data_capacity=6,
                                        episode_data_capacity=3, cache_path=path)
    two_episodes(buf, "box")
    buf.close()
    buf = TrajectoryReplayBuffer.load_from(path)
    assert buf.current_episode_id == 2 and ids_of(buf).tolist() == [0, 0, 1, 1, 1]
    buf.extend(steps([20, 21, 22, 23]))
    buf.set_current_episode_data(ep_value("box", 102))
    assert ids_of(buf).tolist() == [1, 1, 2, 2, 2, 2]
    with pytest.raises(KeyError):
        buf.episode_id_to_episode_data_index(0)
    assert_tree_equal(buf[:]["episode_data"], stack([ep_value("box", g) for g in (101, 101, 102, 102, 102, 102)]))
    buf.close()


# ----------------------------------------------------------------------------------------
# bad input raises before any write (docs/design.md 3.5)
# ----------------------------------------------------------------------------------------
BAD_INPUTS = {
    "step_shape_extend": lambda b: b.extend({"obs": np.zeros((2, 4), np.float32)}),
    "step_shape_append": lambda b: b.append({"obs": np.zeros(2, np.float32)}),
    "step_shape_wrapped": lambda b: b.extend({"step_data": {"obs": np.zeros((2, 3, 1), np.float32)}}),
    "missing_key": lambda b: b.extend({"step_data": {"act": np.zeros((2, 3), np.float32)}}),
    "ids_too_short": lambda b: b.extend({"step_data": steps([1, 2, 3]), "episode_ids": np.array([5, 5])}),
    "ids_too_long": lambda b: b.extend({"step_data": steps([1, 2]), "episode_ids": np.array([5, 5, 5])}),
    "ids_float": lambda b: b.extend({"step_data": steps([1, 2]), "episode_ids": np.array([5.0, 6.0])}),
    "ids_2d": lambda b: b.extend({"step_data": steps([1, 2]), "episode_ids": np.array([[5], [6]])}),
    "id_float_append": lambda b: b.append({"step_data": step(1), "episode_ids": 5.0}),
    "ep_data_shape": lambda b: b.extend({"step_data": steps([1, 2]), "episode_data": np.zeros((2, 3), np.float32)}),
    "ep_data_rows": lambda b: b.extend({"step_data": steps([1, 2]), "episode_data": np.zeros((3, 2), np.float32)}),
    "set_current_shape": lambda b: b.set_current_episode_data(np.zeros(5, np.float32)),
    "set_at_shape": lambda b: b.set_episode_data_at(0, np.zeros((1, 2), np.float32)),
    "set_current_dtype": lambda b: b.set_current_episode_data(np.array([1 + 2j, 0])),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_before_any_write(tmp_path, case):
    path = tmp_path / "s"
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP_SPACES["box"], cache_path=path,
                                        chunk_rows=4)
    two_episodes(buf, "box")
    buf.extend(steps([20]))
    buf.flush()
    before, n, cur = file_digest(path), len(buf), buf.current_episode_id
    with pytest.raises((BadValueError, SpaceMismatchError)):
        BAD_INPUTS[case](buf)
    assert file_digest(path) == before, f"{case}: the store's files changed"
    assert len(buf) == n and buf.current_episode_id == cur
    # The buffer still works, with nothing of the bad value in it.
    buf.extend(steps([21]))
    buf.mark_episode_end()
    buf.extend(steps([30]))
    assert ids_of(buf).tolist() == [0, 0, 1, 1, 1, 2, 2, 3]
    np.testing.assert_array_equal(buf[:]["step_data"]["obs"][:, 0], [0, 1, 10, 11, 12, 20, 21, 30])
    assert_tree_equal(buf[:5]["episode_data"], stack([ep_value("box", g) for g in (100, 100, 101, 101, 101)]))
    with pytest.raises(KeyError):
        buf.episode_id_to_episode_data_index(2)
    buf.close()


def test_episode_ids_out_of_range_are_refused_before_any_write(tmp_path):
    """Explicit episode ids (extend, set_episode_data_at) must leave next_episode_id inside what a
    commit record may hold (below 2**62): the largest id is accepted and the store reopens; one
    more, a negative id or a uint64 beyond int64 raise BadValueError and change nothing."""
    path = tmp_path / "t"
    tb = TrajectoryReplayBuffer.create(Box(-1, 1, (2,), np.float32), cache_path=path,
                                       episode_data_instance_space=Box(-1, 1, (), np.float32))
    top = 2**62 - 2
    tb.extend({"step_data": np.zeros((1, 2), np.float32), "episode_ids": np.array([top], np.uint64)})
    for bad in (np.array([top + 1]), np.array([2**64 - 1], np.uint64), np.array([-1])):
        with pytest.raises(BadValueError):
            tb.extend({"step_data": np.zeros((1, 2), np.float32), "episode_ids": bad})
    for bad in (top + 1, -1):
        with pytest.raises(BadValueError):
            tb.set_episode_data_at(bad, np.float32(0.5))
    assert len(tb) == 1
    tb.close()
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        assert len(ro) == 1 and int(ro.get_at_with_metadata(0)[1]["episode_ids"]) == top
