"""Per-field windows (issue 16): ``get_sequences`` / ``sample_sequences`` with ``offsets`` a mapping
of step fields to their own offsets and ``pad`` one mode or a mode per field.

Every step's fields encode its absolute row, so each frame is compared with a plain-numpy
reference built from the rows written: a frame is valid when its row exists and belongs to the
anchor's episode; ``"edge"`` repeats the anchor's episode's first step (frames before the anchor)
or last step (after it) within the window of all fields together; ``"zero"`` fills zeros.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.spaces import Box, Dict, Discrete, Tuple

from trajstore import TrajectoryReplayBuffer
from trajstore.buffers.rows import TrajectoryRows
from trajstore.errors import BadArgumentError, BadOptionError, UnknownFieldError
from trajstore.sampling import field_windows

STEP = Dict({
    "obs": Dict({"image": Box(0, 255, (2, 2), np.uint8), "state": Box(-1e9, 1e9, (3,), np.float32)}),
    "action": Box(-1e9, 1e9, (2,), np.float32),
    "reward": Box(-1e9, 1e9, (), np.float32),
})
EP = Box(-1e9, 1e9, (), np.float32)


def step_values(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Leaf name -> (n, ...) values of absolute ``rows``, each tracing back to its row."""
    rows = np.asarray(rows, np.int64)
    return {
        "obs/image": ((rows[:, None, None] * 3 + np.arange(4).reshape(2, 2)) % 251).astype(np.uint8),
        "obs/state": np.stack([rows, rows * 2, -rows], 1).astype(np.float32),
        "action": np.stack([rows + 0.5, -rows - 0.5], 1).astype(np.float32),
        "reward": rows.astype(np.float32) / 4,
    }


def nested(flat: dict[str, np.ndarray]) -> dict:
    return {"obs": {"image": flat["obs/image"], "state": flat["obs/state"]}, "action": flat["action"],
            "reward": flat["reward"]}


def write(buf: TrajectoryReplayBuffer, lengths: list[int], row: int = 0) -> int:
    """Episodes of ``lengths`` steps (the last one left open), episode data = episode id."""
    for e, n in enumerate(lengths):
        rows = np.arange(row, row + n)
        buf.extend(nested(step_values(rows)))
        if buf.episode_space is not None:
            buf.set_current_episode_data(np.float32(buf.current_episode_id))
        if e < len(lengths) - 1:
            buf.mark_episode_end()
        row += n
    return row


def logical(buf: TrajectoryReplayBuffer) -> tuple[np.ndarray, np.ndarray]:
    """(episode ids, absolute rows) of the buffer's logical rows."""
    data, meta = buf.get_at_with_metadata(np.arange(len(buf)))
    return np.asarray(meta["episode_ids"]), np.asarray(data["step_data"]["reward"] * 4).astype(np.int64)


def leaf(tree: dict, key: str):
    for k in key.split("/"):
        tree = tree[k]
    return tree


def reference(ids: np.ndarray, absrows: np.ndarray, anchors: np.ndarray, offsets: dict, pads: dict):
    """Per key: (valid (B, T), {leaf name: (B, T, ...) values}) as the module docstring defines them."""
    n = len(ids)
    every = [o for offs in offsets.values() for o in offs] + [0]
    lo, hi = min(every), max(every)
    out = {}
    for key, offs in offsets.items():
        offs = list(offs)
        names = [name for name in step_values(np.zeros(0)) if name == key or name.startswith(key + "/")]
        valid = np.zeros((len(anchors), len(offs)), bool)
        vals = {name: np.zeros((len(anchors), len(offs), *step_values(np.zeros(1))[name].shape[1:]),
                               step_values(np.zeros(1))[name].dtype) for name in names}
        for b, a in enumerate(anchors):
            first = a
            while first - 1 >= max(0, a + lo) and ids[first - 1] == ids[a]:
                first -= 1
            last = a
            while last + 1 <= min(n - 1, a + hi) and ids[last + 1] == ids[a]:
                last += 1
            for t, o in enumerate(offs):
                r = a + o
                valid[b, t] = 0 <= r < n and ids[r] == ids[a]
                if valid[b, t]:
                    src = r
                elif pads[key] == "edge":
                    src = first if o < 0 else last
                else:
                    continue
                for name in names:
                    vals[name][b, t] = step_values(absrows[src : src + 1])[name][0]
        out[key] = (valid, vals)
    return out


