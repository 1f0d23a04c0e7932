"""robomimic HDF5 import (issue 14): files laid out as robomimic's datasets (data/demo_<i> with
obs/*, next_obs/*, actions, rewards, dones, states; mask/* splits; env_args), written with h5py;
values, demo order, masks as episode data, bad input refused before writing, a damaged file leaves
nothing behind, and the imported store exported as Diffusion Policy data."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.cli import main  # noqa: E402
from trajstore.errors import BadValueError, DamagedStoreError, NotATrajstoreError  # noqa: E402
from trajstore.interop import export_diffusion_policy, import_robomimic  # noqa: E402
from trajstore.maintenance.combine import filter_store  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.metadata import get_dataset_info  # noqa: E402

LENGTHS = {0: 30, 1: 45, 2: 0, 10: 12, 3: 50}  # written out of order; demo_2 is empty


def write_robomimic(path: Path, lengths: dict[int, int] = LENGTHS, seed: int = 0,
                    compression: str | None = None) -> dict[int, dict[str, np.ndarray]]:
    """A robomimic-layout file (Lift-like keys) and its demos' arrays by index."""
    rng = np.random.default_rng(seed)
    demos: dict[int, dict[str, np.ndarray]] = {}
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["env_args"] = json.dumps({"env_name": "Lift", "type": 1, "env_kwargs": {"control_freq": 20}})
        data.attrs["total"] = sum(lengths.values())
        for i, n in lengths.items():
            arrays = {"obs/robot0_eef_pos": rng.standard_normal((n, 3)),
                      "obs/agentview_image": rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8),
                      "next_obs/robot0_eef_pos": rng.standard_normal((n, 3)),
                      "next_obs/agentview_image": rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8),
                      "actions": rng.uniform(-1, 1, (n, 7)), "rewards": (np.arange(n) == n - 1).astype(np.float64),
                      "dones": (np.arange(n) == n - 1).astype(np.int64) * (i != 1),  # demo_1 ends without done
                      "states": rng.standard_normal((n, 32))}
            g = data.create_group(f"demo_{i}")
            g.attrs["num_samples"] = n
            g.attrs["model_file"] = "<mujoco/>"
            for k, v in arrays.items():
                g.create_dataset(k, data=v, compression=compression, chunks=(max(1, min(n, 500)), *v.shape[1:])
                                 if compression and n else None)
            demos[i] = arrays
        f["mask/train"] = np.array([b"demo_0", b"demo_3", b"demo_10"])
        f["mask/valid"] = np.array([b"demo_1"])
    return demos


def _no_leftovers(parent: Path) -> None:
    assert not [p for p in os.listdir(parent) if "trajstore-partial" in p]


def test_import_demos_in_order_with_masks(tmp_path: Path) -> None:
    demos = write_robomimic(tmp_path / "lift.hdf5")
    order = [0, 1, 3, 10]  # by the demo index, the empty demo_2 skipped
    with import_robomimic(tmp_path / "lift.hdf5", tmp_path / "s") as buf:
        table = buf.episodes()
        assert table["length"].tolist() == [LENGTHS[i] for i in order]
        for eid, i in zip(table["episode_id"].tolist(), order):
            ep = buf.get_episode(eid)
            step, epd = ep["step_data"], ep["episode_data"]
            d = demos[i]
            np.testing.assert_array_equal(step["obs"]["robot0_eef_pos"], d["obs/robot0_eef_pos"])
            np.testing.assert_array_equal(step["obs"]["agentview_image"], d["obs/agentview_image"])
            np.testing.assert_array_equal(step["next_obs"]["agentview_image"], d["next_obs/agentview_image"])
            np.testing.assert_array_equal(step["action"], d["actions"])
            np.testing.assert_array_equal(step["reward"], d["rewards"])
            np.testing.assert_array_equal(step["info"]["states"], d["states"])
            np.testing.assert_array_equal(step["terminated"], d["dones"] != 0)
            # the demo's last step ends it: truncated where dones does not
            assert step["truncated"].tolist() == [False] * (len(d["dones"]) - 1) + [i == 1]
            assert int(epd["demo"][0]) == i and int(epd["length"][0]) == LENGTHS[i]
            assert float(epd["return"][0]) == 1.0 and int(epd["seed"][0]) == -1
            assert bool(epd["mask"]["train"][0]) == (i in (0, 3, 10))
            assert bool(epd["mask"]["valid"][0]) == (i == 1)
        assert buf.step_space["obs"]["agentview_image"].dtype == np.uint8
        info = get_dataset_info(buf)["imported_from"]
        assert info["env_args"]["env_name"] == "Lift" and info["masks"] == ["train", "valid"]
    assert verify_store(tmp_path / "s").ok
    # the mask field selects a split with the --where language
    out = filter_store(tmp_path / "s", tmp_path / "valid", "mask.valid == 1")
    assert out["episodes"] == 1 and out["steps"] == LENGTHS[1]


def test_robomimic_to_diffusion_policy(tmp_path: Path) -> None:
    """An imported robomimic store exports as Diffusion Policy data (a flat Dict obs)."""
    import zarr

    demos = write_robomimic(tmp_path / "lift.hdf5")
    import_robomimic(tmp_path / "lift.hdf5", tmp_path / "s").close()
    out = export_diffusion_policy(tmp_path / "s", tmp_path / "dp.zarr")
    assert out["episodes"] == 4
    root = zarr.open_group(str(tmp_path / "dp.zarr"), mode="r")
    np.testing.assert_array_equal(root["meta/episode_ends"][:], np.cumsum([30, 45, 50, 12]))
    np.testing.assert_array_equal(root["data/robot0_eef_pos"][:30], demos[0]["obs/robot0_eef_pos"])


