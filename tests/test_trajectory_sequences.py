"""TrajectoryReplayBuffer sequences (docs/design.md 1 "Sequences", issue 3 items 7-8):
``get_sequences`` (docs/design.md's worked example = unienv.md acceptance case 9, episode-aware
frame stacking), frames beyond the buffer's ends, ``sample_sequences`` inside and across
episodes, torch shapes, a ring across its wrap point, ``episodes()`` / ``get_episode``.

Every step's obs encodes ``[episode id, step number in episode, absolute row]``, so each
returned frame can be traced back to the row it came from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.spaces import Box, Dict

from trajstore import TrajectoryReplayBuffer
from trajstore.core import episodes

SCALAR = Dict({"obs": Box(-np.inf, np.inf, (), np.float32)})
STEP = Dict({"obs": Box(-np.inf, np.inf, (3,), np.float32), "img": Box(0, 255, (2, 2), np.uint8)})
EP = Box(-np.inf, np.inf, (2,), np.float32)


def npy(x):
    if isinstance(x, dict):
        return {k: npy(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.cpu().numpy()
    return np.asarray(x)


def encode(eid, k, row) -> dict[str, np.ndarray]:
    eid, k, row = (np.asarray(a, np.int64).reshape(-1) for a in (eid, k, row))
    obs = np.stack([eid, k, row], axis=1).astype(np.float32)
    img = ((row * 7 + eid)[:, None, None] + np.arange(4).reshape(2, 2)) % 251
    return {"obs": obs, "img": img.astype(np.uint8)}


def record(buf, lengths, *, row=0, with_data=True, end_last=True) -> int:
    """Record episodes of the given lengths (obs per :func:`encode`, absolute rows from
    ``row``); returns the next absolute row."""
    for e, length in enumerate(lengths):
        eid = buf.current_episode_id
        buf.extend(encode(np.full(length, eid), np.arange(length), np.arange(row, row + length)))
        row += length
        if with_data:
            buf.set_current_episode_data(np.array([eid, -eid], np.float32))
        if end_last or e < len(lengths) - 1:
            buf.mark_episode_end()
    return row


def reference(ids: np.ndarray, values: np.ndarray, idx, offsets, pad: str):
    """docs/design.md's definition, frame by frame, over the logical rows of the buffer."""
    n = len(ids)
    idx = np.arange(n)[idx] if not isinstance(idx, np.ndarray) else idx
    offsets = np.asarray(offsets)
    B, T = len(idx), len(offsets)
    mask = np.zeros((B, T), bool)
    out = np.zeros((B, T, *values.shape[1:]), values.dtype)
    for b, a in enumerate(idx):
        for t, o in enumerate(offsets):
            r = a + o
            mask[b, t] = 0 <= r < n and ids[r] == ids[a]
        valid = np.flatnonzero(mask[b])
        for t, o in enumerate(offsets):
            if mask[b, t]:
                out[b, t] = values[a + o]
            elif pad == "edge":
                src = valid[0] if o < 0 else valid[-1]
                out[b, t] = values[a + offsets[src]]
    return mask, out


def logical_ids(buf) -> np.ndarray:
    return npy(buf.get_at_with_metadata(np.arange(len(buf)))[1]["episode_ids"])


