"""Write tests/data/lerobot_v3 with LeRobot's own writer: the dataset tests/test_interop_lerobot_written.py
reads (the test needs no LeRobot; this script does).

    python -m venv /work/venvs/lerobot
    /work/venvs/lerobot/bin/pip install torch==2.9.1 torchvision==0.24.1 lerobot==0.4.4   # LeRobot pins torch<2.11
    /work/venvs/lerobot/bin/python scripts/make_lerobot_fixture.py            # rewrites tests/data/lerobot_v3

(The tests' LeRobot parts also need trajstore's own dependencies there: ``pip install "zarr>=3.1.5,<4"
numcodecs hypothesis pytest``, run with ``PYTHONPATH=.``.)

3 episodes x 20 frames at 10 fps, one camera ``observation.images.top`` of 32x48 (LeRobot's video
encoding: AV1, libsvtav1), 6-dim float32 ``observation.state`` and ``action``, tasks "pick cube"
(episodes 0 and 2) and "place cube" (episode 1); the values are tests/lerobot_fixture.py's
``written_step`` and ``written_frame``.  ``LeRobotDataset.create`` + ``add_frame`` +
``save_episode`` + ``finalize``, then the folder is read back with ``LeRobotDataset`` as a check.
The versions that wrote it go to ``meta/written_by.json`` (trajstore's reader ignores the file).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lerobot_fixture import (  # noqa: E402
    WRITTEN,
    WRITTEN_CAM,
    WRITTEN_EPISODES,
    WRITTEN_FPS,
    WRITTEN_LENGTH,
    WRITTEN_SIZE,
    written_frame,
    written_step,
    written_task,
)

REPO_ID = "trajstore/written-fixture"


def features() -> dict[str, dict[str, object]]:
    """LeRobot features of the fixture (LeRobot adds timestamp, frame_index, episode_index, index, task_index)."""
    h, w = WRITTEN_SIZE
    return {
        "observation.state": {"dtype": "float32", "shape": (6,), "names": [f"joint{i}" for i in range(6)]},
        "action": {"dtype": "float32", "shape": (6,), "names": [f"joint{i}" for i in range(6)]},
        WRITTEN_CAM: {"dtype": "video", "shape": (h, w, 3), "names": ["height", "width", "channels"]},
    }


def write(root: Path) -> None:
    """Write the dataset at ``root`` (which must not exist) with LeRobot's writer."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset.create(repo_id=REPO_ID, fps=WRITTEN_FPS, root=root, features=features(),
                               robot_type="fixture", use_videos=True)
    for ep in range(WRITTEN_EPISODES):
        for t in range(WRITTEN_LENGTH):
            state, action = written_step(ep, t)
            ds.add_frame({"observation.state": state, "action": action, WRITTEN_CAM: written_frame(ep, t),
                          "task": written_task(ep)})
        ds.save_episode()
    ds.finalize()


def check(root: Path) -> None:
    """Read ``root`` back with LeRobot's loader: every state and action as written."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset(REPO_ID, root=root, video_backend="pyav")  # torchcodec needs FFmpeg's shared libraries
    assert len(ds) == WRITTEN_EPISODES * WRITTEN_LENGTH, len(ds)
    for i in (0, WRITTEN_LENGTH - 1, WRITTEN_LENGTH, len(ds) - 1):
        item = ds[i]
        ep, t = divmod(i, WRITTEN_LENGTH)
        state, action = written_step(ep, t)
        np.testing.assert_array_equal(item["observation.state"].numpy(), state)
        np.testing.assert_array_equal(item["action"].numpy(), action)
        assert item["task"] == written_task(ep), item["task"]
        assert tuple(item[WRITTEN_CAM].shape) == (3, *WRITTEN_SIZE)


def main(argv: list[str] | None = None) -> None:
    """Write the fixture (into a temporary folder renamed into place) and check it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=WRITTEN, help="where (default: tests/data/lerobot_v3)")
    out = Path(ap.parse_args(argv).out).resolve()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    check(tmp)
    pkgs = ("lerobot", "torch", "av", "pyarrow", "datasets", "numpy")
    (tmp / "meta/written_by.json").write_text(json.dumps({p: version(p) for p in pkgs}, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {size} bytes in {sum(1 for p in out.rglob('*') if p.is_file())} files")


if __name__ == "__main__":
    main(sys.argv[1:])