def check(buf, anchors, offsets, pad, got_data, got_mask):
    ids, absrows = logical(buf)
    pads = pad if isinstance(pad, dict) else {k: pad for k in offsets}
    pads = {k: pads.get(k, "edge") for k in offsets}
    want = reference(ids, absrows, anchors, offsets, pads)
    assert set(got_mask) == set(offsets)
    for key, (valid, vals) in want.items():
        mask = np.asarray(got_mask[key])
        assert mask.dtype == bool and mask.shape == (len(anchors), len(list(offsets[key])))
        np.testing.assert_array_equal(mask, valid, err_msg=key)
        for name, v in vals.items():
            got = np.asarray(leaf(got_data["step_data"], name))
            assert got.dtype == v.dtype and got.shape == v.shape, name
            np.testing.assert_array_equal(got, v, err_msg=f"{key}: {name}")


OFFSETS = {
    "obs/image": [-3, -1, 0],  # gapped, and under half the span: gathered row by row
    "obs/state": [-1, 0],
    "action": range(0, 6),  # consecutive: read as blocks of the span
}


@pytest.mark.parametrize("pad", ["edge", "zero", {"obs/image": "zero", "action": "edge"}])
def test_fields_match_numpy_reference(tmp_path, pad):
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, cache_path=tmp_path / "s", chunk_rows=8)
    write(buf, [5, 1, 9, 2, 12, 4])
    anchors = np.arange(len(buf))
    data, mask = buf.get_sequences(anchors, OFFSETS, pad=pad)
    check(buf, anchors, OFFSETS, pad, data, mask)
    # Only the named fields, nested as in the space; episode data of each anchor's episode.
    assert set(data["step_data"]) == {"obs", "action"} and set(data["step_data"]["obs"]) == {"image", "state"}
    ids, _ = logical(buf)
    np.testing.assert_array_equal(data["episode_data"], ids.astype(np.float32))
    # A subset of anchors, any order, negative indices and a slice give the same frames.
    for idx, rows in ((np.array([7, 0, -1]), [7, 0, len(buf) - 1]), (slice(3, 9), list(range(3, 9))), (4, [4])):
        data, mask = buf.get_sequences(idx, OFFSETS, pad=pad)
        check(buf, np.array(rows), OFFSETS, pad, data, mask)
    buf.close()


def test_whole_subtree_and_single_field(tmp_path):
    """A Dict node names all its leaves; one field alone; offsets as numpy arrays or ranges."""
    buf = TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s", chunk_rows=4)
    write(buf, [6, 3, 7])
    anchors = np.arange(len(buf))
    for offsets in ({"obs": np.array([-2, -1, 0])}, {"reward": range(-1, 3), "obs": [0]}, {"action": [2, 0, 2, -4]}):
        data, mask = buf.get_sequences(anchors, offsets, pad="edge")
        check(buf, anchors, offsets, "edge", data, mask)
        assert data["episode_data"] is None
    buf.close()


@pytest.mark.parametrize("pad", ["edge", "zero"])
def test_ring_wrap(tmp_path, pad):
    """A ring that wrapped (its oldest episode partly evicted): frames before logical row 0 do not
    exist, and windows across the physical wrap point read the right rows."""
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, step_data_capacity=20,
                                        cache_path=tmp_path / "s", chunk_rows=8)
    write(buf, [7, 4, 9, 3, 8, 5])  # 36 rows into a ring of 20
    assert len(buf) == 20
    _, absrows = logical(buf)
    assert absrows.tolist() == list(range(16, 36))
    anchors = np.arange(20)
    data, mask = buf.get_sequences(anchors, OFFSETS, pad=pad)
    check(buf, anchors, OFFSETS, pad, data, mask)
    buf.close()


