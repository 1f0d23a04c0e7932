"""Video fields (issue 31 point 3): a step field kept as one H.264 / AV1 stream per episode.

Real stores on disk, real PyAV encoders and decoders (FFmpeg's libx264, libsvtav1, libdav1d), a
real writer process killed with SIGKILL at several instants, damaged segment and index bytes
written into a real store, and a fresh process where PyAV cannot be imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import BadOptionError, DamagedStoreError, MissingDependencyError
from trajstore.maintenance.verify import verify_store

pytest.importorskip("av")

ROOT = str(Path(__file__).resolve().parents[1])
H, W = 48, 64
SPACE = Dict({"obs": Box(0, 255, (H, W, 3), np.uint8), "t": Box(0, 2**62, (), np.int64)})


def frames(n: int, seed: int = 0) -> np.ndarray:
    """``n`` smooth (H, W, 3) uint8 frames drifting over time, as a camera sees a scene move."""
    y, x = np.mgrid[0:H, 0:W].astype(np.float64)
    rng = np.random.default_rng(seed)
    fx, fy = rng.uniform(5, 9, 2)
    out = np.empty((n, H, W, 3), np.uint8)
    for i in range(n):
        out[i] = np.stack([128 + 60 * np.sin((x + 2 * i + 5 * c + seed) / fx) + 50 * np.cos((y - i) / fy)
                           for c in range(3)], -1).clip(0, 255).astype(np.uint8)
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def record(path: Path, lengths: list[int], compressor: str = "h264:crf=18:g=4", **kw) -> np.ndarray:
    """A store of episodes of ``lengths`` frames (step by step, then an episode end); all frames."""
    allf = np.concatenate([frames(n, seed=e) for e, n in enumerate(lengths)])
    t = 0
    with TrajectoryReplayBuffer.create(SPACE, cache_path=str(path), compressor={"obs": compressor}, **kw) as tb:
        for n in lengths:
            for _ in range(n):
                tb.append({"obs": allf[t], "t": np.int64(t)})
                t += 1
            tb.mark_episode_end()
    return allf


@pytest.mark.parametrize("compressor,min_db", [("h264:crf=18:g=4", 35), ("av1", 30), ("lerobot", 30),
                                               ("h264:crf=10:g=3:pix_fmt=yuv444p:preset=ultrafast", 40)])
def test_round_trip_within_a_psnr_bound_one_stream_per_episode(tmp_path, compressor, min_db):
    allf = record(tmp_path / "s", [12, 9, 15], compressor)
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert len(ro) == 36
        got = ro[:]["step_data"]
        assert np.array_equal(got["t"], np.arange(36))
        assert got["obs"].shape == allf.shape and got["obs"].dtype == np.uint8
        assert psnr(got["obs"], allf) >= min_db
    video = tmp_path / "s" / "step_data" / "obs" / "video"
    assert sorted(os.listdir(video)) == ["0", "12", "21", "index"]  # one segment per episode
    attrs = json.loads((tmp_path / "s" / "step_data" / "obs" / "zarr.json").read_text())["attributes"]
    assert attrs["trajstore_video"]["codec"] == ("h264" if compressor.startswith("h264") else "av1")
    if compressor == "lerobot":
        assert attrs["trajstore_video"] | {"preset": "10"} == {"codec": "av1", "crf": 30, "gop": 2,
                                                                "pix_fmt": "yuv420p", "preset": "10"}
    assert not list((tmp_path / "s").rglob("obs/c"))  # no zarr chunks: the frames are in the segments


def test_random_frames_equal_sequential_decode_and_windows_decode_each_gop_once(tmp_path):
    record(tmp_path / "s", [17, 11, 20])
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        seq = ro[:]["step_data"]["obs"]
        rng = np.random.default_rng(1)
        idx = rng.permutation(48)
        assert np.array_equal(ro[idx]["step_data"]["obs"], seq[idx])
        for i in (0, 3, 4, 16, 17, 30, 47):  # keyframes, frames after them, episode firsts and lasts
            assert np.array_equal(ro[i]["step_data"]["obs"], seq[i])
        anchors = np.array([5, 17, 30, 47])
        data, valid = ro.get_sequences(anchors, list(range(-4, 4)))
        rows = np.clip(anchors[:, None] + np.arange(-4, 4), 0, 47)
        w = data["step_data"]["obs"]
        assert w.shape == (4, 8, H, W, 3)
        assert np.array_equal(w[valid], seq[rows][valid])
        data, _ = ro.sample_sequences(6, 5, rng=0, within_episode=True)
        t = data["step_data"]["t"]
        assert np.array_equal(data["step_data"]["obs"], seq[t])
        batch = ro.sample(16, rng=np.random.default_rng(2))
        assert np.array_equal(batch["step_data"]["obs"], seq[batch["step_data"]["t"]])
        view = ro.get_slice(np.arange(10, 30))
        assert np.array_equal(view[:]["step_data"]["obs"], seq[10:30])


def test_torch_dataloader_workers_read_video_frames(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from trajstore.torch.datasets import TransitionDataset

    record(tmp_path / "s", [10, 14])
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        seq = ro[:]["step_data"]["obs"]
    ds = TransitionDataset(str(tmp_path / "s"), ["obs", "t"])
    seen = 0
    for batch in DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork"):
        assert torch.equal(batch["obs"], torch.from_numpy(seq[batch["t"].numpy()]))
        seen += len(batch["t"])
    assert seen == 24


def test_a_timed_commit_counts_only_ended_episodes_and_close_seals_the_last(tmp_path):
    allf = frames(30)
    with TrajectoryReplayBuffer.create(SPACE, cache_path=str(tmp_path / "s"), compressor={"obs": "h264"},
                                       commit_interval=0) as tb:
        tb.extend({"obs": allf[:12], "t": np.arange(12)})
        tb.mark_episode_end()
        tb.extend({"obs": allf[12:20], "t": np.arange(12, 20)})  # the timed commit: episode 2 is held
        with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
            assert len(ro) == 12
        assert np.array_equal(tb[12:20]["step_data"]["obs"], allf[12:20])  # the writer reads what it holds
        tb.extend({"step_data": {"obs": allf[20:30], "t": np.arange(20, 30)},
                   "episode_ids": np.full(10, 7)})  # an explicit new id ends episode 2
        with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
            assert len(ro) == 20
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert len(ro) == 30 and psnr(ro[:]["step_data"]["obs"], allf) > 30
    assert sorted(os.listdir(tmp_path / "s" / "step_data" / "obs" / "video")) == ["0", "12", "20", "index"]
    assert verify_store(str(tmp_path / "s"), deep=True).ok


def test_refused_where_there_are_no_episodes_or_rows_change(tmp_path):
    with pytest.raises(BadOptionError, match="ReplayBuffer has no episodes"):
        ReplayBuffer.create(SPACE, cache_path=str(tmp_path / "r"), compressor={"obs": "h264"})
    with pytest.raises(BadOptionError, match="ring"):
        ReplayBuffer.create(SPACE, cache_path=str(tmp_path / "r2"), capacity=100, compressor={"obs": "h264"})
    with pytest.raises(BadOptionError, match="ring"):
        TrajectoryReplayBuffer.create(SPACE, cache_path=str(tmp_path / "t"), step_data_capacity=100,
                                      compressor={"obs": "av1"})
    for bad, match in [("h264:crf=99", "crf"), ("h264:q=3", "video setting"), ("av1:pix_fmt=yuv444p", "pixel"),
                       ("h264:g=0", "keyframe"), ("av1:preset=zzz", r"av1 preset must be one of \['0'"),
                       ("av1:preset=14", "av1 preset"), ("h264:preset=quick", r"h264 preset must be one of \['ultrafast'")]:
        with pytest.raises(BadOptionError, match=match):
            TrajectoryReplayBuffer.create(SPACE, cache_path=str(tmp_path / "b"), compressor={"obs": bad})
    for shape, dtype in [((47, 64, 3), np.uint8), ((48, 64, 17), np.uint8), ((48, 64, 3), np.float32)]:
        with pytest.raises(BadOptionError, match=r"uint8 RGB frames \(H, W, 3\)"):
            TrajectoryReplayBuffer.create(Dict({"obs": Box(0, 255, shape, dtype)}), cache_path=str(tmp_path / "c"),
                                          compressor={"obs": "h264"})
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    record(tmp_path / "s", [6, 6])
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s")) as tb:
        with pytest.raises(BadOptionError, match="written once, in order"):
            tb.set_at(2, {"obs": np.zeros((H, W, 3), np.uint8), "t": np.int64(0)})
    assert verify_store(str(tmp_path / "s"), deep=True).ok


def _damage(store: Path, what: str) -> None:
    video = store / "step_data" / "obs" / "video"
    seg = video / "9"
    if what == "packets":
        b = bytearray(seg.read_bytes())
        b[8:200] = bytes(192)
        seg.write_bytes(bytes(b))
    elif what == "short":
        seg.write_bytes(seg.read_bytes()[:-50])
    elif what == "missing":
        seg.unlink()
    elif what == "bigger-frames":  # a well-formed segment whose stream announces 96x128 frames
        from trajstore.images import VideoCodec
        from trajstore.storage.fields.video import write_segment

        big = np.random.default_rng(0).integers(0, 255, (12, 96, 128, 3), dtype=np.uint8)
        seg.write_bytes(write_segment(*VideoCodec("h264", gop=4).encode(big)))
    elif what == "segment-link":  # the same bytes, outside the store, through a link: never followed
        outside = store.parent / "outside-segment"
        outside.write_bytes(seg.read_bytes())
        seg.unlink()
        seg.symlink_to(outside)
    elif what == "index-huge-count":  # an index announcing 2**60 bounds: refused before any allocation
        b = bytearray((video / "index").read_bytes())
        b[8:16] = (2**60).to_bytes(8, "little")
        (video / "index").write_bytes(bytes(b))
    elif what == "index-crc":
        b = bytearray((video / "index").read_bytes())
        b[20] ^= 1
        (video / "index").write_bytes(bytes(b))
    else:  # an index that disagrees with the segments (a valid index: other bounds)
        from trajstore.storage.fields.video import write_index

        (video / "index").write_bytes(write_index([0, 9, 16, 21]))


@pytest.mark.parametrize("what", ["packets", "short", "missing", "bigger-frames", "segment-link", "index-huge-count",
                                  "index-crc", "index-disagrees"])
def test_damaged_stream_or_index_raises_naming_field_and_row(tmp_path, what):
    record(tmp_path / "s", [9, 12])
    _damage(tmp_path / "s", what)
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        if not what.startswith("index"):  # the first episode's segment is intact
            assert np.array_equal(ro[:9]["step_data"]["t"], np.arange(9))
        with pytest.raises(DamagedStoreError, match=r"step_data/obs: .*row"):
            ro[np.arange(21)]
    report = verify_store(str(tmp_path / "s"), deep=True)
    assert not report.ok and "step_data/obs" in str(report)


def test_missing_pyav_names_the_video_extra(tmp_path):
    record(tmp_path / "s", [5])
    code = ("import sys; sys.modules['av'] = None  # as if PyAV were not installed\n"
            "import numpy as np\n"
            "from gymnasium.spaces import Box, Dict\n"
            "from trajstore import TrajectoryReplayBuffer\n"
            "from trajstore.errors import MissingDependencyError\n"
            "try:\n"
            f"    TrajectoryReplayBuffer.create(Dict({{'o': Box(0, 255, (8, 8, 3), np.uint8)}}),\n"
            f"                                  cache_path={str(tmp_path / 'n')!r}, compressor={{'o': 'av1'}})\n"
            "except MissingDependencyError as e:\n"
            "    print('CREATE', e)\n"
            f"rb = TrajectoryReplayBuffer.load_from({str(tmp_path / 's')!r}, read_only=True)\n"
            "print('LEN', len(rb))\n"
            "try:\n"
            "    rb[0]['step_data']['obs']\n"
            "except MissingDependencyError as e:\n"
            "    print('READ', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert "CREATE" in out and "READ" in out and "LEN 5" in out, out
    assert out.count("pip install 'trajstore[video]'") == 2, out
    assert issubclass(MissingDependencyError, ImportError)


# -- crash safety ---------------------------------------------------------------------------------
_WRITER = """
import os, sys, numpy as np
sys.path.insert(0, {tests!r})
from test_video_fields import frames
from trajstore import TrajectoryReplayBuffer
tb = TrajectoryReplayBuffer.load_from({store!r}, commit_interval=0.05)
log = os.open({log!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
imgs = frames(64)
t = len(tb)
open({ready!r}, "w").close()
while True:
    for _ in range(3 + t % 7):
        tb.append({{"obs": imgs[t % 64], "t": np.int64(t)}})
        t += 1
    tb.mark_episode_end()
    if t % 3 == 0:
        tb.flush()
        os.write(log, f"{{t}}\\n".encode())
"""


def test_sigkill_during_video_episode_writes_leaves_the_last_commit(tmp_path):
    store, log, ready = tmp_path / "s", tmp_path / "log", tmp_path / "ready"
    with TrajectoryReplayBuffer.create(SPACE, cache_path=str(store), compressor={"obs": "h264:g=3"}):
        pass
    imgs = frames(64)
    for delay in (0.05, 0.3, 0.7):  # several kill instants
        ready.unlink(missing_ok=True)
        code = _WRITER.format(tests=str(Path(__file__).parent), store=str(store), log=str(log), ready=str(ready))
        p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT})
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(delay)
            assert p.poll() is None, "the writer died before it was killed"
            p.send_signal(signal.SIGKILL)
        finally:
            p.kill()
            p.wait(30)
        assert p.returncode == -signal.SIGKILL
        flushed = max([int(x) for x in log.read_text().split("\n")[:-1] if x.strip()] or [0]) if log.exists() else 0
        with TrajectoryReplayBuffer.load_from(str(store), read_only=True) as ro:
            n = len(ro)
            assert n >= flushed, f"rows lost: {n} in the store, {flushed} committed before the kill"
            got = ro[:]["step_data"]
            assert np.array_equal(got["t"], np.arange(n))
            assert psnr(got["obs"], imgs[np.arange(n) % 64]) > 30
        report = verify_store(str(store), deep=True)
        assert report.ok, report
    assert n > 0


def test_cli_show_and_verify_name_the_video_field(tmp_path):
    record(tmp_path / "s", [8, 8], "av1:crf=35")
    out = subprocess.run([sys.executable, "-m", "trajstore", "info", str(tmp_path / "s")], capture_output=True,
                         text=True, timeout=120, check=True, env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert "video av1:crf=35:g=2" in out, out
    out = subprocess.run([sys.executable, "-m", "trajstore", "verify", "--deep", str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr


def test_bench_video_quick_returns_its_markdown_section():
    """scripts/bench_video.py --quick (timings are printed by the script, never asserted here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_video", Path(ROOT) / "scripts" / "bench_video.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.main(["--quick", "--calls", "2", "--length", "64", "--stores", "raw,jpeg:90,h264,av1 (lerobot)"])
    assert text.startswith("## Video (scripts/bench_video.py)")
    for name in ("| raw |", "| jpeg:90 |", "| h264 |", "| av1 (lerobot) |"):
        assert name in text, text


def test_filter_combine_and_copy_keep_video_segments_byte_for_byte(tmp_path):
    from trajstore import combine
    from trajstore.maintenance.combine import filter_store

    record(tmp_path / "s", [9, 12, 7])
    src_video = tmp_path / "s" / "step_data" / "obs" / "video"
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        seq = ro[:]["step_data"]["obs"]
    filter_store(str(tmp_path / "s"), str(tmp_path / "f"), "length < 10")  # episodes 0 and 2 (rows 0..8, 21..27)
    video = tmp_path / "f" / "step_data" / "obs" / "video"
    assert sorted(os.listdir(video)) == ["0", "9", "index"]
    assert (video / "0").read_bytes() == (src_video / "0").read_bytes()
    assert (video / "9").read_bytes() == (src_video / "21").read_bytes()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "f"), read_only=True) as ro:
        assert np.array_equal(ro[:]["step_data"]["obs"], np.concatenate([seq[:9], seq[21:]]))
    combine([str(tmp_path / "s"), str(tmp_path / "f")], str(tmp_path / "c"))
    video = tmp_path / "c" / "step_data" / "obs" / "video"
    assert sorted(os.listdir(video), key=lambda k: (len(k), k)) == ["0", "9", "21", "28", "37", "index"]
    assert (video / "37").read_bytes() == (src_video / "21").read_bytes()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "c"), read_only=True) as ro:
        assert np.array_equal(ro[28:]["step_data"]["obs"], np.concatenate([seq[:9], seq[21:]]))
    record(tmp_path / "other", [5], "h264:crf=30")
    with pytest.raises(BadOptionError, match="video"):
        combine([str(tmp_path / "s"), str(tmp_path / "other")], str(tmp_path / "c2"))
    assert verify_store(str(tmp_path / "c"), deep=True).ok


