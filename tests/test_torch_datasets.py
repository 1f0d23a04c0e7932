"""trajstore.torch: map-style datasets over real stores, read by real DataLoader worker processes."""

from __future__ import annotations

import itertools
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.storage.fields.layout import ChunkedField
from trajstore.torch import RandomBatchSampler, SampleBatch, SequenceDataset, TransitionDataset, collate_batch

STEP = gym.spaces.Dict({
    "obs": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
    "action": gym.spaces.Discrete(3),
    "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float64),
})
EPISODE = gym.spaces.Dict({"return": gym.spaces.Box(-np.inf, np.inf, (), np.float64)})
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

LENGTHS = [37, 5, 120, 1, 64, 73]  # 300 rows, episodes of very different lengths


def _fill(buf: TrajectoryReplayBuffer) -> None:
    row = 0
    for e, n in enumerate(LENGTHS):
        r = np.arange(row, row + n)
        buf.extend({"obs": np.stack([r, r * 2, r * 3, np.full(n, e)], 1).astype(np.float32),
                    "action": r % 3, "reward": r * 0.5})
        buf.set_current_episode_data({"return": float(e) * 10})
        buf.mark_episode_end()
        row += n


@pytest.fixture
def store(tmp_path) -> str:
    path = str(tmp_path / "offline")
    with TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EPISODE, cache_path=path) as buf:
        _fill(buf)
    return path


@pytest.fixture
def lz4_store(tmp_path) -> str:
    path = str(tmp_path / "offline_lz4")
    with TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EPISODE, cache_path=path,
                                       compressor="lz4", chunk_rows=16) as buf:
        _fill(buf)
    return path


def _check_rows(batch: dict, rows: np.ndarray) -> None:
    """Values of rows given the fill pattern (obs encodes the row and its episode)."""
    obs = np.asarray(batch["obs"])
    np.testing.assert_array_equal(obs[:, 0], rows)
    np.testing.assert_array_equal(obs[:, 1], rows * 2)
    np.testing.assert_array_equal(np.asarray(batch["action"]), rows % 3)
    np.testing.assert_array_equal(np.asarray(batch["reward"]), rows * 0.5)


def test_transition_items_match_buffer(store):
    ds = TransitionDataset(store, ["obs", "action", "reward", "episode_data/return"], episode_ids=True)
    assert len(ds) == sum(LENGTHS)
    ref = TrajectoryReplayBuffer.load_from(store, read_only=True)
    item, meta = ref.get_at_with_metadata(np.arange(len(ds)))
    for i in (0, 36, 37, 41, 42, 299, -1):
        got = ds[i]
        j = i % len(ds)
        assert isinstance(got["obs"], torch.Tensor) and got["obs"].dtype == torch.float32
        np.testing.assert_array_equal(got["obs"].numpy(), item["step_data"]["obs"][j])
        assert int(got["action"]) == item["step_data"]["action"][j]
        assert float(got["episode_data/return"]) == item["episode_data"]["return"][j]
        assert int(got["episode_id"]) == meta["episode_ids"][j]
    with pytest.raises(IndexError):
        ds[len(ds)]
    ref.close()
    np_ds = TransitionDataset(store, "obs", output="numpy")
    batch = np_ds.__getitems__([3, 1, 2])
    assert isinstance(batch, SampleBatch) and len(batch) == 3
    assert set(batch.data) == {"obs"} and isinstance(batch.data["obs"], np.ndarray)
    np.testing.assert_array_equal(batch.data["obs"][:, 0], [3, 1, 2])
    np.testing.assert_array_equal(batch[1]["obs"], batch.data["obs"][1])
    with pytest.raises(KeyError):
        TransitionDataset(store, ["nope"])


