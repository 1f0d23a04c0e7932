"""lz4 fields of small rows (vectors, scalars) read a random row from one small blosc block (issue 35).

c-blosc enlarges the blocks of lz4 with a ``typesize`` of at most 16 to 64 KiB or more, so the
previous layout of (17,) float32 rows decoded 964 rows per random row.  New stores declare a
``typesize`` above 16 (``_rowblocks.small_rows_codec``): 2 KiB blocks.  Checked here: the layout
(and that plain zarr reads it), exact round trips through every read path, stores of the previous
layout (read, and appended to without switching layout), a live reader while a writer appends and
overwrites a ring (never an uncommitted or stale row), and hostile frames (DamagedStoreError
naming the field and the row, inside a bounded address space).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box, Dict

sys.path.insert(0, os.path.dirname(__file__))

import test_hostile as _hostile

from trajstore import ReplayBuffer
from trajstore.errors import DamagedStoreError
from trajstore.storage.fields import _rowblocks, chunked
from trajstore.storage.fields import spec as fieldspec
from trajstore.storage.fields.chunked import ChunkedField

HDR = struct.Struct("<BBBBiii")
SPACE = Dict({"obs": Box(-np.inf, np.inf, (17,), np.float32), "rew": Box(-np.inf, np.inf, (), np.float32),
              "done": Box(0, 1, (), np.uint8), "act": Box(-9, 9, (3,), np.int64)})
OLD = zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=4, blocksize=16 << 10)


@pytest.fixture
def decoded(monkeypatch):
    """Every field size takes the row path; counts the rows decoded from their own block."""
    monkeypatch.setattr(chunked, "SMALL_BLOCK_ROW_READS_ABOVE_BYTES", 0)
    calls = {"rows": 0}
    orig = _rowblocks.FrameCache._decode

    def counting(self, out, rows, *rest):
        calls["rows"] += len(rows)
        return orig(self, out, rows, *rest)

    monkeypatch.setattr(_rowblocks.FrameCache, "_decode", counting)
    return calls


def _data(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n, 17)).astype(np.float32)
    obs[:, 0] = np.arange(n)  # the row's number: a stale or misplaced row shows
    obs[: n // 4, 1:] = np.round(obs[: n // 4, 1:], 1)  # compressible rows: c-blosc stores the others as they are
    return {"obs": obs, "rew": rng.standard_normal(n).astype(np.float32),
            "done": (rng.random(n) < 0.1).astype(np.uint8), "act": rng.integers(-9, 9, (n, 3))}


def _build(path: Path, n: int, **kw) -> dict[str, np.ndarray]:
    data = _data(n)
    with ReplayBuffer.create(SPACE, cache_path=str(path), **kw) as rb:
        for lo in range(0, n, 97):
            rb.extend({k: v[lo : lo + 97] for k, v in data.items()})
    return data


def _field(rb: ReplayBuffer, name: str) -> ChunkedField:
    f = next(f for f in rb._table.fields if f.spec.array_path.endswith(name))
    assert isinstance(f, ChunkedField)
    return f


def _header(path: Path) -> tuple:
    return HDR.unpack_from(path.read_bytes(), 0)


def _equal(got: dict, data: dict, idx) -> None:
    for k, v in data.items():
        np.testing.assert_array_equal(got[k], v[idx], err_msg=k)


def test_small_rows_policy():
    f4 = np.dtype(np.float32)
    c = fieldspec.row_block_codec("lz4", f4, 68)  # (17,) float32: a row is an item, 32 rows a block
    assert (c.typesize, c.blocksize, c.shuffle.value) == (68, 2176, "shuffle")
    assert fieldspec.row_block_codec("lz4", f4, 4).typesize == 32  # scalars: 8 rows an item
    assert fieldspec.row_block_codec("lz4", np.dtype(np.int64), 24).typesize == 24
    assert fieldspec.row_block_codec("lz4", np.dtype(np.int64), 16).typesize == 32
    assert fieldspec.row_block_codec("lz4", np.dtype(np.uint8), 1).shuffle.value == "noshuffle"
    c = fieldspec.row_block_codec("lz4", f4, 1000)  # no divisor is the row: the largest multiple of 4 dividing it
    assert c.typesize == 200 and c.blocksize % 1000 == 0 and c.blocksize % 200 == 0
    c = fieldspec.row_block_codec("lz4", f4, 268)  # 4 x 67: no typesize in 17..255 fits, blosc's layout
    assert (c.typesize, c.blocksize) == (4, fieldspec.SMALL_ROWS_BLOCK_BYTES)
    assert fieldspec.row_block_codec("zstd", f4, 68).typesize == 4  # zstd keeps its block size anyway
    for codec, small in ((fieldspec.row_block_codec("lz4", f4, 68), True), (OLD, False),
                         (fieldspec.row_block_codec("zstd", f4, 68), False),  # (zstd: 16 KiB, above the bound)
                         (fieldspec.row_block_codec("lz4", f4, 1000), True), (fieldspec.row_block_codec("lz4", f4, 4), True)):
        assert _rowblocks.small_blocks(codec) == small


def test_layout_round_trip_and_plain_zarr(tmp_path, decoded):
    store = tmp_path / "s"
    n = 5000
    data = _build(store, n, compressor="lz4", chunk_rows=512)
    meta = json.loads((store / "step_data/obs/zarr.json").read_text())
    assert meta["codecs"][1]["configuration"]["typesize"] == 68
    v, _vlz, flags, ts, nbytes, bs, _cb = _header(store / "step_data/obs/c/3/0")
    assert (v, ts, nbytes, bs) == (2, 68, 512 * 68, 2176) and flags & 0x10  # c-blosc kept the block size, unsplit
    for name, want in data.items():  # plain zarr reads the same values
        np.testing.assert_array_equal(zarr.open_array(str(store / "step_data" / name), mode="r")[:n], want)
    with ReplayBuffer.load_from(str(store), read_only=True) as rb:
        rng = np.random.default_rng(1)
        for size in (1, 3, 8, 9, 256, 2000):
            idx = rng.integers(0, n, size)
            _equal(rb[idx], data, idx)
        assert decoded["rows"] > 0
        for i in (0, 511, 512, n - 1):
            _equal(rb[i], data, i)
        _equal(rb[:], data, slice(None))
        _equal(rb[1000:1300], data, slice(1000, 1300))
        s = rb.sample(300, rng=3)
        np.testing.assert_array_equal(s["obs"], data["obs"][s["obs"][:, 0].astype(np.int64)])
        f = _field(rb, "obs")
        assert f._small_blocks and f._frames.frames
        known = f._frames._known.nonzero()[0]
        assert not f._frames._stored[known].any()  # decoded from compressed blocks
        f.drop_cache()
        assert not f._frames.frames and f._frames.held_bytes == 0


def test_incompressible_rows_are_copied(tmp_path, decoded):
    """c-blosc stores a chunk it cannot compress as is (flag "memcpyed"): rows are copied from it."""
    bits = np.random.default_rng(3).integers(0, 1 << 32, (3000, 17), dtype=np.uint32).view(np.float32)
    with ReplayBuffer.create(Box(-np.inf, np.inf, (17,), np.float32), cache_path=str(tmp_path / "s"),
                             compressor="lz4", chunk_rows=512) as rb:
        rb.extend(bits)
    assert _header(tmp_path / "s/step_data/c/2/0")[2] & 0x02
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as rb:
        idx = np.random.default_rng(4).integers(0, 3000, 700)
        np.testing.assert_array_equal(rb[idx].view(np.uint32), bits[idx].view(np.uint32))
        f = rb._table.fields[0]
        assert f._frames._stored[:5].all() and f._frames._known[:5].all()  # (chunk 5: zero padding compresses)


def test_wide_float_rows_get_one_unsplit_block_per_row(tmp_path, decoded, monkeypatch):
    """(1024,) float32 rows (4 KiB): typesize 128, a block per row (typesize 4 was 64 KiB blocks)."""
    monkeypatch.setattr(chunked, "ROW_READS_ABOVE_BYTES", 0)
    x = np.round(np.random.default_rng(6).standard_normal((300, 1024)), 2).astype(np.float32)
    with ReplayBuffer.create(Box(-np.inf, np.inf, (1024,), np.float32), cache_path=str(tmp_path / "s"),
                             compressor="lz4", chunk_rows=64) as rb:
        rb.extend(x)
    _v, _vlz, flags, ts, _nb, bs, _cb = _header(tmp_path / "s/step_data/c/1/0")
    assert (ts, bs) == (128, 4096) and flags & 0x10
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as rb:
        idx = np.random.default_rng(7).integers(0, 300, 12)  # (a few per chunk: row reads)
        np.testing.assert_array_equal(rb[idx], x[idx])
    assert decoded["rows"] > 0


def test_previous_layout_reads_and_stays(tmp_path, decoded, monkeypatch):
    """A store of the previous layout (typesize 4, asked 16 KiB: 64 KiB blocks) reads row by row,
    and a writer that reopens it keeps writing that layout: the new default is for new stores."""
    monkeypatch.setattr(chunked, "ROW_READS_ABOVE_BYTES", 0)
    store = tmp_path / "old"
    data = _build(store, 3000, compressor={"obs": OLD, "*": "lz4"}, chunk_rows=1024, capacity=3000)
    assert _header(store / "step_data/obs/c/0/0")[5] == 65536
    with ReplayBuffer.load_from(str(store), read_only=True) as rb:
        f = _field(rb, "obs")
        assert f._partial and not f._small_blocks
        idx = np.random.default_rng(0).integers(0, 3000, 500)
        _equal(rb[idx], data, idx)
        assert decoded["rows"] > 0
    more = _data(1200, seed=9)
    more["obs"][:, 0] += 3000
    with ReplayBuffer.load_from(str(store)) as rb:  # the ring wraps: chunks 0 and 1 are rewritten
        rb.extend(more)
    meta = json.loads((store / "step_data/obs/zarr.json").read_text())
    assert meta["codecs"][1]["configuration"]["typesize"] == 4
    assert _header(store / "step_data/obs/c/0/0")[5] == 65536
    want = {k: np.concatenate([v[1200:], more[k]]) for k, v in data.items()}
    with ReplayBuffer.load_from(str(store), read_only=True) as rb:
        idx = np.random.default_rng(2).integers(0, 3000, 700)
        _equal(rb[idx], want, idx)


def test_live_reader_sees_only_committed_fresh_rows(tmp_path, decoded):
    store = str(tmp_path / "ring")
    cap, n = 1500, 6000
    data = _data(n, seed=4)
    with ReplayBuffer.create(SPACE, cache_path=store, compressor="lz4", chunk_rows=256, capacity=cap) as w:
        w.extend({k: v[:700] for k, v in data.items()})
        w.flush()
        reader = ReplayBuffer.load_from(store, read_only=True)
        committed = 700
        rng = np.random.default_rng(5)
        for lo in range(700, n, 350):
            w.extend({k: v[lo : lo + 350] for k, v in data.items()})  # written, not committed yet
            for _ in range(3):
                # the reader's rows: a run of consecutive rows, all committed (a ring eviction
                # record may have dropped the oldest ones before the writer overwrites them)
                seen = reader[:]["obs"][:, 0].astype(np.int64)
                first, count = int(seen[0]), len(seen)
                np.testing.assert_array_equal(seen, np.arange(first, first + count))
                with ReplayBuffer.load_from(store, read_only=True) as fresh:  # what the commit record counts
                    assert (len(fresh), int(fresh[0]["obs"][0])) == (count, first), (lo, first, count)
                assert first + count <= lo + 350 and count <= cap and first + count >= committed - cap
                got = reader.sample(200, rng=rng)
                num = got["obs"][:, 0].astype(np.int64)
                assert num.min() >= first and num.max() < first + count
                _equal(got, data, num)  # every field of every row: fresh, not a stale frame
                idx = rng.integers(0, count, 100)
                _equal(reader[idx], data, idx + first)
            if lo % 1050 == 0:
                w.flush()
                committed = lo + 350
        w.flush()
        committed = n
        idx = rng.integers(0, cap, 400)
        _equal(reader[idx], data, idx + n - cap)  # frames mapped before the rewrites were dropped
        reader.close()
    assert decoded["rows"] > 0


# ------------------------------------------------------------------------------------------ hostile
def _tamper(how: str):
    def tamper(store: Path) -> None:
        key = store / "step_data/obs/c/1/0"
        b = bytearray(key.read_bytes())
        v, vlz, flags, ts, nbytes, bs, cbytes = HDR.unpack_from(b, 0)
        nblocks = -(-nbytes // bs)
        starts = np.frombuffer(bytes(b[16 : 16 + 4 * nblocks]), "<i4")
        if how == "nbytes":
            HDR.pack_into(b, 0, v, vlz, flags, ts, nbytes * 64, bs, cbytes)
        elif how == "cbytes":
            HDR.pack_into(b, 0, v, vlz, flags, ts, nbytes, bs, 1 << 30)
        elif how == "blocksize":
            HDR.pack_into(b, 0, v, vlz, flags, ts, nbytes, nbytes * 8, cbytes)
        elif how == "version":
            b[0] = 7
        elif how == "offset":
            struct.pack_into("<i", b, 16 + 4 * 2, len(b) + 64)
        elif how == "block-length":  # a block's own compressed length past the frame
            for s in starts.tolist():
                struct.pack_into("<i", b, s, 1 << 30)
        elif how == "block-bytes":  # garbage inside every block
            for s in starts.tolist():
                b[s + 4 : s + 40] = bytes(range(36))
        key.write_bytes(bytes(b))
    return tamper


def _read_rows(path: str) -> dict:
    out = {}
    for name, fn in (("rows", lambda rb: rb[np.arange(256, 512, 5)]), ("one", lambda rb: rb[300]),
                     ("scan", lambda rb: rb[:]), ("sample", lambda rb: [rb.sample(64, rng=s) for s in range(8)])):
        try:
            with ReplayBuffer.load_from(path, read_only=True) as rb:
                fn(rb)
            out[name] = "ok"
        except DamagedStoreError as e:
            out[name] = f"T:{e}"
        except Exception as e:  # noqa: BLE001 - reported: anything else is a bug
            out[name] = f"X:{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def hostile_base(tmp_path_factory):
    base = tmp_path_factory.mktemp("lz4_hostile") / "base"
    _build(base, 1000, compressor="lz4", chunk_rows=256)
    return base


@pytest.mark.parametrize("how", ["nbytes", "cbytes", "blocksize", "version", "offset", "block-length", "block-bytes"])
def test_hostile_small_row_frame(tmp_path, hostile_base, decoded, how):
    store = tmp_path / "s"
    shutil.copytree(hostile_base, store)
    _tamper(how)(store)
    result, _secs = _hostile.run_isolated(lambda: _read_rows(str(store)), tmp_path / "out.json")
    assert isinstance(result, dict), result  # not killed by a signal, not out of memory, not hung
    for name, outcome in result.items():
        assert outcome.startswith("T:"), (how, name, outcome)
        assert "step_data/obs" in outcome, outcome  # names the field
        if how in ("block-length", "block-bytes") and name in ("rows", "one"):
            m = re.search(r"rows? (\d+)", outcome)  # ... and the row (physical): one of chunk 1's
            assert m and 256 <= int(m.group(1)) < 512, outcome
