"""``trajstore copy`` field by field (issue 31): ``--compressor obs=h264`` transcodes a raw or per-frame
field into a video field (one segment per episode), ``obs=png`` / ``obs=none`` a video field into
frames or raw rows; fields not named keep their codec, video segments kept in their settings are
copied byte for byte.  A SIGKILL during such a copy leaves the destination absent or complete.

Real stores, the real CLI in a subprocess, real PyAV / imagecodecs encoders.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.cli.maintain import copy_store
from trajstore.errors import BadOptionError
from trajstore.maintenance.verify import verify_store

pytest.importorskip("av")
pytest.importorskip("imagecodecs")

sys.path.insert(0, str(Path(__file__).parent))
from test_video_fields import H, W, frames, psnr  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])
SPACE = Dict({"obs": Box(0, 255, (H, W, 3), np.uint8), "t": Box(0, 2**62, (), np.int64)})
EPISODE = Dict({"ret": Box(-np.inf, np.inf, (), np.float64)})


def source(path: Path, lengths: list[int], compressor: dict | None = None, last_open: bool = False) -> np.ndarray:
    """A trajectory store of episodes of ``lengths`` frames, with episode data; the last episode
    left in progress when ``last_open``.  Returns the frames."""
    allf = np.concatenate([frames(n, seed=e) for e, n in enumerate(lengths)])
    t = 0
    with TrajectoryReplayBuffer.create(SPACE, cache_path=str(path), compressor=compressor,
                                       episode_data_instance_space=EPISODE) as tb:
        for e, n in enumerate(lengths):
            tb.extend({"obs": allf[t : t + n], "t": np.arange(t, t + n)})
            t += n
            if not (last_open and e == len(lengths) - 1):
                tb.set_current_episode_data({"ret": np.float64(e)})
                tb.mark_episode_end()
    return allf


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trajstore", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})


def segments(store: Path, field: str = "obs") -> list[str]:
    return sorted(os.listdir(store / "step_data" / field / "video"), key=lambda k: (len(k), k))


def test_cli_copy_transcodes_a_raw_field_into_video_one_segment_per_episode(tmp_path):
    allf = source(tmp_path / "s", [12, 9, 15], last_open=True)
    out = run_cli("copy", str(tmp_path / "s"), str(tmp_path / "d"), "--compressor", "obs=h264:crf=18:g=4", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["method"] == "relayout" and rep["rows"] == 36
    assert rep["lossy"]["step_data/obs"]["codec"].startswith("h264:crf=18:g=4")
    assert rep["lossy"]["step_data/obs"]["psnr_db"] >= 35
    assert segments(tmp_path / "d") == ["0", "12", "21", "index"]  # episodes as segments (the open one sealed)
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "d"), read_only=True) as d, \
            TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as s:
        assert psnr(d[:]["step_data"]["obs"], allf) >= 35
        assert np.array_equal(d[:]["step_data"]["t"], np.arange(36))
        assert d.current_episode_id == s.current_episode_id
    assert verify_store(str(tmp_path / "d"), deep=True).ok
    text = run_cli("copy", str(tmp_path / "s"), str(tmp_path / "d2"), "--compressor", "obs=av1")
    assert text.returncode == 0, text.stderr
    assert "obs av1:crf=30" in text.stdout and "dB PSNR" in text.stdout, text.stdout


@pytest.mark.parametrize("target,exact", [("png", True), ("none", True), ("zstd", True), ("jpeg:90", False)])
def test_copy_of_a_video_field_to_frames_or_raw_rows(tmp_path, target, exact):
    source(tmp_path / "s", [10, 14], {"obs": "h264:crf=20"})
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as s:
        decoded = s[:]["step_data"]["obs"]
    rep = copy_store(str(tmp_path / "s"), str(tmp_path / "d"), compressor={"obs": target})
    assert not (tmp_path / "d" / "step_data" / "obs" / "video").exists()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "d"), read_only=True) as d:
        got = d[:]["step_data"]["obs"]
    if exact:  # the decoded frames, kept losslessly: equal, compared bit for bit
        assert np.array_equal(got, decoded) and rep["lossy"] == {}
    else:
        assert rep["lossy"]["step_data/obs"]["psnr_db"] >= 30 and psnr(got, decoded) >= 30
    meta = json.loads((tmp_path / "d" / "step_data" / "obs" / "zarr.json").read_text())
    assert "trajstore_video" not in meta.get("attributes", {})
    assert verify_store(str(tmp_path / "d"), deep=True).ok


def test_video_segments_kept_in_their_settings_pass_byte_for_byte(tmp_path):
    """``--chunk-rows`` (a relayout keeping every codec) and a copy naming another field keep the
    video field's settings and copy its segments as their bytes: the copy equals the source."""
    source(tmp_path / "s", [9, 12, 7], {"obs": "h264:crf=20:g=4"})
    src_video = tmp_path / "s" / "step_data" / "obs" / "video"
    for name, args in (("rechunk", ["--chunk-rows", "8"]), ("named", ["--compressor", "t=zstd"])):
        out = run_cli("copy", str(tmp_path / "s"), str(tmp_path / name), *args, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["lossy"] == {}  # compared bit for bit
        assert segments(tmp_path / name) == ["0", "9", "21", "index"]
        for seg in ("0", "9", "21"):
            copied = (tmp_path / name / "step_data" / "obs" / "video" / seg).read_bytes()
            assert copied == (src_video / seg).read_bytes()
    meta = json.loads((tmp_path / "named" / "step_data" / "t" / "zarr.json").read_text())
    assert "zstd" in json.dumps(meta["codecs"])


def test_per_frame_to_video_and_grey_stacks(tmp_path):
    """A per-frame JPEG field of (84, 84, 4) stacks becomes an H.264 video field of grey pictures."""
    from test_video_grey import stacks

    space = Dict({"obs": Box(0, 255, (84, 84, 4), np.uint8)})
    allf = stacks(20, (84, 84, 4))
    with TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "s"), compressor={"obs": "png"}) as tb:
        tb.extend({"obs": allf[:8]})
        tb.mark_episode_end()
        tb.extend({"obs": allf[8:]})
    rep = copy_store(str(tmp_path / "s"), str(tmp_path / "d"), compressor={"obs": "h264:crf=16"})
    assert rep["lossy"]["step_data/obs"]["psnr_db"] >= 38
    assert segments(tmp_path / "d") == ["0", "8", "index"]
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "d"), read_only=True) as d:
        assert psnr(d[:]["step_data"]["obs"], allf) >= 38


