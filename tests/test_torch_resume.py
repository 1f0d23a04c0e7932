"""Resumable order of trajstore.torch's batch samplers (issue 35, point 3): stopped mid-epoch and
resumed from ``state_dict`` (through JSON, in a new process, with DataLoader workers) they yield
exactly the remaining batches; a store that grew joins at the next epoch; a state of another
sampler, seed or dataset raises ResumeStateError naming the difference."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from torch.utils.data import DataLoader

from trajstore import ReplayBuffer
from trajstore.errors import ResumeStateError
from trajstore.torch import MixtureDataset, MixtureSampler, RandomBatchSampler, TransitionDataset, collate_batch

HERE = Path(__file__).resolve().parent
SPACE = gym.spaces.Dict({"obs": gym.spaces.Box(-1e9, 1e9, (2,), np.float32)})


def store(path, n: int, tag: int = 0) -> str:
    obs = np.zeros((n, 2), np.float32)
    obs[:, 0] = 1000 * tag + np.arange(n)
    with ReplayBuffer.create(SPACE, cache_path=path) as rb:
        rb.extend({"obs": obs})
    return str(path)


def test_random_batch_sampler_resumes_the_rest_of_its_epoch(tmp_path) -> None:
    ds = TransitionDataset(store(tmp_path / "s", 50))
    whole = list(RandomBatchSampler(ds, 4, num_batches=9, seed=1))
    first = RandomBatchSampler(ds, 4, num_batches=9, seed=1)
    head = list(itertools.islice(iter(first), 3))
    state = json.loads(json.dumps(first.state_dict()))            # position 3, through JSON
    again = RandomBatchSampler(ds, 4, num_batches=9, seed=1)
    again.load_state_dict(state)
    assert head + list(again) == whole
    assert list(again) == whole                                     # the next iter() is a whole epoch
    again.set_epoch(1)
    assert list(again) != whole
    with pytest.raises(ResumeStateError, match="seed: saved 1, this sampler 2"):
        RandomBatchSampler(ds, 4, num_batches=9, seed=2).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="batch_size: saved 4, this sampler 5"):
        RandomBatchSampler(ds, 5, num_batches=9, seed=1).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="sampler: saved 'RandomBatchSampler', this sampler 'MixtureSampler'"):
        MixtureSampler(MixtureDataset([ds]), 4, num_batches=9, seed=1).load_state_dict(state)


def test_a_store_that_grew_joins_at_the_next_epoch(tmp_path) -> None:
    path = store(tmp_path / "s", 50)
    sampler = RandomBatchSampler(TransitionDataset(path), 16, num_batches=6, seed=3)
    whole = list(sampler)
    state = sampler.state_dict(consumed=2)
    with ReplayBuffer.load_from(path) as rb:                        # 30 rows more
        rb.extend({"obs": np.zeros((30, 2), np.float32)})
    grown = RandomBatchSampler(TransitionDataset(path), 16, num_batches=6, seed=3)
    grown.load_state_dict(state)
    assert list(grown) == whole[2:]                                 # the saved epoch over its 50 rows
    grown.set_epoch(1)
    assert max(max(b) for b in grown) >= 50                         # the next one over all 80
    small = RandomBatchSampler(TransitionDataset(store(tmp_path / "t", 40)), 16, num_batches=6, seed=3)
    with pytest.raises(ResumeStateError, match="rows: saved 50, this dataset has 40"):
        small.load_state_dict(state)


def test_mixture_resumes_in_a_new_process_through_workers(tmp_path) -> None:
    a, b = store(tmp_path / "a", 30, 1), store(tmp_path / "b", 20, 2)
    mix = MixtureDataset({"a": a, "b": b}, fields=["obs"])
    sampler = MixtureSampler(mix, 8, {"a": 1, "b": 3}, num_batches=10, seed=5)
    whole = [mix.read_batch(i)["obs"][:, 0].tolist() for i in sampler]
    loader = DataLoader(mix, batch_sampler=sampler, num_workers=2, collate_fn=collate_batch)
    consumed = 0
    for batch in loader:                                            # the loader draws ahead of the loop
        assert batch["obs"][:, 0].tolist() == whole[consumed]
        consumed += 1
        if consumed == 4:
            break
    (tmp_path / "state.json").write_text(json.dumps(sampler.state_dict(consumed=consumed)))
    del loader
    out = subprocess.run([sys.executable, str(HERE / "_resume_worker.py"), str(tmp_path), str(tmp_path / "state.json")],
                         capture_output=True, text=True, check=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert [json.loads(line) for line in out.stdout.splitlines()] == whole[4:]
    other = MixtureDataset({"a": a, "b": store(tmp_path / "c", 21, 3)}, fields=["obs"])
    with pytest.raises(ResumeStateError, match=r"sizes: saved \[30, 20\], this sampler \[30, 21\]"):
        MixtureSampler(other, 8, {"a": 1, "b": 3}, num_batches=10, seed=5).load_state_dict(
            json.loads((tmp_path / "state.json").read_text()))
    with pytest.raises(ResumeStateError, match="weights: saved"):
        MixtureSampler(mix, 8, {"a": 1, "b": 2}, num_batches=10, seed=5).load_state_dict(
            json.loads((tmp_path / "state.json").read_text()))


def test_buffer_sample_resumes_from_its_generator_state_in_a_new_process(tmp_path) -> None:
    """``sample(n, rng=gen)`` draws only from ``gen``: its bit generator's state, saved as JSON and
    loaded in a new process, continues the same batches (docs/offline.md, "Resuming mid-epoch")."""
    path = store(tmp_path / "s", 500)
    gen = np.random.default_rng(11)
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        for _ in range(3):
            rb.sample(16, rng=gen)
        saved = json.dumps(gen.bit_generator.state)
        later = [rb.sample(16, rng=gen)["obs"][:, 0].tolist() for _ in range(2)]
        own_state = json.dumps(rb.default_rng.bit_generator.state)
        own_later = rb.sample(16)["obs"][:, 0].tolist()
    code = (
        "import json, sys, numpy as np\n"
        "from trajstore import ReplayBuffer\n"
        "gen = np.random.default_rng()\n"
        "gen.bit_generator.state = json.loads(sys.argv[2])\n"
        "with ReplayBuffer.load_from(sys.argv[1], read_only=True) as rb:\n"
        "    print(json.dumps([rb.sample(16, rng=gen)['obs'][:, 0].tolist() for _ in range(2)]))\n"
        "    rb.default_rng.bit_generator.state = json.loads(sys.argv[3])\n"
        "    print(json.dumps(rb.sample(16)['obs'][:, 0].tolist()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, path, saved, own_state], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)}).stdout.splitlines()
    assert json.loads(out[0]) == later
    assert json.loads(out[1]) == own_later
    assert later[0] != later[1]