def test_dataset_pickles_as_path_only(store):
    ds = TransitionDataset(store)
    ds[0]  # opens the store in this process
    blob = pickle.dumps(ds)
    assert len(blob) < 4000
    clone = pickle.loads(blob)
    assert clone._src._buf is None  # opened lazily, on first use
    _check_rows(clone.__getitems__([5, 6]).data, np.array([5, 6]))
    mem = TrajectoryReplayBuffer.create(STEP)
    mem.extend({"obs": np.zeros((2, 4), np.float32), "action": [0, 1], "reward": [0.0, 1.0]})
    mem_ds = TransitionDataset(mem)
    assert len(mem_ds) == 2 and int(mem_ds[1]["action"]) == 1  # num_workers=0 works in memory
    with pytest.raises(TypeError, match="in-memory"):
        pickle.dumps(mem_ds)
    mem.close()


@pytest.mark.parametrize("ctx", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_dataloader_4_workers_every_index_once(store, ctx):
    ds = TransitionDataset(store, ["obs", "action", "reward"], episode_ids=True)
    loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=4, collate_fn=collate_batch,
                        multiprocessing_context=ctx, generator=torch.Generator().manual_seed(0))
    seen = []
    for batch in loader:
        rows = batch["obs"][:, 0].numpy().astype(np.int64)
        _check_rows(batch, rows)
        np.testing.assert_array_equal(batch["episode_id"].numpy(), batch["obs"][:, 3].numpy())
        seen.append(rows)
    seen = np.concatenate(seen)
    assert len(seen) == len(ds)
    np.testing.assert_array_equal(np.sort(seen), np.arange(len(ds)))


def test_default_collate_and_persistent_workers(store):
    ds = TransitionDataset(store, ["obs", "action"])
    loader = DataLoader(ds, batch_size=50, shuffle=False, num_workers=2, persistent_workers=True)
    for _epoch in range(2):  # the same two worker processes serve both epochs
        got = [b for b in loader]
        rows = torch.cat([b["obs"][:, 0] for b in got]).numpy()
        np.testing.assert_array_equal(rows, np.arange(len(ds)))
        assert got[0]["action"].dtype == torch.int64
    del loader


def test_distributed_sampler_ranks_cover_dataset(store, tmp_path):
    ds = TransitionDataset(store, ["obs"])
    per_rank = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        loader = DataLoader(ds, batch_size=40, sampler=sampler, num_workers=2, collate_fn=collate_batch)
        per_rank.append(torch.cat([b["obs"][:, 0] for b in loader]).numpy().astype(np.int64))
    assert len(per_rank[0]) == len(per_rank[1]) == len(ds) // 2
    np.testing.assert_array_equal(np.sort(np.concatenate(per_rank)), np.arange(len(ds)))


