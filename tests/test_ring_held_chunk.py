"""A ring whose field keeps its partly filled chunk in RAM (compressed and no-mmap fields) and whose
whole capacity lies in that one chunk: every record, including the eviction records written while
the ring turns over, names only rows that are in the files (what a SIGKILL leaves)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gymnasium.spaces import Box

from trajstore import ReplayBuffer
from trajstore.storage.fields import _syscalls


@pytest.mark.parametrize("compressor", ["lz4", None])
def test_single_chunk_ring_records_only_rows_on_disk(tmp_path, monkeypatch, compressor):
    if compressor is None:
        monkeypatch.setattr(_syscalls, "AVAILABLE", False)  # raw rows through the chunked engine (TRAJSTORE_NO_MMAP)
    space = Box(-np.inf, np.inf, (3,), np.float32)
    cap = 600
    rb = ReplayBuffer.create(space, cache_path=tmp_path / "rb", capacity=cap, chunk_rows=1024,
                             compressor=compressor, commit_interval=3600)
    assert all(f.keeps_partial_chunk for f in rb._table.fields)
    checked = 0
    rng = np.random.default_rng(0)
    for i in range(int(cap * 3.5)):
        rb.append(np.full(3, i, np.float32))
        if rng.random() < 0.05:
            len(rb)  # a read hands the staged rows over mid-block
        if i == 50:
            rb.flush()  # from here on only the ring's eviction records commit (commit_interval is an hour)
        if i % 97 == 0 and i > cap:  # the folder as a SIGKILL would leave it, now
            snap = tmp_path / f"killed{i}"
            shutil.copytree(tmp_path / "rb", snap)
            got = ReplayBuffer.load_from(snap, read_only=True)
            n = len(got)
            if n:
                rows = np.asarray(got[np.arange(n)])[:, 0]
                first = int(rows[-1]) - n + 1
                np.testing.assert_array_equal(rows, np.arange(first, first + n, dtype=np.float32))
                checked += 1
            got.close()
            shutil.rmtree(snap)
    rb.close()
    assert checked >= 10