def test_clear_then_record_again_and_repair_removes_stale_segments(tmp_path):
    from trajstore import repair_store

    allf = record(tmp_path / "s", [10, 12])
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s")) as tb:
        tb.clear()
        tb.extend({"obs": allf[10:], "t": np.arange(12)})
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert len(ro) == 12 and psnr(ro[:]["step_data"]["obs"], allf[10:]) > 35
    report = verify_store(str(tmp_path / "s"), deep=True)
    assert report.ok and [k for k, _ in report.removable] == ["step_data/obs/video/10"]
    repair_store(str(tmp_path / "s"))
    assert sorted(os.listdir(tmp_path / "s" / "step_data" / "obs" / "video")) == ["0", "index"]
    assert verify_store(str(tmp_path / "s"), deep=True).ok


@pytest.mark.parametrize("compressor", ["h264", "av1"])
def test_frames_whose_size_is_no_multiple_of_the_codec_blocks(tmp_path, compressor):
    """50x70: H.264 codes 64x80 (16-pixel macroblocks), AV1 pads to 8; the frames read back 50x70."""
    space = Dict({"cam": Box(0, 255, (50, 70, 3), np.uint8)})
    y, x = np.mgrid[0:50, 0:70]
    f = np.stack([np.stack([(x * 3 + i * 4) % 256, (y * 4) % 256, (x + y + i) % 256], -1) for i in range(9)])
    f = f.astype(np.uint8)
    with TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "s"), compressor={"cam": compressor}) as tb:
        tb.extend({"cam": f})
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        got = ro[np.array([8, 0, 5])]["step_data"]["cam"]
        assert got.shape == (3, 50, 70, 3) and psnr(got, f[[8, 0, 5]]) > 28


