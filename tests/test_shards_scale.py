"""Sharded reads that do not cost a call per shard (issue 17): batches gathered across all shards at
once (trajstore/shards/gather.py) and commit records checked only where a shard's folder changed
(trajstore/shards/watch.py).  Real stores on disk, real forked processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import _shard_workers as SW
import numpy as np
import pytest

from trajstore.shards import create_shard, open_sharded
from trajstore.shards import watch as shard_watch
from trajstore.shards.rows import EPISODE_STRIDE


def _shard(root, name, w, episodes, **kwargs):
    buf = create_shard(root, SW.SPACE, shard=name, **kwargs)
    for e in range(episodes):
        buf.extend(SW.episode_rows(w, e))
        buf.mark_episode_end()
    buf.flush()
    return buf


def _own_rows(ds):
    """Every shard's committed obs and episode ids as its own buffer reads them, in name order."""
    obs, ids = [], []
    for k, name in enumerate(ds.shards["shard"]):
        b = ds.shard(name)
        data, meta = b.get_at_with_metadata(np.arange(len(b)))
        obs.append(data["step_data"]["obs"])
        ids.append(np.asarray(meta["episode_ids"]) + k * EPISODE_STRIDE)
    return np.concatenate(obs), np.concatenate(ids)


@pytest.mark.parametrize("compressed", [False, True])
def test_cross_shard_reads_equal_each_shards_own(tmp_path, compressed):
    """Rows, windows and episode ids read across shards (a wrapped ring, unbounded shards of other
    chunkings; one compressed shard makes the dataset read shard by shard) equal each shard's own."""
    root = str(tmp_path / "ds")
    # (4,) f32 rows: chunks are at least a page, 256 rows; 1024 gives shard c other chunk slots
    bufs = [_shard(root, "a", 0, 30, chunk_rows=256),
            _shard(root, "b", 1, 40, chunk_rows=256, step_data_capacity=100),  # wrapped several times
            _shard(root, "c", 2, 3, chunk_rows=1024),
            _shard(root, "d", 3, 25, chunk_rows=256, **({"compressor": "zstd"} if compressed else {}))]
    ds = open_sharded(root)
    obs, ids = _own_rows(ds)
    n = len(ds)
    assert n == len(obs) and ds.shards["rows"][1] == 100
    idx = np.random.default_rng(0).integers(0, n, 500)
    np.testing.assert_array_equal(ds.get_at(idx)["step_data"]["obs"], obs[idx])
    np.testing.assert_array_equal(ds.get_at(np.arange(n))["step_data"]["obs"], obs)
    np.testing.assert_array_equal(ds.row_source().step_ids(idx), ids[idx])
    anchors = np.arange(0, n, 3)
    data, mask = ds.get_sequences(anchors, [-2, -1, 0, 1, 2])
    rows = np.clip(anchors[:, None] + np.arange(-2, 3), 0, n - 1)
    expect_mask = (anchors[:, None] + np.arange(-2, 3) >= 0) & (anchors[:, None] + np.arange(-2, 3) < n) & (
        ids[rows] == ids[anchors][:, None])
    np.testing.assert_array_equal(mask, expect_mask)
    got = data["step_data"]["obs"]
    np.testing.assert_array_equal(got[mask], obs[rows][mask])
    data, mask = ds.sample_sequences(300, 4, rng=2, within_episode=True)
    o = data["step_data"]["obs"]
    assert mask.all() and (np.diff(o[:, :, 2], axis=1) == 1).all() and (o[:, :, :2] == o[:, :1, :2]).all()
    cross = ds.row_source()._cross
    assert cross and all((v is None) == compressed for v in cross.values())  # the path these reads took
    for b in bufs:
        b.close()
    ds.close()