# ----------------------------------------------------------------------------------------
# docs/design.md's worked example (unienv.md acceptance case 9: episode-aware frame stacking)
# ----------------------------------------------------------------------------------------
WORKED_MASK = [[0, 1, 1], [1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 1, 0], [0, 1, 0]]
WORKED = {
    "edge": [[0, 0, 1], [0, 1, 1], [10, 10, 11], [10, 11, 12], [11, 12, 12], [20, 20, 20]],
    "zero": [[0, 0, 1], [0, 1, 0], [0, 10, 11], [10, 11, 12], [11, 12, 0], [0, 20, 0]],
}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("pad", ["edge", "zero"])
@pytest.mark.parametrize("ids_how", ["mark_episode_end", "explicit"])
def test_design_worked_example(tmp_path, pad, backend, ids_how):
    buf = TrajectoryReplayBuffer.create(SCALAR, cache_path=tmp_path / "s", backend=backend)
    obs = np.array([0, 1, 10, 11, 12, 20], np.float32)
    if ids_how == "explicit":
        buf.extend({"step_data": {"obs": obs}, "episode_ids": np.array([0, 0, 1, 1, 1, 2])})
    else:
        for lo, hi in ((0, 2), (2, 5), (5, 6)):
            buf.extend({"obs": obs[lo:hi]})
            buf.mark_episode_end()
    assert logical_ids(buf).tolist() == [0, 0, 1, 1, 1, 2]
    for idx in (np.arange(6), slice(None), [0, 1, 2, 3, 4, 5], torch.arange(6)):
        data, mask = buf.get_sequences(idx, [-1, 0, 1], pad=pad)
        want_kind = torch.Tensor if backend == "torch" else np.ndarray
        assert isinstance(mask, want_kind) and isinstance(data["step_data"]["obs"], want_kind)
        assert npy(mask).dtype == bool and npy(mask).tolist() == np.array(WORKED_MASK, bool).tolist()
        got = npy(data["step_data"]["obs"])
        assert got.shape == (6, 3) and got.dtype == np.float32
        np.testing.assert_array_equal(got, WORKED[pad])
        assert data["episode_data"] is None
    # A subset of anchors, in any order, gives the same rows.
    data, mask = buf.get_sequences(np.array([4, 0]), np.array([-1, 0, 1]), pad=pad)
    np.testing.assert_array_equal(npy(data["step_data"]["obs"]), [WORKED[pad][4], WORKED[pad][0]])
    np.testing.assert_array_equal(npy(mask), np.array([WORKED_MASK[4], WORKED_MASK[0]], bool))
    buf.close()


def test_frames_beyond_the_buffer_ends_are_invalid(tmp_path):
    """One episode of 5 rows: frames before row 0 and after row 4 do not exist (unlike UniEnv,
    which clamps them), although they would carry the anchor's episode id."""
    buf = TrajectoryReplayBuffer.create(SCALAR, cache_path=tmp_path / "s")
    buf.extend({"obs": np.arange(5, dtype=np.float32) + 1})  # still the open episode 0
    offsets = [-3, -2, -1, 0, 1, 2, 3]
    data, mask = buf.get_sequences(np.array([0, 2, 4]), offsets)
    assert mask.tolist() == [[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]]
    np.testing.assert_array_equal(data["step_data"]["obs"],
                                  [[1, 1, 1, 1, 2, 3, 4], [1, 1, 2, 3, 4, 5, 5], [2, 3, 4, 5, 5, 5, 5]])
    data, mask = buf.get_sequences(np.array([0, 4]), offsets, pad="zero")
    np.testing.assert_array_equal(data["step_data"]["obs"], [[0, 0, 0, 1, 2, 3, 4], [2, 3, 4, 5, 0, 0, 0]])
    # Offsets far outside the buffer.
    data, mask = buf.get_sequences(2, [-100, 0, 100])
    assert npy(mask).tolist() == [[False, True, False]]
    np.testing.assert_array_equal(data["step_data"]["obs"], [[3, 3, 3]])
    with pytest.raises(IndexError):
        buf.get_sequences(5, [0])
    with pytest.raises(ValueError):
        buf.get_sequences(0, [0], pad="reflect")
    buf.close()


@pytest.mark.parametrize("pad", ["edge", "zero"])
def test_get_sequences_matches_definition(tmp_path, pad):
    """Random episodes (some of one step), random anchors, sorted offsets with gaps: every
    frame, mask and pad value equals the definition computed row by row."""
    rng = np.random.default_rng(5)
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, cache_path=tmp_path / "s", chunk_rows=8)
    record(buf, rng.integers(1, 9, size=25).tolist(), end_last=False)
    ids = logical_ids(buf)
    x = buf[:]
    offsets = [-4, -2, -1, 0, 1, 3, 5]
    idx = rng.integers(0, len(buf), size=200)
    data, mask = buf.get_sequences(idx, offsets, pad=pad)
    for leaf in ("obs", "img"):
        want_mask, want = reference(ids, x["step_data"][leaf], idx, offsets, pad)
        np.testing.assert_array_equal(mask, want_mask)
        np.testing.assert_array_equal(data["step_data"][leaf], want, err_msg=leaf)
    # Episode data: one row per anchor, the anchor's episode.
    np.testing.assert_array_equal(data["episode_data"][:, 0], ids[idx])
    buf.close()


