"""LeRobot datasets in and out (trajstore.interop.lerobot*): fixtures written per LeRobot's
specification with pyarrow and PyAV (tests/lerobot_fixture.py: any sizes, codecs, file splits and
v2.1), the exact values and files checked, hostile inputs refused naming the file.  A dataset
written by LeRobot's own writer: tests/test_interop_lerobot_written.py; every bad input of issue 32
through both import and open: tests/test_interop_lerobot_bad.py."""

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

pytest.importorskip("av")
pq = pytest.importorskip("pyarrow.parquet")

from lerobot_fixture import TASKS, frames_of, step_values, write_v3, write_v21  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.errors import ForeignFileError, NotATrajstoreError, ReadOnlyError, TimeOrderError  # noqa: E402
from trajstore.interop import export_lerobot, import_lerobot, open_lerobot  # noqa: E402
from trajstore.interop.lerobot_video import episode_frames  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402

LENGTHS = [6, 8, 4]
CAMS = ("observation.images.top", "observation.images.wrist")


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_v3(str(tmp_path_factory.mktemp("lr") / "v3"), LENGTHS, CAMS))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _mp4_frames(root: Path, cam: str, t0: float, t1: float, n: int) -> np.ndarray:
    with open(root / f"videos/{cam}/chunk-000/file-000.mp4", "rb") as f:
        return episode_frames(f, "fixture", t0, t1, 10, n, (48, 64))


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255**2 / mse)


def test_import_v3_exact_values_tasks_and_video_packets_kept(v3: Path, tmp_path: Path) -> None:
    out = import_lerobot(v3, tmp_path / "s", save_stats=True)
    assert out["steps"] == 18 and out["episodes"] == 3 and out["version"] == "v3.0"
    assert out["adopted"] == {c: 3 for c in CAMS} and out["transcoded"] == {c: 0 for c in CAMS}
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as b:
        assert b.fps == 10.0 and b.tasks == TASKS
        assert b.episode_tasks() == {0: "pick cube", 1: "place cube", 2: "pick cube"}
        assert b.episodes()["episode_id"].tolist() == [0, 1, 2]
        start = 0
        for e, n in enumerate(LENGTHS):
            step = b[start : start + n]["step_data"]
            for k, v in step_values(e, n).items():
                np.testing.assert_array_equal(step[k], v.reshape(step[k].shape))
            np.testing.assert_array_equal(step["timestamp"], (np.arange(n) / 10.0).astype(np.float32))
            assert step["task_index"].tolist() == [e % 2] * n
            for cam in CAMS:  # the MP4's packets, byte for byte: the same frames its decoder gives
                ref = _mp4_frames(v3, cam, start / 10, (start + n) / 10, n)
                np.testing.assert_array_equal(step[cam], ref)
                assert _psnr(step[cam], frames_of(e, n)) > 20
            start += n
        assert b.stats(episodes=[1])["action"]["count"] == 8
    assert verify_store(tmp_path / "s").ok


def test_import_episode_not_on_a_keyframe_is_transcoded(tmp_path: Path) -> None:
    root = write_v3(str(tmp_path / "odd"), [3, 5], ("cam",), force_key=False)  # g=2: episode 1 starts at frame 3
    out = import_lerobot(root, tmp_path / "s")
    assert out["adopted"]["cam"] + out["transcoded"]["cam"] == 2 and out["transcoded"]["cam"] >= 1
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as b:
        assert _psnr(b[3:8]["step_data"]["cam"], _mp4_frames(Path(root), "cam", 0.3, 0.8, 5)) > 30


def test_import_h264_and_png(tmp_path: Path) -> None:
    root = write_v3(str(tmp_path / "h"), [4, 6], ("cam",), codec="h264")
    assert import_lerobot(root, tmp_path / "s")["adopted"] == {"cam": 2}
    png = import_lerobot(root, tmp_path / "p", video="png")
    assert png["adopted"] == {"cam": 0}
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as a, \
            TrajectoryReplayBuffer.load_from(tmp_path / "p", read_only=True) as p:
        ref = _mp4_frames(Path(root), "cam", 0.4, 1.0, 6)
        np.testing.assert_array_equal(a[4:10]["step_data"]["cam"], ref)
        np.testing.assert_array_equal(p[4:10]["step_data"]["cam"], ref)  # png: the decoded frames, lossless


