"""Copies of image fields (issue 31): ``trajstore copy`` to a zip keeps each field's image codec and
copies the frames as their stored bytes (no decode, no encode).  Real stores, the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from trajstore import ReplayBuffer

pytest.importorskip("imagecodecs")

sys.path.insert(0, str(Path(__file__).parent))
from test_image_edits import stored_frames  # noqa: E402
from test_image_fields import ROOT, frames, make  # noqa: E402

from trajstore.storage.fields.image import read_index  # noqa: E402


def zip_frames(path: Path, field: str) -> tuple[dict, list[bytes]]:
    """``(zarr.json, encoded frames)`` of ``step_data/<field>`` inside the zip ``path``."""
    with zipfile.ZipFile(path) as z:
        meta = json.loads(z.read(f"step_data/{field}/zarr.json"))
        C, n = meta["chunk_grid"]["configuration"]["chunk_shape"][0], meta["shape"][0]
        out: list[bytes] = []
        for k in range(-(-n // C)):
            buf = np.frombuffer(z.read(f"step_data/{field}/c/{k}/0/0/0"), np.uint8)
            offsets, sizes = read_index(buf, C)
            out += [buf[o : o + s].tobytes() if o >= 0 else b"" for o, s in zip(offsets.tolist(), sizes.tolist())]
    return meta, out[:n]


@pytest.mark.parametrize("compressor", ["auto", "keep"])
def test_copy_to_zip_keeps_the_codec_and_the_frames_bytes(tmp_path, compressor):
    src, dst = tmp_path / "s", tmp_path / "copy.zip"
    imgs = frames(37, (24, 24, 3))
    with make(src, (24, 24, 3), "jpeg:75", chunk_rows=16) as rb:
        rb.extend({"img": imgs, "seq": np.arange(37)})
    out = subprocess.run([sys.executable, "-m", "trajstore", "copy", str(src), str(dst), "--compressor", compressor],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    meta, got = zip_frames(dst, "img")
    inner = meta["codecs"][0]["configuration"]["codecs"][0]
    assert inner == {"name": "trajstore.image", "configuration": {"format": "jpeg", "level": 75, "lossless": False,
                                                                  "planes": None}}
    assert got == stored_frames(src, "img")  # byte for byte
    with ReplayBuffer.load_from(str(dst), read_only=True) as z, ReplayBuffer.load_from(str(src), read_only=True) as s:
        assert np.array_equal(z[:]["img"], s[:]["img"]) and np.array_equal(z[:]["seq"], np.arange(37))


def test_copy_of_a_ring_to_zip_copies_only_committed_frames(tmp_path):
    src, dst = tmp_path / "s", tmp_path / "ring.zip"
    imgs = frames(50, (16, 16, 3))
    with make(src, (16, 16, 3), "webp-lossless", capacity=32, chunk_rows=8) as rb:
        rb.extend({"img": imgs[:30], "seq": np.arange(30)})
        rb.flush()
        rb.extend({"img": imgs[30:], "seq": np.arange(30, 50)})  # wraps: the oldest 18 rows overwritten
        from trajstore.cli.maintain import copy_store

        rb.flush()
        copy_store(str(src), str(dst))
    with ReplayBuffer.load_from(str(dst), read_only=True) as z:
        assert np.array_equal(z[:]["seq"], np.arange(18, 50))
        assert np.array_equal(z[:]["img"], imgs[18:50])  # lossless: exact


def test_combine_and_filter_keep_the_codec_and_pass_frames_through(tmp_path):
    """combine and filter_store write image fields in the source's codec, each frame the bytes it
    was stored as (a JPEG is not decoded and encoded again)."""
    from gymnasium.spaces import Box

    from trajstore import TrajectoryReplayBuffer
    from trajstore.maintenance.combine import combine, filter_store

    imgs = frames(30, (16, 16, 3))
    for name in ("a", "b"):
        with TrajectoryReplayBuffer.create(Box(0, 255, (16, 16, 3), np.uint8), cache_path=str(tmp_path / name),
                                           compressor={"step_data": "jpeg:60"}, chunk_rows=8) as tb:
            for ep in range(3):
                tb.extend(imgs[ep * 10 : ep * 10 + 10] if name == "a" else imgs[::-1][ep * 10 : ep * 10 + 10])
                tb.mark_episode_end()
    a, b = stored_frames(tmp_path / "a", "step_data"), stored_frames(tmp_path / "b", "step_data")
    combine([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab"))
    assert stored_frames(tmp_path / "ab", "step_data") == a + b
    filter_store(str(tmp_path / "a"), str(tmp_path / "f"), lambda e: e["episode_id"] != 1)
    assert stored_frames(tmp_path / "f", "step_data") == a[:10] + a[20:]
    meta = json.loads((tmp_path / "f" / "step_data" / "zarr.json").read_text())
    assert meta["codecs"][0]["configuration"]["codecs"][0]["configuration"]["level"] == 60


def test_copy_to_a_new_layout_keeps_lossy_frames_bytes(tmp_path):
    """``trajstore copy --chunk-rows`` (a relayout through the buffer API) keeps the image codec of
    each field and its frames' bytes, so the copy compares equal to the source and verifies."""
    src, dst = tmp_path / "s", tmp_path / "d"
    imgs = frames(37, (24, 24, 3))
    with make(src, (24, 24, 3), "jpeg:75", chunk_rows=16) as rb:
        rb.extend({"img": imgs, "seq": np.arange(37)})
    out = subprocess.run([sys.executable, "-m", "trajstore", "copy", str(src), str(dst), "--chunk-rows", "8"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert stored_frames(dst, "img") == stored_frames(src, "img")
    meta = json.loads((dst / "step_data" / "img" / "zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"][0] == 8