# ----------------------------------------------------------------------------------------
# sample_sequences
# ----------------------------------------------------------------------------------------
def _logical_of(buf):
    """absolute row number (obs[:, 2]) -> logical row, for the rows present."""
    rows = buf[:]["step_data"]["obs"][:, 2].astype(np.int64)
    return {int(r): i for i, r in enumerate(rows)}


@pytest.mark.parametrize("capacity", [None, 40], ids=["unbounded", "ring40"])
def test_sample_sequences_within_episode(tmp_path, capacity):
    rng = np.random.default_rng(7)
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, step_data_capacity=capacity,
                                        cache_path=tmp_path / "s", chunk_rows=8)
    record(buf, rng.integers(1, 12, size=30).tolist())
    ids = logical_ids(buf)
    data, mask = buf.sample_sequences(300, 4, rng=np.random.default_rng(0), within_episode=True)
    obs = npy(data["step_data"]["obs"])
    assert obs.shape == (300, 4, 3) and mask.shape == (300, 4) and mask.all()
    eid, k, row = obs[..., 0], obs[..., 1], obs[..., 2]
    assert (eid == eid[:, :1]).all(), "a within_episode window joins two episodes"
    assert (np.diff(k, axis=1) == 1).all() and (np.diff(row, axis=1) == 1).all(), "frames are not consecutive steps"
    pos = _logical_of(buf)
    assert all(int(r) in pos for r in row.ravel()), "a frame comes from a row that is not in the buffer"
    assert all(ids[pos[int(r)]] == e for r, e in zip(row.ravel(), eid.ravel()))
    np.testing.assert_array_equal(npy(data["episode_data"])[:, 0], eid[:, 0])
    # Reproducible with the same seed; the windows spread over many episodes.
    data2, _ = buf.sample_sequences(300, 4, rng=np.random.default_rng(0), within_episode=True)
    np.testing.assert_array_equal(npy(data2["step_data"]["obs"]), obs)
    ep = buf.episodes()
    eligible = int((ep["length"] >= 4).sum())
    assert eligible >= 3 and len(np.unique(eid[:, 0])) >= min(5, eligible)
    with pytest.raises(ValueError):
        buf.sample_sequences(4, 50, rng=0, within_episode=True)  # longer than any episode
    buf.close()


@pytest.mark.parametrize("pad", ["edge", "zero"])
@pytest.mark.parametrize("capacity", [None, 40], ids=["unbounded", "ring40"])
def test_sample_sequences_across_episodes(tmp_path, capacity, pad):
    rng = np.random.default_rng(8)
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, step_data_capacity=capacity,
                                        cache_path=tmp_path / "s", chunk_rows=8)
    record(buf, rng.integers(1, 8, size=30).tolist(), end_last=False)
    ids = logical_ids(buf)
    x = buf[:]
    pos = _logical_of(buf)
    T = 5
    data, mask = buf.sample_sequences(400, T, rng=1, pad=pad, within_episode=False)
    obs, mask = npy(data["step_data"]["obs"]), npy(mask)
    assert obs.shape == (400, T, 3) and mask.shape == (400, T) and mask[:, 0].all()
    anchors = np.array([pos[int(r)] for r in obs[:, 0, 2]])
    want_mask, want = reference(ids, x["step_data"]["obs"], anchors, np.arange(T), pad)
    np.testing.assert_array_equal(mask, want_mask)
    np.testing.assert_array_equal(obs, want)
    assert (~mask).any() and mask[:, 1:].any(), "the sample should include windows that cross a boundary"
    buf.close()


