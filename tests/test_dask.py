"""trajstore.dask: column views as dask arrays, computed by a LocalCluster of worker processes."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

da = pytest.importorskip("dask.array", reason="needs dask[distributed]")
distributed = pytest.importorskip("distributed", reason="needs dask[distributed]")

from trajstore import ReplayBuffer, TrajectoryReplayBuffer  # noqa: E402
from trajstore.dask import to_dask  # noqa: E402

SPACE = gym.spaces.Dict({
    "obs": gym.spaces.Dict({"pos": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                            "img": gym.spaces.Box(0, 255, (4, 4), np.uint8)}),
    "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float64),
})


def _data(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": {"pos": rng.standard_normal((n, 3)).astype(np.float32) * 3 + 1,
                    "img": rng.integers(0, 256, (n, 4, 4)).astype(np.uint8)},
            "reward": rng.standard_normal(n)}


def test_chunks_follow_store_and_ring(tmp_path):
    path = str(tmp_path / "ring")
    data = _data(5000)
    rb = ReplayBuffer.create(SPACE, cache_path=path, capacity=3000, compressor="lz4", chunk_rows=512)
    rb.extend(data)
    assert to_dask(rb.get_column("reward")).shape == (0,)  # nothing committed yet
    rb.flush()
    arr = to_dask(rb.get_column(["obs", "pos"]))
    assert arr.shape == (3000, 3) and arr.dtype == np.float32
    # logical row 0 is absolute row 2000 (physical 2000 % 3000): blocks end at stored chunk edges
    # and at the ring's wrap point
    start, C = 2000, 512
    edges = np.cumsum((0,) + arr.chunks[0])[:-1] + start
    phys = edges % 3000
    assert all(p % C == 0 or p == 0 or e == start for p, e in zip(phys, edges))
    assert all(c <= C for c in arr.chunks[0])
    np.testing.assert_array_equal(arr.compute(scheduler="threads"), data["obs"]["pos"][-3000:])
    nested = to_dask(rb.get_column("obs"))
    assert set(nested) == {"pos", "img"} and nested["img"].shape == (3000, 4, 4)
    np.testing.assert_array_equal(nested["img"][10:20].compute(), data["obs"]["img"][2010:2020])
    with pytest.raises(TypeError, match="column view"):
        to_dask(rb.get_slice(slice(0, 10)).get_column("reward"))
    rb.close()


def test_trajectory_step_columns(tmp_path):
    path = str(tmp_path / "traj")
    buf = TrajectoryReplayBuffer.create(SPACE, cache_path=path)
    data = _data(700)
    for lo in range(0, 700, 100):
        buf.extend({"obs": {k: v[lo : lo + 100] for k, v in data["obs"].items()}, "reward": data["reward"][lo : lo + 100]})
        buf.mark_episode_end()
    buf.flush()
    buf.extend({"obs": {k: v[:5] for k, v in data["obs"].items()}, "reward": data["reward"][:5]})
    assert len(buf) == 705
    assert to_dask(buf.get_column(["step_data", "reward"])).shape == (700,)  # committed rows only
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        arr = to_dask(ro.get_column(["step_data", "reward"]))
        assert float(arr.sum().compute()) == pytest.approx(float(data["reward"].sum()))
    buf.close()


@pytest.mark.slow
def test_field_statistics_on_local_cluster(tmp_path):
    """Per-field statistics computed by a LocalCluster of 3 worker processes, each opening the store."""
    path = str(tmp_path / "big")
    n = 60_000
    data = _data(n, seed=1)
    with TrajectoryReplayBuffer.create(SPACE, cache_path=path, compressor="lz4", chunk_rows=4096) as buf:
        for lo in range(0, n, 1000):
            buf.extend({"obs": {k: v[lo : lo + 1000] for k, v in data["obs"].items()},
                        "reward": data["reward"][lo : lo + 1000]})
            buf.mark_episode_end()
    ro = TrajectoryReplayBuffer.load_from(path, read_only=True)
    pos = to_dask(ro.get_column(["step_data", "obs", "pos"]))
    img = to_dask(ro.get_column(["step_data", "obs", "img"]))
    rew = to_dask(ro.get_column(["step_data", "reward"]))
    assert pos.numblocks[0] == -(-n // 4096)
    with distributed.LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None,
                                  worker_dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        stats = client.compute({
            "pos_mean": pos.mean(axis=0), "pos_std": pos.std(axis=0), "pos_min": pos.min(axis=0),
            "pos_max": pos.max(axis=0), "img_mean": img.astype(np.float64).mean(),
            "reward_mean": rew.mean(), "reward_sum": rew.sum(),
        }, sync=True)
        pids = client.run(lambda: __import__("os").getpid())
        assert len(set(pids.values())) == 3
    p = data["obs"]["pos"]
    np.testing.assert_allclose(stats["pos_mean"], p.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(stats["pos_std"], p.std(axis=0), rtol=1e-4)
    np.testing.assert_array_equal(stats["pos_min"], p.min(axis=0))
    np.testing.assert_array_equal(stats["pos_max"], p.max(axis=0))
    assert stats["img_mean"] == pytest.approx(data["obs"]["img"].mean())
    assert stats["reward_sum"] == pytest.approx(data["reward"].sum())
    ro.close()
