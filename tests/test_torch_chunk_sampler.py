"""ChunkShuffleSampler (issue 35, point 4): epochs read chunk by chunk from a shuffled pool.

Every item once per epoch, batches from a few chunks only, deterministic for a seed, resumable
mid-epoch (through JSON, in a new process), DataLoader workers each reading their own chunks, and
on a moto S3 server a few requests per batch where uniformly random batches make dozens.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from torch.utils.data import DataLoader, get_worker_info

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import BadArgumentError, BadOptionError, EmptyBufferError, ResumeStateError
from trajstore.torch import (
    ChunkShuffleSampler,
    MixtureDataset,
    SequenceDataset,
    TransitionDataset,
    collate_batch,
)

HERE = Path(__file__).resolve().parent
SPACE = gym.spaces.Dict({"obs": gym.spaces.Box(-1e9, 1e9, (2,), np.float32),
                         "reward": gym.spaces.Box(-1e9, 1e9, (), np.float32)})
C = 64  # rows per chunk of the test stores


def store(path, n: int, *, capacity: int | None = None, chunk_rows: int = C, storage_options=None) -> str:
    """A ReplayBuffer store whose obs[:, 0] is the row's absolute number (its logical row unless a ring wrapped)."""
    obs = np.zeros((n, 2), np.float32)
    obs[:, 0] = np.arange(n)
    # lz4: chunks of exactly chunk_rows (raw chunks are rounded up to whole pages)
    with ReplayBuffer.create(SPACE, cache_path=path, capacity=capacity, chunk_rows=chunk_rows, compressor="lz4",
                             storage_options=storage_options) as rb:
        rb.extend({"obs": obs, "reward": np.zeros(n, np.float32)})
    return str(path)


def flat(batches) -> list[int]:
    return [i for b in batches for i in b]