# ----------------------------------------------------------------------------------------
# torch shapes
# ----------------------------------------------------------------------------------------
def test_sequences_torch_shapes(tmp_path):
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, cache_path=tmp_path / "s",
                                        backend="torch")
    record(buf, [3, 5, 4])
    data, mask = buf.get_sequences(torch.tensor([0, 4, 11]), [-2, -1, 0])
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and tuple(mask.shape) == (3, 3)
    assert tuple(data["step_data"]["obs"].shape) == (3, 3, 3) and data["step_data"]["obs"].dtype == torch.float32
    assert tuple(data["step_data"]["img"].shape) == (3, 3, 2, 2) and data["step_data"]["img"].dtype == torch.uint8
    assert isinstance(data["episode_data"], torch.Tensor) and tuple(data["episode_data"].shape) == (3, 2)
    assert mask.tolist() == [[False, False, True], [False, True, True], [True, True, True]]
    data, mask = buf.sample_sequences(16, 3, rng=0, within_episode=True)
    assert tuple(data["step_data"]["obs"].shape) == (16, 3, 3) and tuple(mask.shape) == (16, 3) and bool(mask.all())
    data, mask = buf.sample_sequences(16, 6, rng=0)
    assert tuple(data["step_data"]["img"].shape) == (16, 6, 2, 2) and tuple(mask.shape) == (16, 6)
    smp = buf.sample(32, rng=0)
    obs = smp["step_data"]["obs"].numpy()
    np.testing.assert_array_equal(smp["episode_data"].numpy()[:, 0], obs[:, 0])
    buf.close()


# ----------------------------------------------------------------------------------------
# ring across the wrap point
# ----------------------------------------------------------------------------------------
def test_sequences_across_the_wrap_point(tmp_path):
    """Capacity 6: ids [1,1,2,2,2,2] after 5 + 4 rows (offset 3).  Logical rows 2 and 3 are
    physical rows 5 and 0 (same episode: joined); logical row 5 (physical 2) is physically next
    to logical row 0 (physical 3): never joined."""
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, step_data_capacity=6,
                                        cache_path=tmp_path / "s", chunk_rows=2)
    row = record(buf, [2, 3])
    record(buf, [4], row=row, end_last=False)
    assert len(buf) == 6 and buf.offset == 3
    ids = logical_ids(buf)
    assert ids.tolist() == [1, 1, 2, 2, 2, 2]
    x = buf[:]
    np.testing.assert_array_equal(x["step_data"]["obs"][:, 2], [3, 4, 5, 6, 7, 8])
    offsets = [-3, -2, -1, 0, 1, 2, 3]
    for pad in ("edge", "zero"):
        data, mask = buf.get_sequences(np.arange(6), offsets, pad=pad)
        want_mask, want = reference(ids, x["step_data"]["obs"], np.arange(6), offsets, pad)
        np.testing.assert_array_equal(mask, want_mask)
        np.testing.assert_array_equal(data["step_data"]["obs"], want)
    assert mask[2].tolist() == [False, False, False, True, True, True, True]
    assert mask[5].tolist() == [True, True, True, True, False, False, False]

    # One long episode filling the whole ring: its ids are equal across the physical seam,
    # but logical row 5 + 1 does not exist.
    one = TrajectoryReplayBuffer.create(STEP, step_data_capacity=6, cache_path=tmp_path / "one", chunk_rows=4)
    one.extend(encode(np.zeros(9), np.arange(9), np.arange(9)))
    assert one.offset == 3 and logical_ids(one).tolist() == [0] * 6
    data, mask = one.get_sequences(np.array([0, 5]), [-1, 0, 1])
    assert mask.tolist() == [[False, True, True], [True, True, False]]
    np.testing.assert_array_equal(data["step_data"]["obs"][..., 2], [[3, 3, 4], [7, 8, 8]])
    for _ in range(5):
        d, m = one.sample_sequences(64, 4, rng=np.random.default_rng(_), within_episode=True)
        rows = d["step_data"]["obs"][..., 2]
        assert m.all() and (np.diff(rows, axis=1) == 1).all() and rows.min() >= 3 and rows.max() <= 8
    one.close()
    buf.close()


