"""Compressed fields read random rows one blosc block at a time (issue 12, point 3).

A blosc frame (zarr's ``blosc`` codec output for a chunk) is a header, a table of block offsets
and independently compressed blocks; ``fieldspec.row_block_codec`` makes one block per image row,
and ``ChunkedField`` decodes only the blocks of the rows asked for.  Checked here: the layout, that
plain zarr reads the same values, old layouts (auto-sized blocks, other codecs), ring wrap and
staged rewrites, hostile frames (DamagedStoreError, never a crash), SIGKILL of the writers, and
``scripts/bench_compressed.py --quick``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box, Dict

sys.path.insert(0, os.path.dirname(__file__))

import _workers as W
import test_crash as _crash
import test_hostile as _hostile

from trajstore import ReplayBuffer
from trajstore.errors import DamagedStoreError
from trajstore.storage.fields import _rowblocks, chunked
from trajstore.storage.fields import spec as fieldspec
from trajstore.storage.fields.chunked import ChunkedField

ROOT = Path(__file__).resolve().parent.parent
IMG = (32, 32, 3)  # 3072 bytes: above ROW_BLOCK_MIN_BYTES once the tests lower it
SPACE = Dict({"img": Box(0, 255, IMG, np.uint8), "x": Box(-np.inf, np.inf, (3,), np.float32)})


@pytest.fixture
def row_reads(monkeypatch):
    """Row reads for every field size (the default keeps small fields on whole cached chunks)."""
    monkeypatch.setattr(chunked, "ROW_READS_ABOVE_BYTES", 0)
    monkeypatch.setattr(fieldspec, "ROW_BLOCK_MIN_BYTES", 1024)
    calls = {"rows": 0}
    orig = _rowblocks.FrameCache._decode

    def counting(self, out, rows, *rest):
        calls["rows"] += len(rows)
        return orig(self, out, rows, *rest)

    monkeypatch.setattr(_rowblocks.FrameCache, "_decode", counting)
    return calls


def _data(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 255, (n, *IMG), dtype=np.uint8)
    img[:, : IMG[0] // 2] = (np.arange(n) % 251)[:, None, None, None]  # compressible half
    return {"img": img, "x": rng.standard_normal((n, 3)).astype(np.float32)}


def _build(path: Path, n: int, **kw) -> dict[str, np.ndarray]:
    data = _data(n)
    with ReplayBuffer.create(SPACE, cache_path=str(path), **kw) as rb:
        for lo in range(0, n, 97):
            rb.extend({k: v[lo : lo + 97] for k, v in data.items()})
    return data


def _img_field(rb: ReplayBuffer) -> ChunkedField:
    f = next(f for f in rb._table.fields if f.spec.array_path.endswith("img"))
    assert isinstance(f, ChunkedField)
    return f


@pytest.mark.parametrize("compressor", ["lz4", "zstd"])
def test_row_block_layout_reads_like_zarr(tmp_path, row_reads, compressor):
    store = tmp_path / "s"
    data = _build(store, 700, compressor=compressor, chunk_rows=64)
    meta = json.loads((store / "step_data/img/zarr.json").read_text())
    blosc = meta["codecs"][1]["configuration"]
    assert meta["codecs"][0]["name"] == "bytes" and len(meta["codecs"]) == 2
    assert blosc["blocksize"] == int(np.prod(IMG)) and blosc["shuffle"] == "noshuffle"
    assert 16 < blosc["typesize"] <= 255 and int(np.prod(IMG)) % blosc["typesize"] == 0
    # plain zarr opens every array and reads the same values
    for name, want in data.items():
        z = zarr.open_array(str(store / "step_data" / name), mode="r")
        np.testing.assert_array_equal(z[:700], want)
    g = zarr.open_group(str(store), mode="r")
    np.testing.assert_array_equal(g["step_data/img"][[5, 699, 64]], data["img"][[5, 699, 64]])

    with ReplayBuffer.load_from(str(store), read_only=True) as rb:
        rng = np.random.default_rng(1)
        idx = rng.integers(0, 700, 40)
        got = rb[idx]
        np.testing.assert_array_equal(got["img"], data["img"][idx])
        np.testing.assert_array_equal(got["x"], data["x"][idx])
        assert row_reads["rows"] > 0
        for i in (0, 63, 64, 699):
            np.testing.assert_array_equal(rb[i]["img"], data["img"][i])
        np.testing.assert_array_equal(rb[:]["img"], data["img"])  # scan: whole chunks from frames
        np.testing.assert_array_equal(rb[100:150]["img"], data["img"][100:150])
        s = rb.sample(64, rng=3)
        rows = s["img"][:, 0, 0, 0].astype(np.int64)
        assert set(rows.tolist()) <= set(range(251))
        f = _img_field(rb)
        assert f._frames.frames and f._partial
        f.drop_cache()
        assert not f._frames.frames and f._frames.held_bytes == 0


def test_existing_layouts_still_read(tmp_path, row_reads):
    """Stores written before this layout (blosc with auto-sized blocks, and non-blosc codecs)."""
    old = zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=1)
    for name, comp in (("old", old), ("zstd-plain", zarr.codecs.ZstdCodec(level=1))):
        store = tmp_path / name
        data = _build(store, 500, compressor=comp, chunk_rows=128)
        meta = json.loads((store / "step_data/img/zarr.json").read_text())
        assert "blocksize" not in json.dumps(meta["codecs"]) or meta["codecs"][1]["configuration"]["blocksize"] == 0
        with ReplayBuffer.load_from(str(store), read_only=True) as rb:
            idx = np.random.default_rng(2).integers(0, 500, 100)
            np.testing.assert_array_equal(rb[idx]["img"], data["img"][idx])
            np.testing.assert_array_equal(rb[:]["img"], data["img"])
            assert _img_field(rb)._partial == (name == "old")


def test_policy():
    rb = 64 * 64 * 3
    c = fieldspec.row_block_codec("lz4", np.dtype(np.uint8), rb)
    assert c.blocksize == rb and c.typesize == 32 and c.shuffle.value == "noshuffle"
    c = fieldspec.row_block_codec("zstd", np.dtype(np.float32), 64 * 64 * 4)
    assert c.typesize == 4 and c.shuffle.value == "shuffle"
    small = fieldspec.row_block_codec("zstd", np.dtype(np.float32), 17 * 4)  # small rows: 16 KiB blocks
    assert small.blocksize == fieldspec.SMALL_ROWS_BLOCK_BYTES and small.typesize == 4
    c = fieldspec.row_block_codec("lz4", np.dtype(np.float32), 64 * 64 * 4)  # lz4: unsplit, a block per row
    assert c.typesize == 128 and c.blocksize == 64 * 64 * 4 and c.shuffle.value == "shuffle"
    # (lz4 small rows: test_lz4_vectors.test_small_rows_policy)
    assert fieldspec.row_block_codec("lz4", np.dtype(np.uint8), 4099) is None  # prime: no typesize fits
    spec = fieldspec.make_field_spec("a", (84, 84, 4), np.uint8, capacity=None, compressor="lz4", chunk_rows=None)
    assert spec.compressor.blocksize == 84 * 84 * 4 and spec.chunk_rows * 84 * 84 * 4 <= fieldspec.COMPRESSED_CHUNK_BYTES


def test_ring_wrap_and_staged_rewrites(tmp_path, row_reads):
    store = str(tmp_path / "ring")
    data = _data(900, seed=5)
    with ReplayBuffer.create(SPACE, cache_path=store, compressor="lz4", chunk_rows=32, capacity=320) as rb:
        reader = None
        for lo in range(0, 900, 50):
            rb.extend({k: v[lo : lo + 50] for k, v in data.items()})
            if lo == 400:
                rb.flush()
                reader = ReplayBuffer.load_from(store, read_only=True)
                np.testing.assert_array_equal(reader[:]["img"], data["img"][450 - 320 : 450])
                reader[np.arange(0, 320, 7)]  # fill its frame cache
        rb.flush()
        want = data["img"][900 - 320 :]
        np.testing.assert_array_equal(rb[:]["img"], want)
        idx = np.random.default_rng(0).integers(0, 320, 200)
        np.testing.assert_array_equal(rb[idx]["img"], want[idx])
        # the old reader sees the new rows (its mapped frames were dropped on the new commit)
        np.testing.assert_array_equal(reader[idx]["img"], want[idx])
        np.testing.assert_array_equal(reader[:]["img"], want)
        # staged rewrites: set_at, remove_at; then the reader again
        new = np.full((3, *IMG), 7, np.uint8)
        rb.set_at(np.array([5, 100, 319]), {"img": new, "x": np.zeros((3, 3), np.float32)})
        want = want.copy()
        want[[5, 100, 319]] = 7
        np.testing.assert_array_equal(rb[[5, 100, 319, 6]]["img"], want[[5, 100, 319, 6]])
        rb.remove_at(np.array([0, 1]))
        want = want[2:]
        np.testing.assert_array_equal(rb[:]["img"], want)
        idx = np.random.default_rng(1).integers(0, len(want), 100)
        np.testing.assert_array_equal(reader[idx]["img"], want[idx])
        reader.close()
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        np.testing.assert_array_equal(ro[idx]["img"], want[idx])
        np.testing.assert_array_equal(zarr.open_group(store, mode="r")["step_data/img"][:].shape, (320, *IMG))


# ------------------------------------------------------------------------------------------ hostile
HDR = struct.Struct("<BBBBiii")


def _frame_tamper(how: str):
    def tamper(path: Path) -> None:
        key = path / "step_data/img/c/1/0/0/0"
        b = bytearray(key.read_bytes())
        v, vlz, flags, ts, nbytes, bs, cbytes = HDR.unpack_from(b, 0)
        nblocks = -(-nbytes // bs)
        if how == "offset-out":
            struct.pack_into("<i", b, 16 + 4 * 3, len(b) + 1000)
        elif how == "offset-negative":
            struct.pack_into("<i", b, 16 + 4 * 2, -5)
        elif how == "offset-into-table":
            struct.pack_into("<i", b, 16, 8)
        elif how == "cbytes-huge":
            HDR.pack_into(b, 0, v, vlz, flags, ts, nbytes, bs, 1 << 30)
        elif how == "nbytes-huge":
            HDR.pack_into(b, 0, v, vlz, flags, ts, 1 << 30, bs, cbytes)
        elif how == "blocksize-zero":
            HDR.pack_into(b, 0, v, vlz, flags, ts, nbytes, 0, cbytes)
        elif how == "blocksize-tiny":
            HDR.pack_into(b, 0, v, vlz, flags, ts, nbytes, 1, cbytes)
        elif how == "memcpyed-short":
            HDR.pack_into(b, 0, v, vlz, flags | 0x02, ts, nbytes, bs, cbytes)
        elif how == "typesize-zero":
            HDR.pack_into(b, 0, v, vlz, flags, 0, nbytes, bs, cbytes)
        elif how == "truncated":
            b = b[: len(b) // 2]
        elif how == "split-sizes":  # each block's first int32 is its compressed length: make it huge
            first = 16 + 4 * nblocks
            starts = np.frombuffer(bytes(b[16:first]), "<i4")
            for s in starts.tolist():
                struct.pack_into("<i", b, s, 1 << 30)
        elif how.startswith("fuzz"):
            rng = np.random.default_rng(int(how[4:]))
            first = 16 + 4 * nblocks
            pos = rng.integers(first, len(b), 64)
            for p in pos.tolist():
                b[p] = int(rng.integers(0, 256))
        key.write_bytes(bytes(b))
    return tamper


HOSTILE = ["offset-out", "offset-negative", "offset-into-table", "cbytes-huge", "nbytes-huge", "blocksize-zero",
           "blocksize-tiny", "memcpyed-short", "typesize-zero", "truncated", "split-sizes",
           *[f"fuzz{i}" for i in range(6)]]


def _read_everything(path: str) -> dict:
    chunked.ROW_READS_ABOVE_BYTES = 0  # (in the forked child)
    out = {}
    for name, fn in (("rows", lambda rb: rb[np.arange(0, 300, 3)]), ("scan", lambda rb: rb[:]),
                     ("one", lambda rb: [rb[i] for i in range(64, 128, 5)]),
                     ("sample", lambda rb: rb.sample(64, rng=0))):
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
    base = tmp_path_factory.mktemp("hostile") / "base"
    saved = fieldspec.ROW_BLOCK_MIN_BYTES
    fieldspec.ROW_BLOCK_MIN_BYTES = 1024
    try:
        _build(base, 300, compressor="lz4", chunk_rows=64)
    finally:
        fieldspec.ROW_BLOCK_MIN_BYTES = saved
    return base


@pytest.mark.parametrize("how", HOSTILE)
def test_hostile_frame(tmp_path, hostile_base, how):
    import shutil

    store = tmp_path / "s"
    shutil.copytree(hostile_base, store)
    _frame_tamper(how)(store)
    result, _secs = _hostile.run_isolated(lambda: _read_everything(str(store)), tmp_path / "out.json")
    assert isinstance(result, dict), result  # not killed by a signal, not out of memory, not hung
    for name, outcome in result.items():
        assert not outcome.startswith("X:"), (how, name, outcome)
        if not how.startswith("fuzz") and how != "split-sizes":
            assert outcome.startswith("T:"), (how, name, outcome)


# ------------------------------------------------------------------------------------------ SIGKILL
@pytest.fixture
def row_block_workers(monkeypatch):
    """The crash workers' (8, 8, 3) uint8 rows (192 bytes) get one-row blocks: the store is created
    in this process, the children read the codec from zarr.json; row reads in the verifying reads."""
    monkeypatch.setattr(fieldspec, "ROW_BLOCK_MIN_BYTES", 64)
    monkeypatch.setattr(chunked, "ROW_READS_ABOVE_BYTES", 0)


def _assert_row_blocks(store: str) -> None:
    meta = json.loads(Path(store, "step_data/img/zarr.json").read_text())
    assert meta["codecs"][1]["configuration"]["blocksize"] == 192


@pytest.mark.slow
def test_sigkill_append_and_ring_overwrite_row_blocks(tmp_path, procs, row_block_workers):
    for cap in (None, 1000):
        sub = tmp_path / f"cap{cap}"
        sub.mkdir()
        total = _crash._append_kill_rounds(sub, procs, capacity=cap, compressor="lz4", chunk_rows=64, rounds=8,
                                           max_batch=64, max_unflushed=200, seed=41 if cap is None else 42,
                                           min_total=1200 if cap else 0)
        _assert_row_blocks(str(sub / "store"))
        assert total > 0


@pytest.mark.slow
def test_sigkill_set_at_remove_at_row_blocks(tmp_path, procs, row_block_workers):
    _crash.test_sigkill_during_set_at_and_remove_at(tmp_path, procs, "lz4")
    _assert_row_blocks(str(tmp_path / "store"))


def test_workers_space_gets_row_blocks(monkeypatch):
    monkeypatch.setattr(fieldspec, "ROW_BLOCK_MIN_BYTES", 64)
    spec = fieldspec.make_field_spec("img", (8, 8, 3), np.uint8, capacity=None, compressor="lz4", chunk_rows=64)
    assert spec.compressor.blocksize == 192
    assert W.SPACE["img"].shape == (8, 8, 3)


# ------------------------------------------------------------------------------------------ bench
def test_bench_compressed_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench_compressed.py"), "--quick",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["sample256"]["ratio"] > 0 and res["scan"]["old_rows_per_s"] > 0
    assert [v["rows"] for v in res["vectors"]["sizes"]] == [2000, 20000]
    assert all(v["systems"]["lz4"]["calls"] > 0 and v["ratio_cold"] > 0 for v in res["vectors"]["sizes"])
    if "remote" in res:
        assert res["remote"]["after"]["gets_per_batch"] > 0