def test_import_and_open_episodes_over_several_files(tmp_path: Path) -> None:
    """Episodes spread over two data files and two MP4s per camera (times restart in each)."""
    root = write_v3(str(tmp_path / "two"), [4, 6, 2, 4], ("cam",), files=2)
    assert import_lerobot(root, tmp_path / "s")["adopted"] == {"cam": 4}
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as a, open_lerobot(root) as b:
        start = 0
        for e, n in enumerate([4, 6, 2, 4]):
            np.testing.assert_array_equal(a[start : start + n]["step_data"]["action"], step_values(e, n)["action"])
            assert _psnr(a[start : start + n]["step_data"]["cam"], frames_of(e, n)) > 20
            start += n
        for k in a.step_space.keys():
            np.testing.assert_array_equal(a[:]["step_data"][k], b[:]["step_data"][k])


def test_import_v21(tmp_path: Path) -> None:
    root = write_v21(str(tmp_path / "v21"), [4, 6])
    out = import_lerobot(root, tmp_path / "s")
    assert out["version"] == "v2.1" and out["steps"] == 10 and out["adopted"] == {"observation.images.top": 2}
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as b:
        np.testing.assert_array_equal(b[4:10]["step_data"]["action"], step_values(1, 6)["action"])
        assert b.episode_tasks() == {0: "pick cube", 1: "place cube"}
        assert _psnr(b[4:10]["step_data"]["observation.images.top"], frames_of(1, 6)) > 20