# ----------------------------------------------------------------------------------------
# episodes() and get_episode
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_episodes_and_get_episode(tmp_path, backend):
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, step_data_capacity=10,
                                        cache_path=tmp_path / "s", backend=backend, chunk_rows=4)
    row = record(buf, [3, 1, 4], end_last=False)  # episode 2 still being recorded
    ep = {k: npy(v) for k, v in buf.episodes().items()}
    assert ep["episode_id"].tolist() == [0, 1, 2]
    assert ep["start"].tolist() == [0, 3, 4] and ep["length"].tolist() == [3, 1, 4]
    assert ep["live"].tolist() == [False, False, True]
    e = buf.get_episode(2)
    obs = npy(e["step_data"]["obs"])
    assert obs.shape == (4, 3) and obs[:, 0].tolist() == [2] * 4 and obs[:, 1].tolist() == [0, 1, 2, 3]
    assert npy(e["episode_data"]).tolist() == [[2, -2]] * 4
    if backend == "torch":
        assert isinstance(e["step_data"]["obs"], torch.Tensor)
    buf.mark_episode_end()
    assert not npy(buf.episodes()["live"]).any()
    # 13 rows into a ring of 10: rows 3..12 stay (episode 0 gone, episode 1's single step kept).
    record(buf, [5], row=row, end_last=False)
    ep = {k: npy(v) for k, v in buf.episodes().items()}
    assert ep["episode_id"].tolist() == [1, 2, 3] and ep["start"].tolist() == [0, 1, 5]
    assert ep["length"].tolist() == [1, 4, 5] and ep["live"].tolist() == [False, False, True]
    buf.extend(encode([3, 3], [5, 6], [13, 14]))  # evicts rows 3 (episode 1) and 4 (episode 2's first step)
    ep = {k: npy(v) for k, v in buf.episodes().items()}
    assert ep["episode_id"].tolist() == [2, 3] and ep["start"].tolist() == [0, 3] and ep["length"].tolist() == [3, 7]
    assert npy(buf.get_episode(2)["step_data"]["obs"])[:, 1].tolist() == [1, 2, 3]
    for gone in (0, 1, 99):
        with pytest.raises(KeyError):
            buf.get_episode(gone)
    buf.close()
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as ro:
        ep = {k: npy(v) for k, v in ro.episodes().items()}
        assert ep["episode_id"].tolist() == [2, 3] and ep["length"].tolist() == [3, 7]


# ----------------------------------------------------------------------------------------
# windows read as blocks, and the run index that decides their validity
# ----------------------------------------------------------------------------------------
def _check_one_run(buf, ids):
    """The run index's answer "rows lo .. lo + span share one id" for every window, against the
    ids: short spans come from its bitmap of run starts, spans past 56 rows from a binary search."""
    n, start = len(ids), buf._table.state.start
    for span in (0, 1, 3, 7, 8, 31, 55, 56, 57, 80):
        lo = np.arange(max(n - span, 0))
        if lo.size == 0:
            continue
        window = ids[lo[:, None] + np.arange(span + 1)]
        want = (window == window[:, :1]).all(axis=1)
        np.testing.assert_array_equal(buf.run_index.one_run(lo + start, span), want, err_msg=f"span {span}")


def _check_block_windows(buf, offsets_list=((0, 1, 2, 3), (-3, -2, -1, 0), (-2, -1, 0, 1, 2), (0,)), n_idx=150,
                         seed=0):
    """Every contiguous window (read as blocks) equals the definition, for both pads."""
    rng = np.random.default_rng(seed)
    ids, x = logical_ids(buf), buf[:]["step_data"]
    _check_one_run(buf, ids)
    idx = rng.integers(0, len(buf), size=n_idx)
    for offsets in offsets_list:
        for pad in ("edge", "zero"):
            data, mask = buf.get_sequences(idx, offsets, pad=pad)
            for leaf in ("obs", "img"):
                want_mask, want = reference(ids, x[leaf], idx, offsets, pad)
                np.testing.assert_array_equal(npy(mask), want_mask, err_msg=f"{offsets} {pad}")
                np.testing.assert_array_equal(npy(data["step_data"][leaf]), want, err_msg=f"{offsets} {pad} {leaf}")