def test_windows_wider_than_the_buffer(tmp_path):
    """Spans longer than the buffer (frames resolved row by row) and far offsets (a sparse span)."""
    buf = TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s", chunk_rows=4)
    write(buf, [3, 4])
    anchors = np.arange(len(buf))
    for pad in ("edge", "zero"):
        for offsets in ({"obs/state": [-1, 0], "action": range(0, 10)}, {"obs/state": [-100_000, 0], "action": [0, 5]}):
            data, mask = buf.get_sequences(anchors, offsets, pad=pad)
            check(buf, anchors, offsets, pad, data, mask)
    buf.close()


def test_torch_backend(tmp_path):
    buf = TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s", backend="torch")
    write(buf, [4, 5])
    data, mask = buf.get_sequences(torch.arange(9), {"obs/state": [-1, 0], "action": range(3)})
    assert isinstance(mask["action"], torch.Tensor) and mask["action"].dtype == torch.bool
    assert tuple(data["step_data"]["action"].shape) == (9, 3, 2) and tuple(mask["obs/state"].shape) == (9, 2)
    assert isinstance(data["step_data"]["obs"]["state"], torch.Tensor)
    buf.close()


class CountingRows(TrajectoryRows):
    """The buffer's real row source, recording which leaves each read asks for."""

    def __init__(self, buf):
        super().__init__(buf)
        self.reads: list[tuple[str, list[int], int]] = []

    def read_rows(self, rows, leaves):
        self.reads.append(("rows", list(leaves), len(rows)))
        return super().read_rows(rows, leaves)

    def gather_windows(self, first, length, leaves):
        self.reads.append(("windows", list(leaves), length))
        return super().gather_windows(first, length, leaves)


def test_each_named_field_read_once_and_others_not_at_all(tmp_path):
    buf = TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s", chunk_rows=8)
    write(buf, [10, 10, 10])
    src = CountingRows(buf)
    step_leaves = dict(zip(["action", "obs/image", "obs/state", "reward"], src.step_leaves))  # gymnasium sorts keys
    w = field_windows.get_field_windows(src, STEP, np.arange(5, 25), {"obs/image": [-1, 0], "action": range(16)})
    read = sorted(j for _, leaves, _ in src.reads for j in leaves)
    assert read == sorted([step_leaves["obs/image"], step_leaves["action"]])
    # The action chunk covers the span -1 .. 15: one block read of 17 rows; the 2 image frames are gathered.
    assert ("windows", [step_leaves["action"]], 17) in src.reads
    assert ("rows", [step_leaves["obs/image"]], 20 * 2) in src.reads
    assert w.steps["action"][0].shape == (20, 16, 2) and w.valid["obs/image"].shape == (20, 2)
    buf.close()


def test_sample_within_episode(tmp_path):
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, cache_path=tmp_path / "s", chunk_rows=8)
    write(buf, [3, 20, 2, 25, 6, 18])
    ids, absrows = logical(buf)
    offsets = {"obs/state": [-1, 0], "action": range(0, 8)}
    data, mask = buf.sample_sequences(256, offsets=offsets, within_episode=True, rng=1)
    assert all(bool(np.asarray(m).all()) for m in mask.values())
    state, action = data["step_data"]["obs"]["state"], data["step_data"]["action"]
    anchors = state[:, 1, 0].astype(np.int64)  # frame at offset 0 holds the anchor's absolute row
    assert (state[:, 0, 0] == anchors - 1).all() and (action[:, :, 0] == anchors[:, None] + np.arange(8) + 0.5).all()
    row_of = {int(r): i for i, r in enumerate(absrows)}
    logical_anchors = np.array([row_of[int(a)] for a in anchors])
    assert (ids[logical_anchors - 1] == ids[logical_anchors]).all()
    assert (ids[logical_anchors + 7] == ids[logical_anchors]).all()
    np.testing.assert_array_equal(data["episode_data"], ids[logical_anchors].astype(np.float32))
    # Every valid anchor is drawn (rows 1 .. len-8 of the episodes long enough), and only those.
    ok = np.array([a >= 1 and a + 7 < len(ids) and ids[a - 1] == ids[a] == ids[a + 7] for a in range(len(ids))])
    drawn = set(logical_anchors.tolist())
    for seed in range(2, 6):
        d, _ = buf.sample_sequences(256, offsets=offsets, within_episode=True, rng=seed)
        drawn |= {row_of[int(a)] for a in d["step_data"]["obs"]["state"][:, 1, 0]}
    assert drawn == set(np.flatnonzero(ok).tolist())
    # Same seed, same sample; other rows checked against the reference with padding.
    again, _ = buf.sample_sequences(256, offsets=offsets, within_episode=True, rng=1)
    np.testing.assert_array_equal(again["step_data"]["action"], action)
    buf.close()


