"""trajstore.torch.MixtureDataset / MixtureSampler (issue 35, point 2): weights per dataset and per
item (per episode), deterministic for a seed, the drawn proportions the weights' (tested with fixed
seeds against bounds of 5 standard deviations / a chi-square bound), datasets with their own spaces
or a declared common subset of fields, real DataLoader workers.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from test_remote import s3_options  # noqa: F401  (the moto S3 server fixture)
from torch.utils.data import DataLoader

from trajstore import TrajectoryReplayBuffer
from trajstore.errors import BadOptionError, BadWeightsError, SpaceMismatchError, UnknownFieldError
from trajstore.torch import (
    MixtureDataset,
    MixtureSampler,
    SequenceDataset,
    TransitionDataset,
    collate_batch,
    episode_item_weights,
)


def make_store(path, tag: int, episode_lengths, obs_dim: int = 2, extra: bool = False,
               storage_options: dict | None = None) -> str:
    """A trajectory store whose obs[:, 0] is ``1000 * tag + row`` (so every item says where it came from)."""
    space = {"obs": gym.spaces.Box(-1e9, 1e9, (obs_dim,), np.float32), "action": gym.spaces.Discrete(3)}
    if extra:
        space["image"] = gym.spaces.Box(0, 255, (2, 2), np.uint8)
    n = int(sum(episode_lengths))
    obs = np.zeros((n, obs_dim), np.float32)
    obs[:, 0] = 1000 * tag + np.arange(n)
    value = {"obs": obs, "action": np.arange(n) % 3}
    if extra:
        value["image"] = np.zeros((n, 2, 2), np.uint8)
    ids = np.repeat(np.arange(len(episode_lengths)), episode_lengths)
    with TrajectoryReplayBuffer.create(gym.spaces.Dict(space), cache_path=path, storage_options=storage_options) as tb:
        tb.extend({"step_data": value, "episode_ids": ids})
    return str(path)


@pytest.fixture
def stores(tmp_path):
    return {"a": make_store(tmp_path / "a", 1, [4, 6]), "b": make_store(tmp_path / "b", 2, [10, 10, 10]),
            "c": make_store(tmp_path / "c", 3, [7])}


def drawn(sampler: MixtureSampler) -> np.ndarray:
    return np.concatenate([np.asarray(b) for b in sampler])


def within(count: float, n: int, p: float) -> bool:
    """A binomial count within 5 standard deviations of its mean (fails with probability < 1e-6)."""
    return abs(count - n * p) <= 5 * np.sqrt(n * p * (1 - p))


def test_dataset_weights_give_their_proportions_and_items_are_uniform(stores) -> None:
    mix = MixtureDataset(stores, fields=["obs"])
    assert len(mix) == 10 + 30 + 7 and mix.names == ["a", "b", "c"]
    sampler = MixtureSampler(mix, 500, {"a": 1, "b": 2, "c": 5}, num_batches=200, seed=7)
    idx = drawn(sampler)
    k, local = mix.locate(idx)
    n = len(idx)
    for j, p in enumerate([1 / 8, 2 / 8, 5 / 8]):
        assert within((k == j).sum(), n, p), (j, (k == j).sum(), n * p)
    # inside dataset "b" every one of its 30 items is equally likely: chi-square with 29 degrees of freedom
    counts = np.bincount(local[k == 1], minlength=30)
    expected = counts.sum() / 30
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 <= 29 + 6 * np.sqrt(2 * 29)
    assert np.array_equal(drawn(sampler), idx)                     # deterministic for the seed
    sampler.set_epoch(1)
    assert not np.array_equal(drawn(sampler), idx)
    per_batch = MixtureSampler(mix, 2, [1, 2, 5], per_batch=True, num_batches=4000, seed=2)
    k = np.array([mix.locate(b)[0] for b in per_batch])
    assert (k == k[:, :1]).all()
    assert all(within((k[:, 0] == j).sum(), 4000, p) for j, p in enumerate([1 / 8, 2 / 8, 5 / 8]))
    default = MixtureSampler(mix, 470, num_batches=100, seed=1)     # no weights: by size, every item alike
    k, _ = mix.locate(drawn(default))
    for j, size in enumerate([10, 30, 7]):
        assert within((k == j).sum(), len(k), size / 47)


def test_episode_weights_per_episode_and_per_step(stores) -> None:
    ds = TransitionDataset(stores["b"])                             # three episodes of 10 steps
    mix = MixtureDataset({"a": stores["a"], "b": ds}, fields=["obs"])
    # by "return": a callable of the episode ids; per episode: episode 2 drawn 3x as often as 0, never 1
    w = episode_item_weights(ds, lambda ids: np.where(ids == 1, 0.0, ids + 1.0), per="episode")
    sampler = MixtureSampler(mix, 400, {"a": 0, "b": 1}, item_weights={"b": w}, num_batches=100, seed=3)
    k, local = mix.locate(drawn(sampler))
    assert (k == 1).all()
    episode = local // 10
    n = len(local)
    assert (episode != 1).all() and within((episode == 0).sum(), n, 1 / 4)
    a = TransitionDataset(stores["a"])                              # episodes of 4 and 6 steps
    per_step = episode_item_weights(a, {0: 1.0, 1: 1.0}, per="step")
    per_episode = episode_item_weights(a, {0: 1.0, 1: 1.0}, per="episode")
    assert per_step.tolist() == [1.0] * 10
    assert np.allclose(per_episode, [1 / 4] * 4 + [1 / 6] * 6)
    mix = MixtureDataset({"a": a})
    sampler = MixtureSampler(mix, 300, item_weights={"a": per_episode}, num_batches=100, seed=4)
    assert within((drawn(sampler) < 4).sum(), 30000, 1 / 2)         # each episode half the draws


@pytest.mark.parametrize("weights, match", [
    ({"a": -1, "b": 1}, r"dataset weights: weight -1.0 of dataset 'a' is not a finite number >= 0"),
    ([0, 0, 0], "every weight is zero"),
    ([1, float("nan"), 1], "weight nan of dataset 'b'"),
])
def test_bad_weights_are_named(stores, weights, match) -> None:
    mix = MixtureDataset(stores, fields=["obs"])
    with pytest.raises(BadWeightsError, match=match):
        MixtureSampler(mix, 8, weights)
    with pytest.raises(BadWeightsError, match="item weights of dataset 'c': weight -2.0 at position 3"):
        MixtureSampler(mix, 8, item_weights={"c": [1, 1, 1, -2, 1, 1, 1]})
    with pytest.raises(BadWeightsError, match="episode weights: every weight is zero"):
        episode_item_weights(TransitionDataset(stores["b"]), {7: 1.0})


def test_common_fields_mix_a_batch_and_own_spaces_stay_per_batch(tmp_path, stores) -> None:
    other = make_store(tmp_path / "d", 4, [5], obs_dim=3, extra=True)
    mix = MixtureDataset({"a": stores["a"], "d": other}, fields=["action"])
    batch = mix.read_batch([12, 0, 3, 11])
    assert batch["dataset"].tolist() == [1, 0, 0, 1] and batch["action"].tolist() == [2, 0, 0, 1]
    assert set(batch) == {"action", "dataset"}
    with pytest.raises(SpaceMismatchError, match=r"field 'obs': dataset 'a' has per-item shape and dtype \(\(2,\)"):
        MixtureDataset({"a": stores["a"], "d": other}, fields=["obs"])
    with pytest.raises(UnknownFieldError, match="dataset 'a' has no field 'image'"):
        MixtureDataset({"a": TransitionDataset(stores["a"]), "d": other}, fields=["image"])
    own = MixtureDataset({"a": stores["a"], "d": other})            # each keeps its own spaces
    with pytest.raises(BadOptionError, match="per_batch=True"):
        MixtureSampler(own, 4)
    for b in MixtureSampler(own, 6, [1, 1], per_batch=True, num_batches=20, seed=0):
        batch = own.read_batch(b)
        if batch["dataset"][0] == 1:
            assert batch["obs"].shape == (6, 3) and batch["image"].shape == (6, 2, 2)
        else:
            assert batch["obs"].shape == (6, 2) and "image" not in batch
        assert (batch["obs"][:, 0] // 1000 == torch.where(batch["dataset"] == 1, 4, 1)).all()


def test_sequence_datasets_mix_too(stores) -> None:
    mix = MixtureDataset({"a": SequenceDataset(stores["a"], 3, ["obs"], within_episode=True),
                          "c": SequenceDataset(stores["c"], 3, ["obs"], within_episode=True)}, fields=["obs"])
    batch = mix.read_batch(np.arange(len(mix)))
    assert batch["obs"].shape == (len(mix), 3, 2)
    first = batch["obs"][:, 0, 0]
    assert (batch["obs"][:, 1:, 0] - first[:, None] == torch.tensor([1.0, 2.0])).all()   # consecutive rows
    assert ((first // 1000) == torch.where(batch["dataset"] == 1, 3, 1)).all()


def test_dataloader_workers_read_the_same_batches(stores) -> None:
    mix = MixtureDataset(stores, fields=["obs", "action"])
    sampler = MixtureSampler(mix, 16, [1, 2, 1], num_batches=6, seed=11)
    expected = [mix.read_batch(b) for b in sampler]
    loader = DataLoader(mix, batch_sampler=sampler, num_workers=2, collate_fn=collate_batch)
    got = list(loader)
    assert len(got) == 6
    for g, e in zip(got, expected):
        assert set(g) == set(e) and all(torch.equal(g[key], e[key]) for key in e)


def test_a_local_and_a_remote_store_mix_through_workers(tmp_path, s3_options) -> None:  # noqa: F811 (the fixture)
    remote = make_store(f"s3://trajstore-test/mix-{tmp_path.name}", 5, [6, 6], storage_options=s3_options)
    local = make_store(tmp_path / "local", 6, [5])
    mix = MixtureDataset({"local": local, "remote": remote}, fields=["obs"], storage_options={"remote": s3_options})
    sampler = MixtureSampler(mix, 8, {"local": 1, "remote": 3}, num_batches=3, seed=5)
    got = list(DataLoader(mix, batch_sampler=sampler, num_workers=2, collate_fn=collate_batch))
    for g, b in zip(got, sampler):
        k, local_idx = mix.locate(b)
        assert g["dataset"].tolist() == k.tolist()
        assert (g["obs"][:, 0] == torch.from_numpy(np.where(k == 1, 5000, 6000) + local_idx).float()).all()
