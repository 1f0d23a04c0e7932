"""DataLoader workers read batches straight into the shared memory they cross in, and decode frames on
their share of the CPUs (issue 35 point 4): real DataLoader worker processes (fork) over real stores.

- the batches of a seed are the same with 0 and 2 workers (vector rows, lz4 frames read by whole
  chunks and row by row, per-frame codec frames, sequences of frames);
- a worker's image batch is decoded in place in its shared-memory segment (not copied there);
- a worker decodes on ``max(1, cpus // num_workers)`` threads unless the user set a number;
- small batches cross in the workers' segments too, copied out by the main process: exact with any
  prefetch depth and with persistent workers, and no segment stays mapped once its worker is gone
  (killed included).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from multiprocessing.reduction import ForkingPickler

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import trajstore.images as ti
from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import BadOptionError
from trajstore.storage.fields import chunked
from trajstore.storage.fields.out import new_rows, returned_rows, rows_into, temporary_rows
from trajstore.torch import RandomBatchSampler, SequenceDataset, TransitionDataset, _transfer, collate_batch

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

IMG = (24, 24, 4)  # 2.3 KiB a row: a batch of 64 is 144 KiB, past PIPE_MAX_BYTES (shared memory)


def _frames(rows: np.ndarray) -> np.ndarray:
    """Smooth frames (a codec's case), different for every row."""
    y, x = np.mgrid[0:IMG[0], 0:IMG[1]]
    base = (x[None, :, :, None] * 5 + y[None, :, :, None] * 3 + np.arange(IMG[2]) * 40) % 200
    return ((base + rows[:, None, None, None] * 7) % 256).astype(np.uint8)


def _store(path: str, compressor) -> str:
    space = gym.spaces.Dict({"obs": gym.spaces.Box(0, 255, IMG, np.uint8), "row": gym.spaces.Box(0, 2**40, (), np.int64)})
    with TrajectoryReplayBuffer.create(space, cache_path=path, compressor=compressor, chunk_rows=32) as tb:
        for lo in range(0, 600, 150):  # episodes of 150 rows
            r = np.arange(lo, lo + 150)
            tb.extend({"obs": _frames(r), "row": r})
            tb.mark_episode_end()
    return path


def _batches(ds, workers: int, n: int = 12, batch: int = 64, plain: bool = False) -> list[dict]:
    if plain:
        loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                            generator=torch.Generator().manual_seed(3),
                            multiprocessing_context="fork" if workers else None)
    else:
        loader = DataLoader(ds, batch_sampler=RandomBatchSampler(ds, batch, num_batches=n, seed=7),
                            num_workers=workers, collate_fn=collate_batch,
                            multiprocessing_context="fork" if workers else None)
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in loader]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and len(a) > 2
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("codec", ["raw", "lz4", "lz4-rows", "png"])
def test_batches_of_a_seed_are_the_same_with_and_without_workers(tmp_path, monkeypatch, codec):
    if codec == "png":
        pytest.importorskip("imagecodecs")
    if codec == "lz4-rows":  # big-field route: each row decoded alone (blosc_getitem), not whole chunks
        monkeypatch.setattr(chunked, "ROW_READS_ABOVE_BYTES", 0)
    compressor = {"raw": None, "lz4": "lz4", "lz4-rows": "lz4", "png": {"obs": "png"}}[codec]
    path = _store(str(tmp_path / codec), compressor)
    ds = TransitionDataset(path, ["obs", "row"], episode_ids=True)
    zero, two = _batches(ds, 0), _batches(ds, 2)
    _same(zero, two)
    for b in two:  # and they are the stored rows
        np.testing.assert_array_equal(b["obs"].numpy(), _frames(b["row"].numpy()))
        np.testing.assert_array_equal(b["episode_id"].numpy(), b["row"].numpy() // 150)
    _same(_batches(ds, 0, plain=True), _batches(ds, 2, plain=True))
    seqs = SequenceDataset(path, 5, ["obs", "row"], pad="zero")
    zero, two = _batches(seqs, 0, n=6, batch=16), _batches(seqs, 2, n=6, batch=16)
    _same(zero, two)
    for b in two:
        valid = b["mask"].numpy()
        rows = b["row"].numpy()
        np.testing.assert_array_equal(b["obs"].numpy()[valid], _frames(rows[valid]))
        assert not b["obs"].numpy()[~valid].any()  # zero padding written into the shared batch


def _vectors(path: str) -> str:
    space = gym.spaces.Dict({"obs": gym.spaces.Box(-np.inf, np.inf, (5,), np.float32), "action": gym.spaces.Discrete(4)})
    with ReplayBuffer.create(space, cache_path=path) as rb:
        r = np.arange(3000)
        rb.extend({"obs": np.stack([r * 1.5 + k for k in range(5)], 1).astype(np.float32), "action": r % 4})
    return path


def test_vector_batches_are_the_same_with_and_without_workers(tmp_path):
    ds = TransitionDataset(_vectors(str(tmp_path / "v")))
    zero, two = _batches(ds, 0, batch=256), _batches(ds, 2, batch=256)
    _same(zero, two)
    _same(_batches(ds, 0, plain=True, batch=256), _batches(ds, 2, plain=True, batch=256))


def test_worker_batches_are_decoded_in_place(tmp_path, monkeypatch):
    """After a dataset's first batch, the next ones are decoded into the segment they cross in:
    the batch's frames are the very array the field decoded into (no copy), values intact after
    crossing, and a read that raises gives its segment back."""
    path = _store(str(tmp_path / "lz4"), "lz4")
    ds = TransitionDataset(path, ["obs", "row"], output="numpy")
    made: list[np.ndarray] = []
    real = _transfer._Arena.__call__

    def spy(self, shape, dtype):
        a = real(self, shape, dtype)
        if a is not None:
            made.append(a)
        return a

    monkeypatch.setattr(_transfer._Arena, "__call__", spy)
    first = _transfer.pack_read(lambda: ds.read_batch(np.arange(100, 164)), "key")
    assert first._segment is not None and not made  # the first batch: read, then copied in
    idx = np.arange(64)[::-1] * 9
    second = _transfer.pack_read(lambda: ds.read_batch(idx), "key")
    assert second._segment is not None and second._segment is not first._segment
    assert [a.shape for a in made] == [(64, *IMG), (64,)]
    assert second["obs"].data_ptr() == made[0].ctypes.data and second["row"].data_ptr() == made[1].ctypes.data
    back = pickle.loads(ForkingPickler.dumps(second))
    np.testing.assert_array_equal(back["obs"].numpy(), _frames(idx))
    np.testing.assert_array_equal(back["row"].numpy(), idx)
    busy = [s for s in _transfer._worker_pool().segments if not s.free]

    def broken():
        ds.read_batch(idx)
        raise RuntimeError("a read that fails after decoding")

    with pytest.raises(RuntimeError):
        _transfer.pack_read(broken, "key")
    assert [s for s in _transfer._worker_pool().segments if not s.free] == busy  # its segment given back


def test_new_rows_uses_the_offered_memory_only_for_returned_rows():
    pool = np.zeros(1024, np.uint8)
    calls = []

    def alloc(shape, dtype):
        calls.append((shape, dtype))
        return pool[: int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    assert new_rows((2, 3), np.float32).base is None  # nothing offered: np.empty
    with rows_into(alloc):
        assert new_rows((4,), np.int64).base is None and not calls  # offered, but not a returned read
        with returned_rows():
            a = new_rows((2, 4), np.int32)
            assert a.base is not None and np.shares_memory(a, pool) and calls == [((2, 4), np.dtype(np.int32))]
            with temporary_rows():
                assert not np.shares_memory(new_rows((2, 4), np.int32), pool)
            assert np.shares_memory(new_rows((1,), np.uint8), pool)
    with returned_rows():
        assert new_rows((3,), np.uint8).base is None  # marked, but nothing offered


def _children() -> set[int]:
    """The live forked child processes of this process (DataLoader workers: the same command line;
    not multiprocessing's resource tracker, which is a child started anew)."""
    me = os.getpid()
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                same = f.read() == cmdline
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me and fields[0] != "Z" and same:
            found.add(int(name))
    return found


def _shm_files() -> set[str]:
    """Files of torch's or trajstore's shared memory in /dev/shm (others come and go: the machine's)."""
    return {n for n in os.listdir("/dev/shm") if "torch" in n or "trajstore" in n}


def _state(pid: int) -> str:
    """The state letter of process ``pid`` ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _segments_of(pids: set[int]) -> int:
    """This process's mappings of the shared-memory segments of the worker processes ``pids``."""
    with open("/proc/self/maps") as f:
        return sum(any(f"trajstore-batch-{pid}-" in line for pid in pids) for line in f)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="segments are memfd files (Linux)")
def test_small_batches_cross_in_segments_with_any_prefetch(tmp_path):
    """Batches of 3.5 KiB cross in the workers' segments, copied out by the main process (so the
    batches the loop keeps stay intact while the segments are reused): with a prefetch deeper than a
    worker's pool (the batches that find no free segment take the pipe) and with persistent workers
    over two epochs, the batches are exactly those of 0 workers."""
    ds = TransitionDataset(_vectors(str(tmp_path / "v")))
    zero = _batches(ds, 0, n=40, batch=128)

    def loader(**kw) -> DataLoader:
        return DataLoader(ds, batch_sampler=RandomBatchSampler(ds, 128, num_batches=40, seed=7), num_workers=2,
                          collate_fn=collate_batch, multiprocessing_context="fork", **kw)

    deep = loader(prefetch_factor=3 * _transfer.POOL_SEGMENTS)
    before = _children()
    it = iter(deep)
    kept, workers = [next(it)], _children() - before
    kept += list(it)  # every batch held, not cloned
    _same(zero, kept)
    assert _segments_of(workers) > 0  # (mapped once each, then reused)
    del it
    persistent = loader(persistent_workers=True)
    for _epoch in range(2):
        _same(zero, list(persistent))
    del persistent


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="segments are memfd files (Linux)")
def test_no_segments_left_behind(tmp_path):
    """The main process unmaps the segments of exited workers (when the next loader maps its own),
    a killed worker's included, so loaders one after the other never pile up shared memory; and
    nothing is ever left in /dev/shm."""
    ds = TransitionDataset(_vectors(str(tmp_path / "v")))
    shm = _shm_files()

    def loader() -> DataLoader:
        return DataLoader(ds, batch_sampler=RandomBatchSampler(ds, 128, num_batches=30, seed=1), num_workers=2,
                          collate_fn=collate_batch, multiprocessing_context="fork")

    earlier: set[int] = set()
    for _ in range(3):
        before = _children()
        it = iter(loader())
        next(it)
        workers = _children() - before
        assert len(list(it)) == 29 and _segments_of(workers) > 0
        assert _segments_of(earlier) == 0  # the previous loader's, unmapped
        del it
        earlier |= workers
    before = _children()
    it = iter(loader())
    next(it)
    victims = _children() - before
    assert len(victims) == 2
    # (torch's SIGCHLD handler would raise RuntimeError in this thread at any point once a worker
    # is dead, even inside the iterator's __del__: the default action, while the workers die and go)
    handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        os.kill(min(victims), signal.SIGKILL)  # while its batches are in flight
        while _state(min(victims)) not in ("Z", "X", ""):
            time.sleep(0.01)
        del it
    finally:
        signal.signal(signal.SIGCHLD, handler)
    assert len(list(loader())) == 30
    assert _segments_of(earlier | victims) == 0
    assert _shm_files() <= shm