@pytest.mark.parametrize("how", [{"within_episode": True, "allow_pad": True}, {}])
def test_sample_with_padding(tmp_path, how):
    """``allow_pad=True`` (or ``within_episode=False``): every row is an anchor, frames outside its
    episode padded as get_sequences pads them."""
    buf = TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s", chunk_rows=8)
    write(buf, [3, 5, 2, 6])
    _, absrows = logical(buf)
    offsets = {"obs/state": [-1, 0], "action": range(0, 4)}
    data, mask = buf.sample_sequences(128, offsets=offsets, pad={"action": "zero"}, rng=3, **how)
    anchors = np.searchsorted(absrows, data["step_data"]["obs"]["state"][:, 1, 0].astype(np.int64))
    assert len(set(anchors.tolist())) == len(buf)  # 128 draws from 16 rows: every row drawn
    check(buf, anchors, offsets, {"action": "zero"}, data, mask)
    assert not mask["action"].all()
    buf.close()


def test_seq_len_still_works_and_errors_of_sample(tmp_path):
    buf = TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s", chunk_rows=8)
    write(buf, [10, 10])
    data, mask = buf.sample_sequences(4, 3, rng=0, within_episode=True)
    assert mask.shape == (4, 3) and data["step_data"]["action"].shape == (4, 3, 2)
    with pytest.raises(BadArgumentError, match="got both"):
        buf.sample_sequences(4, 3, offsets={"action": [0]})
    with pytest.raises(BadArgumentError, match="got neither"):
        buf.sample_sequences(4)
    with pytest.raises(BadOptionError, match="inside one episode"):
        buf.sample_sequences(4, offsets={"action": range(-5, 20)}, within_episode=True)
    data, mask = buf.sample_sequences(4, offsets={"action": range(-5, 20)}, within_episode=True, allow_pad=True)
    assert mask["action"].shape == (4, 25)
    buf.close()


def test_bad_input(tmp_path):
    buf = TrajectoryReplayBuffer.create(STEP, cache_path=tmp_path / "s")
    write(buf, [4])
    cases = [
        ({"observation": [0]}, "edge", UnknownFieldError, r"'observation'.*fields: \['action', 'obs', 'obs/image'"),
        ({"obs/depth": [0]}, "edge", UnknownFieldError, "obs/depth"),
        ({"": [0]}, "edge", UnknownFieldError, "not a field"),
        ({3: [0]}, "edge", BadArgumentError, "str field paths"),
        ({}, "edge", BadOptionError, "empty mapping"),
        ({"action": []}, "edge", BadOptionError, r"offsets\['action'\] is empty"),
        ({"action": [0.0, 1.5]}, "edge", BadArgumentError, r"must be integers; got float64"),
        ({"action": [[0, 1]]}, "edge", BadArgumentError, r"1-D .* shape \(1, 2\)"),
        ({"action": 3}, "edge", BadArgumentError, "1-D"),
        ({"action": [0, "1"]}, "edge", BadArgumentError, "must be integers"),
        ({"obs": [0], "obs/image": [0]}, "edge", BadOptionError, "overlap"),
        ({"action": [0]}, "reflect", BadOptionError, r"pad must be one of \('edge', 'zero'\); got 'reflect'"),
        ({"action": [0]}, {"action": "wrap"}, BadOptionError, r"pad\['action'\] must be one of"),
        ({"action": [0]}, {"obs": "zero"}, BadOptionError, r"pad names \['obs'\], which offsets does not"),
    ]
    for offsets, pad, err, msg in cases:
        with pytest.raises(err, match=msg):
            buf.get_sequences(0, offsets, pad=pad)
        with pytest.raises(err, match=msg):
            buf.sample_sequences(2, offsets=offsets, pad=pad)
    buf.close()


