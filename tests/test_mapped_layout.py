"""The memory-mapped engine's address layout (``trajstore.storage.fields._vmap``).

Chunks of at least a huge page (2 MiB) start on huge-page boundaries, with a gap after each,
so the kernel can map a chunk's 2 MiB page-cache folios one fault each (issue 12: cold image
reads).  Every read and write path must see the same rows through that gapped layout as
through the contiguous one and as zarr-python's own reader: rows, random gathers, windows
inside a chunk and across a chunk's end, ring wraps, single-row rewrites (stores into the
mapping) and block writes (pwrite).

Real huge-page chunks ((84,84,4) frames, 256 rows: 7.2 MB) run once; the same paths run on
small rows with ``_syscalls.HUGE`` lowered to three pages, which puts a two-page gap after every
four-page chunk and makes chunk ends frequent.
"""

from __future__ import annotations

import ctypes
import os
import resource

import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.storage.fields import _syscalls, _vmap

pytestmark = pytest.mark.skipif(not _syscalls.AVAILABLE, reason="the mapped engine is off in this process")

FRAME = (84, 84, 4)


def _rows(seq: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Row ``v`` is filled with bytes that name ``v`` (distinct for neighbours, not constant)."""
    seq = np.asarray(seq, np.int64)
    width = int(np.prod(shape))
    return ((seq[:, None] * 7 + np.arange(width)) % 251).astype(np.uint8).reshape(len(seq), *shape)


def _field(buf: object) -> object:
    """The one raw field of a single-Box buffer (white box: its mapping)."""
    return next(f for f in buf._table.fields if f.spec.array_path.endswith("step_data"))  # type: ignore[attr-defined]


@pytest.fixture(params=["frames", "small-rows"])
def layout(request, monkeypatch):
    """(row shape, chunk rows) of a gapped layout: real 2 MiB pages, or three-page "huge pages"."""
    if request.param == "frames":
        return FRAME, 256
    monkeypatch.setattr(_syscalls, "HUGE", 3 * _syscalls.PAGE)
    return (64,), 4 * _syscalls.PAGE // 64  # four pages per chunk, six per slot


def test_slot_bytes():
    huge = _syscalls.HUGE
    assert _vmap.slot_bytes(_syscalls.PAGE) == _syscalls.PAGE  # small chunks stay contiguous
    assert _vmap.slot_bytes(huge - _syscalls.PAGE) == huge - _syscalls.PAGE
    assert _vmap.slot_bytes(huge) == huge
    assert _vmap.slot_bytes(256 * 28224) == 4 * huge  # (84,84,4) frames, 256-row chunks: 7.2 MB in 8 MiB


def test_gapped_rows_match_zarr_and_the_model(tmp_path, layout):
    shape, C = layout
    n = 3 * C + C // 2
    rb = ReplayBuffer.create(Box(0, 255, shape, np.uint8), cache_path=tmp_path / "s", chunk_rows=C)
    rb.extend(_rows(np.arange(n), shape))
    va = _field(rb)._va
    assert va.array is None and va.stride > va.chunk_bytes and va.base % _syscalls.HUGE == 0, "layout is not gapped"
    model = list(range(n))
    # single rows go through the mapping, blocks through pwrite: both across chunk ends
    rb.set_at(np.array([0, C - 1, C, 2 * C + 1]), _rows(np.array([1000, 1001, 1002, 1003]), shape))
    model[0], model[C - 1], model[C], model[2 * C + 1] = 1000, 1001, 1002, 1003
    block = np.arange(C - 3, 2 * C + 5)
    rb.set_at(block, _rows(block + 2000, shape))
    for i in block.tolist():
        model[i] = i + 2000
    rb.flush()
    expect = _rows(np.array(model), shape)
    np.testing.assert_array_equal(rb[:], expect)
    np.testing.assert_array_equal(rb[C - 2 : 2 * C + 2], expect[C - 2 : 2 * C + 2])
    idx = np.random.default_rng(0).integers(0, n, 300)
    np.testing.assert_array_equal(rb[idx], expect[idx])
    z = zarr.open_array(str(tmp_path / "s" / "step_data"), mode="r")
    np.testing.assert_array_equal(z[:n], expect)
    rb.close()
    with ReplayBuffer.load_from(tmp_path / "s", read_only=True) as ro:
        np.testing.assert_array_equal(ro[:], expect)
        np.testing.assert_array_equal(ro[idx], expect[idx])


def test_gapped_ring_wraps(tmp_path, layout):
    shape, C = layout
    cap = 2 * C
    rb = ReplayBuffer.create(Box(0, 255, shape, np.uint8), cache_path=tmp_path / "s", capacity=cap, chunk_rows=C)
    total = 0
    for size in (C - 1, 3, C + 2, 1, 1, C // 2):
        rb.extend(_rows(np.arange(total, total + size), shape))
        total += size
    for v in range(total, total + 5):  # appends are staged, then written as a block
        rb.append(_rows(np.array([v]), shape)[0])
    total += 5
    expect = _rows(np.arange(total - cap, total), shape)
    np.testing.assert_array_equal(rb[:], expect)
    rb.close()
    with ReplayBuffer.load_from(tmp_path / "s", read_only=True) as ro:
        np.testing.assert_array_equal(ro[:], expect)


def test_gapped_windows_inside_and_across_chunk_ends(tmp_path, layout):
    shape, C = layout
    n = 3 * C
    tb = TrajectoryReplayBuffer.create(Box(0, 255, shape, np.uint8), cache_path=tmp_path / "t", chunk_rows=C)
    tb.extend({"step_data": _rows(np.arange(n), shape), "episode_ids": np.zeros(n, np.int64)})
    tb.close()
    expect = _rows(np.arange(n), shape)
    with TrajectoryReplayBuffer.load_from(tmp_path / "t", read_only=True) as ro:
        offsets = np.arange(-3, 2)
        anchors = np.array([3, 10, C - 2, C - 1, C, C + 1, 2 * C - 4, 2 * C + 2, n - 2])  # inside and across
        data, valid = ro.get_sequences(anchors, offsets)
        assert valid.all()
        np.testing.assert_array_equal(data["step_data"], expect[anchors[:, None] + offsets])
        field = _field(ro)
        for length in (1, 4, C, C + 1):
            phys = np.array([0, 1, C - length % C, C - 1, C + 3, 2 * C - 1]) % (n - length + 1)
            got = field.gather_windows(phys, length)
            np.testing.assert_array_equal(got, expect[phys[:, None] + np.arange(length)])


def _faults_touching_pages(addr: int, nbytes: int) -> int:
    """Minor faults this process takes reading one byte of every page of ``[addr, addr + nbytes)``."""
    view = np.ndarray((nbytes,), np.uint8, buffer=(ctypes.c_char * nbytes).from_address(addr))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    int(view[:: _syscalls.PAGE].sum())
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_chunk_maps_as_few_faults_as_a_plain_file(tmp_path):
    """The point of the gapped layout: a freshly written (84,84,4) chunk file is mapped with no
    more faults than the same bytes in a plain file mapped at a huge-page boundary.  Where the
    kernel or filesystem gives no huge folios (the plain file takes a fault per 64 KiB or so),
    there is nothing to compare and the test skips."""
    C = 256
    frames = _rows(np.arange(C), FRAME)
    plain = tmp_path / "plain"
    plain.write_bytes(frames.tobytes())
    fd = os.open(plain, os.O_RDONLY)
    try:
        va = _vmap.VirtualArray(1, C, FRAME, np.dtype(np.uint8), False)
        va.map_chunk(0, fd, "plain")
        control = _faults_touching_pages(va.base, va.chunk_bytes)
        va.close()
    finally:
        os.close(fd)
    pages = frames.nbytes // _syscalls.PAGE
    if control > pages // 8:
        pytest.skip(f"no huge page-cache folios here: a plain file took {control} faults for {pages} pages")
    rb = ReplayBuffer.create(Box(0, 255, FRAME, np.uint8), cache_path=tmp_path / "s", chunk_rows=C)
    rb.extend(np.concatenate([frames, frames]))
    rb.close()
    with ReplayBuffer.load_from(tmp_path / "s", read_only=True) as ro:
        ro[0]  # maps the chunks (touches one page of chunk 0)
        va = _field(ro)._va
        got = _faults_touching_pages(va.base + va.stride, va.chunk_bytes)  # chunk 1, untouched so far
    assert got <= control + 2, f"chunk 1 took {got} faults to read; a plain file of the same bytes {control}"
