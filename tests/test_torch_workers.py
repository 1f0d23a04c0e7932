"""trajstore.torch with DataLoader worker processes: whole batches cross as one buffer (in the pipe
when small, in shared memory when large), values exactly the stored rows, plain
``DataLoader(ds, batch_size=..., num_workers=...)`` as fast a path as ``collate_fn=collate_batch``."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.torch import (
    RandomBatchSampler,
    SampleBatch,
    SequenceDataset,
    TransitionDataset,
    collate_batch,
)
from trajstore.torch._transfer import POOL_SEGMENTS, _alive, _mapped, pack

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning",
                                        "ignore:.*pin_memory.*:UserWarning")

STEP = gym.spaces.Dict({
    "obs": gym.spaces.Dict({"pos": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                            "flag": gym.spaces.MultiBinary(2)}),
    "action": gym.spaces.Discrete(5),
    "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float64),
})
LENGTHS = [40, 3, 200, 1, 90, 66]  # 400 rows
IMG = (32, 32, 4)  # 4 KiB a row: a batch of 256 is 1 MiB, past SHM_MIN_BYTES in trajstore.torch._transfer


def _step_values(rows: np.ndarray, episode: np.ndarray) -> dict:
    return {"obs": {"pos": np.stack([rows, rows * 2, episode], 1).astype(np.float32),
                    "flag": np.stack([rows % 2, (rows // 2) % 2], 1).astype(np.int8)},
            "action": rows % 5, "reward": rows * 0.25}


def _make_traj(path: str, **kwargs) -> str:
    with TrajectoryReplayBuffer.create(STEP, cache_path=path, **kwargs) as buf:
        row = 0
        for e, n in enumerate(LENGTHS):
            r = np.arange(row, row + n)
            buf.extend(_step_values(r, np.full(n, e)))
            buf.mark_episode_end()
            row += n
    return path


@pytest.fixture(params=["raw", "lz4"])
def traj(tmp_path, request) -> str:
    kw = {"compressor": "lz4", "chunk_rows": 32} if request.param == "lz4" else {}
    return _make_traj(str(tmp_path / f"traj_{request.param}"), **kw)


def _image(rows: np.ndarray) -> np.ndarray:
    return ((rows[:, None] * 7 + np.arange(int(np.prod(IMG)))) % 251).astype(np.uint8).reshape(-1, *IMG)


@pytest.fixture
def images(tmp_path) -> str:
    path = str(tmp_path / "images")
    space = gym.spaces.Dict({"obs": gym.spaces.Box(0, 255, IMG, np.uint8),
                             "row": gym.spaces.Box(0, 2**40, (), np.int64)})
    with ReplayBuffer.create(space, cache_path=path, compressor="lz4", chunk_rows=64) as rb:
        r = np.arange(700)
        rb.extend({"obs": _image(r), "row": r})
    return path


def _check(batch: dict, rows: np.ndarray) -> None:
    ep = np.searchsorted(np.cumsum(LENGTHS), rows, side="right")
    want = _step_values(rows, ep)
    assert batch["obs"]["pos"].dtype == torch.float32 and batch["obs"]["flag"].dtype == torch.int8
    assert batch["action"].dtype == torch.int64 and batch["reward"].dtype == torch.float64
    assert batch["obs"]["pos"].shape == (len(rows), 3) and batch["reward"].shape == (len(rows),)
    np.testing.assert_array_equal(batch["obs"]["pos"].numpy(), want["obs"]["pos"])
    np.testing.assert_array_equal(batch["obs"]["flag"].numpy(), want["obs"]["flag"])
    np.testing.assert_array_equal(batch["action"].numpy(), want["action"])
    np.testing.assert_array_equal(batch["reward"].numpy(), want["reward"])


@pytest.mark.parametrize("collate", [None, collate_batch], ids=["default_collate", "collate_batch"])
def test_plain_dataloader_epoch_exact(traj, collate):
    """``DataLoader(ds, batch_size=..., num_workers=2)``: in order, every row once, exact values."""
    ds = TransitionDataset(traj, ["obs", "action", "reward"])
    kw = {} if collate is None else {"collate_fn": collate}
    loader = DataLoader(ds, batch_size=64, num_workers=2, **kw)
    batches = list(loader)
    assert [len(b["reward"]) for b in batches] == [64] * 6 + [16]
    rows = np.concatenate([b["obs"]["pos"][:, 0].numpy() for b in batches]).astype(np.int64)
    np.testing.assert_array_equal(rows, np.arange(400))
    for b, lo in zip(batches, range(0, 400, 64)):
        _check(b, np.arange(lo, min(lo + 64, 400)))
        assert type(b) is dict  # a plain dict in the main process


@pytest.mark.parametrize("ctx", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_pin_memory_persistent_workers(traj, ctx):
    ds = TransitionDataset(traj, ["obs", "action", "reward"])
    loader = DataLoader(ds, batch_size=50, shuffle=True, num_workers=2, pin_memory=True, persistent_workers=True,
                        multiprocessing_context=ctx, generator=torch.Generator().manual_seed(1))
    for _epoch in range(2):
        seen = []
        for b in loader:
            rows = b["obs"]["pos"][:, 0].numpy().astype(np.int64)
            _check(b, rows)
            if torch.cuda.is_available():
                assert b["reward"].is_pinned()
            seen.append(rows)
        np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(400))
    del loader


@pytest.mark.parametrize("ctx", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_image_batches_cross_in_shared_memory(images, ctx):
    ds = TransitionDataset(images)
    loader = DataLoader(ds, batch_sampler=RandomBatchSampler(ds, 256, num_batches=4, seed=2), num_workers=2,
                        collate_fn=collate_batch, multiprocessing_context=ctx)
    want = list(RandomBatchSampler(ds, 256, num_batches=4, seed=2))
    got = list(loader)
    assert len(got) == 4
    for b, idx in zip(got, want):
        assert b["obs"].shape == (256, *IMG) and b["obs"].dtype == torch.uint8 and b["row"].dtype == torch.int64
        assert b["row"].data_ptr() - b["obs"].data_ptr() == b["obs"].nbytes  # both in one buffer, one after the other
        np.testing.assert_array_equal(b["row"].numpy(), idx)
        np.testing.assert_array_equal(b["obs"].numpy(), _image(np.asarray(idx)))
    epoch = list(DataLoader(ds, batch_size=300, num_workers=2, multiprocessing_context=ctx))  # 1.2 MiB, 0.4 MiB
    assert [len(b["row"]) for b in epoch] == [300, 300, 100]
    np.testing.assert_array_equal(torch.cat([b["row"] for b in epoch]).numpy(), np.arange(700))
    np.testing.assert_array_equal(torch.cat([b["obs"] for b in epoch]).numpy(), _image(np.arange(700)))
    small = next(iter(DataLoader(ds, batch_size=8, num_workers=1)))  # 32 KiB: copied out of its segment
    np.testing.assert_array_equal(small["obs"].numpy(), _image(np.arange(8)))


def test_sequences_with_workers_never_cross_episodes(traj):
    T = 16
    ds = SequenceDataset(traj, T, ["obs/pos", "reward"], within_episode=True)
    loader = DataLoader(ds, batch_size=32, num_workers=2)  # default collate, sequential
    firsts = []
    for b in loader:
        pos = b["obs/pos"].numpy()
        assert pos.shape[1:] == (T, 3) and b["mask"].dtype == torch.bool and bool(b["mask"].all())
        np.testing.assert_array_equal(pos[:, :, 0] - pos[:, :1, 0], np.broadcast_to(np.arange(T), pos.shape[:2]))
        assert (pos[:, :, 2] == pos[:, :1, 2]).all()  # one episode per window
        np.testing.assert_array_equal(b["reward"].numpy(), pos[:, :, 0] * 0.25)
        firsts.append(pos[:, 0, 0].astype(np.int64))
    np.testing.assert_array_equal(np.concatenate(firsts), ds.anchors)  # every window once, in order
    padded = SequenceDataset(traj, T, ["reward"], pad="zero")
    b = next(iter(DataLoader(padded, batch_size=len(padded), num_workers=1)))
    assert b["reward"].shape == (400, T) and int(b["mask"].sum()) == sum(
        min(T, n - k) for n in LENGTHS for k in range(n))


def test_pack_round_trip_and_default_collate(traj):
    value = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.array([True, False])},
             "t": (np.zeros((2, 0), np.int16), np.array([7, 8], np.uint8)), "s": np.float64(2.5)}
    for big in (False, True):
        if big:
            value["img"] = np.ones((256, *IMG), np.uint8)
        packed = pack(value)
        assert packed._how == "pool"  # small batches too, copied out of their segment when unpickled
        back = pickle.loads(ForkingPickler.dumps(packed))
        assert packed._segment.free == (not big)  # a small batch's segment is free again at once
        assert type(back) is dict and isinstance(back["t"], tuple)
        for got, want in ((back["a"], value["a"]), (back["b"]["c"], value["b"]["c"]), (back["t"][0], value["t"][0]),
                          (back["t"][1], value["t"][1]), (back["s"], value["s"])):
            assert got.dtype == torch.from_numpy(np.asarray(want)).dtype and tuple(got.shape) == np.shape(want)
            np.testing.assert_array_equal(got.numpy(), want)
        back["a"][0, 0] = 5  # writable
    ds = TransitionDataset(traj, ["action", "reward"])
    sb = ds.__getitems__([4, 2])
    assert isinstance(sb, SampleBatch) and default_collate(sb) is sb.data  # not split and restacked
    items = default_collate([ds[4], ds[2]])  # a list of single items still collates as mappings
    np.testing.assert_array_equal(items["action"].numpy(), [4, 2])
    np.testing.assert_array_equal(default_collate([sb[0], sb[1]])["reward"].numpy(), [1.0, 0.5])


def test_reused_segments_never_overwrite_held_batches(images):
    """Workers reuse their shared-memory segments only once every tensor of the batch in them is
    freed: batches kept by the loop stay intact while later ones stream past, and a loop holding
    more batches than the pools have segments gets fresh shared memory instead."""
    ds = TransitionDataset(images, ["obs", "row"])
    n = 3 * 2 * POOL_SEGMENTS
    sampler = RandomBatchSampler(ds, 256, num_batches=n, seed=5)
    want = list(RandomBatchSampler(ds, 256, num_batches=n, seed=5))
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, collate_fn=collate_batch, prefetch_factor=4)
    kept = {}
    for k, b in enumerate(loader):
        np.testing.assert_array_equal(b["row"].numpy(), want[k])
        np.testing.assert_array_equal(b["obs"].numpy(), _image(np.asarray(want[k])))
        if k % 2 == 0:
            kept[k] = b  # held across the rest of the loop: more than all the segments
    for k, b in kept.items():
        np.testing.assert_array_equal(b["row"].numpy(), want[k])
        np.testing.assert_array_equal(b["obs"].numpy(), _image(np.asarray(want[k])))
    assert sum(_alive(pid) for pid, _ in _mapped.values()) <= 2 * POOL_SEGMENTS
