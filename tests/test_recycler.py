"""Recycled return batches (trajstore.storage.fields.recycler): a large batch a read returns reuses
the memory of a batch returned earlier that nothing references any more, never one still held
(the batch, a view of it, a torch tensor or a memoryview sharing its memory)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import trajstore.images as ti
from trajstore import ReplayBuffer
from trajstore.errors import BadOptionError
from trajstore.storage.fields import recycler
from trajstore.storage.fields.out import new_rows

pytestmark = pytest.mark.skipif(not recycler.available(), reason="recycling needs CPython with the GIL")

#: Frames per store kind: jpeg (84, 84, 3), 5.4 MB a batch of 256; raw (64, 64, 4), 4.2 MB, whose
#: rows lie in one mapped array (a chunk is 2 MiB), read by VirtualArray.take.
SHAPES = {"raw": (64, 64, 4), "jpeg:90": (84, 84, 3)}


def _ptr(a: Any) -> int:
    return int(np.asarray(a).__array_interface__["data"][0])


def _within(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.shares_memory(a, b))


@pytest.fixture(autouse=True)
def _fresh_recycler() -> Iterator[None]:
    ti.set_batch_recycling(True)
    ti.release_recycled_batches()
    yield
    ti.set_batch_recycling(True)
    ti.release_recycled_batches()


@pytest.fixture(params=["raw", "jpeg:90"], ids=["raw", "jpeg"])
def rb(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ReplayBuffer]:
    """A read-only store of 300 distinct random frames (raw: mapped rows; jpeg: decoded frames)."""
    rng = np.random.default_rng(0)
    path, shape = str(tmp_path / "s"), SHAPES[request.param]
    with ReplayBuffer.create(gym.spaces.Box(0, 255, shape, np.uint8), cache_path=path, capacity=300,
                             compressor=None if request.param == "raw" else request.param) as w:
        w.extend(rng.integers(0, 256, (300, *shape), dtype=np.uint8))
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        yield ro


def test_dropped_batches_are_reused_and_a_loop_cycles_through_two(rb: ReplayBuffer) -> None:
    b1 = rb.sample(256, rng=1)
    p1 = _ptr(b1)
    b2 = rb.sample(256, rng=2)
    assert _ptr(b2) != p1 and b1.flags.c_contiguous and b1.shape[0] == 256 and b1.dtype == np.uint8
    assert b1.nbytes >= recycler.MIN_BYTES and recycler.held() == (2, 2 * b1.nbytes)
    del b1
    b3 = rb.sample(256, rng=3)
    assert _ptr(b3) == p1  # call 1's memory, nothing referencing it any more
    del b2, b3
    batch, seen = None, set()
    for i in range(6):  # batch = rb.sample(256): call n + 1 runs while batch n is held
        batch = rb.sample(256, rng=10 + i)
        seen.add(_ptr(batch))
    assert len(seen) == 2
    assert recycler.held()[0] == 2


def test_rows_by_index_are_recycled_too(rb: ReplayBuffer) -> None:
    idx = np.arange(256) % 300
    a = rb[idx]
    p = _ptr(a)
    expect = a.copy()
    del a
    b = rb[idx]
    assert _ptr(b) == p and np.array_equal(b, expect)


@pytest.mark.parametrize("keep", ["batch", "view", "torch", "memoryview"])
def test_a_held_batch_is_never_overwritten(rb: ReplayBuffer, keep: str) -> None:
    b1 = rb.sample(256, rng=1)
    expect = b1.copy()
    held: Any
    if keep == "batch":
        held = b1
    elif keep == "view":
        held = b1[100:110, 5:50]  # its .base is the recycled array, not b1
        expect = expect[100:110, 5:50]
    elif keep == "torch":
        torch = pytest.importorskip("torch")
        held = torch.from_numpy(b1)
    else:
        held = memoryview(b1)
    mine = np.asarray(held)
    del b1
    for i in range(6):  # each result dropped at once: its memory is reused, b1's never
        got = rb.sample(256, rng=20 + i)
        assert not _within(got, mine)
        del got
    assert np.array_equal(np.asarray(held), expect)


def test_the_byte_cap_holds_and_a_bigger_batch_is_not_recycled(rb: ReplayBuffer) -> None:
    size = rb.sample(256, rng=0).nbytes
    ti.set_batch_recycling(True, max_bytes=2 * size + 1)
    kept = [rb.sample(256, rng=i) for i in range(4)]  # all held: 4 batches, only 2 fit
    n, nbytes = recycler.held()
    assert n == 2 and nbytes == 2 * size
    expect = [k.copy() for k in kept]
    for i in range(4):
        rb.sample(256, rng=50 + i)
    assert all(np.array_equal(k, e) for k, e in zip(kept, expect))
    ti.set_batch_recycling(True, max_bytes=size - 1)
    assert recycler.held() == (0, 0)
    b = rb.sample(256, rng=7)
    assert b.shape[0] == 256 and recycler.held() == (0, 0)


def test_the_switch_turns_it_off_and_releases(rb: ReplayBuffer) -> None:
    b = rb.sample(256, rng=1)
    assert b.base is not None and recycler.held()[0] >= 1
    ti.set_batch_recycling(False)
    assert not ti.batch_recycling() and recycler.held() == (0, 0)
    c = rb.sample(256, rng=2)
    assert c.shape[0] == 256 and recycler.held() == (0, 0)
    assert np.array_equal(b, rb.sample(256, rng=1))  # still intact, now merely the caller's
    ti.set_batch_recycling(True)
    assert ti.batch_recycling()
    with pytest.raises(BadOptionError):
        ti.set_batch_recycling(1)  # type: ignore[arg-type]
    with pytest.raises(BadOptionError):
        ti.set_batch_recycling(True, max_bytes=-1)


def test_small_batches_are_left_to_numpy(tmp_path: Path) -> None:
    with ReplayBuffer.create(gym.spaces.Box(-1, 1, (17,), np.float32), cache_path=str(tmp_path / "v"),
                             capacity=1000) as w:
        w.extend(np.zeros((1000, 17), np.float32))
        assert w.sample(256).base is None and recycler.held() == (0, 0)


def test_only_plain_dtypes_are_recycled() -> None:
    a = new_rows((256, 2048), np.dtype([("a", "f4"), ("b", "i8")]))  # structured: a view of recycled memory
    assert a.shape == (256, 2048) and a.base is not None and a.flags.c_contiguous
    assert new_rows((256, 2048), np.dtype(("f4", (3,)))).shape == (256, 2048, 3)  # a subarray dtype: numpy's
    assert new_rows((256, 2048), object)[0, 0] is None  # objects: numpy's (None-filled)
    assert new_rows((16, 17), np.float32).base is None  # small: numpy's
    assert recycler.held()[0] == 1


def test_threads_never_share_a_batch(rb: ReplayBuffer) -> None:
    bad: list[str] = []

    def loop(seed: int) -> None:
        keep: list[tuple[np.ndarray, np.ndarray]] = []
        for i in range(8):
            b = rb.sample(256, rng=seed * 100 + i)
            keep = [*keep[-1:], (b, b.copy())]
            del b
            if not all(np.array_equal(x, y) for x, y in keep):
                bad.append(f"thread {seed}: a held batch changed")

    threads = [threading.Thread(target=loop, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert recycler.held()[0] <= recycler.MAX_ARRAYS


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_an_empty_recycler(rb: ReplayBuffer) -> None:
    b = rb.sample(256, rng=1)
    assert recycler.held()[0] >= 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        try:
            empty = recycler.held() == (0, 0)
            c = rb.sample(256, rng=2)
            ok = empty and not np.shares_memory(c, b) and recycler.held()[0] == 1
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1"