def test_a_long_episode_is_cut_into_bounded_segments(tmp_path):
    """An episode longer than MAX_RUN_ROWS is held at most 2 x MAX_RUN_ROWS frames at a time, even
    without a commit, and reads back across its segments."""
    from trajstore.storage.fields.video import MAX_RUN_ROWS, read_index

    n = 2 * MAX_RUN_ROWS + 52
    space = Dict({"cam": Box(0, 255, (16, 16, 3), np.uint8)})
    f = np.zeros((n, 16, 16, 3), np.uint8)
    f[:, :, :, 0] = (np.arange(n) % 200)[:, None, None]
    with TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "s"), commit_interval=3600,
                                       compressor={"cam": "h264:g=16:preset=ultrafast"}) as tb:
        for lo in range(0, n, 100):
            tb.extend({"cam": f[lo : lo + 100]})
    bounds = read_index((tmp_path / "s" / "step_data" / "cam" / "video" / "index").read_bytes(), n)
    assert bounds.tolist() == [0, MAX_RUN_ROWS, 2 * MAX_RUN_ROWS, n]
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        idx = np.array([0, MAX_RUN_ROWS - 1, MAX_RUN_ROWS, n - 1, 1500])
        got = ro[idx]["step_data"]["cam"]
        assert np.abs(got[..., 0].astype(int) - f[idx, :, :, 0]).max() <= 3