def test_mapping_needs_a_dict_step_space(tmp_path):
    """A Box or Tuple step space takes one list of offsets; a Tuple inside a Dict is named whole."""
    box = TrajectoryReplayBuffer.create(Box(-1, 1, (2,), np.float32), cache_path=tmp_path / "box")
    box.extend(np.zeros((3, 2), np.float32))
    with pytest.raises(BadArgumentError, match="needs a Dict step space; .* is Box"):
        box.get_sequences(0, {"": [0]})
    assert box.get_sequences(0, [0, 1])[1].shape == (1, 2)
    box.close()
    sp = Dict({"pair": Tuple((Discrete(5), Box(-9, 9, (), np.float32))), "x": Discrete(3)})
    buf = TrajectoryReplayBuffer.create(sp, cache_path=tmp_path / "tuple")
    buf.extend({"pair": (np.arange(4), np.arange(4, dtype=np.float32) * 2), "x": np.arange(4) % 3})
    with pytest.raises(UnknownFieldError, match="a Tuple is named whole"):
        buf.get_sequences(0, {"pair/0": [0]})
    data, mask = buf.get_sequences(np.arange(4), {"pair": [-1, 0]}, pad="zero")
    assert set(data["step_data"]) == {"pair"} and isinstance(data["step_data"]["pair"], tuple)
    np.testing.assert_array_equal(data["step_data"]["pair"][0], [[0, 0], [0, 1], [1, 2], [2, 3]])
    np.testing.assert_array_equal(data["step_data"]["pair"][1], [[0, 0], [0, 2], [2, 4], [4, 6]])
    assert mask["pair"].tolist() == [[False, True]] + [[True, True]] * 3
    buf.close()


# ----------------------------------------------------------------------------------------
# SequenceDataset(offsets=...) and collate_batch
# ----------------------------------------------------------------------------------------
def test_sequence_dataset_per_field(tmp_path):
    from torch.utils.data import DataLoader

    from trajstore import ReplayBuffer
    from trajstore.torch import RandomBatchSampler, SequenceDataset, collate_batch

    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EP, cache_path=tmp_path / "s", chunk_rows=8)
    write(buf, [5, 1, 9, 2, 12, 4])
    buf.close()
    pad = {"obs/image": "zero"}
    ds = SequenceDataset(tmp_path / "s", offsets=OFFSETS, fields=["episode_data"], pad=pad, output="numpy")
    ro = TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True)
    assert len(ds) == len(ro) and ds.fields == ["obs/image", "obs/state", "action", "episode_data"]
    batch = ds.read_batch(np.arange(len(ds)))
    want, mask = ro.get_sequences(ds.anchors, OFFSETS, pad=pad)
    check(ro, ds.anchors, OFFSETS, pad, want, batch["mask"])
    for key in OFFSETS:
        np.testing.assert_array_equal(batch[key], leaf(want["step_data"], key))
        np.testing.assert_array_equal(batch["mask"][key], mask[key])
    np.testing.assert_array_equal(batch["episode_data"], want["episode_data"])
    item = ds[3]
    assert item["action"].shape == (6, 2) and item["mask"]["obs/state"].shape == (2,)

    # within_episode: anchors whose window -3 .. 5 lies inside one episode, all masks True.
    ids, _ = logical(ro)
    inner = SequenceDataset(tmp_path / "s", offsets=OFFSETS, within_episode=True, stride=2)
    ok = [a for a in range(0, len(ids), 2) if a >= 3 and a + 5 < len(ids) and ids[a - 3] == ids[a] == ids[a + 5]]
    assert inner.anchors.tolist() == ok == [20, 22]
    loader = DataLoader(inner, batch_sampler=RandomBatchSampler(inner, 8, num_batches=3, seed=0),
                        collate_fn=collate_batch, num_workers=1)
    for b in loader:
        assert tuple(b["obs/image"].shape) == (8, 3, 2, 2) and tuple(b["action"].shape) == (8, 6, 2)
        assert set(b["mask"]) == set(OFFSETS) and all(bool(m.all()) for m in b["mask"].values())
        assert isinstance(b["obs/state"], torch.Tensor)
    default = DataLoader(inner, batch_size=2)  # torch's default_collate, item by item
    b = next(iter(default))
    assert tuple(b["mask"]["action"].shape) == (2, 6) and tuple(b["obs/state"].shape) == (2, 2, 3)
    ro.close()

    with pytest.raises(BadArgumentError, match="got both"):
        SequenceDataset(tmp_path / "s", 4, offsets=OFFSETS)
    with pytest.raises(BadOptionError, match="may only add 'episode_data"):
        SequenceDataset(tmp_path / "s", offsets=OFFSETS, fields=["reward"])
    with pytest.raises(UnknownFieldError, match="'obs/depth'"):
        SequenceDataset(tmp_path / "s", offsets={"obs/depth": [0]})
    rb = ReplayBuffer.create(Dict({"x": Box(-1, 1, (), np.float32)}), cache_path=tmp_path / "rb")
    rb.extend({"x": np.zeros(4, np.float32)})
    rb.close()
    with pytest.raises(BadArgumentError, match="needs a TrajectoryReplayBuffer store"):
        SequenceDataset(tmp_path / "rb", offsets={"x": [0]})


