"""A LeRobot v3.0 dataset written by LeRobot's own writer (tests/data/lerobot_v3, made by
scripts/make_lerobot_fixture.py with ``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` /
``finalize``): imported and opened by trajstore with the exact values, tasks, timestamps and episode
boundaries; exported by trajstore and read back by LeRobot's loader (only where LeRobot imports)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")
pq = pytest.importorskip("pyarrow.parquet")

from lerobot_fixture import (  # noqa: E402
    WRITTEN,
    WRITTEN_CAM,
    WRITTEN_EPISODES,
    WRITTEN_FPS,
    WRITTEN_LENGTH,
    WRITTEN_SIZE,
    WRITTEN_TASKS,
    written_frame,
    written_step,
    written_task,
)

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.interop import export_lerobot, import_lerobot, open_lerobot  # noqa: E402
from trajstore.interop.lerobot_video import episode_frames  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402

ROOT = Path(WRITTEN)
N = WRITTEN_EPISODES * WRITTEN_LENGTH


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255**2 / mse)


def _expected(ep: int) -> dict[str, np.ndarray]:
    steps = [written_step(ep, t) for t in range(WRITTEN_LENGTH)]
    return {"observation.state": np.stack([s for s, _ in steps]), "action": np.stack([a for _, a in steps]),
            "timestamp": (np.arange(WRITTEN_LENGTH) / WRITTEN_FPS).astype(np.float32).astype(np.float64)}


def _mp4_frames(ep: int) -> np.ndarray:
    """Episode ``ep``'s frames as trajstore's own decoder reads them from LeRobot's MP4 (its time range
    from meta/episodes)."""
    eps = pq.read_table(ROOT / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    row = eps[ep]
    key = f"videos/{WRITTEN_CAM}"
    path = ROOT / f"videos/{WRITTEN_CAM}/chunk-{row[key + '/chunk_index']:03d}/file-{row[key + '/file_index']:03d}.mp4"
    with open(path, "rb") as f:
        return episode_frames(f, str(path), row[key + "/from_timestamp"], row[key + "/to_timestamp"], WRITTEN_FPS,
                              WRITTEN_LENGTH, WRITTEN_SIZE)


def test_the_fixture_is_lerobots_own() -> None:
    """The files are what LeRobot's writer leaves (not this project's spec writer): v3.0 info with
    LeRobot's defaults, per-episode stats columns in meta/episodes, the versions that wrote it."""
    info = json.loads((ROOT / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == WRITTEN_FPS
    assert info["total_episodes"] == WRITTEN_EPISODES and info["total_frames"] == N
    assert info["features"][WRITTEN_CAM]["dtype"] == "video"
    assert json.loads((ROOT / "meta/written_by.json").read_text())["lerobot"]
    cols = pq.read_schema(ROOT / "meta/episodes/chunk-000/file-000.parquet").names
    assert "stats/action/mean" in cols and "dataset_from_index" in cols
    assert sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file()) < 300_000


def test_import_exact_values_tasks_timestamps_boundaries(tmp_path: Path) -> None:
    out = import_lerobot(ROOT, tmp_path / "s", save_stats=True)
    assert out["version"] == "v3.0" and out["episodes"] == WRITTEN_EPISODES and out["steps"] == N
    assert out["adopted"] == {WRITTEN_CAM: WRITTEN_EPISODES}  # LeRobot's AV1 packets kept as they are
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as b:
        assert b.fps == float(WRITTEN_FPS) and b.tasks == WRITTEN_TASKS
        assert b.episode_tasks() == {e: written_task(e) for e in range(WRITTEN_EPISODES)}
        eps = b.episodes()
        assert eps["episode_id"].tolist() == list(range(WRITTEN_EPISODES))
        assert eps["start"].tolist() == [e * WRITTEN_LENGTH for e in range(WRITTEN_EPISODES)]
        assert eps["length"].tolist() == [WRITTEN_LENGTH] * WRITTEN_EPISODES
        for e in range(WRITTEN_EPISODES):
            step = b.get_episode(e)["step_data"]
            for k, v in _expected(e).items():
                np.testing.assert_array_equal(step[k], v)
            assert step["task_index"].tolist() == [WRITTEN_TASKS.index(written_task(e))] * WRITTEN_LENGTH
            np.testing.assert_array_equal(step[WRITTEN_CAM], _mp4_frames(e))  # the packets, byte for byte
            want = np.stack([written_frame(e, t) for t in range(WRITTEN_LENGTH)])
            assert _psnr(step[WRITTEN_CAM], want) > 20  # AV1 at crf 30 on 32x48 frames
        # LeRobot's own stats.json against the store's statistics of the same rows
        theirs = json.loads((ROOT / "meta/stats.json").read_text())
        ours = b.stats(fields=["action", "observation.state"])
        for k in ("action", "observation.state"):
            np.testing.assert_allclose(ours[k]["mean"], theirs[k]["mean"], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(ours[k]["min"], theirs[k]["min"])
            np.testing.assert_allclose(ours[k]["max"], theirs[k]["max"])
            assert int(np.asarray(ours[k]["count"]).reshape(-1)[0]) == N
    assert verify_store(tmp_path / "s").ok


def test_open_in_place_windows_at_episode_boundaries(tmp_path: Path) -> None:
    import_lerobot(ROOT, tmp_path / "s")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in ROOT.rglob("*"))
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as a, open_lerobot(ROOT) as b:
        assert len(b) == N and b.tasks == WRITTEN_TASKS and b.fps == float(WRITTEN_FPS)
        for k in a.step_space.keys():
            np.testing.assert_array_equal(a[:]["step_data"][k], b[:]["step_data"][k])
        dt = 1 / WRITTEN_FPS
        deltas = {WRITTEN_CAM: [-dt, 0.0], "observation.state": [-dt, 0.0], "action": [0.0, dt, 2 * dt]}
        last0, first1 = WRITTEN_LENGTH - 1, WRITTEN_LENGTH
        w = b.get_time_windows([last0, first1, first1 + 1], deltas)
        # an episode's first step has no frame before it, its last no action after it: padded, not the neighbour's
        assert w[f"{WRITTEN_CAM}_is_pad"].tolist() == [[False, False], [True, False], [False, False]]
        assert w["action_is_pad"].tolist() == [[False, True, True], [False, False, False], [False, False, False]]
        np.testing.assert_array_equal(w["observation.state"][2], np.stack([written_step(1, t)[0] for t in (0, 1)]))
        np.testing.assert_array_equal(w["action"][1], np.stack([written_step(1, t)[1] for t in (0, 1, 2)]))
        np.testing.assert_array_equal(w["action"][0][0], written_step(0, last0)[1])
        np.testing.assert_array_equal(w[WRITTEN_CAM][2], a[first1 : first1 + 2]["step_data"][WRITTEN_CAM])
    assert sorted((str(p), p.stat().st_mtime_ns) for p in ROOT.rglob("*")) == before


def _lerobot_dataset(root: Path, **kwargs: object) -> object:
    pytest.importorskip("lerobot")
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    return LeRobotDataset("trajstore/readback", root=root, **kwargs)


def test_lerobot_reads_the_fixture_as_trajstore_does() -> None:
    """Where LeRobot imports: its loader and open_lerobot give the same values and windows."""
    dt = 1 / WRITTEN_FPS
    deltas = {WRITTEN_CAM: [-dt, 0.0], "action": [0.0, dt, 2 * dt]}
    ds = _lerobot_dataset(ROOT, delta_timestamps=deltas, video_backend="pyav")
    with open_lerobot(ROOT) as b:
        w = b.get_time_windows([0, WRITTEN_LENGTH - 1, WRITTEN_LENGTH + 5], deltas)
        for j, i in enumerate([0, WRITTEN_LENGTH - 1, WRITTEN_LENGTH + 5]):
            item = ds[i]  # type: ignore[index]
            np.testing.assert_array_equal(item["action"].numpy(), w["action"][j])
            assert item["action_is_pad"].tolist() == w["action_is_pad"][j].tolist()
            assert item[f"{WRITTEN_CAM}_is_pad"].tolist() == w[f"{WRITTEN_CAM}_is_pad"][j].tolist()
            theirs = np.round(item[WRITTEN_CAM].numpy().transpose(0, 2, 3, 1) * 255)
            assert _psnr(theirs, w[WRITTEN_CAM][j]) > 40
            assert item["task"] == written_task(i // WRITTEN_LENGTH)


def test_export_is_read_back_by_lerobot(tmp_path: Path) -> None:
    """Where LeRobot imports: export_lerobot's folder of the imported fixture, read by
    ``LeRobotDataset``: values, tasks, timestamps, episode boundaries, frames within the codec's loss."""
    pytest.importorskip("lerobot")
    import_lerobot(ROOT, tmp_path / "s")
    export_lerobot(tmp_path / "s", tmp_path / "ex")
    with TrajectoryReplayBuffer.load_from(tmp_path / "s", read_only=True) as s:
        frames = s[:]["step_data"][WRITTEN_CAM]
    ds = _lerobot_dataset(tmp_path / "ex", video_backend="pyav")
    assert len(ds) == N and ds.meta.total_episodes == WRITTEN_EPISODES  # type: ignore[arg-type,attr-defined]
    assert list(ds.meta.tasks.index) == WRITTEN_TASKS  # type: ignore[attr-defined]
    for i in range(0, N, 7):
        item = ds[i]  # type: ignore[index]
        ep, t = divmod(i, WRITTEN_LENGTH)
        state, action = written_step(ep, t)
        np.testing.assert_array_equal(item["observation.state"].numpy(), state)
        np.testing.assert_array_equal(item["action"].numpy(), action)
        assert int(item["episode_index"]) == ep and int(item["frame_index"]) == t
        assert float(item["timestamp"]) == pytest.approx(t / WRITTEN_FPS)
        assert item["task"] == written_task(ep)
        frame = np.round(item[WRITTEN_CAM].numpy().transpose(1, 2, 0) * 255)
        assert _psnr(frame, frames[i]) > 30  # the export encodes the frames again (AV1)
