"""Edits of lossy image fields (issue 31): ``set_at``, ``remove_at`` and episode removal encode
only the rows written; every other frame keeps its stored bytes (a JPEG decoded and encoded again
would lose quality at every edit).  Real stores on disk, the shards' bytes read back through their
index, and a writer killed with SIGKILL in the middle of rewrites."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box

from trajstore import ReplayBuffer, TrajectoryReplayBuffer

pytest.importorskip("imagecodecs")

sys.path.insert(0, str(Path(__file__).parent))
from test_image_fields import ROOT, frames, make  # noqa: E402

from trajstore.storage.fields.image import read_index  # noqa: E402


def stored_frames(store: Path, field: str) -> list[bytes]:
    """The encoded bytes of every row of array ``step_data/<field>`` (or ``step_data``; b"": never
    written), from its shard files (not a staging area's)."""
    arr = store / "step_data" / field if field != "step_data" else store / "step_data"
    meta = json.loads((arr / "zarr.json").read_text())
    C, n = meta["chunk_grid"]["configuration"]["chunk_shape"][0], meta["shape"][0]
    out: list[bytes] = []
    for k in range(-(-n // C)):
        f = arr / "c" / str(k) / "0" / "0" / "0"
        if not f.exists():
            out += [b""] * C
            continue
        buf = np.fromfile(f, np.uint8)
        offsets, sizes = read_index(buf, C)
        out += [buf[o : o + s].tobytes() if o >= 0 else b"" for o, s in zip(offsets.tolist(), sizes.tolist())]
    return out[:n]


def test_set_at_and_remove_at_keep_other_lossy_frames_bit_identical(tmp_path):
    store = tmp_path / "s"
    imgs, new = frames(40, (24, 24, 3)), frames(3, (24, 24, 3), seed=9)
    with make(store, (24, 24, 3), "jpeg:70", chunk_rows=8) as rb:
        rb.extend({"img": imgs, "seq": np.arange(40)})
    before = stored_frames(store, "img")
    with ReplayBuffer.load_from(str(store)) as rb:  # shards read from disk, not the writer's own frames
        rb.set_at(np.array([3, 17, 30]), {"img": new, "seq": np.array([100, 101, 102])})
    after = stored_frames(store, "img")
    assert [i for i in range(40) if before[i] != after[i]] == [3, 17, 30]
    with ReplayBuffer.load_from(str(store)) as rb:
        rb.remove_at(np.array([5, 6]))
        # the same writer edits again: frames it holds from the last edit move as they are
        rb.set_at(np.array([0]), {"img": new[:1], "seq": np.array([7])})
        rb.remove_at(np.array([1]))
    moved = stored_frames(store, "img")
    expect = list(after)
    del expect[5:7]
    del expect[1]
    assert moved[1:] == expect[1:] and moved[0] != expect[0]
    seq = np.arange(40)
    seq[[3, 17, 30]] = [100, 101, 102]
    seq = np.delete(seq, [5, 6])
    seq[0] = 7
    seq = np.delete(seq, [1])
    with ReplayBuffer.load_from(str(store), read_only=True) as ro:
        assert np.array_equal(ro[:]["seq"], seq)


def test_removing_an_episode_moves_later_frames_without_encoding_them(tmp_path):
    store = tmp_path / "t"
    imgs = frames(30, (16, 16, 3))
    with TrajectoryReplayBuffer.create(Box(0, 255, (16, 16, 3), np.uint8), cache_path=str(store),
                                       compressor={"step_data": "jpeg:50"}, chunk_rows=8) as tb:
        for ep in range(3):
            tb.extend(imgs[ep * 10 : ep * 10 + 10])
            tb.mark_episode_end()
    before = stored_frames(store, "step_data")
    with TrajectoryReplayBuffer.load_from(str(store)) as tb:
        tb.remove_episodes([1])
    assert stored_frames(store, "step_data") == before[:10] + before[20:]


_EDITOR = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_image_fields import frames
from trajstore import ReplayBuffer
rb = ReplayBuffer.load_from({store!r})
new = frames(8, (24, 24, 3), seed=5)
open({ready!r}, "w").close()
i = 0
while True:
    rows = np.array([i % 40, (i * 7 + 3) % 40])
    rb.set_at(rows, {{"img": new[[i % 8, (i + 1) % 8]], "seq": rows}})
    i += 1
"""


def test_sigkill_during_set_at_of_a_lossy_field(tmp_path):
    """A writer killed while it rewrites JPEG rows: the store reopens at a commit, verifies, and every
    row holds its old frame's bytes or one of the new frames' encodings."""
    from trajstore.maintenance.verify import verify_store

    store, ready = tmp_path / "s", tmp_path / "ready"
    imgs = frames(40, (24, 24, 3))
    with make(store, (24, 24, 3), "jpeg:80", chunk_rows=8) as rb:
        rb.extend({"img": imgs, "seq": np.arange(40)})
    original = stored_frames(store, "img")
    code = _EDITOR.format(tests=str(Path(__file__).parent), store=str(store), ready=str(ready))
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        assert p.poll() is None, "the editor died before it was killed"
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait(30)
    assert p.returncode == -signal.SIGKILL
    ReplayBuffer.load_from(str(store)).close()  # a writer's open rolls a staged rewrite forward
    report = verify_store(str(store), deep=True)
    assert report.ok, report
    from trajstore.images import ImageCodec

    codec = ImageCodec("jpeg", 80)
    new = {codec.encode_frame(f) for f in frames(8, (24, 24, 3), seed=5)}
    got = stored_frames(store, "img")
    assert len(got) == 40 and all(g == o or g in new for g, o in zip(got, original))
    assert any(g != o for g, o in zip(got, original))  # some edits were committed


def test_sequences_and_torch_datasets_decode_on_the_pool_into_one_batch(tmp_path, monkeypatch):
    """get_sequences, sample_sequences and trajstore.torch's datasets decode a batch's frames on the
    decode threads (the calling thread and the pool's), into one array of the whole batch.  The
    codec is the real one; a wrapper of its per-frame decoder records which thread ran each decode.
    The threads take frames one at a time from a shared iterator, so a pool thread that wakes late
    could find none left: the calling thread's first frame of each read waits (at most 10 s) until a
    pool thread has taken one."""
    import threading

    from trajstore.images import ImageCodec, set_decode_threads
    from trajstore.torch.datasets import SequenceDataset, TransitionDataset

    imgs = frames(96, (20, 20, 3))
    with TrajectoryReplayBuffer.create(Box(0, 255, (20, 20, 3), np.uint8), cache_path=str(tmp_path / "t"),
                                       compressor={"step_data": "png"}, chunk_rows=16) as tb:
        for ep in range(3):
            tb.extend(imgs[ep * 32 : ep * 32 + 32])
            tb.mark_episode_end()
    seen: list[str] = []
    pool_took = threading.Event()
    real = ImageCodec.frame_decoder

    def recording(self, row_shape):
        dec = real(self, row_shape)

        def record(data, out):
            name = threading.current_thread().name
            if name.startswith("trajstore-decode"):
                pool_took.set()
            elif not any(s.startswith("trajstore-decode") for s in seen) and name not in seen:
                pool_took.wait(10)
            seen.append(name)
            dec(data, out)
        return record

    monkeypatch.setattr(ImageCodec, "frame_decoder", recording)
    set_decode_threads(2)
    try:
        with TrajectoryReplayBuffer.load_from(str(tmp_path / "t"), read_only=True) as ro:
            reads = {
                "get_sequences": lambda: ro.get_sequences(np.arange(3, 96, 3), [-3, -2, -1, 0])[0]["step_data"],
                "sample_sequences": lambda: ro.sample_sequences(32, 4, rng=0, within_episode=True)[0]["step_data"],
                "SequenceDataset": lambda: SequenceDataset(str(tmp_path / "t"), 4, output="numpy").read_batch(
                    np.arange(0, 64, 2))["data"],
                "TransitionDataset": lambda: TransitionDataset(str(tmp_path / "t"), output="numpy").read_batch(
                    np.arange(64))["data"],
            }
            for name, read in reads.items():
                seen.clear()
                pool_took.clear()
                got = read()
                assert got.flags.c_contiguous or (got.base is not None and got.base.flags.c_contiguous), name
                assert len(seen) >= 32, name
                assert {s.startswith("trajstore-decode") for s in seen} == {True, False}, (name, set(seen))
    finally:
        set_decode_threads(None)


def test_set_at_in_a_ring_still_filling_a_shard_keeps_other_frames(tmp_path):
    """A ring whose writer holds the shard it fills (rows not yet encoded): ``set_at`` there encodes
    the held rows once and the row written; committed frames keep their bytes."""
    store = tmp_path / "r"
    imgs, new = frames(30, (16, 16, 3)), frames(1, (16, 16, 3), seed=4)
    with make(store, (16, 16, 3), "jpeg:70", capacity=24, chunk_rows=8) as rb:
        rb.extend({"img": imgs[:20], "seq": np.arange(20)})
        rb.flush()
        before = stored_frames(store, "img")
        rb.extend({"img": imgs[20:], "seq": np.arange(20, 30)})  # wraps: slots 20..23, then 0..5
        rb.set_at(np.array([0]), {"img": new, "seq": np.array([99])})  # logical row 0 = slot 6
        after = stored_frames(store, "img")
    assert after[8:20] == before[8:20]  # shards the edit and the new rows did not touch
    assert after[6] != before[6] and after[7] == before[7]  # the edited shard: its other committed frame kept
    with ReplayBuffer.load_from(str(store), read_only=True) as ro:
        assert ro[:]["seq"].tolist() == [99, *range(7, 30)]