@pytest.mark.parametrize("capacity", [None, 37], ids=["unbounded", "ring37"])
def test_block_windows_with_interleaved_ids(tmp_path, capacity, monkeypatch):
    """Explicit ids that come back after another episode's rows (0 0 1 0 1 1 2 ...): a run of
    equal ids is not an episode, so windows crossing runs must read ids; chunks of 8 rows and a
    ring of 37 put windows across chunk boundaries and the wrap point."""
    monkeypatch.setattr(episodes._Boundaries, "_SLACK", 8)  # the run-start bitmap trims and regrows
    monkeypatch.setattr(episodes.RunIndex, "_SCAN_ROWS", 3)  # ids are scanned in blocks: runs cross them
    rng = np.random.default_rng(3)
    buf = TrajectoryReplayBuffer.create(STEP, step_data_capacity=capacity, cache_path=tmp_path / "s", chunk_rows=8)
    row = 0
    for _ in range(12):
        k = int(rng.integers(1, 9))
        ids = rng.integers(0, 4, size=k)
        buf.extend({"step_data": encode(ids, np.arange(k), np.arange(row, row + k)), "episode_ids": ids})
        row += k
        _check_block_windows(buf, n_idx=60, seed=row)
        _check_episodes(buf)  # interleaved ids: an episode of several runs
    buf.close()


def _check_episodes(buf):
    ids = logical_ids(buf)
    uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    ep = buf.episodes()
    np.testing.assert_array_equal(ep["episode_id"], uniq[order])
    np.testing.assert_array_equal(ep["start"], first[order])
    np.testing.assert_array_equal(ep["length"], counts[order])
    for eid in uniq.tolist():
        np.testing.assert_array_equal(npy(buf.get_episode(eid)["step_data"]["obs"]),
                                      buf[:]["step_data"]["obs"][ids == eid])


def test_run_index_follows_rewrites_and_eviction(tmp_path, monkeypatch):
    """The run index is extended on append and rebuilt after set_at (new ids), remove_at (rows
    move), clear and eviction past the rows it covered; a read-only view of the same store keeps
    its own index in step with the writer's commits."""
    monkeypatch.setattr(episodes._Boundaries, "_SLACK", 8)  # the run-start bitmap trims and regrows
    monkeypatch.setattr(episodes.RunIndex, "_SCAN_ROWS", 5)  # ids are scanned in blocks: runs cross them
    buf = TrajectoryReplayBuffer.create(STEP, step_data_capacity=48, cache_path=tmp_path / "s", chunk_rows=8)
    reader = None
    row = record(buf, [5, 3, 7, 1, 6], with_data=False)
    _check_block_windows(buf)
    buf.flush()
    reader = TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True)
    _check_block_windows(reader)
    for step in range(6):
        if step == 0:  # new ids for rows 2..5: a run boundary appears inside the first episode
            buf.set_at(np.arange(2, 6), {"step_data": encode(np.full(4, 99), np.arange(4), np.arange(2, 6)),
                                         "episode_ids": np.full(4, 99)})
        elif step == 1:
            buf.remove_at(np.array([0, 7, 8, 13]))
        elif step == 2:  # the ring wraps and evicts every row the index had covered
            row = record(buf, [9, 11, 8, 10, 12], row=row, with_data=False)
        elif step == 3:
            buf.clear()
            row = record(buf, [4, 4], row=row, with_data=False)
        else:
            row = record(buf, [int(step) + 2, 3], row=row, with_data=False)
        _check_block_windows(buf, seed=step)
        starts = buf.run_index._starts[: buf.run_index._n]
        ids = logical_ids(buf)
        live = starts[starts >= buf._table.state.start] - buf._table.state.start
        want = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        np.testing.assert_array_equal(live[live > 0], want[want > 0])
        buf.flush()
        _check_block_windows(reader, seed=step)
        for b in (buf, reader):  # episodes() / get_episode come from the run index: same as a scan
            _check_episodes(b)
    reader.close()
    buf.close()