def test_copies_video_cannot_make_are_refused_and_leave_nothing(tmp_path):
    source(tmp_path / "s", [6, 6])
    with ReplayBuffer.create(SPACE, cache_path=str(tmp_path / "rb")) as rb:
        rb.extend({"obs": frames(5), "t": np.arange(5)})
    cases = [(tmp_path / "rb", tmp_path / "d1", {"obs": "h264"}, "no episodes"),
             (tmp_path / "s", tmp_path / "d2.zip", {"obs": "h264"}, r"\.zip copy cannot hold video"),
             (tmp_path / "s", tmp_path / "d3", {"camera": "h264"}, r"name no field; the fields are"),
             (tmp_path / "s", tmp_path / "d4", {"t": "h264"}, r"uint8 RGB frames")]
    for src, dst, comp, match in cases:
        with pytest.raises(BadOptionError, match=match):
            copy_store(str(src), str(dst), compressor=comp)
        assert not dst.exists()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as s:
        with pytest.raises(BadOptionError, match=r"step_data/obs: a \.zip copy cannot hold video fields \(h264"):
            s.dumps(str(tmp_path / "d5.zip"), compressor={"obs": "h264"})
    assert sorted(os.listdir(tmp_path)) == ["rb", "s"]  # nothing beside the destinations
    out = run_cli("copy", str(tmp_path / "s"), str(tmp_path / "d5"), "--compressor", "obs=h264,obs=av1")
    assert out.returncode == 2 and "names a field twice" in out.stderr
    out = run_cli("copy", str(tmp_path / "s"), str(tmp_path / "d5"), "--compressor", "obs=h264,jpeg")
    assert out.returncode == 2 and "FIELD=CODEC" in out.stderr


def test_copy_to_zip_names_a_per_frame_codec_for_one_field(tmp_path):
    """A .zip copy takes FIELD=CODEC too: the video field as PNG frames, the others as they are."""
    source(tmp_path / "s", [7, 5], {"obs": "h264"})
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as s:
        decoded = s[:]["step_data"]["obs"]
    copy_store(str(tmp_path / "s"), str(tmp_path / "d.zip"), compressor={"obs": "png"})
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "d.zip"), read_only=True) as z:
        assert np.array_equal(z[:]["step_data"]["obs"], decoded)


# -- a copy killed while it transcodes -----------------------------------------------------------------
@pytest.mark.parametrize("src_comp,arg", [(None, "obs=h264:preset=ultrafast"), ({"obs": "h264:preset=ultrafast"},
                                                                                  "obs=png")])
def test_sigkill_during_a_transcoding_copy_leaves_no_partial_destination(tmp_path, src_comp, arg):
    """``trajstore copy --compressor obs=...`` SIGKILLed at several instants after it started its build
    folder: the destination is absent or a whole verified store, the source is intact, and a new
    copy succeeds and removes what the killed one left (as tests/test_cli_shards.py's kill).

    Every copy passes ``--overwrite``: a copy killed after it verified its store and journaled the
    publish, before the rename, is published by the next command's recovery (PublishRecoveredWarning),
    after which a copy without ``--overwrite`` rightly finds the destination taken."""
    lengths = [25] * 40
    source(tmp_path / "s", lengths, src_comp)
    dst = tmp_path / "d"
    absent = 0
    for delay in (0.0, 0.3, 1.0):
        proc = subprocess.Popen([sys.executable, "-m", "trajstore", "copy", str(tmp_path / "s"), str(dst),
                                 "--compressor", arg, "--overwrite"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": ROOT})
        mine = f"-{proc.pid}-"
        try:
            deadline = time.monotonic() + 120
            while not any(p.startswith(".d.trajstore-partial-") and mine in p for p in os.listdir(tmp_path)):
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the copy never started its build folder"
                time.sleep(0.002)
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            assert proc.wait(60) in (-signal.SIGKILL, 0)
        if dst.exists():  # killed after the publish: a whole store
            assert run_cli("verify", "--deep", str(dst)).returncode == 0
            with TrajectoryReplayBuffer.load_from(str(dst), read_only=True) as d:
                assert len(d) == sum(lengths)
            shutil.rmtree(dst)
        else:
            absent += 1
            assert run_cli("info", str(dst)).returncode == 1
    print(f"kills: {absent} before the publish, {3 - absent} after")
    assert absent >= 1, "no kill fell before the publish"
    assert verify_store(str(tmp_path / "s"), deep=True).ok
    out = run_cli("copy", str(tmp_path / "s"), str(dst), "--compressor", arg, "--overwrite", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rows"] == sum(lengths)
    assert [p for p in os.listdir(tmp_path) if p.startswith(".d.")] == []  # the killed copies' folders removed
