"""``import trajstore`` loads the core only: maintenance, analytics, integrations and the CLI are
imported when first used (issue 12: import cost; scripts/bench_import.py measures it)."""

from __future__ import annotations

import json
import subprocess
import sys

LAZY = ["trajstore.maintenance.verify", "trajstore.maintenance.repair", "trajstore.maintenance.summary", "trajstore.dask", "trajstore.cli",
        "trajstore.torch", "trajstore.sb3", "trajstore.recording", "trajstore.interop", "h5py", "minari", "dask", "torch", "stable_baselines3", "tqdm",
        "matplotlib", "fsspec.implementations.http", "s3fs", "trajstore.ray", "ray"]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_trajstore_loads_no_optional_module() -> None:
    loaded = _modules_after("import trajstore")
    assert not loaded & set(LAZY), sorted(loaded & set(LAZY))


def test_lazy_names_resolve_on_first_use() -> None:
    loaded = _modules_after("import trajstore\nfrom trajstore import verify_store, repair_store\n"
                            "assert callable(verify_store) and callable(repair_store)\n"
                            "assert {'verify_store', 'repair_store'} <= set(dir(trajstore))\n"
                            "from trajstore import *")
    assert {"trajstore.maintenance.verify", "trajstore.maintenance.repair"} <= loaded


def test_unknown_attribute_is_an_attribute_error() -> None:
    import pytest

    import trajstore

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        trajstore.nope  # noqa: B018


def test_first_batches_of_a_fresh_reader_do_not_import_numpy_ma(tmp_path) -> None:
    """A process's first plain ``np.unique`` imports numpy.ma (40-60 ms); the read paths of a fresh
    reader (a DataLoader worker's first batch) use ``trajstore.core.ring.distinct`` instead."""
    import gymnasium as gym
    import numpy as np

    from trajstore import TrajectoryReplayBuffer

    space = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (3,), np.float32), "action": gym.spaces.Discrete(4)})
    path = tmp_path / "t"
    with TrajectoryReplayBuffer.create(space, cache_path=path) as tb:
        ids = np.repeat(np.arange(10), 30)
        tb.extend({"step_data": {"obs": np.zeros((300, 3), np.float32), "action": np.arange(300) % 4},
                   "episode_ids": ids})
    loaded = _modules_after(
        "import numpy as np\nfrom trajstore import TrajectoryReplayBuffer\n"
        f"tb = TrajectoryReplayBuffer.load_from({str(path)!r}, read_only=True)\ng = np.random.default_rng(0)\n"
        "tb.sample(8, rng=g)\ntb.sample_sequences(8, 4, rng=g, within_episode=True)\n"
        "d, m = tb.sample_sequences(8, offsets={'obs': [-1, 0], 'action': range(4)}, rng=g, within_episode=True)\n"
        "assert m['action'].all()")
    assert "numpy.ma" not in loaded