@pytest.mark.parametrize("how", [{"within_episode": True}, {"within_episode": True, "allow_pad": True}])
@pytest.mark.parametrize("overwritten", [16, 40])
def test_reader_of_a_live_ring_never_keeps_overwritten_earlier_frames(tmp_path, monkeypatch, how, overwritten):
    """A writer evicts the oldest rows of a ring and overwrites their slots while a reader reads a
    sample's windows (injected between the draw and the read, so it happens every time).  Anchors
    that survived at the new ring start have frames at offset -1 in the evicted rows: the reader
    must draw those anchors again, not keep frames it read from reused slots (the check used to
    follow the anchor row only, and returned rows ``overwritten + 63`` and up as their frame -1)."""
    store = tmp_path / "s"
    w = TrajectoryReplayBuffer.create(STEP, step_data_capacity=64, cache_path=store, chunk_rows=16)
    write(w, [64])  # one episode, still open: every frame of a surviving anchor is valid
    w.flush()
    ro = TrajectoryReplayBuffer.load_from(store, read_only=True)
    real_read, writes = field_windows._read, []

    def read_while_writing(src, anchors, *args, **kwargs):
        if not writes:  # the first read: the writer evicts rows 0 .. overwritten - 1 and reuses their slots
            writes.append(anchors.copy())  # logical rows of the old record, which are its absolute rows
            write(w, [overwritten], row=64)
            w.flush()
        return real_read(src, anchors, *args, **kwargs)

    monkeypatch.setattr(field_windows, "_read", read_while_writing)
    offsets = {"obs/state": [-1, 0], "action": [0, 1]}
    data, mask = ro.sample_sequences(256, offsets=offsets, rng=0, **how)
    assert ro._store.committed.tables["step_data"].start == overwritten  # the reader saw the eviction
    assert overwritten in writes[0]  # the first read had an anchor at the new start, its frame -1 evicted
    state = np.asarray(data["step_data"]["obs"]["state"])[:, :, 0].astype(np.int64)
    anchors = state[:, 1]
    assert (anchors >= overwritten).all()  # anchors evicted meanwhile were drawn again
    valid = np.asarray(mask["obs/state"])
    assert valid[:, 1].all()
    np.testing.assert_array_equal(state[valid[:, 0], 0], anchors[valid[:, 0]] - 1)  # no frame from a reused slot
    action, act_ok = np.asarray(data["step_data"]["action"])[:, :, 0], np.asarray(mask["action"])
    np.testing.assert_array_equal(action[act_ok], (anchors[:, None] + [0.5, 1.5])[act_ok])
    ro.close()
    w.close()