def test_every_item_once_from_a_few_chunks_per_batch(tmp_path) -> None:
    ds = TransitionDataset(store(tmp_path / "s", 1000))           # 15 full chunks and one of 40 rows
    sampler = ChunkShuffleSampler(ds, 32, pool_chunks=3, seed=0)
    batches = list(sampler)
    assert sorted(flat(batches)) == list(range(1000)) and len(sampler) == len(batches)
    assert [len(b) for b in batches[:-1]] == [32] * (len(batches) - 1) and 0 < len(batches[-1]) <= 32
    assert all(len({i // C for i in b}) <= 6 for b in batches)     # a pool of 3 chunks (and what the last left)
    whole_chunks = list(ChunkShuffleSampler(TransitionDataset(store(tmp_path / "w", 16 * C)), 32, pool_chunks=3, seed=0))
    for p in range(5):                                              # pools of 3 whole chunks of 64 rows: 6 batches each
        pool = flat(whole_chunks[6 * p : 6 * p + 6])
        chunks = {i // C for i in pool}
        assert len(chunks) == 3 and sorted(pool) == [i for k in sorted(chunks) for i in range(k * C, k * C + C)]
        assert pool != sorted(pool)                                 # shuffled within the pool
    chunk_order = list(dict.fromkeys(i // C for i in flat(batches)))
    assert chunk_order != sorted(chunk_order)                       # chunks in a random order
    assert batches == list(ChunkShuffleSampler(ds, 32, pool_chunks=3, seed=0))     # deterministic
    assert list(sampler) == batches                                 # iter() again: the same epoch
    assert batches != list(ChunkShuffleSampler(ds, 32, pool_chunks=3, seed=1))
    sampler.set_epoch(1)
    again = list(sampler)
    assert again != batches and sorted(flat(again)) == list(range(1000))
    dropped = list(ChunkShuffleSampler(ds, 32, pool_chunks=3, seed=0, drop_last=True))
    assert dropped == batches[:-1]


def test_sequences_and_a_wrapped_ring_group_items_by_their_chunk(tmp_path) -> None:
    ids = np.repeat(np.arange(10), 50)
    with TrajectoryReplayBuffer.create(SPACE, cache_path=tmp_path / "t", chunk_rows=C, compressor="lz4") as tb:
        tb.extend({"step_data": {"obs": np.zeros((500, 2), np.float32), "reward": np.zeros(500, np.float32)},
                   "episode_ids": ids})
    seqs = SequenceDataset(tmp_path / "t", 8, ["obs"], within_episode=True, stride=2)
    batches = list(ChunkShuffleSampler(seqs, 16, pool_chunks=2, seed=3))
    assert sorted(flat(batches)) == list(range(len(seqs)))
    assert all(len({int(seqs.anchors[i]) // C for i in b}) <= 4 for b in batches)
    # A ring of 256 rows that wrapped: logical row i is slot (i + 144) % 256; chunks are slots // 64.
    ring = TransitionDataset(store(tmp_path / "r", 400, capacity=256), ["obs"])
    assert ring.read_batch([0])["obs"][0, 0] == 144
    batches = list(ChunkShuffleSampler(ring, 32, pool_chunks=1, seed=0))
    assert sorted(flat(batches)) == list(range(256))
    slots = [{(i + 144) % 256 // C for i in b} for b in batches]
    assert all(len(s) == 1 for s in slots)                          # pools of one whole chunk: 2 batches each


def test_a_sharded_dataset_groups_items_by_the_chunks_of_each_shard(tmp_path) -> None:
    from trajstore.shards import create_shard

    for name, n in (("a", 200), ("b", 150)):                        # obs[:, 0]: 1000 * shard + row in it
        obs = np.zeros((n, 2), np.float32)
        obs[:, 0] = 1000 * (name == "b") + np.arange(n)
        with create_shard(tmp_path / "sh", SPACE, shard=name, kind="replay", chunk_rows=C, compressor="lz4") as buf:
            buf.extend({"obs": obs, "reward": np.zeros(n, np.float32)})
    ds = TransitionDataset(tmp_path / "sh", ["obs"])
    batches = list(ChunkShuffleSampler(ds, 16, pool_chunks=1, seed=2))
    assert sorted(flat(batches)) == list(range(350))
    where = ds.read_batch(np.arange(350))["obs"][:, 0].long()      # 0..199, then 1000..1149
    chunks = [{(int(where[i]) // 1000, int(where[i]) % 1000 // C) for i in b} for b in batches]
    # Pools of one chunk: shard a has 3 whole chunks of 64 rows and one of 8, shard b 2 and one of 22;
    # a batch takes the rows the pool before left, and the pool of 8 rows passes them on.
    assert len(set().union(*chunks)) == 4 + 3 and all(len(c) <= 3 for c in chunks)
    assert sum(len(c) == 1 for c in chunks) >= 15                   # most batches: rows of one chunk


def test_resumes_the_rest_of_its_epoch_in_a_new_process(tmp_path) -> None:
    path = store(tmp_path / "s", 700)
    ds = TransitionDataset(path, ["obs"])
    sampler = ChunkShuffleSampler(ds, 32, pool_chunks=2, num_workers=2, seed=7)
    sampler.set_epoch(2)
    whole = list(sampler)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, collate_fn=collate_batch)
    consumed = 0
    for batch in loader:                                            # the loader reads ahead of the loop
        assert batch["obs"][:, 0].long().tolist() == whole[consumed]
        consumed += 1
        if consumed == 5:
            break
    del loader
    (tmp_path / "state.json").write_text(json.dumps(sampler.state_dict(consumed=consumed)))
    code = ("import json, sys\nfrom trajstore.torch import ChunkShuffleSampler, TransitionDataset\n"
            "ds = TransitionDataset(sys.argv[1], ['obs'])\n"
            "s = ChunkShuffleSampler(ds, 32, pool_chunks=2, num_workers=2, seed=7)\n"
            "s.load_state_dict(json.load(open(sys.argv[2])))\nprint(json.dumps(list(s)))\n")
    out = subprocess.run([sys.executable, "-c", code, path, str(tmp_path / "state.json")], capture_output=True,
                         text=True, check=True, timeout=300, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert json.loads(out.stdout) == whole[5:]
    state = json.loads((tmp_path / "state.json").read_text())
    again = ChunkShuffleSampler(ds, 32, pool_chunks=2, num_workers=2, seed=7)
    again.load_state_dict(state)
    assert list(again) == whole[5:] and list(again) == whole        # then the whole epoch again
    for kwargs, message in (({"seed": 8}, "seed: saved 7, this sampler 8"),
                            ({"pool_chunks": 3}, "pool_chunks: saved 2, this sampler 3"),
                            ({"num_workers": 0}, "num_workers: saved 2, this sampler 0")):
        with pytest.raises(ResumeStateError, match=message):
            ChunkShuffleSampler(ds, 32, **{"pool_chunks": 2, "num_workers": 2, "seed": 7, **kwargs}).load_state_dict(state)
    other = TransitionDataset(store(tmp_path / "o", 700, chunk_rows=128), ["obs"])   # same items, other chunks
    with pytest.raises(ResumeStateError, match="chunks: saved 11, this dataset's first 700 items lie in 6"):
        ChunkShuffleSampler(other, 32, pool_chunks=2, num_workers=2, seed=7).load_state_dict(state)
    small = TransitionDataset(store(tmp_path / "m", 600), ["obs"])
    with pytest.raises(ResumeStateError, match="rows: saved 700, this dataset has 600"):
        ChunkShuffleSampler(small, 32, pool_chunks=2, num_workers=2, seed=7).load_state_dict(state)


def test_rows_appended_later_join_at_the_next_epoch(tmp_path) -> None:
    path = store(tmp_path / "s", 300)
    sampler = ChunkShuffleSampler(TransitionDataset(path), 16, seed=3)
    whole = list(sampler)
    state = sampler.state_dict(consumed=4)
    with ReplayBuffer.load_from(path) as rb:                        # 100 rows more
        rb.extend({"obs": np.zeros((100, 2), np.float32), "reward": np.zeros(100, np.float32)})
    grown = ChunkShuffleSampler(TransitionDataset(path), 16, seed=3)
    grown.load_state_dict(state)
    assert list(grown) == whole[4:]                                 # the saved epoch over its 300 rows
    grown.set_epoch(1)
    assert sorted(flat(grown)) == list(range(400))                  # the next one over all 400


class Tagged(TransitionDataset):
    """A dataset whose batches say which DataLoader worker read them."""

    def _read(self, indices, out):
        batch = super()._read(indices, out)
        info = get_worker_info()
        batch["worker"] = out(np.full(len(indices), -1 if info is None else info.id))
        return batch


def test_each_worker_reads_whole_chunks_of_its_own(tmp_path) -> None:
    ds = Tagged(store(tmp_path / "s", 16 * C), ["obs"])             # 16 chunks: 8 per worker
    sampler = ChunkShuffleSampler(ds, 16, pool_chunks=2, num_workers=2, seed=1)
    batches = list(sampler)
    chunks = [{i // C for i in b} for b in batches]
    assert not set().union(*chunks[0::2]) & set().union(*chunks[1::2])   # turns alternate between the streams
    readers: dict[int, set[int]] = {}
    seen = []
    for batch in DataLoader(ds, batch_sampler=sampler, num_workers=2, collate_fn=collate_batch):
        rows = batch["obs"][:, 0].long()
        seen += rows.tolist()
        for r, w in zip(rows.tolist(), batch["worker"].tolist()):
            readers.setdefault(r // C, set()).add(w)
    assert sorted(seen) == list(range(16 * C))
    assert all(len(w) == 1 for w in readers.values()) and set().union(*readers.values()) == {0, 1}
    # In the main process (num_workers=0) the same items come, in batches drawn from one stream.
    plain = [b["obs"][:, 0].long().tolist() for b in DataLoader(ds, batch_sampler=ChunkShuffleSampler(ds, 16, seed=1),
                                                                   collate_fn=collate_batch)]
    assert sorted(flat(plain)) == list(range(16 * C))


def test_bad_arguments_say_what_was_expected(tmp_path) -> None:
    ds = TransitionDataset(store(tmp_path / "s", 100))
    for kwargs, message in (({"batch_size": 0}, "batch_size must be an int >= 1; got 0"),
                            ({"batch_size": True}, "batch_size must be an int >= 1; got True"),
                            ({"batch_size": 8, "pool_chunks": 0}, "pool_chunks must be an int >= 1; got 0"),
                            ({"batch_size": 8, "num_workers": -1}, "num_workers must be an int >= 0; got -1"),
                            ({"batch_size": 8, "chunk_rows": 2.5}, "chunk_rows must be an int >= 1; got 2.5")):
        with pytest.raises(BadOptionError, match=message):
            ChunkShuffleSampler(ds, **kwargs)
    with pytest.raises(BadArgumentError, match="got int"):
        ChunkShuffleSampler(100, 8)
    with pytest.raises(BadArgumentError, match="MixtureSampler"):
        ChunkShuffleSampler(MixtureDataset([ds]), 8)
    with ReplayBuffer.create(SPACE, cache_path=tmp_path / "empty"):
        pass
    with pytest.raises(EmptyBufferError, match="empty dataset"):
        ChunkShuffleSampler(TransitionDataset(tmp_path / "empty"), 8)
    # chunk_rows given: items grouped by it (here 10-row blocks: batches of one pool of 2 blocks)
    batches = list(ChunkShuffleSampler(ds, 10, pool_chunks=2, chunk_rows=10, seed=0))
    assert all(len({i // 10 for i in b}) <= 3 for b in batches) and sorted(flat(batches)) == list(range(100))


# -- requests per batch on a moto S3 server ----------------------------------------------------------


@pytest.fixture(scope="module")
def counted_s3():
    """A moto S3 server on 127.0.0.1 (a free port the OS picks) whose HTTP requests are counted
    on the server side, so requests made by DataLoader worker processes count too."""
    moto_server = pytest.importorskip("moto.server", reason="needs moto[server]")
    s3fs = pytest.importorskip("s3fs", reason="needs s3fs")
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    counter = {"n": 0}
    lock = threading.Lock()
    wsgi = server._server  # moto's werkzeug server: wrap its app to count the requests it serves
    app = wsgi.app

    def counting(environ, start_response):
        with lock:
            counter["n"] += 1
        return app(environ, start_response)

    wsgi.app = counting
    endpoint = f"http://{host}:{port}"
    opts = {"key": "testing", "secret": "testing", "endpoint_url": endpoint, "use_listings_cache": False,
            "client_kwargs": {"region_name": "us-east-1"}, "max_concurrency": 1}
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket="chunks")
    try:
        yield opts, counter
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_a_remote_epoch_costs_a_few_requests_per_batch(counted_s3) -> None:
    opts, counter = counted_s3
    url = f"s3://chunks/{uuid.uuid4().hex}"
    store(url, 32 * 256, chunk_rows=256, storage_options=opts)      # 32 chunks of 256 rows per field
    ds = TransitionDataset(url, ["obs", "reward"], storage_options=opts)
    before = counter["n"]
    ds.read_batch(np.random.default_rng(0).integers(0, len(ds), 256))   # one uniformly random batch, cold
    random_batch = counter["n"] - before
    assert random_batch > 40                                        # most of the 2 x 32 chunks, one request each
    for workers in (0, 2):
        ds = TransitionDataset(url, ["obs", "reward"], storage_options=opts)   # nothing cached
        sampler = ChunkShuffleSampler(ds, 256, num_workers=workers, seed=0)
        before, seen = counter["n"], []
        for batch in DataLoader(ds, batch_sampler=sampler, num_workers=workers, collate_fn=collate_batch):
            seen += batch["obs"][:, 0].long().tolist()
        per_batch = (counter["n"] - before) / len(sampler)
        assert sorted(seen) == list(range(len(ds))) and len(sampler) == 32
        assert per_batch <= 8, f"{per_batch:.1f} requests per batch with {workers} workers"