def _threads_collate(batch):
    out = dict(collate_batch(batch))  # (a plain dict: the worker's one-buffer batch carries only its own fields)
    out["threads"] = torch.tensor([ti.decode_threads(), torch.utils.data.get_worker_info().num_workers])
    return out


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_decode_on_their_share_of_the_cpus(tmp_path, monkeypatch, workers):
    monkeypatch.delenv("TRAJSTORE_DECODE_THREADS", raising=False)
    ti.set_decode_threads(None)
    path = _store(str(tmp_path / "s"), "lz4")
    ds = TransitionDataset(path, ["row"])
    cpus = len(os.sched_getaffinity(0))

    def seen() -> set[int]:
        loader = DataLoader(ds, batch_size=50, num_workers=workers, collate_fn=_threads_collate,
                            multiprocessing_context="fork")
        return {int(b["threads"][0]) for b in loader}

    assert seen() == {max(1, cpus // workers)}
    assert ti.decode_threads() == cpus  # the main process keeps every CPU
    monkeypatch.setenv("TRAJSTORE_DECODE_THREADS", "3")  # the user's number wins
    assert seen() == {3}
    monkeypatch.delenv("TRAJSTORE_DECODE_THREADS")
    ti.set_decode_threads(2)  # so does set_decode_threads (inherited by forked workers)
    try:
        assert seen() == {2}
    finally:
        ti.set_decode_threads(None)


def test_share_decode_threads_in_process():
    cpus = len(os.sched_getaffinity(0))
    try:
        ti.share_decode_threads(4)
        assert ti.decode_threads() == max(1, cpus // 4)
        ti.share_decode_threads(1)
        assert ti.decode_threads() == cpus
        with pytest.raises(BadOptionError, match="processes"):
            ti.share_decode_threads(0)
    finally:
        ti.share_decode_threads(1)