@pytest.mark.parametrize("mode", ["watched", "not a local filesystem", "no inotify", "too few shards to watch"])
def test_next_read_sees_every_finished_commit(tmp_path, monkeypatch, mode):
    """As a single store: a read sees every commit that finished before it, in any shard, whether
    the shards are watched (inotify) or checked by stat (a filesystem the watch does not trust, or
    no inotify instance to be had)."""
    monkeypatch.setattr(shard_watch, "SWEEP_INTERVAL_S", 1e9)  # no periodic re-check to fall back on
    watched = mode == "watched"
    if mode == "not a local filesystem":
        monkeypatch.setattr(shard_watch, "LOCAL_FS", frozenset())
    elif mode == "no inotify":
        monkeypatch.setattr(shard_watch, "_inotify", lambda: False)
    elif mode == "too few shards to watch":
        monkeypatch.setattr(shard_watch, "WATCH_MIN_SHARDS", 6)
    root = str(tmp_path / "ds")
    bufs = [_shard(root, f"s{k}", k, 2, chunk_rows=32) for k in range(5)]
    ds = open_sharded(root)
    src = ds.row_source()
    assert (src._checks.watch is None) == (mode == "too few shards to watch")
    assert src._checks.unwatched == (set() if watched else {f"s{k}" for k in range(5)})
    n = len(ds)
    for round_ in range(3):
        for k, b in enumerate(bufs):
            rows = SW.episode_rows(k, 10 + round_)
            b.extend(rows)
            b.mark_episode_end()
            b.flush()
            n += len(rows["obs"])
            assert len(ds) == n  # no refresh(), no wait
            got = ds.sample(64, rng=round_)["step_data"]["obs"]
            assert (got[:, 3] == [SW.episode_length(int(w), int(e)) for w, e in got[:, :2]]).all()
    newest = ds.get_at(np.array([int(ds.shards["start"][4] + ds.shards["rows"][4] - 1)]))["step_data"]["obs"][0]
    assert newest[:2].tolist() == [4, 12]
    for b in bufs:
        b.close()
    ds.close()


def _forked_reader(ds, q, go):
    q.put(len(ds))
    go.wait(30)
    q.put(len(ds))


def test_forked_reader_watches_for_itself(tmp_path, monkeypatch):
    """A dataset used in a forked child gets its own watch (the inherited descriptor is the
    parent's queue): both processes see a commit made after the fork."""
    monkeypatch.setattr(shard_watch, "SWEEP_INTERVAL_S", 1e9)
    monkeypatch.setattr(shard_watch, "WATCH_MIN_SHARDS", 1)
    root = str(tmp_path / "ds")
    a, b = _shard(root, "a", 0, 2), _shard(root, "b", 1, 2)
    ds = open_sharded(root)
    n0 = len(ds)
    ctx = mp.get_context("fork")
    q, go = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_forked_reader, args=(ds, q, go), daemon=True)
    p.start()
    try:
        assert q.get(timeout=30) == n0
        b.extend(SW.episode_rows(1, 5))
        b.flush()
        n1 = n0 + len(SW.episode_rows(1, 5)["obs"])
        go.set()
        assert q.get(timeout=30) == n1
        assert len(ds) == n1
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    a.close(), b.close(), ds.close()


def test_event_flood_still_sees_commits(tmp_path, monkeypatch):
    """More events than the kernel queues (a folder flooded with files): the overflow makes the
    next check look at every shard, so a commit made during the flood is still seen at once."""
    monkeypatch.setattr(shard_watch, "SWEEP_INTERVAL_S", 1e9)
    monkeypatch.setattr(shard_watch, "WATCH_MIN_SHARDS", 1)
    root = str(tmp_path / "ds")
    a, b = _shard(root, "a", 0, 2), _shard(root, "b", 1, 2)
    ds = open_sharded(root)
    n = len(ds)
    limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
    a_dir = str(tmp_path / "ds" / "shards" / "a")
    for i in range(limit // 2 + 100):  # create + close-write: two events each, into a's watched folder
        name = os.path.join(a_dir, f"flood-{i}")
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644))
    b.extend(SW.episode_rows(1, 7))
    b.flush()
    assert len(ds) == n + len(SW.episode_rows(1, 7)["obs"])
    got = ds.sample(256, rng=0)["step_data"]["obs"]
    assert (got[:, 3] == [SW.episode_length(int(w), int(e)) for w, e in got[:, :2]]).all()
    a.close(), b.close(), ds.close()