class _Camera(gymnasium.Env):
    """A gymnasium env whose observation is a camera frame of a moving square (episodes of 11 steps)."""

    observation_space = Box(0, 255, (H, W, 3), np.uint8)
    action_space = Box(-1, 1, (2,), np.float32)

    def __init__(self) -> None:
        self.t = 0

    def _frame(self) -> np.ndarray:
        f = frames(1, seed=self.t)[0]
        f[10:20, self.t * 4 : self.t * 4 + 10] = (250, 20, 20)
        return f

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._frame(), {}

    def step(self, action):
        self.t += 1
        return self._frame(), 1.0, self.t >= 11, False, {}


def test_recorder_writes_each_episode_as_one_segment(tmp_path):
    from trajstore.recording import RecordEpisodes

    env = RecordEpisodes(_Camera(), cache_path=str(tmp_path / "s"), record_next_obs=True,
                         compressor={"obs": "h264:crf=18", "next_obs": "h264:crf=18"})
    for ep in range(3):
        obs, _ = env.reset(seed=ep)
        done = False
        while not done:
            obs, _r, term, trunc, _ = env.step(env.action_space.sample())
            done = term or trunc
    env.reset()
    env.buffer.close()
    for field in ("obs", "next_obs"):
        assert sorted(os.listdir(tmp_path / "s" / "step_data" / field / "video"), key=lambda k: (len(k), k)) == [
            "0", "11", "22", "index"]
    env2 = _Camera()
    expect = [env2.reset()[0]] + [env2.step(None)[0] for _ in range(11)]
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        got = ro[11:22]["step_data"]
        assert psnr(got["obs"], np.stack(expect[:11])) > 30 and psnr(got["next_obs"], np.stack(expect[1:])) > 30
    assert verify_store(str(tmp_path / "s"), deep=True).ok
