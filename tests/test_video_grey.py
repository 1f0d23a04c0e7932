"""Video fields of grey frames and frame stacks (issue 31 point 3): ``(H, W)``, ``(H, W, 1)`` and stacks
of grey planes ``(84, 84, 4)`` / ``(4, 84, 84)``, each frame coded as one grey picture (the planes one
above the other) in the luma of an H.264 (4:0:0) or AV1 (4:2:0, flat chroma) stream.

Real stores on disk, real PyAV encoders and decoders (libx264, libsvtav1, FFmpeg's h264, libdav1d).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

from trajstore import TrajectoryReplayBuffer
from trajstore.errors import BadOptionError, DamagedStoreError
from trajstore.maintenance.verify import verify_store

pytest.importorskip("av")


def grey(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """``n`` smooth (h, w) uint8 grey frames of a scene drifting over time."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    fx, fy = np.random.default_rng(seed).uniform(5, 9, 2)
    return np.stack([(128 + 60 * np.sin((x + 2 * i + seed) / fx) + 50 * np.cos((y - i) / fy)).clip(0, 255)
                     for i in range(n)]).astype(np.uint8)


def stacks(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """``n`` frames of ``shape``: grey frames, or Atari-style stacks of the last C grey frames
    ((H, W, C) planes last, (C, H, W) planes first)."""
    if len(shape) == 2 or shape[-1] == 1:
        return grey(n, shape[0], shape[1], seed).reshape(n, *shape)
    last = shape[2] <= 16 and shape[0] > 16
    c, h, w = (shape[2], shape[0], shape[1]) if last else shape
    g = grey(n + c - 1, h, w, seed)
    out = np.stack([g[i : i + c] for i in range(n)])  # (n, C, H, W): frames t .. t+C-1
    return np.ascontiguousarray(out.transpose(0, 2, 3, 1)) if last else out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def record(path: Path, shape: tuple[int, ...], lengths: list[int], compressor: str) -> np.ndarray:
    allf = np.concatenate([stacks(n, shape, seed=e) for e, n in enumerate(lengths)])
    space = Dict({"obs": Box(0, 255, shape, np.uint8), "t": Box(0, 2**62, (), np.int64)})
    t = 0
    with TrajectoryReplayBuffer.create(space, cache_path=str(path), compressor={"obs": compressor}) as tb:
        for n in lengths:
            tb.extend({"obs": allf[t : t + n], "t": np.arange(t, t + n)})
            tb.mark_episode_end()
            t += n
    return allf


def settings(path: Path) -> dict:
    return json.loads((path / "step_data" / "obs" / "zarr.json").read_text())["attributes"]["trajstore_video"]


@pytest.mark.parametrize("shape", [(48, 64), (48, 64, 1), (84, 84, 4), (4, 84, 84), (45, 63), (3, 21, 33)])
@pytest.mark.parametrize("compressor,min_db,pix", [("h264:crf=18:g=4", 38, "gray"), ("lerobot", 32, "yuv420p"),
                                                   ("h264:crf=18:pix_fmt=yuv420p", 38, "yuv420p")])
def test_grey_frames_and_stacks_round_trip_within_a_psnr_bound(tmp_path, shape, compressor, min_db, pix):
    allf = record(tmp_path / "s", shape, [9, 7], compressor)
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        got = ro[:]["step_data"]
        assert got["obs"].shape == allf.shape and got["obs"].dtype == np.uint8
        assert np.array_equal(got["t"], np.arange(16))
        assert psnr(got["obs"], allf) >= min_db, f"{compressor} {shape}: {psnr(got['obs'], allf):.1f} dB"
        for i in (0, 3, 8, 9, 15):  # single frames: each plane in its place
            assert psnr(ro[i]["step_data"]["obs"], allf[i]) >= min_db - 3
    cfg = settings(tmp_path / "s")
    assert cfg["pix_fmt"] == pix
    planes = {(84, 84, 4): -1, (4, 84, 84): 0, (3, 21, 33): 0}.get(shape)
    assert cfg.get("planes") == planes and ("planes" in cfg) == (planes is not None)
    assert sorted(os.listdir(tmp_path / "s" / "step_data" / "obs" / "video")) == ["0", "9", "index"]
    assert verify_store(str(tmp_path / "s"), deep=True).ok


def test_stack_planes_land_in_place_for_random_rows_and_windows(tmp_path):
    """A frame stack's planes differ (a plane per time step): random rows, windows across episodes
    and sequences decode each plane into its own channel, equal to a sequential decode."""
    allf = record(tmp_path / "s", (84, 84, 4), [13, 11], "h264:crf=12:g=5")
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        seq = ro[:]["step_data"]["obs"]
        for c in range(4):
            assert psnr(seq[..., c], allf[..., c]) > 40
        # plane c of frame t is plane c-1 of frame t+1 (the stack shifts): the planes are not swapped
        assert psnr(seq[1:13, :, :, :3], seq[:12, :, :, 1:]) > 38
        idx = np.random.default_rng(0).permutation(24)
        assert np.array_equal(ro[idx]["step_data"]["obs"], seq[idx])
        data, valid = ro.get_sequences(np.array([2, 12, 20]), list(range(-2, 3)))
        rows = np.clip(np.array([2, 12, 20])[:, None] + np.arange(-2, 3), 0, 23)
        assert np.array_equal(data["step_data"]["obs"][valid], seq[rows][valid])


@pytest.mark.parametrize("shape,dtype,compressor,match", [
    ((48, 64, 17), np.uint8, "h264", r"grey frames \(H, W\) or \(H, W, 1\), and frame stacks of C <= 16"),
    ((2, 8, 8, 2), np.uint8, "h264", r"got \(2, 8, 8, 2\) uint8"),
    ((48, 64), np.float32, "h264", r"uint8 RGB frames .* got \(48, 64\) float32"),
    ((16, 600, 600), np.uint8, "h264", r"every side at most 8192 pixels; got \(16, 600, 600\) uint8 with planes=0"),
    ((48, 64, 3), np.uint8, "h264:pix_fmt=gray", r"gray is for grey frames; frames \(48, 64, 3\) are RGB"),
    ((48, 64), np.uint8, "h264:pix_fmt=yuv444p", r"yuv444p is for RGB frames; .* are grey \(use gray or yuv420p\)"),
    ((84, 84, 4), np.uint8, "av1:pix_fmt=gray", r"av1 pixel format must be one of \['yuv420p'\]"),
])
def test_frames_video_cannot_hold_are_refused_with_the_allowed_shapes(tmp_path, shape, dtype, compressor, match):
    with pytest.raises(BadOptionError, match=match):
        TrajectoryReplayBuffer.create(Dict({"obs": Box(0, 255, shape, dtype)}), cache_path=str(tmp_path / "s"),
                                      compressor={"obs": compressor})
    assert not (tmp_path / "s").exists()


def test_a_video_codec_object_gets_the_stack_layout_and_stored_settings_are_checked(tmp_path):
    from trajstore.images import VideoCodec
    from trajstore.storage.fields.video_codec import codec_from_attrs

    allf = stacks(6, (84, 84, 4))
    space = Dict({"obs": Box(0, 255, (84, 84, 4), np.uint8)})
    with TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "s"),
                                       compressor={"obs": VideoCodec("h264", crf=15)}) as tb:
        tb.extend({"obs": allf})
    cfg = settings(tmp_path / "s")
    assert cfg["planes"] == -1 and cfg["pix_fmt"] == "yuv420p"  # the object's pixel format, kept
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert psnr(ro[:]["step_data"]["obs"], allf) > 38
    for bad in (None, True, 5, "last"):
        with pytest.raises(ValueError, match="planes"):
            codec_from_attrs({**cfg, "planes": bad})
    for zj in (tmp_path / "s" / "zarr.json", tmp_path / "s" / "step_data" / "obs" / "zarr.json"):  # (consolidated)
        text = zj.read_text()
        assert text.count('"planes": -1') + text.count('"planes":-1') == 1
        # 4 planes of 84x84 read as 84 planes of 84x4: refused at open
        zj.write_text(text.replace('"planes": -1', '"planes": 0').replace('"planes":-1', '"planes":0'))
    with pytest.raises(DamagedStoreError, match=r"step_data/obs: video settings"):
        with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
            ro[0]  # (fields open at the first read)


def test_a_grey_segment_coding_other_pictures_is_damage_naming_the_row(tmp_path):
    """A well-formed segment whose pictures are of another size (here RGB 48x64 frames where the
    field holds (84, 84, 4) stacks, coded 336x84) is DamagedStoreError naming the field and row."""
    from trajstore.images import VideoCodec
    from trajstore.storage.fields.video import write_segment

    record(tmp_path / "s", (84, 84, 4), [5, 6], "h264:g=3")
    other = np.random.default_rng(0).integers(0, 255, (6, 48, 64, 3), dtype=np.uint8)
    (tmp_path / "s" / "step_data" / "obs" / "video" / "5").write_bytes(
        write_segment(*VideoCodec("h264", gop=3).encode(other)))
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert ro[:5]["step_data"]["obs"].shape == (5, 84, 84, 4)
        with pytest.raises(DamagedStoreError, match=r"step_data/obs: row \d+ .* does not decode"):
            ro[np.arange(11)]
    assert not verify_store(str(tmp_path / "s"), deep=True).ok
