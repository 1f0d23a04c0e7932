"""Image fields decoded on several threads (issue 31): the decode threads take a batch's frames
one at a time from one shared iterator, each frame straight into the batch's array, so a batch
decoded on 1, 2 or 3 threads must be the same array, whatever order and repeats its rows come in.

Real stores on disk and the real imagecodecs codecs; no wall-clock assertions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box

import trajstore.images as ti
from trajstore import ReplayBuffer
from trajstore.errors import DamagedStoreError

pytest.importorskip("imagecodecs")


def _frames(n: int, shape: tuple[int, ...]) -> np.ndarray:
    """``n`` smooth frames (shifted sines, one per frame), what a render looks like to a codec."""
    y, x = np.mgrid[0 : shape[0], 0 : shape[1]].astype(np.float64)
    out = np.empty((n, *shape), np.uint8)
    for i in range(n):
        base = 127 + 100 * np.sin((x + 3 * i) / 5) * np.cos((y - 2 * i) / 7)
        out[i] = (base[..., None] + 10 * np.arange(shape[2]) if len(shape) == 3 else base).clip(0, 255)
    return out


def _store(path: Path, shape: tuple[int, ...], compressor: str, n: int) -> np.ndarray:
    imgs = _frames(n, shape)
    with ReplayBuffer.create(Box(0, 255, shape, np.uint8), cache_path=str(path), capacity=n + 24,
                             compressor=compressor, chunk_rows=16) as rb:
        rb.extend(imgs)
    return imgs


def _decoded(path: Path, idx: np.ndarray, threads: int) -> np.ndarray:
    ti.set_decode_threads(threads)
    try:
        with ReplayBuffer.load_from(str(path), read_only=True) as ro:
            return np.asarray(ro[idx])
    finally:
        ti.set_decode_threads(None)


@pytest.mark.parametrize(("compressor", "shape"), [
    ("jpeg:90", (24, 24, 3)), ("png", (24, 24, 3)), ("webp-lossless", (24, 24, 3)),
    ("webp-lossless", (20, 24)), ("png", (20, 24, 1)), ("png", (16, 16, 4)),
])
def test_threaded_decode_equals_one_thread_for_repeated_out_of_order_rows(tmp_path, compressor, shape):
    """Rows across 4 shards, descending, repeated (one row 5 times), one shard's rows interleaved
    with another's: 2 and 3 threads give the 1-thread array (and lossless codecs the frames)."""
    imgs = _store(tmp_path / "s", shape, compressor, 60)
    idx = np.array([59, 3, 3, 40, 17, 59, 0, 33, 3, 58, 16, 15, 3, 44, 1, 3, 29, 28, 50, 2, 2, 47, 31, 10])
    idx = np.concatenate([idx, idx[::-1], np.arange(59, -1, -7)])
    one = _decoded(tmp_path / "s", idx, 1)
    assert one.shape == (len(idx), *shape)
    for threads in (2, 3):
        assert np.array_equal(_decoded(tmp_path / "s", idx, threads), one), threads
    if compressor != "jpeg:90":
        assert np.array_equal(one, imgs[idx])


def test_a_damaged_frame_raises_on_threads_and_the_pool_reads_on(tmp_path):
    """A frame that does not decode, read among many on 2 threads, raises DamagedStoreError naming
    its row; the threads stop, and the next batch (without it) reads on the same pool."""
    imgs = _store(tmp_path / "s", (24, 24, 3), "png", 48)
    shard = next(p for p in sorted((tmp_path / "s" / "step_data" / "c").rglob("*")) if p.is_file())
    data = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(data[-4 - 16 * 16 : -4]), "<u8").reshape(16, 2)
    off, size = (int(v) for v in index[9])
    data[off : off + size] = b"\x00" * size  # frame 9's bytes; the index and its checksum intact
    shard.write_bytes(bytes(data))
    ti.set_decode_threads(2)
    try:
        with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
            for _ in range(3):
                with pytest.raises(DamagedStoreError, match=r"row 9 \(chunk 0\) does not decode"):
                    ro[np.r_[np.arange(47, 9, -1), 9, np.arange(9)]]
            fine = np.r_[np.arange(47, 9, -1), np.arange(9)]
            assert np.array_equal(np.asarray(ro[fine]), imgs[fine])
    finally:
        ti.set_decode_threads(None)


def test_the_switch_interval_is_short_while_threads_decode_and_restored_after(tmp_path):
    """parallel() shortens sys.setswitchinterval while its threads run (a thread waiting for the
    GIL gets it within DECODE_SWITCH_INTERVAL, not 5 ms) and sets the previous value again after,
    also when a frame raises, and when several batches decode at once from different threads."""
    import sys
    import threading

    from trajstore.storage.fields import image as image_module

    before = sys.getswitchinterval()
    seen: list[float] = []

    def look(items):
        for _ in items:
            seen.append(sys.getswitchinterval())

    ti.set_decode_threads(2)
    try:
        image_module.parallel(look, list(range(8)))
        assert seen and all(abs(v - image_module.DECODE_SWITCH_INTERVAL) < 1e-6 for v in seen)
        assert sys.getswitchinterval() == before

        def boom(items):
            for _ in items:
                raise ValueError("a frame that does not decode")

        with pytest.raises(ValueError, match="does not decode"):
            image_module.parallel(boom, list(range(8)))
        assert sys.getswitchinterval() == before

        def drain(items):
            for _ in items:
                sum(range(2000))  # holds the GIL: the batches overlap

        readers = [threading.Thread(target=image_module.parallel, args=(drain, list(range(200)))) for _ in range(3)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout=30)
        assert sys.getswitchinterval() == before
    finally:
        ti.set_decode_threads(None)
    imgs = _store(tmp_path / "s", (24, 24, 3), "jpeg:90", 40)
    assert _decoded(tmp_path / "s", np.arange(40), 2).shape == imgs.shape
    assert sys.getswitchinterval() == before