def test_batch_reads_each_chunk_once(lz4_store, monkeypatch):
    calls: list[tuple[str, list[int]]] = []
    orig = ChunkedField._fetch

    def counting(self, ks):
        calls.append((self.spec.array_path, list(ks)))
        return orig(self, ks)

    monkeypatch.setattr(ChunkedField, "_fetch", counting)
    ds = TransitionDataset(lz4_store, ["obs", "reward"])
    rng = np.random.default_rng(0)
    for _ in range(3):
        idx = rng.integers(0, len(ds), 64)
        buf = ds.buffer
        for f in buf._table.fields:
            f.drop_cache()
        calls.clear()
        batch = collate_batch(ds.__getitems__(idx))
        _check_rows({**batch, "action": idx % 3}, idx)
        per_field: dict[str, list[int]] = {}
        for path, ks in calls:
            per_field.setdefault(path, []).extend(ks)
        assert set(per_field) == {"step_data/obs", "step_data/reward"}
        for path, ks in per_field.items():
            assert len(ks) == len(set(ks)) == len(np.unique(idx // 16))  # each chunk once, only those needed
        assert len(calls) == 2  # one concurrent fetch per field per batch


def test_sequences_match_get_sequences(store):
    ref = TrajectoryReplayBuffer.load_from(store, read_only=True)
    T = 8
    for pad in ("edge", "zero"):
        ds = SequenceDataset(store, T, ["obs", "reward", "episode_data/return"], pad=pad, output="numpy")
        assert len(ds) == sum(LENGTHS)
        idx = np.array([0, 30, 36, 37, 41, 42, 161, 162, 299])
        got = collate_batch(ds.__getitems__(idx))
        want, mask = ref.get_sequences(idx, np.arange(T), pad=pad)
        np.testing.assert_array_equal(got["mask"], mask)
        np.testing.assert_array_equal(got["obs"], want["step_data"]["obs"])
        np.testing.assert_array_equal(got["reward"], want["step_data"]["reward"])
        np.testing.assert_array_equal(got["episode_data/return"], want["episode_data"]["return"])
        assert got["obs"].shape == (len(idx), T, 4)
    ref.close()


def test_sequences_within_episode_with_workers(store):
    T = 32
    ds = SequenceDataset(store, T, ["obs"], within_episode=True, stride=2)
    starts = np.cumsum([0] + LENGTHS[:-1])
    want = np.concatenate([np.arange(s, s + n - T + 1) for s, n in zip(starts, LENGTHS) if n >= T])
    np.testing.assert_array_equal(ds.anchors, want[want % 2 == 0])
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, collate_fn=collate_batch)
    firsts = []
    for batch in loader:
        assert batch["obs"].shape[1:] == (T, 4) and bool(batch["mask"].all())
        obs = batch["obs"].numpy()
        np.testing.assert_array_equal(obs[:, :, 0] - obs[:, :1, 0], np.broadcast_to(np.arange(T), obs.shape[:2]))
        assert (obs[:, :, 3] == obs[:, :1, 3]).all()  # one episode per window
        firsts.append(obs[:, 0, 0])
    np.testing.assert_array_equal(np.sort(np.concatenate(firsts)), ds.anchors)


def test_random_batch_sampler_endless_and_fixed(store):
    ds = TransitionDataset(store, ["obs"])
    endless = RandomBatchSampler(ds, 64, seed=7)
    with pytest.raises(TypeError):
        len(endless)
    loader = DataLoader(ds, batch_sampler=endless, num_workers=2, collate_fn=collate_batch)
    batches = list(itertools.islice(iter(loader), 25))  # more than any epoch of the dataset
    assert len(batches) == 25 and all(b["obs"].shape == (64, 4) for b in batches)
    want = list(itertools.islice(iter(RandomBatchSampler(len(ds), 64, seed=7)), 25))
    for b, idx in zip(batches, want):
        np.testing.assert_array_equal(b["obs"][:, 0].numpy(), idx)
    fixed = RandomBatchSampler(ds, 10, num_batches=5, replacement=False, seed=1)
    assert len(fixed) == 5
    got = [b for b in DataLoader(ds, batch_sampler=fixed, collate_fn=collate_batch)]
    assert len(got) == 5 and all(len(set(b["obs"][:, 0].tolist())) == 10 for b in got)
    other_rank = list(itertools.islice(iter(RandomBatchSampler(ds, 10, seed=1, rank=1, num_replicas=2)), 1))[0]
    assert other_rank != list(iter(RandomBatchSampler(ds, 10, seed=1, rank=0, num_replicas=2)).__next__())


def test_writer_buffer_and_replay_buffer_sources(tmp_path):
    path = str(tmp_path / "rb")
    rb = ReplayBuffer.create(STEP, cache_path=path)
    rb.extend({"obs": np.arange(400, dtype=np.float32).reshape(100, 4), "action": np.arange(100) % 3,
               "reward": np.arange(100) * 1.0})
    ds = TransitionDataset(rb, ["obs", "reward"])  # a writer: flushed, workers open it read-only
    assert len(ds) == 100
    rows = torch.cat([b["reward"] for b in DataLoader(ds, batch_size=30, num_workers=2, collate_fn=collate_batch)])
    np.testing.assert_array_equal(rows.numpy(), np.arange(100.0))
    seq = SequenceDataset(rb, 5, ["reward"], pad="zero")  # no episode ids: one long episode
    last = seq[98]
    np.testing.assert_array_equal(last["reward"].numpy(), [98, 99, 0, 0, 0])
    np.testing.assert_array_equal(last["mask"].numpy(), [1, 1, 0, 0, 0])
    rb.close()