@pytest.mark.parametrize("slack", [8, 1 << 15], ids=["bitmap-rebuilt", "bitmap-extended"])
def test_run_index_when_a_readers_ring_start_moves_back(tmp_path, monkeypatch, slack):
    """An eviction record moves a reader's ring start a guard band ahead of what the next commit
    keeps, so after that commit the start moves back: the reader's run index covers those rows
    again (joining the run they continue) and its bitmap of run starts answers as the ids do."""
    monkeypatch.setattr(episodes._Boundaries, "_SLACK", slack)
    monkeypatch.setattr(episodes.RunIndex, "_SCAN_ROWS", 4)  # a moved-back start covers rows in blocks
    buf = TrajectoryReplayBuffer.create(STEP, step_data_capacity=48, cache_path=tmp_path / "s", chunk_rows=8)
    row = record(buf, [30, 25], with_data=False)
    buf.flush()
    reader = TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True)
    rng = np.random.default_rng(0)
    starts = []

    def check():
        ids = logical_ids(reader)  # syncs the reader with the latest record
        starts.append(reader._table.state.start)
        _check_one_run(reader, ids)
        data, mask = reader.sample_sequences(16, 4, rng=rng, within_episode=True)
        frames = npy(data["step_data"]["obs"])
        assert npy(mask).all() and (frames[:, :, 0] == frames[:, :1, 0]).all()

    for step in range(300):
        if step % 5 == 0:  # a rewrite (of a row with its own data) starts a new epoch: the reader
            k = len(buf) - 1  # rebuilds its index at the next check, from a start run ahead
            buf.set_at(np.array([k]), buf.get_at(np.array([k]))["step_data"])
        row = record(buf, [1], row=row, with_data=False, end_last=rng.random() < 0.1)
        check()  # the extend wrote an eviction record: the start runs ahead
        if step % 3 == 2:
            buf.flush()
            check()  # the commit keeps rows the eviction record had dropped: the start moves back
    moved_back = int((np.diff(starts) < 0).sum())
    assert moved_back >= 20, moved_back
    reader.close()
    buf.close()


@pytest.mark.parametrize("slack", [0, 8, 100])
def test_run_start_bitmap_against_a_set(monkeypatch, slack):
    """The bitmap of run starts as a ring uses it: rows appended at the end, the covered range's
    start advancing (old bytes trimmed), starts marked and cleared; every "no start in
    (lo, lo + span]" answer matches a plain set of start rows."""
    monkeypatch.setattr(episodes._Boundaries, "_SLACK", slack)
    rng = np.random.default_rng(slack)
    bits, marked = episodes._Boundaries(), set()
    lo, hi = 1000, 1000
    bits.reset(lo, hi, np.zeros(0, np.int64))
    for step in range(200):
        new_hi = hi + int(rng.integers(0, 40))
        lo = max(lo, new_hi - 300) + int(rng.integers(0, 3))
        new = np.unique(rng.integers(hi, max(new_hi, hi + 1), size=int(rng.integers(0, 6))))[: max(new_hi - hi, 0)]
        hi = new_hi
        bits.extend(hi, lo)
        bits.mark(new, True)
        marked |= set(new.tolist())
        if step % 7 == 0 and marked:
            gone = max(marked)
            bits.mark(np.array([gone]), False)
            marked.discard(gone)
        assert bits.covers(lo)
        ref = np.zeros(hi + 1, bool)
        ref[[r for r in marked if r < hi]] = True
        for span in (0, 1, 9, 56):
            q = np.arange(lo, max(hi - span, lo))
            if q.size:
                want = np.array([not ref[r + 1 : r + span + 1].any() for r in q.tolist()])
                np.testing.assert_array_equal(bits.none_in(q, span), want, err_msg=f"step {step} span {span}")


def test_within_episode_when_valid_windows_are_rare(tmp_path):
    """One long episode among many one-step episodes: few windows qualify, the rounds adapt
    their draws and every returned window lies inside the long episode."""
    buf = TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s", chunk_rows=16)
    row = record(buf, [1] * 300, with_data=False)
    record(buf, [12], row=row, with_data=False)
    data, mask = buf.sample_sequences(64, 8, rng=0, within_episode=True)
    rows = npy(data["step_data"]["obs"])[..., 2]
    assert npy(mask).all() and (rows >= 300).all() and (np.diff(rows, axis=1) == 1).all()
    assert len(np.unique(rows[:, 0])) == 5  # every one of the 5 eligible windows is drawn
    buf.close()