def test_export_files_then_import_round_trip(v3: Path, tmp_path: Path) -> None:
    import_lerobot(v3, tmp_path / "s")
    out = export_lerobot(tmp_path / "s", tmp_path / "ex")
    assert out["episodes"] == 3 and out["steps"] == 18 and out["cameras"] == sorted(CAMS)
    ex = tmp_path / "ex"
    info = json.loads((ex / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10 and info["chunks_size"] == 1000
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert info["total_episodes"] == 3 and info["total_frames"] == 18 and info["splits"] == {"train": "0:3"}
    assert info["features"]["observation.state"] == {"dtype": "float32", "shape": [3], "names": ["0", "1", "2"]}
    assert info["features"]["observation.images.top"]["dtype"] == "video"
    assert info["features"]["observation.images.top"]["shape"] == [48, 64, 3]
    eps = pq.read_table(ex / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["length"] for e in eps] == LENGTHS and [e["dataset_from_index"] for e in eps] == [0, 6, 14]
    assert eps[1]["videos/observation.images.top/from_timestamp"] == pytest.approx(0.6)
    assert eps[1]["videos/observation.images.top/to_timestamp"] == pytest.approx(1.4)
    assert [e["tasks"] for e in eps] == [["pick cube"], ["place cube"], ["pick cube"]]
    tasks = pq.read_table(ex / "meta/tasks.parquet")
    assert tasks.column("task").to_pylist() == TASKS
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]  # pandas' index: the task
    data = pq.read_table(ex / "data/chunk-000/file-000.parquet")
    assert data.column("index").to_pylist() == list(range(18))
    stats = json.loads((ex / "meta/stats.json").read_text())
    assert np.asarray(stats["observation.images.top"]["mean"]).shape == (3, 1, 1)
    assert stats["action"]["count"] == [18]
    import_lerobot(ex, tmp_path / "back")
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as a, \
            TrajectoryReplayBuffer.load_from(tmp_path / "back", read_only=True) as b:
        x, y = a[:]["step_data"], b[:]["step_data"]
        for k in ("observation.state", "action", "next.reward", "timestamp", "task_index"):
            np.testing.assert_array_equal(x[k], y[k])
        for cam in CAMS:
            assert _psnr(x[cam], y[cam]) > 30
        assert b.tasks == a.tasks and b.episode_tasks() == a.episode_tasks() and b.fps == 10.0


def test_open_in_place_equals_import(v3: Path, tmp_path: Path) -> None:
    import_lerobot(v3, tmp_path / "s")
    before = sorted(str(p) for p in v3.rglob("*"))
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as a, open_lerobot(v3) as b:
        assert len(b) == 18 and b.fps == 10.0 and b.tasks == TASKS
        for k in a.step_space.keys():
            np.testing.assert_array_equal(a[:]["step_data"][k], b[:]["step_data"][k])
        w = b.get_time_windows([0, 7], {"observation.images.top": [-0.1, 0.0], "action": [0.0, 0.1, 0.2]})
        assert w["observation.images.top"].shape == (2, 2, 48, 64, 3)
        assert w["observation.images.top_is_pad"].tolist() == [[True, False], [False, False]]
        np.testing.assert_array_equal(w["action"][1], a[7:10]["step_data"]["action"])
        seq = b.sample_time_windows(4, {"action": [0.0, 0.1]}, rng=0)
        assert seq["action"].shape == (4, 2, 2)
        assert b.sample(3)["step_data"]["observation.state"].shape == (3, 3)
        with pytest.raises(ReadOnlyError):
            b.mark_episode_end()
        from torch.utils.data import DataLoader

        from trajstore.torch import TimeWindowDataset

        ds = TimeWindowDataset(b, {"observation.images.top": [-0.1, 0.0], "action": [0.0, 0.1]})
        batch = next(iter(DataLoader(ds, batch_size=4, num_workers=1)))  # the worker reopens it by path
        assert tuple(batch["observation.images.top"].shape) == (4, 2, 48, 64, 3)
        np.testing.assert_array_equal(batch["action"][1].numpy(), a[1:3]["step_data"]["action"])
    assert sorted(str(p) for p in v3.rglob("*")) == before  # nothing written next to the files


def test_bad_inputs_name_the_file_and_write_nothing(v3: Path, tmp_path: Path) -> None:
    d = _copy(v3, tmp_path / "no-info")
    (d / "meta/info.json").unlink()
    with pytest.raises(NotATrajstoreError, match="meta/info.json"):
        import_lerobot(d, tmp_path / "s")
    for template in ("../../{video_key}.mp4", "videos/{video_key.__class__}.mp4", "/etc/{file_index}.mp4"):
        d = _copy(v3, tmp_path / f"t{abs(hash(template))}")
        info = json.loads((d / "meta/info.json").read_text())
        info["video_path"] = template
        (d / "meta/info.json").write_text(json.dumps(info))
        with pytest.raises(ForeignFileError, match="video_path"):
            import_lerobot(d, tmp_path / "s")
    d = _copy(v3, tmp_path / "short")  # the MP4 holds 10 frames; the episodes claim 18
    mp4 = d / "videos/observation.images.top/chunk-000/file-000.mp4"
    write_v3(str(tmp_path / "small"), [6, 4], ("observation.images.top",))
    shutil.copy(tmp_path / "small/videos/observation.images.top/chunk-000/file-000.mp4", mp4)
    with pytest.raises(ForeignFileError, match=r"file-000\.mp4.*shorter"):
        import_lerobot(d, tmp_path / "s")
    d = _copy(v3, tmp_path / "mismatch")  # episode 1 claims 9 rows
    t = pq.read_table(d / "meta/episodes/chunk-000/file-000.parquet")
    t = t.set_column(t.column_names.index("length"), "length", [[6, 9, 4]])
    t = t.set_column(t.column_names.index("dataset_to_index"), "dataset_to_index", [[6, 15, 18]])
    pq.write_table(t, d / "meta/episodes/chunk-000/file-000.parquet")
    with pytest.raises(ForeignFileError, match=r"data/chunk-000/file-000\.parquet.*episode 1"):
        import_lerobot(d, tmp_path / "s")
    d = _copy(v3, tmp_path / "time")
    t = pq.read_table(d / "data/chunk-000/file-000.parquet")
    ts = t.column("timestamp").to_numpy().copy()
    ts[8] = 0.0  # episode 1, step 2 goes back in time
    import pyarrow as pa

    t = t.set_column(t.column_names.index("timestamp"), "timestamp", pa.array(ts))
    pq.write_table(t, d / "data/chunk-000/file-000.parquet")
    with pytest.raises(TimeOrderError, match=r"file-000\.parquet: episode 1"):
        import_lerobot(d, tmp_path / "s")
    with pytest.raises(TimeOrderError):
        open_lerobot(d)
    d = _copy(v3, tmp_path / "link")
    os.symlink("/etc/passwd", d / "meta/extra")
    with pytest.raises(ForeignFileError, match="meta/extra"):
        import_lerobot(d, tmp_path / "s")
    assert not (tmp_path / "s").exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


_KILL_PROGRAM = """
import sys, time
from trajstore.interop import lerobot as lr
episode = lr._Importer.episode
def slow(self, *a, **k):
    episode(self, *a, **k)
    open(sys.argv[3], "w").close()
    time.sleep(60)
lr._Importer.episode = slow
lr.import_lerobot(sys.argv[1], sys.argv[2])
"""


def test_import_killed_midway_leaves_no_store(v3: Path, tmp_path: Path) -> None:
    """SIGKILL of an import after its first episode: no store at the destination, and the import
    run again writes it whole."""
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _KILL_PROGRAM, str(v3), str(tmp_path / "s"), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the import child never wrote its first episode"
        assert [p for p in tmp_path.iterdir() if "partial" in p.name]  # killed mid-way
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert not (tmp_path / "s").exists()
    assert import_lerobot(v3, tmp_path / "s")["episodes"] == 3
    assert verify_store(tmp_path / "s").ok


_EXPORT_PROGRAM = """
import sys
from trajstore.interop import export_lerobot
open(sys.argv[3], "w").close()
export_lerobot(sys.argv[1], sys.argv[2], video="av1", robot_type=sys.argv[4], overwrite=True)
"""


def _encoders_of(parent: int) -> list[int]:
    """Pids of the AV1 encoder children (video_worker.py) whose parent is ``parent``."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"video_worker.py" in cmd:
            out.append(int(name))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_export_killed_at_random_instants_leaves_the_old_export_or_the_new(v3: Path, tmp_path: Path) -> None:
    """SIGKILL of ``export_lerobot(..., overwrite=True)`` (AV1: its encoder child running) at random
    instants: the destination is always a whole export, the old one or the new one, that imports
    back; the killed export's encoder child leaves on its own; the next export completes and leaves
    no partial folder."""
    import_lerobot(v3, tmp_path / "s")
    dst = tmp_path / "ex"
    export_lerobot(tmp_path / "s", dst, video="h264", robot_type="old")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    rng = np.random.default_rng(6)
    took, seen, killed, before, orphans = None, {"old": 0, "new": 0}, 0, "old", 0
    for r in range(8):
        ready = tmp_path / f"ready{r}"
        child = subprocess.Popen([sys.executable, "-c", _EXPORT_PROGRAM, str(tmp_path / "s"), str(dst), str(ready),
                                  f"r{r}"], env=env)
        encoders: set[int] = set()
        try:
            deadline = time.monotonic() + 120
            while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            if took is None:  # the first round runs to its end: how long an export takes
                child.wait(120)
                took = time.monotonic() - t0
            stop = t0 + rng.uniform(0.1, 1.0) * took
            while time.monotonic() < stop and child.poll() is None:
                encoders.update(_encoders_of(child.pid))
                time.sleep(0.005)
            was_killed = child.poll() is None
            killed += was_killed
            orphans += was_killed and bool(encoders)  # an encoder child was running when its export died
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            child.kill()
            child.wait()
        deadline = time.monotonic() + 30
        while [p for p in encoders if os.path.exists(f"/proc/{p}")] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in encoders if os.path.exists(f"/proc/{p}")], "an encoder outlived its killed export"
        now = json.loads((dst / "meta/info.json").read_text())["robot_type"]
        assert now in (before, f"r{r}"), (now, before, r)
        seen["old" if now == before else "new"] += 1
        before = now
        back = import_lerobot(dst, tmp_path / f"back{r}")
        assert back["episodes"] == 3 and back["steps"] == 18
        shutil.rmtree(tmp_path / f"back{r}")
    assert killed >= 3 and seen["old"] and seen["new"] and orphans, (killed, seen, orphans)
    export_lerobot(tmp_path / "s", dst, video="av1", robot_type="again", overwrite=True)
    assert json.loads((dst / "meta/info.json").read_text())["robot_type"] == "again"
    assert not [p.name for p in tmp_path.iterdir() if "partial" in p.name or ".trajstore-" in p.name]


def test_cli_import_and_export(v3: Path, tmp_path: Path) -> None:
    run = [sys.executable, "-m", "trajstore"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    got = subprocess.run(run + ["import", "lerobot", str(v3), str(tmp_path / "s"), "--json"], capture_output=True,
                         text=True, env=env)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["episodes"] == 3
    got = subprocess.run(run + ["export", "lerobot", str(tmp_path / "s"), str(tmp_path / "ex"), "--video", "h264",
                                "--json"], capture_output=True, text=True, env=env)
    assert got.returncode == 0, got.stderr
    info = json.loads((tmp_path / "ex/meta/info.json").read_text())
    assert info["features"]["observation.images.top"]["info"]["video.codec"] == "h264"
    got = subprocess.run(run + ["import", "d4rl", str(v3), str(tmp_path / "x"), "--video", "png"],
                         capture_output=True, text=True, env=env)
    assert got.returncode == 2 and "lerobot imports only" in got.stderr


def test_import_and_open_through_fsspec(v3: Path, tmp_path: Path) -> None:
    """A dataset behind fsspec (its in-memory filesystem): the same store as from the folder."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    base = f"/lerobot-{uuid.uuid4().hex}"
    for p in v3.rglob("*"):
        if p.is_file():
            fs.pipe(f"{base}/{p.relative_to(v3).as_posix()}", p.read_bytes())
    try:
        out = import_lerobot(f"memory://{base}", tmp_path / "s")
        assert out["adopted"] == {c: 3 for c in CAMS}
        import_lerobot(v3, tmp_path / "local")
        with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as a, \
                TrajectoryReplayBuffer.load_from(tmp_path / "local", read_only=True) as b, \
                open_lerobot(f"memory://{base}") as c:
            for k in a.step_space.keys():
                np.testing.assert_array_equal(a[:]["step_data"][k], b[:]["step_data"][k])
                np.testing.assert_array_equal(c[:]["step_data"][k], b[:]["step_data"][k])
        with pytest.raises(NotATrajstoreError, match="meta/info.json"):
            fs.rm(f"{base}/meta/info.json")
            import_lerobot(f"memory://{base}", tmp_path / "t")
    finally:
        fs.rm(base, recursive=True)


def test_export_refuses_timestamps_off_the_frame_grid(tmp_path: Path) -> None:
    """With cameras, LeRobot finds a frame's picture at its timestamp: one off frame_index / fps
    would show another picture, so the export refuses it and writes nothing."""
    from gymnasium.spaces import Box, Dict

    from trajstore.errors import BadValueError

    space = Dict({"timestamp": Box(0, np.inf, (), np.float64), "cam": Box(0, 255, (16, 16, 3), np.uint8)})
    with TrajectoryReplayBuffer.create(space, cache_path=tmp_path / "s") as b:
        b.extend({"timestamp": np.array([0.0, 0.1, 0.25]), "cam": np.zeros((3, 16, 16, 3), np.uint8)})
    with pytest.raises(BadValueError, match="frame 2: timestamp 0.25"):
        export_lerobot(tmp_path / "s", tmp_path / "ex", fps=10)
    assert not (tmp_path / "ex").exists()
    with pytest.raises(BadValueError):
        export_lerobot(tmp_path / "s", tmp_path / "ex", fps=8)
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
