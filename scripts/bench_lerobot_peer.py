"""LeRobot's own loader, timed for scripts/bench_lerobot.py in a child process (its Python may be
another virtual environment's: LeRobot pins its own torch).  Imports no trajstore.

    python scripts/bench_lerobot_peer.py ROOT DELTAS_JSON ANCHORS_NPY [VIDEO_BACKEND]

Prints one line: ``ready {json}`` (versions, the video backend) or ``missing <why>``; then for each
line ``round K`` read from stdin it reads ``LeRobotDataset[i]`` for every anchor ``i`` of
``ANCHORS_NPY[K]`` (as a DataLoader worker does, one window at a time) and prints the seconds taken (or ``error <why>``, and ends);
``quit`` (or the end of stdin) ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> None:
    """Serve rounds until stdin closes."""
    root, deltas, anchors_path = argv[:3]
    backend = argv[3] if len(argv) > 3 else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing is downloaded
    try:
        import numpy as np
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError as e:
        print(f"missing {type(e).__name__}: {e}", flush=True)
        return
    from importlib.metadata import version

    anchors = np.load(anchors_path)
    kwargs = {"video_backend": backend} if backend else {}
    try:
        ds = LeRobotDataset("bench/local", root=root, delta_timestamps=json.loads(deltas), **kwargs)
        ds[int(anchors[0].ravel()[0])]  # opens the files once, as the first window of a worker does
    except Exception as e:  # noqa: BLE001  # reported, not raised: the benchmark goes on without it
        print(f"missing LeRobotDataset failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return
    import torch

    about = {"lerobot": version("lerobot"), "torch": version("torch"), "backend": str(ds.video_backend),
             "torch_threads": torch.get_num_threads()}
    print("ready " + json.dumps(about), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        t = time.perf_counter()
        try:
            for i in anchors[int(cmd[1])].ravel().tolist():
                ds[int(i)]
        except Exception as e:  # noqa: BLE001  # reported to the benchmark, which goes on without LeRobot
            print(f"error {type(e).__name__}: {str(e)[:300]}".replace("\n", " "), flush=True)
            return
        print(f"{time.perf_counter() - t:.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