def _edit(path: Path, change: str) -> None:
    with h5py.File(path, "r+") as f:
        if change == "nodata":
            f.move("data", "demos")
        elif change == "nodones":
            del f["data/demo_3/dones"]
        elif change == "shape":
            del f["data/demo_3/states"]
            f["data/demo_3/states"] = np.zeros((50, 31))
        elif change == "length":
            del f["data/demo_10/rewards"]
            f["data/demo_10/rewards"] = np.zeros(11)
        elif change == "mask":
            del f["mask/valid"]
            f["mask/valid"] = np.zeros(3)


@pytest.mark.parametrize("change, error, words", [
    ("nodata", NotATrajstoreError, ["expected a group 'data'", "['demos', 'mask']"]),
    ("nodones", NotATrajstoreError, ["data/demo_3 has no 'dones'"]),
    ("shape", BadValueError, ["data/demo_3 differs from data/demo_0 at 'states'", "(31,)", "(32,)"]),
    ("length", BadValueError, ["data/demo_10/rewards has shape (11,)", "expected (12, ...)"]),
    ("mask", BadValueError, ["mask/valid is not a 1-D array of demo names"]),
])
def test_bad_input_is_refused_before_writing(tmp_path: Path, change: str, error: type, words: list[str]) -> None:
    write_robomimic(tmp_path / "bad.hdf5")
    _edit(tmp_path / "bad.hdf5", change)
    with pytest.raises(error) as e:
        import_robomimic(tmp_path / "bad.hdf5", tmp_path / "dst")
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not (tmp_path / "dst").exists()
    _no_leftovers(tmp_path)


def test_damaged_demo_leaves_no_partial_store(tmp_path: Path) -> None:
    lengths = {0: 3000, 1: 3000, 2: 3000}
    write_robomimic(tmp_path / "d.hdf5", lengths, compression="gzip")
    with h5py.File(tmp_path / "d.hdf5") as f:
        chunk: Any = f["data/demo_2/actions"].id.get_chunk_info(3)  # the last demo, after two were written
    with open(tmp_path / "d.hdf5", "r+b") as fh:
        fh.seek(chunk.byte_offset)
        fh.write(b"\xff" * chunk.size)
    with pytest.raises(DamagedStoreError, match="data/demo_2/actions: rows 0:3000 cannot be read"):
        import_robomimic(tmp_path / "d.hdf5", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    _no_leftovers(tmp_path)


def test_cli_import_robomimic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The env_name is every demo's task; --stats stores every episode's statistics at import."""
    write_robomimic(tmp_path / "lift.hdf5")
    assert main(["import", "robomimic", str(tmp_path / "lift.hdf5"), str(tmp_path / "s"), "--json", "--stats"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "robomimic" and out["episodes"] == 4 and out["skipped"] == ["demo_2"]
    assert out["steps"] == sum(LENGTHS.values()) and out["task"] == "Lift" and out["stats"] is True
    assert main(["info", str(tmp_path / "s"), "--json"]) == 0
    robot = json.loads(capsys.readouterr().out)["robot"]
    assert robot["tasks"] == 1 and robot["episodes_with_task"] == 4 and robot["stats"]["current"]
    assert robot["stats"]["episodes"] == 4 and "action" in robot["stats"]["fields"]
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as buf:
        assert buf.tasks == ["Lift"] and set(buf.episode_tasks().values()) == {"Lift"}
        stored, exact = buf.stats(fields=["action"]), buf.stats(fields=["action"], exact=True)
    np.testing.assert_allclose(stored["action"]["mean"], exact["action"]["mean"])
    np.testing.assert_array_equal(stored["action"]["max"], exact["action"]["max"])


_KILLED_IMPORT = """
import sys, time
from trajstore import TrajectoryReplayBuffer
from trajstore.interop import import_robomimic
original = TrajectoryReplayBuffer.save_stats
def stored_then_wait(self):  # the statistics and tasks are written: tell the parent, wait to be killed
    n = original(self)
    open(sys.argv[3], "w").close()
    time.sleep(60)
    return n
TrajectoryReplayBuffer.save_stats = stored_then_wait
import_robomimic(sys.argv[1], sys.argv[2], stats=True)
"""


def test_import_killed_after_storing_stats_leaves_no_store(tmp_path: Path) -> None:
    """SIGKILL of an import once it stored the statistics and tasks in its temporary store (before
    its close, verify and rename): nothing at the destination; the import run again gives a store
    whose statistics are current."""
    import signal
    import subprocess
    import sys
    import time

    write_robomimic(tmp_path / "lift.hdf5")
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_IMPORT, str(tmp_path / "lift.hdf5"), str(tmp_path / "dst"),
                              str(ready)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the import child never stored its statistics"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert not (tmp_path / "dst").exists()
    with import_robomimic(tmp_path / "lift.hdf5", tmp_path / "dst", stats=True) as buf:
        assert buf.tasks == ["Lift"] and len(buf.episode_tasks()) == 4
    assert verify_store(tmp_path / "dst").ok
    from trajstore.maintenance.summary import store_info

    stats = store_info(tmp_path / "dst")["robot"]["stats"]
    assert stats["current"] and stats["episodes"] == 4 and "action" in stats["fields"]
    _no_leftovers(tmp_path)
