"""Sharded datasets read by the torch datasets (DataLoader workers) and by dask (a
distributed.LocalCluster of worker processes): issue 17."""

from __future__ import annotations

import _shard_workers as SW
import numpy as np
import pytest
from gymnasium.spaces import Box

from trajstore.errors import BadArgumentError
from trajstore.shards import create_shard, open_sharded
from trajstore.shards.rows import EPISODE_STRIDE

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from trajstore.torch import SequenceDataset, TransitionDataset  # noqa: E402

SPEC = {"b": (1, 9), "a": (0, 7), "c": (2, 11)}  # shard name -> (writer, episodes)


@pytest.fixture
def root(tmp_path):
    path = str(tmp_path / "ds")
    for name, (w, n) in SPEC.items():
        buf = create_shard(path, SW.SPACE, shard=name, episode_data_instance_space=SW.EPISODE_SPACE, chunk_rows=16)
        for e in range(n):
            buf.extend(SW.episode_rows(w, e))
            buf.set_current_episode_data({"ret": np.float64(w * 1000 + e)})
            buf.mark_episode_end()
        buf.close()
    return path


def _model():
    return np.concatenate([SW.episode_rows(SPEC[n][0], e)["obs"] for n in sorted(SPEC) for e in range(SPEC[n][1])])


def test_transition_dataset_workers(root):
    ds = TransitionDataset(root, ["obs", "episode_data/ret"], episode_ids=True)
    model = _model()
    assert len(ds) == len(model)
    batches = list(DataLoader(ds, batch_size=32, num_workers=2))
    obs = np.concatenate([b["obs"].numpy() for b in batches])
    np.testing.assert_array_equal(obs, model)
    ret = np.concatenate([b["episode_data/ret"].numpy() for b in batches])
    np.testing.assert_array_equal(ret, model[:, 0] * 1000 + model[:, 1])
    ids = np.concatenate([b["episode_id"].numpy() for b in batches])
    shard_pos = {"a": 0, "b": 1, "c": 2}
    writer_shard = {w: shard_pos[n] for n, (w, _) in SPEC.items()}
    np.testing.assert_array_equal(ids // EPISODE_STRIDE, [writer_shard[int(w)] for w in model[:, 0]])
    np.testing.assert_array_equal(ids % EPISODE_STRIDE, model[:, 1])
    # an open view works too, in this process
    view = open_sharded(root)
    assert len(TransitionDataset(view, "obs")) == len(model)


def test_sequence_dataset_workers(root):
    ds = SequenceDataset(root, 4, ["obs"], within_episode=True)
    lengths = [SW.episode_length(w, e) for n in sorted(SPEC) for w, m in [SPEC[n]] for e in range(m)]
    assert len(ds) == sum(max(0, L - 3) for L in lengths)  # windows inside one episode of one shard
    batches = list(DataLoader(ds, batch_size=64, num_workers=2, shuffle=True,
                              generator=torch.Generator().manual_seed(0)))
    o = np.concatenate([b["obs"].numpy() for b in batches])
    assert len(o) == len(ds) and np.concatenate([b["mask"].numpy() for b in batches]).all()
    assert (np.diff(o[:, :, 2], axis=1) == 1).all() and (o[:, :, :2] == o[:, :1, :2]).all()
    edge = SequenceDataset(root, 3, ["obs"])  # windows at shard ends are cut by the mask
    last_a = sum(SW.episode_length(0, e) for e in range(SPEC["a"][1])) - 1
    item = edge[last_a]
    assert item["mask"].tolist() == [True, False, False] and (item["obs"][:, 0] == 0).all()


def test_sequence_dataset_refuses_replay_shards(tmp_path):
    path = str(tmp_path / "r")
    buf = create_shard(path, Box(-1, 1, (2,), np.float32), shard="x", kind="replay")
    buf.extend(np.zeros((5, 2), np.float32))
    buf.close()
    assert len(TransitionDataset(path)) == 5
    with pytest.raises(BadArgumentError, match="trajectory shards"):
        SequenceDataset(path, 2)


@pytest.mark.slow  # ~20 s, most of it starting the cluster's worker processes
def test_dask_statistics_on_local_cluster(root):
    distributed = pytest.importorskip("distributed")
    from trajstore.dask import to_dask

    ds = open_sharded(root)
    obs = to_dask(ds.get_column(["step_data", "obs"]))
    whole = to_dask(ds.get_column("step_data"))
    model = _model()
    assert obs.shape == model.shape and whole["obs"].shape == model.shape
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  worker_dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        stats = client.compute({"mean": obs.mean(axis=0), "max": obs.max(axis=0), "sum": obs.sum(axis=0)}, sync=True)
    np.testing.assert_allclose(stats["mean"], model.mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(stats["max"], model.max(axis=0))
    np.testing.assert_allclose(stats["sum"], model.sum(axis=0), rtol=1e-6)
